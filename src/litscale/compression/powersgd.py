"""PowerSGD (Vogels et al. 2019): torch's hooks, with bytes counted and state checkpointed.

torch's ``PowerSGDState`` keeps its error-feedback tensors and warm-start P/Q matrices per
DDP bucket index and has no ``state_dict`` (PyTorch #75666). Here they are saved per
parameter, with the iteration counter and the RNG that draws fresh Q matrices, so a resumed
run continues exactly although DDP groups the parameters into different buckets before its
first-step rebuild. (The batched variant reshapes whole buckets; its state is restored when
the bucket layout is the same.)
"""

# NOTE: no `from __future__ import annotations` here: DDP's register_comm_hook checks the
# hook's annotations, which must be real types (dist.GradBucket, Future[Tensor]), not strings.
import hashlib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from litscale.compression.state import BucketLayout, BucketTensors, CompressionState

Matrix = tuple[str, int, int, int]  # parameter name, rows, columns, approximation rank


class PowerSGDCompressionState(CompressionState):
    """Counters and checkpointing around torch's ``PowerSGDState`` (``self.powersgd``).

    What torch keeps per bucket is translated to per-parameter form whenever DDP's bucket
    layout changes (after a restart's first step) and in ``state_dict``, and handed back in
    torch's per-bucket form when the hook next sees the bucket.
    """

    def __init__(self, *, rank: int, start_iteration: int, warm_start: bool, batched: bool,
                 min_compression_rate: float, error_feedback: bool, seed: int = 0,
                 process_group: Any = None) -> None:
        super().__init__(error_feedback=error_feedback, process_group=process_group, seed=seed)
        self.batched = batched
        self.powersgd = torch_powersgd.PowerSGDState(
            process_group=process_group, matrix_approximation_rank=rank,
            start_powerSGD_iter=start_iteration, min_compression_rate=min_compression_rate,
            use_error_feedback=error_feedback, warm_start=warm_start, random_seed=seed,
            compression_stats_logging_frequency=10**9,
        )
        self.layouts: dict[int, BucketLayout] = {}
        self.matrices: dict[int, list[Matrix]] = {}
        self._errors = BucketTensors()  # errors not (yet) in torch's per-bucket form
        self._low_rank: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (P, Q)
        self._batched_state: dict[int, tuple[BucketLayout, dict[str, torch.Tensor]]] = {}

    def compressed_matrices(self, bucket: dist.GradBucket, names: tuple[str, ...]) -> list[Matrix]:
        """The matrices torch's ``powerSGD_hook`` compresses in this bucket, in the order their
        P and Q sit in its memory: grouped by shape, shapes in order of first appearance."""
        torch_state, groups = self.powersgd, {}
        for name, tensor in zip(names, bucket.gradients(), strict=True):
            rows = tensor.shape[0]
            cols = tensor.numel() // rows
            rank = min(rows, cols, torch_state.matrix_approximation_rank)
            if torch_powersgd._should_compress(rows, cols, rank, torch_state.min_compression_rate)[0]:
                groups.setdefault((rows, cols), []).append((name, rows, cols, rank))
        return [matrix for group in groups.values() for matrix in group]

    def restore_bucket(self, bucket: dist.GradBucket) -> None:
        """Hand torch's state what it holds for this bucket in per-parameter form."""
        index, layout, gradient = bucket.index(), self.layout(bucket), bucket.buffer()
        if self.layouts.get(index, layout) != layout:
            self._to_per_parameter()
        if index not in self.layouts:
            self.layouts[index] = layout
            self.matrices[index] = [] if self.batched else self.compressed_matrices(bucket, layout[0])
        torch_state = self.powersgd
        if self.batched:
            saved = self._batched_state.pop(index, None)
            # The batched variant reshapes a whole bucket: its state fits the same layout only.
            if saved is not None and saved[0] == layout:
                for key, tensor in saved[1].items():
                    getattr(torch_state, key)[index] = tensor.to(gradient.device)
            return
        if index not in torch_state.error_dict and len(self._errors):
            error = self._errors.take(index, layout, gradient.device)
            if error is not None:
                torch_state.error_dict[index] = error.to(gradient.dtype)
        matrices = self.matrices[index]
        compressing = torch_state.iter >= torch_state.start_powerSGD_iter
        if torch_state.warm_start and compressing and matrices and index not in torch_state.p_memory_dict:
            pieces = [self._low_rank.pop(matrix[0], None) or self._fresh_low_rank(matrix, gradient)
                      for matrix in matrices]
            torch_state.p_memory_dict[index] = torch.cat([p.reshape(-1) for p, _ in pieces]).to(gradient)
            torch_state.q_memory_dict[index] = torch.cat([q.reshape(-1) for _, q in pieces]).to(gradient)

    def _fresh_low_rank(self, matrix: Matrix, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A random start for one matrix's Q (P is overwritten before use), seeded by
        (seed, iteration, parameter name) where torch draws one per bucket: the same on every
        rank, and the same whatever bucket the parameter is in, so a resumed run that meets
        other buckets than the uninterrupted one still draws the same Q."""
        name, rows, cols, rank = matrix
        key = f"{self.seed}/{self.powersgd.iter}/{name}".encode()
        generator = torch.Generator().manual_seed(
            int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1)
        q = torch.randn(cols * rank, generator=generator, dtype=like.dtype)
        return like.new_empty(rows * rank), q.to(like.device)

    def _to_per_parameter(self) -> None:
        """Move torch's per-bucket errors and P/Q into per-parameter form (the layout changed)."""
        torch_state = self.powersgd
        if not self.batched:
            for index, error in torch_state.error_dict.items():
                self._errors.set(index, self.layouts[index], error)
            for index, p_memory in torch_state.p_memory_dict.items():
                self._low_rank.update(_split_low_rank(
                    self.matrices[index], p_memory, torch_state.q_memory_dict[index]))
        torch_state.error_dict.clear()
        torch_state.p_memory_dict.clear()
        torch_state.q_memory_dict.clear()
        self.layouts.clear()
        self.matrices.clear()

    def state_dict(self) -> dict[str, Any]:
        state, torch_state = super().state_dict(), self.powersgd
        saved = {
            **state,
            "iteration": torch_state.iter,
            "rng": _rng_state(torch_state.rng),
            "numel": (torch_state.total_numel_before_compression, torch_state.total_numel_after_compression),
        }
        if self.batched:
            saved["batched"] = {
                index: (self.layouts[index], {key: getattr(torch_state, key)[index].cpu()
                                              for key in ("error_dict", "p_memory_dict", "q_memory_dict")
                                              if index in getattr(torch_state, key)})
                for index in self.layouts}
            return saved
        errors, low_rank = BucketTensors(), dict(self._low_rank)
        for index, error in torch_state.error_dict.items():
            errors.set(index, self.layouts[index], error)
        for index, p_memory in torch_state.p_memory_dict.items():
            low_rank.update(_split_low_rank(self.matrices[index], p_memory, torch_state.q_memory_dict[index]))
        # Errors handed over from a checkpoint but not yet consumed are part of the state too.
        saved["errors"] = {**self._errors.per_parameter(), **errors.per_parameter()}
        saved["low_rank"] = {name: (p.cpu(), q.cpu()) for name, (p, q) in low_rank.items()}
        return saved

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        torch_state = self.powersgd
        torch_state.iter = int(state["iteration"])
        torch_state.rng = np.random.RandomState()
        name, keys, position, has_gauss, cached_gaussian = state["rng"]
        torch_state.rng.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian))
        torch_state.total_numel_before_compression, torch_state.total_numel_after_compression = state["numel"]
        torch_state.error_dict, torch_state.p_memory_dict, torch_state.q_memory_dict = {}, {}, {}
        self.layouts.clear()
        self.matrices.clear()
        self._errors.load(state.get("errors", {}))
        self._low_rank = dict(state.get("low_rank", {}))
        self._batched_state = dict(state.get("batched", {}))


