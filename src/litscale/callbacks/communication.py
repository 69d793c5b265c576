"""Bytes on the wire and compression time, logged under ``comm/*``; the compression hook's
state (error-feedback residuals, PowerSGD's matrices and counters) carried in checkpoints.

Lightning saves a callback's ``state_dict`` in the checkpoint and hands it back to
``load_state_dict`` on resume, before the first step: exactly when the hook's state must be
restored. Residuals differ per rank, so every rank's state is gathered into the checkpoint
(written by rank 0) and each rank takes back its own.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from litscale.compression import CommHook
from litscale.loggers import is_logging_step, log_to_loggers


class CommunicationCallback(Callback):
    """Logs ``comm/bytes_per_step`` (sent by this rank), ``comm/dense_bytes_per_step``,
    ``comm/compress_time_s`` (per step, over the logging interval), ``comm/bytes_sent`` and
    ``comm/dense_bytes`` (this rank's totals so far) and ``comm/compression_ratio`` (their
    ratio: over the run); for parameter synchronisations (streaming DiLoCo's fragments),
    ``comm/bytes_per_sync`` (their mean over the run) and ``comm/peak_bytes`` (the largest);
    and checkpoints the hook's state. ``compression`` defaults to the strategy's."""

    def __init__(self, *, compression: CommHook | None = None) -> None:
        self.compression = compression
        self.result: dict[str, float] = {}
        self._last: dict[str, float] | None = None

    def _state(self, trainer: Trainer | None = None) -> Any:
        if self.compression is None and trainer is not None:
            self.compression = getattr(trainer.strategy, "compression", None)
        return None if self.compression is None else self.compression.state

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._state(trainer)  # before Lightning restores callback states on resume

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        state = self._state(trainer)
        if state is None or not hasattr(state, "totals"):
            return
        step = trainer.global_step
        if self._last is not None and not is_logging_step(trainer, step):
            return  # figures are averaged over the interval Lightning logs
        totals = state.totals()
        last, self._last = self._last, totals
        if last is None or totals["steps"] == last["steps"]:
            return
        steps = totals["steps"] - last["steps"]
        self.result = {
            "comm/bytes_per_step": (totals["bytes_sent"] - last["bytes_sent"]) / steps,
            "comm/dense_bytes_per_step": (totals["dense_bytes"] - last["dense_bytes"]) / steps,
            "comm/compress_time_s": (totals["compress_seconds"] - last["compress_seconds"]) / steps,
            "comm/bytes_sent": float(totals["bytes_sent"]),
            "comm/dense_bytes": float(totals["dense_bytes"]),
            "comm/compression_ratio": totals["dense_bytes"] / max(1, totals["bytes_sent"]),
        }
        if totals.get("syncs"):  # parameter synchronisations (local SGD, streaming DiLoCo)
            self.result["comm/bytes_per_sync"] = totals["sync_bytes"] / totals["syncs"]
            self.result["comm/peak_bytes"] = float(totals["peak_bytes"])
        log_to_loggers(trainer, self.result)

    def state_dict(self) -> dict[str, Any]:
        state = self._state()
        if state is None or not hasattr(state, "state_dict"):
            return {}
        local = state.state_dict()
        if getattr(state, "identical_across_ranks", False) or not (dist.is_available() and dist.is_initialized()):
            return {"ranks": [local]}
        # NOTE: every rank calls state_dict() when a checkpoint is saved (Lightning dumps the
        # checkpoint on all ranks and writes it on rank 0), so this collective is safe.
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, local)
        return {"ranks": ranks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state, ranks = self._state(), state_dict.get("ranks")
        if state is None or not ranks:
            return
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if getattr(state, "identical_across_ranks", False):
            state.load_state_dict(ranks[0])
            return
        if len(ranks) == world_size:
            local = ranks[rank]
        else:
            local = moved_state(ranks)
            rank_zero_warn(f"compression state was saved by {len(ranks)} ranks and is resumed on {world_size}: each "
                           "rank's error feedback starts from the saved ranks' mean (what the averaged update has "
                           "not received yet)")
        state.load_state_dict(local)
        self._last = None


# A rank's own error feedback, by parameter (or fragment) name: what its compressed share left out.
PER_RANK_FEEDBACK = ("residuals", "errors", "fragment_residuals")


def moved_state(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The state each rank of another world size resumes with: rank 0's counters and shared
    state (PowerSGD's warm-start factors, identical on every rank), and as each rank's error
    feedback the saved ranks' mean. Every hook here averages what the ranks send, so the update
    was missing the mean of their residuals; handing each new rank that mean gives it back in
    full on the next step, whatever the new world size. PowerSGD's batched errors (one per
    bucket: the buckets of another layout are other tensors) start from zero."""
    moved = {**ranks[0], **({"batched": {}} if "batched" in ranks[0] else {})}
    for key in PER_RANK_FEEDBACK:
        if key not in ranks[0]:
            continue
        shared = set.intersection(*(set(state.get(key) or {}) for state in ranks))
        moved[key] = {name: sum(state[key][name] for state in ranks) / len(ranks) for name in sorted(shared, key=str)}
    return moved
