"""Checkpoints written while training goes on (``checkpoint.async_save=true``).

The training thread pays only for a copy of the state; the write, and the atomic publish of
``litscale.checkpoint.atomic``, happen on one background thread per rank:

- a ``torch.distributed.checkpoint`` directory (FSDP, tensor and pipeline parallel) is saved
  with DCP's ``async_save``: the writer's stager (``KeptCopies``) copies the shards (to pinned
  memory where CUDA is there) before it returns, then DCP plans and writes them in its own
  thread. The ranks agree on the plan
  and rank 0 writes the metadata over a gloo group of their own: collectives on the training
  group from another thread would interleave with the step's.
- a file (one process, DDP, local SGD, ...) is written by rank 0 alone: the checkpoint is
  copied on the training thread by the same stager, then saved by the strategy's
  ``CheckpointIO`` in the background. (Lightning's ``AsyncCheckpointIO`` would return before
  the file exists, and the publish must come after it.)

The stager lives as long as the writer: it keeps its copies' memory from one save to the next
and copies into it, which halves the copy of GPT-2 small's state on CPU (fresh pages cost a
fault each), and it copies GPT-nano's many small tensors in a few milliseconds where DCP's
``DefaultStager`` took 15 (a file) to 77 (FSDP's shards) (``experiments/checkpoints``).

One save at a time: a save waits for the one before it (two would share the staging path
and, for DCP, the group), and so does every removal of an old checkpoint, so a checkpoint is
deleted only once a newer one is published. The strategy's teardown waits for the last; an
error in the background is raised there or at the next save.

Except a second save of the same state: Lightning's ``ModelCheckpoint`` saves twice at each
validation (the top-k file, then ``last.ckpt``), and the second waited for the first's whole
write and then copied the state again. A save whose model and optimizer state is the last
save's, unchanged (the same step and loop position, every state tensor the same storage at the
same version: an optimizer step or a load bumps it), copies nothing and waits for nothing: the
writer publishes the bytes of the last save under the new name too (hard links, a copy where
the file system has none, or for a pointer-published directory a second pointer,
``litscale.checkpoint.atomic``). Where the rest of the checkpoint differs (the callbacks' state
at the first validation: ``last_model_path``), it is written anew around the same copy: a
file from the kept buffers, a directory's ``meta.pt`` beside links to the same shards.
"""

from __future__ import annotations

import copy
import os
import pickle
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from litscale.checkpoint.atomic import followed, link_or_copy, publish, remove

# The model's and the optimizers' state: what a save copies, and a second save of it need not.
STATE_KEYS = ("state_dict", "optimizer_states")


class CheckpointWriter:
    """One background thread that runs a rank's saves and removals in order (submitted and
    waited for by the training thread alone)."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="litscale-checkpoint")
        self._pending: list[Future] = []
        self._group: Any = None
        # Two sets of kept buffers: a sharded save stages its shards with one and copies the rest
        # of the checkpoint with the other, and both copies are written after the save returns.
        self._stager: KeptCopies | None = None
        self._copies: KeptCopies | None = None
        self.last: LastSave | None = None  # set by the strategy after each save it starts

    def holding(self, fingerprint: Fingerprint | None) -> LastSave | None:
        """The last save, if a checkpoint of ``fingerprint`` holds its state unchanged."""
        last = self.last
        return last if last is not None and fingerprint is not None and last.fingerprint.same_state(fingerprint) \
            else None

    def forget(self, path: str) -> None:
        """``path`` is being removed: a later save cannot be published from it."""
        if self.last is not None and self.last.path == path:
            self.last = None

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
            for copies in (self._stager, self._copies):
                if copies is not None:
                    copies.close()

    def stager(self) -> KeptCopies:
        """DCP's stager, kept for every save: a copy of the shards on the CPU (pinned where CUDA
        is there), into the memory of the last copy."""
        if self._stager is None:
            self._stager = KeptCopies(pinned=torch.cuda.is_available())
        return self._stager

    def snapshot(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint with each tensor copied: training may change the originals in place
        while the copy is written."""
        if self._copies is None:
            self._copies = KeptCopies(pinned=torch.cuda.is_available())
        return self._copies.copy(checkpoint)

    def process_group(self) -> Any:
        """The gloo group DCP's background saves synchronise on (created on first use, by
        every rank at the same save)."""
        import torch.distributed as dist

        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group


