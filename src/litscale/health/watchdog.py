"""The watchdog: reads every rank's heartbeat, and when the job is hung, has every rank write
its stacks, prints one line naming the rank the others wait for, and ends the job.

It runs as a thread of global rank 0 under every launcher (litscale's, torchrun, srun): the
training thread may be stuck, the thread is not. A rank 0 that dies is the launcher's to
report, as any failed rank is.

NOTE: a rank 0 whose whole process freezes (SIGSTOP, a C call holding the GIL) freezes its
watchdog thread with it. Rank 1 therefore runs the same watchdog as a standby, which acts
only once rank 0's heartbeat and the primary's own liveness beat (``WATCHDOG_KEY``) have both
been silent for ``silent_s``: one mechanism under every launcher, torchrun and srun included,
where a watchdog in litscale's launcher process would cover its own launches only. Whichever
watchdog stops the job, the ranks' stacks, the line and the stop are the same.

NOTE: under srun and Ray no torchelastic agent hosts the store: rank 0's own process does, and
freezes with it. A read of a frozen store neither answers nor times out (TCPStore's client
waits on), so the standby's reads block; a second thread of the standby then sees that no read
has come back for ``silent_s`` and names rank 0 frozen. On rank 0's host it resumes rank 0
(SIGCONT), which brings the store back, and stops the job as usual; elsewhere it prints the line
and ends its own rank, whose launcher ends the job.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

from torch.distributed import Store

from litscale.health.beats import DONE, Beat
from litscale.health.diagnosis import Hang, Limits, RankState, find_hang
from litscale.health.doctor import UnsafeDumpError, diagnose, load_dumps
from litscale.health.heartbeat import (
    DIAGNOSED_KEY,
    STOP_KEY,
    Heartbeat,
    beat_key,
    dumped_key,
    record_elastic_error,
    report_dead_thread,
    wait_for_key,
)
from litscale.health.stacks import dump_own_stacks, dump_stacks_of
from litscale.health.store import read_json_keys

# How long the ranks have to write their stacks once told to stop.
DUMP_WAIT_S = 15.0
# The first words of the error a hang is recorded with, for the launcher to find.
HANG_ERROR = "HangDetected"
# Set by a launcher that prints the line of a hang itself (litscale's: it reads the line from
# the stopped ranks' errors); otherwise rank 0 prints it (torchrun, srun).
LAUNCHER_REPORTS_ENV = "LITSCALE_LAUNCHER_REPORTS_HANGS"
# The primary watchdog's liveness beat: its poll count, ``CLOSED`` once its watch has ended.
WATCHDOG_KEY = "watchdog"
CLOSED = b"closed"
PRIMARY_RANK = 0
STANDBY_RANK = 1
# How long the standby waits, at its start, for rank 0's first beat.
STANDBY_FIRST_READ_S = 60.0


def store_on_rank_zero() -> bool:
    """Whether rank 0's own process hosts the job's store (srun, Ray), not a torchelastic agent."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


