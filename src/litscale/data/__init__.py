"""LightningDataModules that shard one seeded global order across data-parallel ranks."""

from litscale.data.base import ShardedDataModule
from litscale.data.byte_corpus import ByteCorpusDataModule, expand_paths, missing_paths_error
from litscale.data.digits import DigitsDataModule
from litscale.data.stdlib_code import StdlibCodeDataModule
from litscale.data.synthetic import SyntheticDataModule

__all__ = [
    "ByteCorpusDataModule",
    "DigitsDataModule",
    "ShardedDataModule",
    "StdlibCodeDataModule",
    "SyntheticDataModule",
    "expand_paths",
    "missing_paths_error",
]
