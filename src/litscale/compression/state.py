"""What every compression hook's state shares: bytes on the wire, time spent compressing,
per-parameter error-feedback residuals, and ``state_dict`` / ``load_state_dict``.

The residual store is keyed by parameter name, not by DDP bucket index, because DDP
rebuilds its buckets after the first iteration (and again after every restart): a residual
saved under bucket 3 of one layout would land on the wrong gradients of another.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

BucketLayout = tuple[tuple[str, ...], tuple[int, ...]]


class BucketTensors:
    """Flat per-bucket tensors (one element per gradient element) that survive a change of
    DDP's bucket layout: they are split per parameter and reassembled when it changes."""

    def __init__(self) -> None:
        self._flat: dict[int, tuple[BucketLayout, Tensor]] = {}
        self._by_name: dict[str, Tensor] = {}

    def get(self, index: int, layout: BucketLayout, device: torch.device) -> Tensor | None:
        entry = self._flat.get(index)
        if entry is not None and entry[0] == layout:
            return entry[1]
        if entry is not None:
            self._split_all()  # the layout changed: every bucket's entry is stale
        names, numels = layout
        pieces = [self._by_name.pop(name, None) for name in names]
        if all(piece is None for piece in pieces):
            return None
        like = next(piece for piece in pieces if piece is not None)
        flat = torch.cat([
            (piece if piece is not None else like.new_zeros(numel)).reshape(-1)
            for piece, numel in zip(pieces, numels, strict=True)
        ]).to(device)
        self._flat[index] = (layout, flat)
        return flat

    def take(self, index: int, layout: BucketLayout, device: torch.device) -> Tensor | None:
        """``get``, handing the tensor over: the store forgets it."""
        flat = self.get(index, layout, device)
        self._flat.pop(index, None)
        return flat

    def set(self, index: int, layout: BucketLayout, flat: Tensor) -> None:
        self._flat[index] = (layout, flat)

    def _split_all(self) -> None:
        for (names, numels), flat in self._flat.values():
            for name, piece in zip(names, flat[: sum(numels)].split(list(numels)), strict=True):
                self._by_name[name] = piece.clone()
        self._flat.clear()

    def per_parameter(self) -> dict[str, Tensor]:
        self._split_all()
        return {name: tensor.detach().cpu() for name, tensor in self._by_name.items()}

    def load(self, tensors: dict[str, Tensor]) -> None:
        self._flat.clear()
        self._by_name = {name: t.clone() for name, t in tensors.items()}

    def __len__(self) -> int:
        return len(self._flat) + len(self._by_name)


class CompressionState:
    """Counters and error-feedback residuals shared by litscale's hooks.

    ``bytes_sent`` is the payload this rank hands to collectives (what the hook actually
    communicated); ``dense_bytes`` what the uncompressed all-reduce of the same buckets would
    have sent. ``compress_seconds`` is time spent encoding and decoding, not communicating.
    """

    def __init__(self, *, error_feedback: bool = False, process_group: Any = None,
                 seed: int = 0) -> None:
        self.error_feedback = error_feedback
        self.process_group = process_group
        self.seed = seed
        self.bytes_sent = 0
        self.dense_bytes = 0
        self.compress_seconds = 0.0
        self.steps = 0
        self.residuals = BucketTensors()
        self._names: dict[int, str] = {}

    # --- attaching ------------------------------------------------------------------------
    def bind(self, model: nn.Module) -> None:
        """Name the parameters (for checkpointed state); ``model`` may be the DDP wrapper."""
        module = getattr(model, "module", model)
        self._names = {id(p): name for name, p in module.named_parameters()}

    def layout(self, bucket: dist.GradBucket) -> BucketLayout:
        params = bucket.parameters()
        names = tuple(self._names.get(id(p), f"bucket{bucket.index()}.{i}") for i, p in enumerate(params))
        return names, tuple(p.numel() for p in params)

    @property
    def group(self) -> Any:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def uniform_noise(self, layout: BucketLayout, device: torch.device) -> Tensor:
        """Uniform [0, 1) numbers for stochastic rounding, one per gradient element.

        Drawn per parameter from a seed of (seed, rank, step, parameter name): independent
        across ranks and steps, and the same whatever bucket a parameter sits in, so a
        resumed run (restored ``steps``) rounds exactly as the uninterrupted one would have.
        """
        rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        pieces = []
        for name, numel in zip(*layout, strict=True):
            key = f"{self.seed}/{rank}/{self.steps}/{name}".encode()
            seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
            generator = torch.Generator(device=device).manual_seed(seed)
            pieces.append(torch.rand(numel, generator=generator, device=device))
        return torch.cat(pieces)

    # --- accounting ------------------------------------------------------------------------
    def record(self, bucket: dist.GradBucket, *, sent_bytes: int, dense_bytes: int) -> None:
        self.bytes_sent += int(sent_bytes)
        self.dense_bytes += int(dense_bytes)
        if bucket.is_last():  # DDP reduces bucket 0 last: one step is over
            self.steps += 1

    @contextmanager
    def timed(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.compress_seconds += time.perf_counter() - start

    def totals(self) -> dict[str, float]:
        return {"bytes_sent": self.bytes_sent, "dense_bytes": self.dense_bytes,
                "compress_seconds": self.compress_seconds, "steps": self.steps}

    # --- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state (residuals differ per rank; the callback gathers all ranks)."""
        return {
            **self.totals(),
            "residuals": self.residuals.per_parameter(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bytes_sent, self.dense_bytes = int(state["bytes_sent"]), int(state["dense_bytes"])
        self.compress_seconds, self.steps = float(state["compress_seconds"]), int(state["steps"])
        self.residuals.load(state.get("residuals", {}))