class Watchdog:
    """Polls the heartbeats of ``world_size`` ranks every ``poll_s``; ``limits(median_step_s)``
    gives the limits for the job's current median step time (None before it is known).
    ``standby``: acts only while rank 0 and its watchdog are silent (see the module's note)."""

    def __init__(self, store: Store, world_size: int, *, limits: Callable[[float | None], Limits],
                 stacks_root: str, poll_s: float = 1.0, standby: bool = False,
                 exit: Callable[[int], None] = os._exit, own: Heartbeat | None = None) -> None:
        self.store, self.world_size, self.limits = store, world_size, limits
        self.stacks_root, self.poll_s, self.exit, self.standby = stacks_root, poll_s, exit, standby
        self.own = own  # this rank's heartbeat: its place, read without the store
        self.median_step_s: float | None = None  # set by the training loop of this rank
        self.states: dict[int, RankState] = {}
        self.done: set[int] = set()  # ranks whose watch has ended on purpose
        self._polls = 0
        self._primary: tuple[bytes | None, float] = (None, time.monotonic())  # its beat, seen since
        self.failure: str | None = None  # why the thread stopped early (then no hang is caught)
        self._closed, self._ended = threading.Event(), threading.Event()
        self._answered = time.monotonic()  # when the store last answered a whole poll
        self._stopping = False  # a watchdog thread is stopping the job
        self._thread = threading.Thread(target=self._run, name="litscale-watchdog", daemon=True)
        self._store_watch = threading.Thread(target=self._watch_store, name="litscale-store-watch", daemon=True)

    def start(self) -> Watchdog:
        if self.standby and store_on_rank_zero():
            # Rank 0's beat (its pid and host) while its store answers: it may freeze before
            # the first poll, and then no read comes back.
            if wait_for_key(self.store, beat_key(PRIMARY_RANK), timeout_s=STANDBY_FIRST_READ_S):
                self.check(time.monotonic())
                self._answered = time.monotonic()
            self._store_watch.start()
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5 * self.poll_s)
        if not self.standby:
            try:  # the standby stands down rather than take this for a frozen rank 0
                self.store.set(WATCHDOG_KEY, CLOSED)
            except Exception:  # the job's store may already be gone as the job ends
                pass

    def check(self, now: float) -> Hang | None:
        """Read the heartbeats once; the hang, if the job is hung."""
        keys = [beat_key(rank) for rank in range(self.world_size)]
        for rank, data in enumerate(read_json_keys(self.store, keys)):
            if data is None:
                continue
            beat = Beat.decode(data)
            if beat.phase == DONE:
                self.done.add(rank)
                self.states.pop(rank, None)
            elif rank in self.states:
                self.states[rank].update(beat, now)
            else:
                self.states[rank] = RankState(beat, at_place_since=now, silent_since=now)
        if len(self.states) + len(self.done) < self.world_size:
            return None  # a rank still starting: its process group's own timeout covers it
        return find_hang(self.states, now, self.limits(self.median_step_s))

    def _poll(self, now: float) -> Hang | None:
        """One round: the hang this watchdog is to act on, if any; raises ``StopIteration``
        when its watch is over (the job is being stopped, or, for the standby, rank 0's watch
        ended)."""
        if self.store.check([STOP_KEY]):
            raise StopIteration  # the other watchdog stopped the job (or a resumed rank 0 wakes)
        hang = self.check(now)
        if not self.standby:
            self._polls += 1
            self.store.set(WATCHDOG_KEY, str(self._polls).encode())
            return hang
        (primary,) = read_json_keys(self.store, [WATCHDOG_KEY])
        if primary == CLOSED or PRIMARY_RANK in self.done:
            raise StopIteration
        if primary != self._primary[0]:
            self._primary = (primary, now)
        silent_s = self.limits(self.median_step_s).silent_s
        rank0 = self.states.get(PRIMARY_RANK)
        frozen = (rank0 is not None and now - rank0.silent_since > silent_s
                  and now - self._primary[1] > silent_s)
        return hang if frozen else None

    def _run(self) -> None:
        try:
            while not self._closed.wait(self.poll_s):
                try:
                    hang = self._poll(time.monotonic())
                    self._answered = time.monotonic()
                except StopIteration:
                    return
                except Exception as error:
                    self.failure = report_dead_thread("hang watchdog", error, self._closed,
                                                      "this run is no longer watched for hangs")
                    return
                if hang is not None and not self._stopping:  # (the store watch may be stopping it)
                    self._stop_job(hang)
                    return
        finally:
            self._ended.set()

    def _watch_store(self) -> None:
        """The standby's second thread where rank 0 hosts the store (see the module's note)."""
        while not self._ended.wait(self.poll_s):
            now = time.monotonic()
            silent_s = self.limits(self.median_step_s).silent_s
            rank0 = self.states.get(PRIMARY_RANK)
            if rank0 is None or now - self._answered <= silent_s or self._closed.is_set() or self._stopping:
                continue
            states = dict(self.states)  # as the blocked poll left them, this rank's own place now
            if self.own is not None:
                states[self.own.rank] = RankState(self.own.beat, at_place_since=now, silent_since=now)
            hang = Hang(step=min(s.beat.step for r, s in states.items() if r != PRIMARY_RANK or len(states) == 1),
                        rank=PRIMARY_RANK,
                        doing=rank0.beat.doing(), for_s=now - rank0.silent_since, silent=True,
                        waiting={rank: s.beat.doing() for rank, s in states.items() if rank != PRIMARY_RANK})
            if rank0.beat.host != socket.gethostname():
                self._stop_without_store(hang)
                return
            self._resume(rank0.beat)  # its store answers again: the stop goes as ever
            self.store = self._fresh_store()
            self._stop_job(hang)
            return

    @staticmethod
    def _fresh_store() -> Store:
        """A new client of the job's store (the standby's own may still wait in a read)."""
        from litscale.health.store import health_store

        return health_store()

    def _stop_without_store(self, hang: Hang) -> None:
        """Rank 0 frozen on another host, with the store: this rank's stacks and the line, then
        this rank ends, and its launcher ends the job."""
        stacks_dir = os.path.join(self.stacks_root, f"hang-{hang.step}")
        line = hang.line(stacks_dir)
        record_elastic_error(f"{HANG_ERROR}: {line}", time.time())
        dump_own_stacks(os.path.join(stacks_dir, f"rank{STANDBY_RANK}.txt"), f"rank {STANDBY_RANK}; {line}")
        print(f"error: {line} (rank 0's process, which hosts the job's store, froze on another host)",
              file=sys.stderr, flush=True)
        self.exit(1)

    def _stop_job(self, hang: Hang) -> None:
        """Tell every rank to write its stacks and stop; write rank 0's and those of a rank on
        this host that no longer answers; print the line; end this process."""
        self._stopping = True
        stacks_dir = os.path.join(self.stacks_root, f"hang-{hang.step}")
        line = hang.line(stacks_dir)
        # First, so that the launcher reports this line even if it stops this rank early.
        record_elastic_error(f"{HANG_ERROR}: {line}", time.time())
        # Every heartbeat, this rank's too, sees the order within a second and writes its stacks.
        self.store.set(STOP_KEY, json.dumps({"stacks_dir": stacks_dir, "line": line,
                                             "run_dir": self.stacks_root, "pid": os.getpid()}).encode())
        silent = self.states[hang.rank].beat if hang.silent else None
        if silent is not None and silent.host == socket.gethostname():
            # from outside first (py-spy, where installed): the place where it froze
            dump_stacks_of(silent.pid, os.path.join(stacks_dir, f"rank{silent.rank}.txt"),
                           f"rank {silent.rank} (pid {silent.pid}), not responding; {line}")
        self._wait_for_stacks([rank for rank in range(self.world_size) if silent is None or rank != silent.rank])
        if silent is not None:
            self._resume(silent)
            self._wait_for_stacks([silent.rank])
        self._print_diagnosis()
        if not os.environ.get(LAUNCHER_REPORTS_ENV):
            print(f"error: {line}", file=sys.stderr, flush=True)
        self.exit(1)

    @staticmethod
    def _resume(beat: Beat) -> None:
        """SIGCONT to a silent rank on this host, once the others' stacks are written: a stopped
        process then takes the stop order like the others (its stacks, its exit). A process
        frozen otherwise (a C call holding the GIL) is ended by the launcher's teardown."""
        if beat.host != socket.gethostname():
            return
        try:
            os.kill(beat.pid, signal.SIGCONT)
        except OSError:  # gone already, or not ours to signal
            pass

    def _print_diagnosis(self) -> None:
        """The collective doctor's line on the dumps the ranks just wrote, where it finds the
        ranks disagreeing on a collective (a hang with no mismatch keeps its one error line),
        then let the stopped ranks exit."""
        try:
            dumps = load_dumps(self.stacks_root)
            diagnosis = diagnose(dumps, self.world_size) if dumps else None
            if diagnosis is not None and diagnosis.mismatch:
                print(f"doctor: {diagnosis.line}", file=sys.stderr, flush=True)
        except UnsafeDumpError as error:  # the hang's own line and stop still come
            print(f"doctor: {error}", file=sys.stderr, flush=True)
        finally:
            self.store.set(DIAGNOSED_KEY, b"1")

    def _wait_for_stacks(self, ranks: list[int]) -> None:
        deadline = time.monotonic() + DUMP_WAIT_S
        waiting = [dumped_key(rank) for rank in ranks]
        while waiting and time.monotonic() < deadline:
            waiting = [key for key in waiting if not self.store.check([key])]
            time.sleep(0.2)
