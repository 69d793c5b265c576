"""LightningDataModules that shard one seeded global order across data-parallel ranks."""

from litscale.data.base import ShardedDataModule
from litscale.data.byte_corpus import ByteCorpusDataModule, expand_paths, missing_paths_error
from litscale.data.digits import DigitsDataModule
from litscale.data.stdlib_code import StdlibCodeDataModule
from litscale.data.synthetic import SyntheticDataModule
from litscale.data.tokenizer import load_tokenizer
from litscale.data.tokens import TokenDataModule

__all__ = [
    "ByteCorpusDataModule",
    "DigitsDataModule",
    "ShardedDataModule",
    "StdlibCodeDataModule",
    "SyntheticDataModule",
    "TokenDataModule",
    "expand_paths",
    "load_tokenizer",
    "missing_paths_error",
]
