"""Checkpoints written while training goes on (``checkpoint.async_save=true``).

The training thread pays only for a copy of the state; the write, and the atomic publish of
``litscale.atomic_checkpoint``, happen on one background thread per rank:

- a ``torch.distributed.checkpoint`` directory (FSDP, tensor and pipeline parallel) is saved
  with DCP's ``async_save``: its stager copies the shards (to pinned memory where CUDA is
  there) before it returns, then writes them in its own thread. The ranks agree on the plan
  and rank 0 writes the metadata over a gloo group of their own: collectives on the training
  group from another thread would interleave with the step's.
- a file (one process, DDP, local SGD, ...) is written by rank 0 alone: the checkpoint is
  copied on the training thread by the same DCP stager, then saved by the strategy's
  ``CheckpointIO`` in the background. (Lightning's ``AsyncCheckpointIO`` would return before
  the file exists, and the publish must come after it.)

The stager lives as long as the writer: it keeps its copies' memory from one save to the next
and copies into it, which halves the copy of GPT-2 small's state on CPU (fresh pages cost a
fault each; ``experiments/checkpoints``).

One save at a time: a save waits for the one before it (two would share the staging path
and, for DCP, the group), and so does every removal of an old checkpoint, so a checkpoint is
deleted only once a newer one is published. The strategy's teardown waits for the last; an
error in the background is raised there or at the next save.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


class CheckpointWriter:
    """One background thread that runs a rank's saves and removals in order (submitted and
    waited for by the training thread alone)."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="litscale-checkpoint")
        self._pending: list[Future] = []
        self._group: Any = None
        self._stager: Any = None

    def submit(self, work: Callable[[], None]) -> Future:
        future = self._executor.submit(work)
        self._pending.append(future)
        return future

    def wait(self) -> None:
        """Block until every submitted save and removal is done; raise the first error."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            if self._stager is not None:
                self._stager.close()

    def stager(self) -> Any:
        """DCP's stager, kept for every save: a copy of the state on the CPU (pinned where CUDA
        is there), into the memory of the last copy."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            pinned = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=False))
        return self._stager

    def snapshot(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint with each tensor copied: training may change the originals in place
        while the copy is written."""
        return self.stager().stage(checkpoint)

    def process_group(self) -> Any:
        """The gloo group DCP's background saves synchronise on (created on first use, by
        every rank at the same save)."""
        import torch.distributed as dist

        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group


def start_directory_save(checkpoint: dict[str, Any], directory: str, *, writer: CheckpointWriter,
                         is_global_zero: bool) -> Callable[[], None]:
    """Start saving ``checkpoint`` as Lightning's model-parallel strategies lay a directory
    out: the module's and each optimizer's sharded state through DCP, then the rest in
    ``meta.pt`` by rank 0 (the order ``litscale.checkpoints`` reads a complete directory by).
    Returns once the shards are staged, with the work that completes the directory (on rank
    0: once every rank's shards and the metadata are on disk)."""
    import torch.distributed.checkpoint as dcp

    from litscale.lightning_private import CHECKPOINT_METADATA_FILENAME

    tensors = {"state_dict": checkpoint.pop("state_dict")}
    tensors.update({f"optimizer_{index}": state for index, state in enumerate(checkpoint.pop("optimizer_states", []))})
    os.makedirs(directory, exist_ok=True)
    written = dcp.async_save(tensors, checkpoint_id=directory, process_group=writer.process_group(),
                             async_stager=writer.stager())
    rest = writer.snapshot(checkpoint) if is_global_zero else None

    def complete() -> None:
        written.result()
        if rest is not None:
            torch.save(rest, os.path.join(directory, CHECKPOINT_METADATA_FILENAME))

    return complete


def wait_for_checkpoints(strategy: Any) -> None:
    """Every save the strategy started is written and published (nothing where saves are
    synchronous): for a save that must exist when the caller says so."""
    writer = getattr(strategy, "checkpoint_writer", None)
    if writer is not None:
        writer.wait()
