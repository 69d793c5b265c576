"""Reading a checkpoint's files without running what they hold: ``torch.save`` files
weights-only (tensors, plain data and the few classes named for one read), DCP's ``.metadata``
through a restricted unpickler, DeepSpeed's files with its own few classes allowed. Every check
before launch and every move between layouts reads through here
(``litscale.checkpoint.resume``, ``litscale.checkpoint.moves``, ``litscale.checkpoint.deepspeed``).
"""

from __future__ import annotations

import glob
import os
import pickle
from collections.abc import Sequence
from typing import Any

LIGHTNING_META = "meta.pt"  # Lightning's ModelParallelStrategy writes it after the DCP shards
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint renames it into place after the shards
DEEPSPEED_LATEST = "latest"  # DeepSpeed writes the tag file after its own rank's files


def files_under(directory: str) -> list[str]:
    return [os.path.join(root, name) for root, _, names in os.walk(directory) for name in names]


def read_plain(path: str, *, allowed: Sequence[Any] = (), mmap: bool = True) -> Any:
    """A ``torch.save`` file read without running code (``weights_only``): tensors, plain data,
    and the classes in ``allowed``, built from their data (``torch.serialization.safe_globals``,
    for this read only). Memory-mapped unless ``mmap`` is false: a check reads no tensor."""
    import torch

    with torch.serialization.safe_globals(list(allowed)):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def is_readable_checkpoint(path: str) -> bool:
    """Every pickle the checkpoint at ``path`` holds reads without running code: a file as a
    Lightning checkpoint; a DCP directory's ``meta.pt``, ``.metadata`` and the values it keeps
    beside its tensors; a DeepSpeed directory's every file of its tag
    (``is_readable_deepspeed_checkpoint``, which needs DeepSpeed: ``ImportError`` without it).

    NOTE: checked before any rank starts, on whatever ``ckpt_path`` resolves to; otherwise a bad
    file ends in torch's unpickling traceback, whose advice (``weights_only=False``) would run
    whatever the file holds, and the loaders that unpickle whole as the ranks resume (DCP's
    ``.metadata`` and values, DeepSpeed's own) read only files that passed."""
    if os.path.isdir(path) and is_deepspeed_checkpoint(path):
        return is_readable_deepspeed_checkpoint(path)
    try:
        if os.path.isdir(path):
            _read_dcp_values(path, read_dcp_metadata(path))
            return isinstance(read_plain(os.path.join(path, LIGHTNING_META)), dict)
        checkpoint = read_plain(path)
    except Exception:  # noqa: BLE001 - unpickling errors have many types; all mean unreadable
        return False
    return isinstance(checkpoint, dict) and "state_dict" in checkpoint


# What DCP's ``.metadata`` names beside plain data (torch 2.13): its own dataclasses, and the
# sizes, dtypes (``torch.<dtype>``, allowed by type below), layout and path they hold.
DCP_METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    *((module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "WindowsPath")),
    ("collections", "OrderedDict"),
})


class _DcpMetadataUnpickler(pickle.Unpickler):
    """The restricted unpickler of Python's own documentation ("Restricting Globals"), for DCP's
    ``.metadata``. NOTE: by hand because torch's weights-only unpickler reads only the pickle
    protocol ``torch.save`` writes (2), and DCP writes its metadata with the newest (5)."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) in DCP_METADATA_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def read_dcp_metadata(path: str) -> Any:
    """The ``Metadata`` of the DCP checkpoint directory at ``path`` (every tensor's key and
    shape: ``state_dict.net.w``, ``optimizer_0.state.net.w.exp_avg``), read without running code."""
    from torch.distributed.checkpoint.metadata import Metadata

    with open(os.path.join(path, DCP_METADATA), "rb") as file:
        metadata = _DcpMetadataUnpickler(file).load()
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise pickle.UnpicklingError(f"{path}/{DCP_METADATA} holds no DCP metadata")
    return metadata


def _read_dcp_values(path: str, metadata: Any) -> None:
    """Read weights-only each value of a DCP directory that is not a tensor (DCP keeps a
    ``torch.save`` of it in a shard file: a group's learning rate, its betas); raises where one
    does not read so. NOTE: DCP's own reader unpickles these whole (``weights_only=False``)
    as the ranks load; this check, before any rank starts, is what keeps that to plain data."""
    import io

    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    for index, stored in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        if stored.transform_descriptors:  # compressed or otherwise transformed: not read here
            raise pickle.UnpicklingError(f"{index.fqn} is stored transformed")
        with open(os.path.join(path, stored.relative_path), "rb") as file:
            file.seek(stored.offset)
            torch.load(io.BytesIO(file.read(stored.length)), map_location="cpu", weights_only=True)


def is_deepspeed_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, DEEPSPEED_LATEST))


def deepspeed_classes() -> list[type]:
    """The classes DeepSpeed 0.19 pickles into its checkpoint files beside tensors and plain
    data (a loss scaler's settings, the ZeRO stage, where a parameter's fragment lies in a
    partition); torch's weights-only unpickler builds them from their data, running none of
    their code. ``ImportError`` without DeepSpeed."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def read_deepspeed_file(path: str, *, mmap: bool = True) -> dict[str, Any]:
    """One of DeepSpeed's checkpoint files, read without running code."""
    return read_plain(path, allowed=deepspeed_classes(), mmap=mmap)


def is_readable_deepspeed_checkpoint(path: str) -> bool:
    """Every ``.pt`` file of the checkpoint's tag reads without running code, and the model
    states file is among them. ``ImportError`` without DeepSpeed."""
    deepspeed_classes()
    try:
        model_file, _ = deepspeed_files(path)
        files = [name for name in files_under(os.path.dirname(model_file)) if name.endswith(".pt")]
        return os.path.isfile(model_file) and all(isinstance(read_deepspeed_file(name), dict) for name in files)
    except Exception:  # noqa: BLE001 - unpickling errors have many types; all mean unreadable
        return False


def deepspeed_files(path: str) -> tuple[str, list[str]]:
    """(the model states file, the optimizer files in rank order) of the checkpoint's tag."""
    with open(os.path.join(path, DEEPSPEED_LATEST)) as handle:
        tag = handle.read().strip()
    folder = os.path.join(path, tag)
    ranks = sorted(glob.glob(os.path.join(glob.escape(folder), "zero_pp_rank_*_mp_rank_00_optim_states.pt")),
                   key=lambda name: int(os.path.basename(name).split("_")[3]))
    model = os.path.join(folder, "mp_rank_00_model_states.pt")  # ZeRO-3: each rank writes its own; rank 0's
    return model if os.path.isfile(model) else os.path.join(folder, "zero_pp_rank_0_mp_rank_00_model_states.pt"), ranks
