"""Deciding from the ranks' heartbeats that a job is hung, and who it is waiting for.

Durations are measured on the watcher's own clock, from when it first saw a rank at its
current place, so ranks on hosts with different clocks compare fairly.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from litscale.health.beats import AFTER_FIT, Beat


@dataclass(frozen=True)
class Limits:
    """How long a rank may stay at one place before the job counts as hung: ``step_s`` in an
    ordinary step, longer before the first step is done, in validation and in a checkpoint
    save; ``silent_s`` without a heartbeat at all (a frozen or vanished process); ``after_fit_s``
    in the work after ``fit`` (export, summary; the checkpoint limit when not given)."""

    step_s: float
    first_step_s: float
    validation_s: float
    checkpoint_s: float
    silent_s: float
    after_fit_s: float | None = None

    def for_beat(self, beat: Beat) -> float:
        if beat.phase in AFTER_FIT:
            return self.after_fit_s or self.checkpoint_s
        if not beat.first_step_done:
            return self.first_step_s
        return {"validation": self.validation_s, "checkpoint": self.checkpoint_s}.get(beat.phase, self.step_s)


@dataclass
class RankState:
    """What the watcher knows of one rank: its last beat, and since when (watcher's clock)
    it has been at that place and has published nothing new."""

    beat: Beat
    at_place_since: float
    silent_since: float

    def update(self, beat: Beat, now: float) -> None:
        if beat.position != self.beat.position:
            self.at_place_since = now
        if beat.seq != self.beat.seq:
            self.silent_since = now
        self.beat = beat


@dataclass(frozen=True)
class Hang:
    """A diagnosed hang: the rank the others wait for, what it is doing, for how long, and
    the others and the collective they wait in."""

    step: int
    rank: int
    doing: str
    for_s: float
    waiting: dict[int, str]  # rank -> what it waits in
    silent: bool = False
    culprit_step: int | None = None

    def line(self, stacks_dir: str) -> str:
        where = "not responding (no heartbeat)" if self.silent else f"stuck in {self.doing}"
        if self.culprit_step is not None and self.culprit_step != self.step:
            where += f" at step {self.culprit_step}"
        text = f"hang at step {self.step}: rank {self.rank} {where} for {self.for_s:.0f} s"
        groups: dict[str, list[int]] = {}
        for rank, doing in sorted(self.waiting.items()):
            groups.setdefault(doing, []).append(rank)
        for doing, ranks in groups.items():
            text += f"; {_ranks(ranks)} waiting in {doing}"
        return f"{text}; stacks in {stacks_dir}"


def find_hang(states: dict[int, RankState], now: float, limits: Limits) -> Hang | None:
    """A hang when no rank has moved for longer than its limit; None otherwise. A rank silent
    for ``silent_s`` is past its limit whatever its last beat said (a process frozen before its
    heartbeat told of its first step must not get the first step's limit)."""
    if not states or any(now - s.at_place_since <= limits.for_beat(s.beat)
                         and now - s.silent_since <= limits.silent_s for s in states.values()):
        return None
    culprit = _culprit(states, now, limits)
    state = states[culprit]
    waiting = {rank: s.beat.doing() for rank, s in states.items() if rank != culprit}
    silent = now - state.silent_since > limits.silent_s
    # A silent rank's last beat may be older than its last steps: the step is the heard ranks'.
    heard = [s.beat.step for s in states.values() if now - s.silent_since <= limits.silent_s]
    return Hang(step=min(heard or [s.beat.step for s in states.values()]), rank=culprit,
                doing=state.beat.doing(), for_s=now - state.at_place_since, waiting=waiting,
                silent=silent, culprit_step=None if silent else state.beat.step)


def _culprit(states: dict[int, RankState], now: float, limits: Limits) -> int:
    """The rank the others wait for, in order of evidence: one that stopped reporting; one
    busy in a phase with no collective while others wait in one (the furthest behind, if
    several); the one at a place the fewest ranks share (a rank that went past a collective
    the others wait in is ahead of them: the furthest ahead, on a tie); the longest at its
    place."""
    silent = [r for r, s in states.items() if now - s.silent_since > limits.silent_s]
    if silent:
        return min(silent)
    busy = [r for r, s in states.items() if s.beat.collective is None]
    if busy and len(busy) < len(states):
        return min(busy, key=lambda r: (states[r].beat.position, r))
    counts = Counter(s.beat.position for s in states.values())
    if len(counts) > 1:
        return min(states, key=lambda r: (counts[states[r].beat.position],
                                          _reversed(states[r].beat.position), r))
    return min(states, key=lambda r: (states[r].at_place_since, r))


def _reversed(position: tuple[int, int]) -> tuple[int, int]:
    return -position[0], -position[1]


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))
