"""Mixture-of-experts router statistics, and the auxiliary-loss-free bias update.

After each optimizer step the callback takes what the routers counted over the step's
training forwards (``MoEDecoder.take_router_statistics``: per MoE layer, tokens routed to
each expert and assignments dropped by a capacity), sums it over the ranks, hands it to
``MoEDecoder.update_expert_bias`` (DeepSeek-V3's bias update, identical on every rank because
the counts are) and keeps it on the device. Only logging steps read it on the host:

- ``moe/load_imbalance``: max over mean tokens per expert, averaged over the MoE layers (1 is
  perfectly balanced, ``n_experts / top_k`` all tokens on the same experts);
- ``moe/dropped_fraction``: assignments the capacity dropped over those routed (0 dropless);
- ``moe/aux_loss``: the load-balancing loss ``n_experts * sum_i f_i P_i`` (1 when balanced),
  averaged over the MoE layers, before its coefficient (rank 0's tokens). What the training
  loss adds, ``aux_loss_coef`` times its sum over layers, is ``train/moe_aux_loss``.

``result`` (for ``summary.json``) holds the last step's imbalance (per layer too) and balance
loss, the mean imbalance over the run's steps (``moe/load_imbalance_mean``), and the dropped
fraction and tokens per expert (per MoE layer, ``moe/layers``) over the run. A net
without MoE layers makes it do nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from litscale.loggers import is_logging_step, log_to_loggers
from litscale.parallel.layout import TENSOR


def summed_over_ranks(load: Tensor) -> Tensor:
    """``load`` summed over every rank of the world when a process group exists.

    NOTE: over the world rather than the data-parallel group, which no callback can name for
    every strategy: a pipeline rank without a layer adds zeros to its row, and tensor-parallel
    peers, which compute the MoE layers whole, add the same counts once each. Neither changes
    the sign of ``mean - load`` nor any ratio below (``tensor_parallel_copies`` undoes the
    second for the token counts).
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        load = load.clone()
        dist.all_reduce(load)
    return load


def tensor_parallel_copies(trainer: Trainer) -> int:
    """Ranks that count the same tokens: the tensor-parallel ones (their strategy's mesh)."""
    mesh = getattr(trainer.strategy, "device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh[TENSOR].size() if TENSOR in names else 1


def load_imbalance(load: Tensor) -> Tensor:
    """Per layer: max over mean tokens per expert (``load`` ``[layers, n_experts]``); 0 for a
    layer that saw no token."""
    load = load.float()
    mean = load.mean(dim=-1)
    return torch.where(mean > 0, load.amax(dim=-1) / mean.clamp(min=1e-12), torch.zeros_like(mean))


class MoEStatsCallback(Callback):
    """Applies the MoE bias update after each optimizer step and logs the routers' figures
    (``moe/*``, see the module doc) every ``trainer.log_every_n_steps``; no host sync between."""

    def __init__(self) -> None:
        self.result: dict[str, Any] = {}
        self._stepped: int | None = None
        self._run_load: Tensor | None = None  # [moe layers, n_experts + 1], summed over steps
        self._imbalance_sum: Tensor | float = 0.0
        self._steps = 0
        self._last: tuple[Tensor, Tensor] | None = None  # the last step's load and balance loss
        self._layers: list[int] = []

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stepped = trainer.global_step

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._stepped:
            return  # a batch accumulated without an optimizer step
        self._stepped = trainer.global_step
        net = getattr(pl_module, "net", pl_module)
        statistics = net.take_router_statistics() if hasattr(net, "take_router_statistics") else None
        if statistics is None:
            return
        load = summed_over_ranks(statistics.load)
        net.update_expert_bias(load)
        load = load // tensor_parallel_copies(trainer)
        self._layers = list(net.config.moe_layers)
        self._accumulate(load, statistics.balance)
        if is_logging_step(trainer, trainer.global_step):
            log_to_loggers(trainer, self._step_figures())

    def _accumulate(self, load: Tensor, balance: Tensor) -> None:
        if self._run_load is None:
            self._run_load = torch.zeros_like(load)
        self._run_load = self._run_load.to(load.device) + load
        self._imbalance_sum = self._imbalance_sum + _mean_over_layers(load_imbalance(load[:, :-1]), load)
        self._steps += 1
        self._last = (load, balance)

    def _step_figures(self) -> dict[str, float]:
        load, balance = self._last
        return {"moe/load_imbalance": float(_mean_over_layers(load_imbalance(load[:, :-1]), load)),
                "moe/dropped_fraction": _dropped_fraction(load),
                "moe/aux_loss": float(_mean_over_layers(balance, balance[:, None]))}

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._last is None:
            return
        run = self._run_load.cpu()
        self.result = {
            **self._step_figures(),
            "moe/load_imbalance_mean": float(self._imbalance_sum) / self._steps,
            "moe/load_imbalance_per_layer": load_imbalance(self._last[0][:, :-1]).tolist(),
            "moe/dropped_fraction": _dropped_fraction(run),  # over the run, not the last step
            "moe/layers": self._layers,
            "moe/tokens_per_expert": run[:, :-1].tolist(),
        }
        rank_zero_info(
            f"litscale: moe: load imbalance {self.result['moe/load_imbalance']:.2f} at the last step, "
            f"{self.result['moe/load_imbalance_mean']:.2f} on average (max/mean tokens per expert; "
            f"1 is even) | dropped {self.result['moe/dropped_fraction']:.1%} of assignments | "
            f"balance loss {self.result['moe/aux_loss']:.3f} (1 when balanced)")

    def state_dict(self) -> dict[str, Any]:
        if self._run_load is None:
            return {}
        return {"run_load": self._run_load.cpu(), "imbalance_sum": float(self._imbalance_sum),
                "steps": self._steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self._run_load = state_dict["run_load"]
            self._imbalance_sum, self._steps = state_dict["imbalance_sum"], state_dict["steps"]


def _mean_over_layers(values: Tensor, load: Tensor) -> Tensor:
    """Mean of ``values`` over the layers whose ``load`` row is not all zero: a pipeline stage
    has rows for the layers it does not hold (rank 0's balance loss, never summed)."""
    seen = load.sum(dim=-1) > 0
    return (values * seen).sum() / seen.sum().clamp(min=1)


def _dropped_fraction(load: Tensor) -> float:
    return float(load[:, -1].sum() / load[:, :-1].sum().clamp(min=1))
