"""What a rank reports of itself: its step and what it is doing (a ``Beat``), and the
order of those phases within a step, used to tell a rank that is behind from one waiting."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

# The phases of one training step in the order a rank goes through them; ``data`` is the
# wait for the next batch. Validation and checkpoint saves come after a step's optimizer.
# After ``fit``, the work a run still does (``AFTER_FIT``) is watched too; ``done``: the rank
# stopped reporting on purpose (its watch closed), so no watcher counts it as frozen.
AFTER_FIT = ("export", "summary")
DONE = "done"
PHASES = ("setup", "data", "forward", "backward", "optimizer", "validation", "checkpoint", *AFTER_FIT, DONE)
# Phases whose duration is not a step's: they get their own limits (the first step, too).
LONG_PHASES = ("setup", "validation", "checkpoint", *AFTER_FIT)


@dataclass(frozen=True)
class Beat:
    """One rank's latest report. ``seq`` grows with every publication, so a rank whose
    process is frozen or gone is seen without comparing clocks across hosts."""

    rank: int
    step: int
    phase: str
    collective: str | None = None  # the collective this phase waits in, where it is known
    seq: int = 0
    host: str = ""
    pid: int = 0
    first_step_done: bool = False

    @property
    def position(self) -> tuple[int, int]:
        """Where the rank is in training: later steps, then later phases, are further on."""
        return self.step, PHASES.index(self.phase)

    def doing(self) -> str:
        if self.phase in AFTER_FIT:
            return f"after fit ({self.phase}, in {self.collective})" if self.collective else f"after fit ({self.phase})"
        return f"{self.phase} ({self.collective})" if self.collective else self.phase

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> Beat:
        return cls(**json.loads(data))


def after_fit(trainer: Any, work: str, collective: str | None = None) -> None:
    """Tell the run's callbacks that this rank does ``work`` after fit (``on_after_fit``: the
    watchdog's phase, a fault injected there), waiting in ``collective`` where it does."""
    for callback in trainer.callbacks:
        hook = getattr(callback, "on_after_fit", None)
        if hook is not None:
            hook(trainer, work, collective)
