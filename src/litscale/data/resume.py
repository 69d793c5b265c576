"""Where a sampler's order resumes: a data epoch and a count of samples into it.

Lightning numbers epochs itself and calls ``set_epoch`` with its own count, but that count is
not the data's: a fit stopped by ``max_steps`` marks its epoch complete, so a resume from the
last checkpoint starts Lightning's next epoch while the data still has the rest of the one it
was in. A resumed sampler therefore keeps the offset between the two (the data epoch minus
Lightning's) for the rest of the run, and reports each epoch's start (``on_epoch_start``) so
that the data module can count what the run has drawn of it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator


class ResumableOrder:
    """Mixin of the training samplers: ``set_epoch`` takes Lightning's epoch, ``self.epoch`` is
    the data's; ``resume_at`` starts the next epoch's order part way."""

    epoch: int
    _skip: tuple[int, int] | None = None  # (data epoch, samples of this rank's order to skip)
    _epoch_offset: int = 0
    _resuming: bool = False
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
        if self.on_epoch_start is not None:
            self.on_epoch_start(self.epoch, skipped)
        # NOTE: __len__ stays the whole epoch's: Lightning counts the resumed epoch's batches
        # from where the checkpoint left off, so only the iterator is shorter.
        return itertools.islice(order, skipped, None)
