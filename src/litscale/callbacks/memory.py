"""Memory per rank: parameters, gradients and optimizer state, measured and estimated.

Measured from the tensors this rank actually holds (a DTensor's local shard for FSDP,
DeepSpeed's partitioned flat buffers for ZeRO), counting each byte once, so views into
a flat buffer (DDP's gradient buckets, DeepSpeed's flat groups) are not counted twice.
Gradients are read just before the first optimizer step (DeepSpeed frees its partitioned
gradients in the step), parameters and optimizer state just after it (Adam's state exists
only then).

The estimate is the ZeRO paper's (Rajbhandari et al. 2020, section 5), per rank, for P
parameters, N data-parallel ranks and mixed-precision Adam (2 bytes of 16-bit parameter,
2 of gradient, K=12 of fp32 master copy + momentum + variance):

    DDP 16P;  ZeRO-1 4P + 12P/N;  ZeRO-2 2P + 14P/N;  ZeRO-3 / FSDP 16P/N.

The constants here follow what is stored: parameter and gradient bytes are the parameter
dtype's size (4 in fp32, so DDP in fp32 with Adam is 4 + 4 + 8 = 16P too, but with no
master copy K=8); K is 8 for Adam-family optimizers, 4 for SGD with momentum, 0 without;
DeepSpeed keeps an fp32 master partition even in fp32 training (+4 to K).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch.optim import Optimizer

METRICS = ("memory/params_bytes", "memory/grads_bytes", "memory/optimizer_bytes")


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


def optimizer_state_tensors(optimizer: Optimizer) -> list[torch.Tensor]:
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0]


def optimizer_state_bytes_per_param(optimizer: Optimizer) -> int:
    """K without a master copy: fp32 bytes of state per parameter for common optimizers."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    optimizer = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's wrapper
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or "adam" in type(optimizer).__name__.lower():
        return 8
    if isinstance(optimizer, torch.optim.SGD):
        return 4 if optimizer.defaults.get("momentum", 0) else 0
    return 8


def estimate_bytes(*, num_params: int, world_size: int, zero_stage: int, param_bytes: int,
                   optimizer_bytes_per_param: int) -> dict[str, float]:
    """The ZeRO paper's per-rank bytes: stage 0 (DDP) replicates everything; stage 1 shards
    optimizer state, 2 also gradients, 3 (and FSDP) also parameters."""
    shard = 1 / world_size
    return {
        "memory/estimate_params_bytes": param_bytes * num_params * (shard if zero_stage >= 3 else 1),
        "memory/estimate_grads_bytes": param_bytes * num_params * (shard if zero_stage >= 2 else 1),
        "memory/estimate_optimizer_bytes":
            optimizer_bytes_per_param * num_params * (shard if zero_stage >= 1 else 1),
    }


def _generic_bytes(module: torch.nn.Module, optimizers: list[Optimizer]) -> dict[str, int]:
    return {
        "memory/params_bytes": storage_bytes(module.parameters()),
        "memory/grads_bytes": storage_bytes(p.grad for p in module.parameters()),
        "memory/optimizer_bytes": storage_bytes(t for o in optimizers for t in optimizer_state_tensors(o)),
    }


class MemoryCallback(Callback):
    """Logs and prints (rank 0) this rank's bytes of parameters, gradients and optimizer state
    after the first optimizer step, beside the ZeRO-paper estimate for the strategy. A
    strategy may supply ``memory_bytes()`` when its buffers are not the module's tensors
    (DeepSpeed), and ``zero_stage`` (0 = replicated, 3 = fully sharded) for the estimate."""

    def __init__(self) -> None:
        self.result: dict[str, float] = {}
        self._grads: int | None = None

    def _measure(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, int]:
        custom = getattr(trainer.strategy, "memory_bytes", None)
        return custom() if custom is not None else _generic_bytes(pl_module, trainer.optimizers)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self._grads is None:
            self._grads = self._measure(trainer, pl_module)["memory/grads_bytes"]

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if self.result or trainer.global_step < 1 or self._grads is None:
            return
        measured = {**self._measure(trainer, pl_module), "memory/grads_bytes": self._grads}
        self.result = {k: float(v) for k, v in {**measured, **self._estimate(trainer, pl_module)}.items()}
        pl_module.log_dict(self.result, rank_zero_only=True)
        strategy = trainer.strategy
        rank_zero_info(
            f"litscale: memory per rank ({type(strategy).__name__}, stage "
            f"{getattr(strategy, 'zero_stage', 0)}, {trainer.world_size} ranks): "
            + " | ".join(f"{name.split('/')[1][:-6]} {_mib(measured[name])} (estimate "
                         f"{_mib(self.result[name.replace('/', '/estimate_')])})" for name in METRICS))

    def _estimate(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, float]:
        strategy = trainer.strategy
        params = {id(p): p for p in pl_module.parameters()}.values()
        num_params = sum(getattr(p, "ds_numel", None) or p.numel() for p in params)
        param_bytes = next(iter(params)).element_size() if params else 4
        master_copy = 4 if getattr(strategy, "fp32_master_copy", False) else 0
        return estimate_bytes(
            num_params=num_params, world_size=trainer.world_size,
            zero_stage=getattr(strategy, "zero_stage", 0), param_bytes=param_bytes,
            optimizer_bytes_per_param=optimizer_state_bytes_per_param(trainer.optimizers[0]) + master_copy,
        )


def _mib(value: float) -> str:
    return f"{value / 2**20:.2f} MiB"
