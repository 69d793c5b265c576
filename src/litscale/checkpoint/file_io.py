"""How a file checkpoint (``single``, ``ddp`` and the DDP family) is written and read: the
``CheckpointIO`` every litscale strategy uses unless the user gives its own.

Lightning's ``TorchCheckpointIO`` makes a save atomic by itself: the whole checkpoint is
serialised into memory first (a second copy of the state), written to a temporary file in the
system's temporary directory and moved over the path, which is a second write of every byte
where that directory is on another file system (a node's local ``/tmp``, the checkpoint on a
shared one). litscale publishes each save atomically already (``litscale.checkpoint.atomic``:
written at a staging path, synced, renamed), so here ``torch.save`` writes straight to the path
it is given, once (``experiments/checkpoints/speed.py`` measures it against the disk's rate).

A load maps the file (``torch.load(mmap=True)``) instead of reading it: the ranks of one host
share the page cache's one copy, so a resume reads each byte from storage once per host, not
once per rank. Nothing keeps the mapping past the load: the module's weights are copied into
its parameters, and every other tensor (the optimizer's state, which ``load_state_dict``
adopts) is copied out of it here, so a later save that replaces or deletes the file, from this
host or another, never leaves a rank's state on a file that is gone. A file on a FUSE mount (an
object store's daemon) is read as Lightning reads it.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from typing_extensions import override

from litscale.checkpoint.atomic import is_fuse, mount_type

MODULE_WEIGHTS = "state_dict"  # copied into the parameters by the strategy's load_model_state_dict


def is_local_path(path: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(get_filesystem(path), LocalFileSystem)


class FileCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` for local paths, with ``torch.save`` writing straight to
    the path (the strategy's staging path: the atomic publish is the strategy's) and loads
    memory-mapped; any other path (a URL) as Lightning does it."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or not is_local_path(path):
            super().save_checkpoint(checkpoint, path, storage_options)  # Lightning's refusal, or a URL
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save(checkpoint, path)

    @override
    def load_checkpoint(self, path: Any, map_location: Callable | None = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if not is_local_path(path) or not os.path.isfile(path) or is_fuse(mount_type(os.path.dirname(
                os.path.abspath(path)))):
            return super().load_checkpoint(path, map_location, weights_only)
        _read_ahead(path)
        checkpoint = torch.load(path, map_location=map_location, weights_only=weights_only, mmap=True)
        if not isinstance(checkpoint, dict):
            return checkpoint
        return {key: value if key == MODULE_WEIGHTS else copied_out(value) for key, value in checkpoint.items()}


def _read_ahead(path: str) -> None:
    """Ask the kernel to read the whole file into the page cache now, in large sequential reads:
    a mapping's page faults otherwise read it a readahead window at a time, slower from a cold
    cache. Pages another rank of the host already read are not read again."""
    if not hasattr(os, "posix_fadvise"):  # macOS
        return
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(descriptor)


def copied_out(value: Any) -> Any:
    """``value`` with every tensor in it on the CPU cloned off the memory-mapped file (one that
    ``map_location`` put on an accelerator is a copy already); a tensor met twice stays one copy."""
    seen: dict[int, torch.Tensor] = {}

    def copied(item: Any) -> Any:
        if isinstance(item, torch.Tensor) and item.device.type == "cpu":
            if id(item) not in seen:
                seen[id(item)] = item.clone()
            return seen[id(item)]
        if isinstance(item, dict):
            new = copy.copy(item)  # its own type (an AttributeDict of hyperparameters, ...)
            for name, inner in item.items():
                new[name] = copied(inner)
            return new
        if type(item) in (list, tuple):
            return type(item)(copied(inner) for inner in item)
        return item

    return copied(value)
