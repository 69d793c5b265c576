"""Where a sampler's order resumes: a data epoch and a count of samples into it.

Lightning numbers epochs itself and calls ``set_epoch`` with its own count, but that count is
not the data's: a fit stopped by ``max_steps`` marks its epoch complete, so a resume from the
last checkpoint starts Lightning's next epoch while the data still has the rest of the one it
was in. A resumed sampler therefore keeps the offset between the two (the data epoch minus
Lightning's) for the rest of the run, and reports each epoch's start (``on_epoch_start``) so
that the data module can count what the run has drawn of it.

A checkpoint's position is counted in global samples, and a resume shares it out over its own
data-parallel ranks: it must be a multiple of what they draw together (``shared_position``).
Before any rank starts the app refuses a resume whose position is not, and an elastic job (its
rank count changed on its own) skips ahead to the next one that is.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass


class ResumableOrder:
    """Mixin of the training samplers: ``set_epoch`` takes Lightning's epoch, ``self.epoch`` is
    the data's; ``resume_at`` starts the next epoch's order part way."""

    epoch: int
    _skip: tuple[int, int] | None = None  # (data epoch, samples of this rank's order to skip)
    _epoch_offset: int = 0
    _resuming: bool = False
    #: Samples of this rank's order the current epoch skipped (a resume), once it began.
    skipped: int = 0
    #: Called as ``on_epoch_start(data epoch, samples skipped)`` when an epoch's order begins.
    on_epoch_start: Callable[[int, int], None] | None = None

    def resume_at(self, epoch: int, samples: int) -> None:
        """Start data epoch ``epoch`` ``samples`` in (a resume); Lightning's next ``set_epoch``
        is taken to be that epoch."""
        self._skip, self._resuming = (epoch, samples), True

    def set_epoch(self, epoch: int) -> None:
        if self._resuming and self._skip is not None:
            self._epoch_offset, self._resuming = self._skip[0] - epoch, False
        self.epoch = epoch + self._epoch_offset

    def resumed(self, order: Iterator[int]) -> Iterator[int]:
        """This epoch's ``order`` less the samples a resume skips (once: later epochs whole)."""
        skip, self._skip = self._skip, None
        skipped = skip[1] if skip and skip[0] == self.epoch else 0
        self.skipped = skipped
        if self.on_epoch_start is not None:
            self.on_epoch_start(self.epoch, skipped)
        # NOTE: __len__ stays the whole epoch's: Lightning counts the resumed epoch's batches
        # from where the checkpoint left off, so only the iterator is shorter.
        return itertools.islice(order, skipped, None)


@dataclass(frozen=True)
class SharedPosition:
    """Where a resume continues a checkpoint's position on the run's data-parallel ranks."""

    epoch: int  # the data epoch
    samples: int  # into that epoch's order: a multiple of what the ranks draw together
    skipped: int = 0  # samples of the saved epoch's order after the saved position passed over


def shared_position(epoch: int, samples: int, *, dataset_samples: int, ranks: int,
                    block: int | None = None) -> SharedPosition:
    """The first position at or after ``samples`` of data epoch ``epoch`` that ``ranks``
    data-parallel ranks can share out; ``skipped`` is 0 when it is the saved one itself.

    Each rank's order is every ``ranks``-th index of the permutation, so a position splits only
    at a multiple of ``ranks``; with ``block`` (``ContiguousBlockSampler``: each rank takes a
    contiguous block of every global batch) only at a whole global batch of ``block x ranks``.
    Elsewhere the ranks would draw some samples twice and others never, out of order. A
    position at the end of the epoch's whole units (what the ranks can draw of it) is the next
    epoch's start."""
    unit = ranks * (block or 1)
    end = dataset_samples // unit * unit
    if samples >= end:
        return SharedPosition(epoch + 1, 0)
    shared = -(-samples // unit) * unit
    if shared == end:
        return SharedPosition(epoch + 1, 0, shared - samples)
    return SharedPosition(epoch, shared, shared - samples)


def unshared_position(epoch: int, samples: int, *, ranks: int, block: int | None = None) -> str:
    """Why a saved position does not split over ``ranks`` (``shared_position`` moved it)."""
    blocks = (f" in blocks of {block} samples per rank (micro batch x accumulation, determinism=layout_invariant)"
              if block and block > 1 else "")
    return (f"the checkpoint stopped at sample {samples} of epoch {epoch}, which {ranks} data-parallel "
            f"rank{'s' if ranks != 1 else ''} cannot share out evenly{blocks}")


def skipped_line(saved: int, point: SharedPosition) -> str:
    """What an elastic resume did to the saved position ``saved``: the samples it skipped."""
    continues = f"continues at sample {point.samples}" if point.samples else f"continues at the start of epoch {point.epoch}"
    last = saved + point.skipped - 1
    which = f"sample {saved}" if point.skipped == 1 else f"samples {saved} to {last}"
    return (f"skipped {which} of the epoch's order ({point.skipped} sample{'s' if point.skipped != 1 else ''}, "
            f"not trained in this epoch); the run {continues}")