def _rng_state(rng: np.random.RandomState) -> tuple:
    """numpy's RNG state as plain values and a tensor: Lightning loads checkpoints with
    ``weights_only=True``, which refuses numpy arrays."""
    name, keys, position, has_gauss, cached_gaussian = rng.get_state()
    return name, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached_gaussian)


def _split_low_rank(matrices: list[Matrix], p_memory: torch.Tensor,
                    q_memory: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """torch's flat P and Q memory of one bucket, as (P, Q) per compressed parameter."""
    pieces, p_offset, q_offset = {}, 0, 0
    for name, rows, cols, rank in matrices:
        pieces[name] = (p_memory[p_offset: p_offset + rows * rank].clone(),
                        q_memory[q_offset: q_offset + cols * rank].clone())
        p_offset, q_offset = p_offset + rows * rank, q_offset + cols * rank
    return pieces


def powersgd_compression_hook(
    state: PowerSGDCompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch's ``powerSGD_hook`` (or ``batched_powerSGD_hook``), counting what it sends."""
    torch_state, gradient = state.powersgd, bucket.buffer()
    dense_bytes = gradient.numel() * gradient.element_size()
    state.restore_bucket(bucket)
    compressing = torch_state.iter >= torch_state.start_powerSGD_iter
    numel_before = torch_state.total_numel_after_compression
    hook = torch_powersgd.batched_powerSGD_hook if state.batched else torch_powersgd.powerSGD_hook
    with state.timed():
        future = hook(torch_state, bucket)
    # Until start_iteration torch all-reduces the whole bucket; after it, torch counts the
    # elements of every tensor it all-reduces (P, Q and the tensors it leaves uncompressed)
    # before launching the collectives.
    sent = (torch_state.total_numel_after_compression - numel_before) * gradient.element_size() \
        if compressing else dense_bytes
    state.record(bucket, sent_bytes=sent, dense_bytes=dense_bytes)
    if compressing and _is_gloo(torch_state.process_group):
        # NOTE: torch's hook waits for its P and Q all-reduces inside future callbacks, which
        # run on the process group's worker threads. Gloo has two: with two buckets in flight
        # both can block there while the all-reduces they wait for need a free worker, a
        # deadlock (every run of 50 steps with 8 small buckets on CPU). Finishing each bucket
        # before DDP hands over the next keeps at most one callback waiting. It gives up
        # overlapping this bucket's communication with the rest of backward, on CPU only.
        future.wait()
    return future


def _is_gloo(group: Any) -> bool:
    return dist.get_backend(group) == dist.Backend.GLOO
