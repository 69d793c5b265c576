"""Each rank's heartbeat: its latest ``Beat``, published to the job's store by a thread.

The training loop only assigns fields (a few attribute writes per step: no store round
trip, no collective, no device sync); the thread publishes once per ``interval_s`` and, when
the watchdog asks the job to stop, dumps this rank's stacks and ends the process. A thread,
because the training thread may be the one that is stuck.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import replace

from torch.distributed import Store

from litscale.health import flight_recorder
from litscale.health.beats import DONE, Beat
from litscale.health.stacks import dump_own_stacks

STOP_KEY = "stop"  # set by the watchdog: JSON {"stacks_dir", "line", "run_dir", "pid"}
DIAGNOSED_KEY = "diagnosed"  # set by the watchdog once it has matched the ranks' dumps


def beat_key(rank: int) -> str:
    return f"beat/{rank}"


def dumped_key(rank: int) -> str:
    return f"dumped/{rank}"


# Exit code of a rank stopped by the watchdog (the job's is 1, as for any failure), and the
# first words of the error it leaves for the launcher, followed by the watchdog's line.
STOPPED_EXIT_CODE = 1
STOPPED_BY_WATCHDOG = "stopped by the hang watchdog"


class Heartbeat:
    """Publishes this rank's place in training; stops the process when the job is stopped.

    The process whose watchdog gave the order (its ``pid``) ends itself once every rank's
    stacks are written; ``exit_on_stop=False`` leaves every process running (tests)."""

    def __init__(self, store: Store, rank: int, *, interval_s: float = 1.0, exit_on_stop: bool = True) -> None:
        self.store, self.rank, self.interval_s, self.exit_on_stop = store, rank, interval_s, exit_on_stop
        self.beat = Beat(rank=rank, step=0, phase="setup", host=socket.gethostname(), pid=os.getpid())
        self._seq = 0
        self.failure: str | None = None  # why the thread stopped early (then no one hears this rank)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="litscale-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._publish()
        self._thread.start()
        return self

    def mark(self, step: int, phase: str, collective: str | None = None) -> None:
        """Where this rank is now (called from the training loop's hooks)."""
        self.beat = replace(self.beat, step=step, phase=phase, collective=collective)

    def first_step_done(self) -> None:
        if not self.beat.first_step_done:
            self.beat = replace(self.beat, first_step_done=True)

    def close(self) -> None:
        """Stop publishing, and say so: a rank done on purpose is not a frozen one."""
        self._closed.set()
        self._thread.join(timeout=5 * self.interval_s)
        self.mark(self.beat.step, DONE)
        try:
            self._publish()
        except Exception:  # the job's store may already be gone as the job ends
            pass

    def _publish(self) -> None:
        self._seq += 1
        self.store.set(beat_key(self.rank), replace(self.beat, seq=self._seq).encode())

    def _run(self) -> None:
        try:
            while not self._closed.wait(self.interval_s):
                self._publish()
                if self.store.check([STOP_KEY]):
                    self._stop(json.loads(self.store.get(STOP_KEY)))
        except Exception as error:
            self.failure = report_dead_thread(f"rank {self.rank}: heartbeat", error, self._closed,
                                              "the hang watchdog no longer hears this rank")

    def _stop(self, order: dict) -> None:
        """Write this rank's stacks into the hang report's directory and its Flight Recorder
        buffer into the run dir; end the process once the watchdog has read them all."""
        path = os.path.join(order["stacks_dir"], f"rank{self.rank}.txt")
        dump_own_stacks(path, f"rank {self.rank} ({self.beat.host}, pid {self.beat.pid}) at step "
                              f"{self.beat.step}, in {self.beat.doing()}; {order['line']}")
        if order.get("run_dir"):
            flight_recorder.dump(order["run_dir"], self.rank, reason=order["line"])
        self.store.set(dumped_key(self.rank), b"1")
        if self.exit_on_stop and order.get("pid") != os.getpid():
            # NOTE: the launcher stops every rank once one exits: rank 0 must have matched
            # the dumps and printed the doctor's line first (bounded: it may be gone).
            wait_for_key(self.store, DIAGNOSED_KEY, timeout_s=DIAGNOSIS_WAIT_S)
            record_elastic_error(f"{STOPPED_BY_WATCHDOG}: {order['line']}", time.time())
            os._exit(STOPPED_EXIT_CODE)


# How long a stopped rank waits for the watchdog's diagnosis before it exits anyway.
DIAGNOSIS_WAIT_S = 30.0


def wait_for_key(store: Store, key: str, timeout_s: float, poll_s: float = 0.2) -> bool:
    """Whether ``key`` appeared in ``store`` within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


# How long a watcher thread that failed waits for the job's own end before it reports: a
# store that goes away as the job ends is no failure.
FAILURE_GRACE_S = 2.0


def report_dead_thread(who: str, error: BaseException, closed: threading.Event, consequence: str) -> str | None:
    """Say once, on stderr, that a health thread died and what the run lost; return the reason
    (None when the job was ending anyway)."""
    if closed.wait(FAILURE_GRACE_S):
        return None
    reason = (f"{type(error).__name__}: {error}".splitlines() or [""])[0]
    print(f"litscale: {who} stopped ({reason}); {consequence}", file=sys.stderr, flush=True)
    return reason


def record_elastic_error(message: str, timestamp: float) -> None:
    """Leave ``message`` where torch's elastic agent (litscale's launcher, torchrun) reads a
    failed rank's error, so that the launcher reports it: this process ends with ``os._exit``,
    which skips torch's own recording. The file's format is torch's (``ErrorHandler``)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    with open(path, "w") as handle:
        json.dump({"message": {"message": message, "extraInfo": {"timestamp": str(int(timestamp))}}}, handle)
