"""A health thread that dies says so once, and the run knows it is unwatched: the heartbeat
and the hang watchdog on a store that fails, against the line the user sees."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from litscale.callbacks.watchdog import HangWatchdog
from litscale.health import heartbeat as heartbeat_module
from litscale.health.diagnosis import Limits
from litscale.health.heartbeat import Heartbeat
from litscale.health.watchdog import Watchdog


class FailingStore(dist.Store):
    """A store that answers ``good_calls`` calls, then fails as a store whose server died."""

    def __init__(self, good_calls: int) -> None:
        super().__init__()
        self.inner, self.left = dist.HashStore(), good_calls

    def _call(self, name, *args):
        self.left -= 1
        if self.left < 0:
            raise RuntimeError("Connection reset by peer")
        return getattr(self.inner, name)(*args)

    def set(self, key, value):
        return self._call("set", key, value)

    def get(self, key):
        return self._call("get", key)

    def check(self, keys):
        return self._call("check", keys)


@pytest.fixture(autouse=True)
def short_grace(monkeypatch):
    monkeypatch.setattr(heartbeat_module, "FAILURE_GRACE_S", 0.1)


def wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_heartbeat_whose_store_fails_says_so_once(capsys):
    heart = Heartbeat(FailingStore(good_calls=2), rank=3, interval_s=0.02).start()
    try:
        wait_for(lambda: heart.failure is not None)
    finally:
        heart.close()
    assert heart.failure == "RuntimeError: Connection reset by peer"
    assert capsys.readouterr().err == (
        "litscale: rank 3: heartbeat stopped (RuntimeError: Connection reset by "
        "peer); the hang watchdog no longer hears this rank\n"
    )


def test_a_watchdog_whose_store_fails_says_the_run_is_unwatched(capsys):
    limits = Limits(1.0, 1.0, 1.0, 1.0, 1.0)
    watchdog = Watchdog(
        FailingStore(good_calls=0),
        2,
        limits=lambda median: limits,
        stacks_root="unused",
        poll_s=0.02,
    ).start()
    try:
        wait_for(lambda: watchdog.failure is not None)
    finally:
        watchdog.close()
    assert capsys.readouterr().err == (
        "litscale: hang watchdog stopped (RuntimeError: Connection reset by peer); "
        "this run is no longer watched for hangs\n"
    )


def test_a_thread_stopped_by_the_jobs_end_reports_nothing(capsys):
    heart = Heartbeat(FailingStore(good_calls=2), rank=0, interval_s=0.02)
    heart._closed.set()  # closed as the store goes away
    heart._run()
    assert heart.failure is None and capsys.readouterr().err == ""


def test_the_summary_says_whether_the_run_was_watched():
    class Part:
        def __init__(self, failure):
            self.failure = failure

    callback = HangWatchdog(dirpath="unused")
    callback.heartbeat, callback.watchdog = Part(None), Part("RuntimeError: gone")
    callback.on_train_end(None, None)
    assert callback.result == {"health/watched": False}
    callback.watchdog = Part(None)
    callback.on_train_end(None, None)
    assert callback.result == {"health/watched": True}