class KeptCopies:
    """A checkpoint's copy for a background write, into the memory of the last copy; DCP's
    ``AsyncStager`` for the sharded saves too.

    Written here rather than with DCP's ``DefaultStager``: its generic deep copy costs Python
    time per tensor, 15 ms a save for GPT-nano's 280 tensors and 77 ms for its FSDP shards,
    where these copies take about 4 (``experiments/checkpoints``). The n-th tensor met (a
    DTensor's local shard) is copied into the n-th buffer kept from the last save, made anew
    when its shape or dtype changes, all in one ``torch._foreach_copy_``; tensors on one
    storage (tied weights) stay one copy, as ``torch.save`` keeps them; other leaves are
    deep-copied (a callback's state may change in place)."""

    should_synchronize_after_execute = False  # DCP's AsyncStager: the copy is done when stage returns

    def __init__(self, *, pinned: bool) -> None:
        self.pinned = pinned
        self._buffers: list[torch.Tensor] = []

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return self.copy(state_dict)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._buffers.clear()

    def copy(self, checkpoint: Any) -> Any:
        walk = _Walk(self)
        copied = walk.copy(checkpoint)
        if walk.targets:
            with torch.no_grad():  # the sources need no detaching
                torch._foreach_copy_(walk.targets, walk.sources)
        return copied

    def buffer(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """The ``index``-th kept buffer, made (again) to hold a copy of ``like``."""
        kept = self._buffers[index] if index < len(self._buffers) else None
        if kept is None or kept.shape != like.shape or kept.dtype != like.dtype:
            kept = torch.empty(like.shape, dtype=like.dtype, pin_memory=self.pinned)
            if index < len(self._buffers):
                self._buffers[index] = kept
            else:
                self._buffers.append(kept)
        return kept


class _Walk:
    """One save's copy: the copied structure, and the buffer and source of each tensor."""

    def __init__(self, copies: KeptCopies) -> None:
        self.copies = copies
        self.targets: list[torch.Tensor] = []
        self.sources: list[torch.Tensor] = []
        self.seen: dict[tuple, torch.Tensor] = {}

    def copy(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        if isinstance(value, dict):
            return type(value)((key, self.copy(item)) for key, item in value.items())
        if type(value) in (list, tuple):
            return type(value)(self.copy(item) for item in value)
        return copy.deepcopy(value)

    def tensor(self, tensor: torch.Tensor) -> Any:
        # NOTE: a DTensor's shard and spec taken, and the copy made, directly: ``to_local`` and
        # ``from_local`` are autograd functions, 100 us a tensor, most of a sharded save's copy.
        is_dtensor = isinstance(tensor, DTensor)
        local = tensor._local_tensor if is_dtensor else tensor
        if type(local) is not torch.Tensor:  # another subclass: its own copy
            return copy.deepcopy(tensor.detach())
        storage = (local.data_ptr(), local.shape, local.stride(), local.dtype, local.device)
        buffer = self.seen.get(storage)
        if buffer is None:
            buffer = self.seen[storage] = self.copies.buffer(len(self.targets), local)
            self.targets.append(buffer)
            self.sources.append(local)
        return DTensor(buffer, tensor._spec, requires_grad=False) if is_dtensor else buffer


def start_directory_save(checkpoint: dict[str, Any], directory: str, *, writer: CheckpointWriter,
                         is_global_zero: bool) -> Callable[[], None]:
    """Start saving ``checkpoint`` as Lightning's model-parallel strategies lay a directory
    out: the module's and each optimizer's sharded state through DCP, then the rest in
    ``meta.pt`` by rank 0 (the order ``litscale.checkpoint.resume`` reads a complete directory by).
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


@dataclass(frozen=True)
class Fingerprint:
    """What a checkpoint holds, told without copying it: the training moment (step, epoch,
    loops), each state tensor's storage and version with the state's other leaves, and the
    rest of the checkpoint by value."""

    moment: bytes
    state: tuple
    rest: bytes

    def same_state(self, other: Fingerprint) -> bool:
        return self.moment == other.moment and self.state == other.state


@dataclass(frozen=True)
class LastSave:
    """A rank's last save started in the background: a second save of its state is published
    from it."""

    fingerprint: Fingerprint
    path: str  # where it is published (a pointer is followed when the bytes are read)
    copied_state: dict[str, Any] | None = None  # a file's copied state, on the kept buffers


def fingerprint(checkpoint: dict[str, Any]) -> Fingerprint | None:
    """The checkpoint's fingerprint; None for one that is not Lightning's (no step or loop
    state) or holds what pickle cannot describe (then it is saved anew)."""
    if "global_step" not in checkpoint or "loops" not in checkpoint:
        return None
    identities: list[tuple] = []

    def identity(tensor: torch.Tensor) -> int:
        identities.append(_identity(tensor))
        return len(identities) - 1

    try:
        moment = pickle.dumps(_described((checkpoint["global_step"], checkpoint.get("epoch"), checkpoint["loops"]),
                                         _value))
        state = pickle.dumps(_described([checkpoint.get(key) for key in STATE_KEYS], identity))
        rest = pickle.dumps(_described({key: value for key, value in checkpoint.items() if key not in STATE_KEYS},
                                       _value))
    except Exception:  # noqa: BLE001 - any object pickle refuses: no fingerprint, a fresh save
        return None
    return Fingerprint(moment=moment, state=(state, tuple(identities)), rest=rest)


def _described(value: Any, tensor: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with each tensor replaced by ``tensor(it)``, for pickle to compare."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tensor(value))
    if isinstance(value, dict):
        return [(key, _described(item, tensor)) for key, item in value.items()]
    if type(value) in (list, tuple):
        return (type(value).__name__, [_described(item, tensor) for item in value])
    return value


def _identity(tensor: torch.Tensor) -> tuple:
    """A state tensor as the storage it views and the version of that storage: the same at two
    saves only if nothing wrote to it in between (an in-place update bumps the version)."""
    is_dtensor = isinstance(tensor, DTensor)
    local = tensor._local_tensor if is_dtensor else tensor
    return (local.data_ptr(), tuple(local.shape), local.stride(), local.dtype, str(local.device), local._version,
            tuple(tensor.placements) if is_dtensor else None)


def _value(tensor: torch.Tensor) -> tuple:
    """A (small) tensor of the rest of a checkpoint by value."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    data = local.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return (str(local.dtype), tuple(local.shape), data)


def save_again(last: LastSave, now: Fingerprint, checkpoint: dict[str, Any], *, staging: str, path: str,
               by_pointer: bool, write_file: Callable[[dict[str, Any], str], None]) -> Callable[[], None]:
    """Rank 0's work that publishes a checkpoint holding ``last``'s state at ``path``, from
    ``last``'s bytes, once ``last`` is published (the writer runs its work in order). The rest
    of the checkpoint is copied now, when it differs from the last save's (it is small)."""
    from litscale.lightning_private import CHECKPOINT_METADATA_FILENAME

    same_bytes = now.rest == last.fingerprint.rest
    rest = None if same_bytes else KeptCopies(pinned=False).copy(
        {key: value for key, value in checkpoint.items() if key not in STATE_KEYS})

    def work() -> None:
        source = followed(last.path)
        if same_bytes and by_pointer and os.path.isdir(source):
            publish(source, path, by_pointer=True)  # a second pointer to the same save
            return
        remove(staging)  # what a save cut short left
        if os.path.isdir(source):
            link_or_copy(source, staging)
            if rest is not None:  # the shards linked, the rest its own
                meta = os.path.join(staging, CHECKPOINT_METADATA_FILENAME)
                os.unlink(meta)  # a link to the last save's: not written through
                torch.save(rest, meta)
        elif same_bytes:
            link_or_copy(source, staging)
        else:
            assert last.copied_state is not None, "a file save keeps its copied state"
            write_file({key: last.copied_state[key] if key in STATE_KEYS else rest[key] for key in checkpoint},
                       staging)
        publish(staging, path, by_pointer=by_pointer)

    return work
