"""Memory per rank: parameters, gradients and optimizer state, measured and estimated.

Measured from the tensors this rank actually holds (a DTensor's local shard for FSDP,
DeepSpeed's partitioned flat buffers for ZeRO), counting each byte once, so views into
a flat buffer (DDP's gradient buckets, DeepSpeed's flat groups) are not counted twice.
Gradients are read just before the first optimizer step (DeepSpeed frees its partitioned
gradients in the step), parameters and optimizer state just after it (Adam's state exists
only then).

The estimate is ``litscale.parallel.sharding.state_bytes_per_rank`` (the ZeRO paper's formulas on the
rank's share of the mesh), from what the strategy states of itself (``sharding``,
``resolve_mesh``): the planner predicts memory from the same function.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch.optim import Optimizer

from litscale.measure.step_memory import StepPeak
from litscale.measure.tensor_bytes import optimizer_state_tensors, storage_bytes, torch_optimizer
from litscale.parallel.contract import contract_value
from litscale.parallel.declarations import moe_parameter_counts
from litscale.parallel.layout import mesh_of
from litscale.parallel.sharding import estimate_bytes, state_bytes_per_rank

__all__ = ["MemoryCallback", "estimate_bytes", "storage_bytes"]

METRICS = ("memory/params_bytes", "memory/grads_bytes", "memory/optimizer_bytes")


def optimizer_state_bytes_per_param(optimizer: Optimizer) -> float:
    """K without a master copy: fp32 bytes of state per parameter for common optimizers (the
    mean over its parameters for one that says, as Muon does)."""
    optimizer = torch_optimizer(optimizer)
    if hasattr(optimizer, "state_bytes_per_param"):
        return optimizer.state_bytes_per_param()
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or "adam" in type(optimizer).__name__.lower():
        return 8
    if isinstance(optimizer, torch.optim.SGD):
        return 4 if optimizer.defaults.get("momentum", 0) else 0
    return 8


def _generic_bytes(module: torch.nn.Module, optimizers: list[Optimizer]) -> dict[str, int]:
    return {
        "memory/params_bytes": storage_bytes(module.parameters()),
        "memory/grads_bytes": storage_bytes(p.grad for p in module.parameters()),
        "memory/optimizer_bytes": storage_bytes(t for o in optimizers for t in optimizer_state_tensors(o)),
    }


class MemoryCallback(Callback):
    """Logs and prints (rank 0) this rank's bytes of parameters, gradients and optimizer state
    after the first optimizer step, beside the estimate for the strategy's ``sharding`` on its
    mesh. A strategy may supply ``memory_bytes()`` when its buffers are not the module's
    tensors (DeepSpeed)."""

    def __init__(self, measure_peak: bool = False) -> None:
        self.result: dict[str, float] = {}
        # CPU: one step watched by torch's MemTracker (litscale.measure.step_memory), which slows it.
        self._step_peak: StepPeak | None = None
        self._measure_peak = measure_peak
        self._grads: int | None = None
        self._num_params: int | None = None
        self._moe = (0, 0)  # a mixture of experts' MoE-layer and routed-expert parameters

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Before the strategy splits the network: the formulas take the whole model's count
        # (a pipeline rank keeps only its stages, tensor parallel its slices).
        self._num_params = sum(p.numel() for p in {id(p): p for p in pl_module.parameters()}.values())
        self._moe = moe_parameter_counts(pl_module)

    def _measure(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, int]:
        custom = getattr(trainer.strategy, "memory_bytes", None)
        return custom() if custom is not None else _generic_bytes(pl_module, trainer.optimizers)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        # The second step (the first creates the optimizer's state) unless the run has one.
        if (self._measure_peak and self._step_peak is None and pl_module.device.type == "cpu"
                and trainer.global_step == _watched_step(trainer)):
            self._step_peak = StepPeak(pl_module.device)
            self._step_peak.enter(pl_module, trainer.optimizers)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self._grads is None:
            self._grads = self._measure(trainer, pl_module)["memory/grads_bytes"]

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if self._step_peak is not None and self._step_peak.active and trainer.global_step > _watched_step(trainer):
            self._step_peak.leave()
        if self.result or trainer.global_step < 1 or self._grads is None:
            return
        measured = {**self._measure(trainer, pl_module), "memory/grads_bytes": self._grads}
        self.result = {k: float(v) for k, v in {**measured, **self._estimate(trainer, pl_module)}.items()}
        pl_module.log_dict(self.result, rank_zero_only=True)
        strategy = trainer.strategy
        rank_zero_info(
            f"litscale: memory per rank ({type(strategy).__name__}, stage "
            f"{contract_value(strategy, 'sharding').zero_stage}, {trainer.world_size} ranks): "
            + " | ".join(f"{name.split('/')[1][:-6]} {_mib(measured[name])} (estimate "
                         f"{_mib(self.result[name.replace('/', '/estimate_')])})" for name in METRICS))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # On CUDA the allocator's high-water mark (states, activations and workspaces) is the
        # figure the planner's predicted peak is checked against.
        if pl_module.device.type == "cuda" and self.result:
            self.result["memory/peak_bytes"] = float(torch.cuda.max_memory_allocated(pl_module.device))
        elif self._step_peak is not None:
            self._step_peak.leave()  # a run that ended inside the watched step
            if self._step_peak.peak is not None:
                self._record_cpu_peak(trainer)

    def _record_cpu_peak(self, trainer: Trainer) -> None:
        """The busiest rank's peak (a pipeline's first stage holds the most in flight), the same
        on every rank."""
        row = torch.tensor([float(self._step_peak.peak), float(trainer.global_rank)], dtype=torch.float64)
        if trainer.world_size > 1 and torch.distributed.is_initialized():
            rows = [torch.zeros_like(row) for _ in range(torch.distributed.get_world_size())]
            torch.distributed.all_gather(rows, row)
            row = max(rows, key=lambda r: float(r[0]))
        self.result["memory/peak_bytes"], self.result["memory/peak_rank"] = float(row[0]), float(row[1])
        rank_zero_info(f"litscale: memory peak of one step (CPU, torch's MemTracker): {_mib(float(row[0]))} "
                       f"on rank {int(row[1])}")

    def _estimate(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, float]:
        strategy = trainer.strategy
        params = list({id(p): p for p in pl_module.parameters()}.values())
        num_params = self._num_params or sum(getattr(p, "ds_numel", None) or p.numel() for p in params)
        return state_bytes_per_rank(
            num_params=num_params, mesh=mesh_of(strategy, trainer.world_size), sharding=contract_value(strategy, "sharding"),
            param_bytes=params[0].element_size() if params else 4,
            optimizer_bytes_per_param=optimizer_state_bytes_per_param(trainer.optimizers[0]),
            tensor_whole_params=self._moe[0], expert_params=self._moe[1])


def _watched_step(trainer: Trainer) -> int:
    """The second step (the first creates the optimizer's state), the first of a 1-step run."""
    return 1 if trainer.max_steps is None or trainer.max_steps < 0 or trainer.max_steps > 1 else 0


def _mib(value: float) -> str:
    return f"{value / 2**20:.2f} MiB"
