"""Bytes of memory that tensors hold on this rank, each byte counted once: what the memory
callback measures and DeepSpeed's strategy reports for its own buffers."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim import Optimizer


def shapes_only(tensor: torch.Tensor) -> bool:
    """A meta or fake tensor: shapes traced (the planner's counts, its step on fake tensors),
    nothing computed and no value to read."""
    from torch._subclasses.fake_tensor import is_fake

    return tensor.is_meta or is_fake(tensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of memory covered by ``tensors``, each byte counted once: views into one flat
    buffer (DDP's gradient buckets, DeepSpeed's partitions) add up to the part of the buffer
    they cover, not to the whole buffer once per view, and a buffer's unused tail (a
    communication bucket sized by a config knob) is not counted."""
    spans = []
    for tensor in tensors:
        if tensor is None or local(tensor).numel() == 0:
            continue
        tensor = local(tensor)
        if tensor.is_contiguous():
            start = tensor.data_ptr()
            spans.append((start, start + tensor.numel() * tensor.element_size()))
        else:
            storage = tensor.untyped_storage()
            spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    total, end = 0, -1
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def torch_optimizer(optimizer: object) -> object:
    """The ``torch.optim.Optimizer`` inside Lightning's and DeepSpeed's wrappers (DeepSpeed's
    steps its flat fp32 partitions as its parameters); ``optimizer`` itself if none is inside."""
    while not isinstance(optimizer, Optimizer):
        inner = getattr(optimizer, "_optimizer", None) or getattr(optimizer, "optimizer", None)
        if inner is None:
            return optimizer
        optimizer = inner
    return optimizer


def optimizer_state_tensors(optimizer: Optimizer) -> list[torch.Tensor]:
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0]
