"""Random-number-generator state in checkpoints, per rank, so a resumed run draws the same
dropout masks and shuffles as the uninterrupted one. Lightning saves model, optimizer,
scheduler, loops and callbacks, but not RNG state."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch import Callback


def collect_rng_state() -> dict[str, Any]:
    """This process's RNG states, as plain tensors and lists (loadable with weights_only)."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": [list(item) if isinstance(item, tuple) else item for item in random.getstate()],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class RNGStateCallback(Callback):
    """Saves every rank's RNG state with the checkpoint and restores it on resume.

    The state is restored right before the first resumed training batch, not when the
    checkpoint is loaded: in between, the resumed run creates dataloader iterators (each draws
    a seed from torch's RNG) that the uninterrupted run had already created.
    """

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        state = collect_rng_state()
        if not (dist.is_available() and dist.is_initialized()):
            return {"ranks": [state]}
        # NOTE: Lightning builds the checkpoint dict on every rank before rank 0 writes it,
        # so this collective is reached by all ranks.
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, state)
        return {"ranks": gathered}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        ranks = state_dict.get("ranks") or []
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if rank < len(ranks):  # a resume at a larger world size keeps fresh seeds for new ranks
            self._pending = ranks[rank]

    def on_train_batch_start(self, *args: Any) -> None:
        if self._pending is not None:
            restore_rng_state(self._pending)
            self._pending = None
