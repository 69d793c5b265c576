"""No silent hangs: the diagnosis from heartbeats, the stop protocol in one process, and real
2-rank jobs (litscale's launcher, torchrun, the SLURM launcher's local twin) with a rank that
hangs, skips a collective or is slow (``InjectFault``), against what the user is told."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers.cli import REPO, explain, run_in_own_group, summaries
from helpers.inprocess import train_on_pool

from litscale.callbacks.faults import InjectFault
from litscale.callbacks.straggler import StragglerReport, _ratio_to_peers
from litscale.callbacks.watchdog import HangWatchdog
from litscale.health import watchdog as watchdog_module
from litscale.health.beats import Beat
from litscale.health.diagnosis import Limits, RankState, find_hang
from litscale.health.heartbeat import Heartbeat
from litscale.health.watchdog import Watchdog

LIMITS = Limits(step_s=10, first_step_s=100, validation_s=50, checkpoint_s=50, silent_s=5)


def states(*beats: Beat, at_place_since: float = 0.0) -> dict[int, RankState]:
    """Ranks at their place since ``at_place_since``, their heartbeats still coming."""
    return {b.rank: RankState(b, at_place_since=at_place_since, silent_since=STILL_BEATING) for b in beats}


STILL_BEATING = 1e9  # a heartbeat heard after any `now` of these tests


def beat(rank: int, step: int, phase: str, collective: str | None = None, **kw) -> Beat:
    return Beat(rank=rank, step=step, phase=phase, collective=collective, first_step_done=True, **kw)


ALL_REDUCE = "gradient all-reduce"


# --- the diagnosis --------------------------------------------------------------------------


def test_no_hang_while_any_rank_is_within_its_limit():
    ranks = states(beat(0, 8, "backward", ALL_REDUCE), beat(1, 8, "forward"))
    assert find_hang(ranks, now=10.0, limits=LIMITS) is None  # exactly at the limit: not yet
    ranks[0].at_place_since = 5.0
    assert find_hang(ranks, now=12.0, limits=LIMITS) is None  # rank 0 moved 7 s ago


def test_a_rank_busy_outside_any_collective_is_the_one_the_others_wait_for():
    ranks = states(beat(0, 8, "backward", ALL_REDUCE), beat(1, 8, "forward"), beat(2, 8, "backward", ALL_REDUCE))
    hang = find_hang(ranks, now=12.0, limits=LIMITS)
    assert hang.line("run/hang-8") == ("hang at step 8: rank 1 stuck in forward for 12 s; ranks 0,2 waiting in "
                                       "backward (gradient all-reduce); stacks in run/hang-8")


def test_a_rank_that_went_past_a_collective_the_others_wait_in_is_named():
    """Two ranks, both in a collective, one a step ahead: it skipped the one the other waits in."""
    ranks = states(beat(0, 8, "backward", ALL_REDUCE), beat(1, 9, "backward", ALL_REDUCE))
    hang = find_hang(ranks, now=11.0, limits=LIMITS)
    assert (hang.rank, hang.step) == (1, 8)
    assert hang.line("d") == ("hang at step 8: rank 1 stuck in backward (gradient all-reduce) at step 9 for "
                              "11 s; rank 0 waiting in backward (gradient all-reduce); stacks in d")
    four = states(beat(0, 8, "backward", ALL_REDUCE), beat(1, 8, "backward", ALL_REDUCE),
                  beat(2, 7, "backward", ALL_REDUCE), beat(3, 8, "backward", ALL_REDUCE))
    assert find_hang(four, now=11.0, limits=LIMITS).rank == 2  # the place no other rank shares


def test_a_rank_without_heartbeats_is_named_not_responding():
    ranks = states(beat(0, 3, "backward", ALL_REDUCE), beat(1, 3, "backward", ALL_REDUCE))
    ranks[1].silent_since = 0.0  # its heartbeat stopped, its process frozen or gone
    hang = find_hang(ranks, now=11.0, limits=LIMITS)
    assert hang.line("d").startswith("hang at step 3: rank 1 not responding (no heartbeat) for 11 s; rank 0 ")


@pytest.mark.parametrize(("first_step_done", "phase", "limit"), [
    (False, "forward", 100), (True, "validation", 50), (True, "checkpoint", 50), (True, "data", 10),
    (True, "export", 50), (False, "summary", 50)])  # after fit: its own limit (here the checkpoint's)
def test_first_step_validation_and_checkpoints_have_their_own_limits(first_step_done, phase, limit):
    ranks = states(*(Beat(rank=r, step=0, phase=phase, first_step_done=first_step_done) for r in (0, 1)))
    assert find_hang(ranks, now=limit, limits=LIMITS) is None
    assert find_hang(ranks, now=limit + 0.1, limits=LIMITS) is not None


def test_a_rank_silent_since_before_its_first_step_is_named_at_the_silent_limit():
    """A rank that froze whole before its heartbeat told of its first step: its last beat says
    setup (the first step's limit), yet silence is past any limit; the step is the heard rank's."""
    ranks = states(Beat(rank=0, step=0, phase="setup"), beat(1, 6, "backward", ALL_REDUCE))
    ranks[0].silent_since = 0.0
    hang = find_hang(ranks, now=11.0, limits=LIMITS)
    assert hang.line("d") == ("hang at step 6: rank 0 not responding (no heartbeat) for 11 s; rank 1 waiting in "
                              "backward (gradient all-reduce); stacks in d")


def test_the_default_limit_is_twenty_median_steps_at_least_a_minute():
    watchdog = HangWatchdog(dirpath="d")
    assert watchdog.limits(None).step_s == 60.0 and watchdog.limits(0.5).step_s == 60.0
    assert watchdog.limits(4.0).step_s == 80.0
    assert watchdog.limits(4.0).first_step_s == 600.0
    assert HangWatchdog(dirpath="d", timeout_s=5).limits(4.0).step_s == 5


# --- the stop protocol, in one process --------------------------------------------------------


@pytest.mark.slow
def test_the_watchdog_has_every_heartbeat_write_its_stacks_then_stops_with_one_line(tmp_path, capsys):
    """Two heartbeats and the watchdog on one in-memory store: the stuck 'rank' is named, each
    writes its stacks (this test's own frames among them), and the watchdog ends with code 1."""
    store = dist.HashStore()  # its own: nothing another test wrote is in it
    hearts = [Heartbeat(store, rank, interval_s=0.05, exit_on_stop=False).start() for rank in (0, 1)]
    exits: list[int] = []
    watchdog = Watchdog(store, 2, limits=lambda median: Limits(0.3, 0.3, 0.3, 0.3, 5.0),
                        stacks_root=str(tmp_path), poll_s=0.05, exit=exits.append)
    try:
        hearts[0].mark(4, "backward", ALL_REDUCE)
        hearts[1].mark(4, "forward")
        for heart in hearts:
            heart.first_step_done()
        watchdog.start()
        deadline = time.monotonic() + 10
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:  # no thread of this test outlives it, however it ends
        for part in (watchdog, *hearts):
            part.close()
            part._thread.join(timeout=10)  # close() waits 5 polls; a loaded machine may need more
    assert exits == [1]
    line = capsys.readouterr().err.strip()
    assert re.fullmatch(r"error: hang at step 4: rank 1 stuck in forward for \d+ s; rank 0 waiting in "
                        rf"backward \(gradient all-reduce\); stacks in {re.escape(str(tmp_path))}/hang-4", line)
    for rank in (0, 1):
        stacks = (tmp_path / "hang-4" / f"rank{rank}.txt").read_text()
        assert stacks.startswith(f"rank {rank} (")
        assert "test_the_watchdog_has_every_heartbeat_write_its_stacks" in stacks  # the main thread


@pytest.mark.slow  # over a second alone: out of the quick loop
def test_the_standby_acts_only_once_rank_zero_and_its_watchdog_are_silent(tmp_path, capsys, monkeypatch):
    """Rank 1's standby on one in-memory store: while rank 0's heartbeat and the primary's
    liveness beat come, it leaves the hang alone; when both stop (rank 0 frozen whole), it names
    rank 0 as not responding, with the stacks of the rank that still answers."""
    monkeypatch.setattr(watchdog_module, "DUMP_WAIT_S", 0.5)  # frozen rank 0 writes none here
    store = dist.HashStore()
    hearts = [Heartbeat(store, rank, interval_s=0.05, exit_on_stop=False).start() for rank in (0, 1)]
    exits: list[int] = []
    standby = Watchdog(store, 2, limits=lambda median: Limits(0.3, 0.3, 0.3, 0.3, 0.6), stacks_root=str(tmp_path),
                       poll_s=0.05, standby=True, exit=exits.append)
    try:
        hearts[0].mark(6, "forward")
        hearts[1].mark(6, "backward", ALL_REDUCE)
        for heart in hearts:
            heart.first_step_done()
        standby.start()
        for polls in range(16):  # the primary's liveness beat, as its thread would publish it
            store.set(watchdog_module.WATCHDOG_KEY, str(polls).encode())
            time.sleep(0.05)
        assert exits == []  # hung for a second, but the primary is alive: it is the primary's
        hearts[0]._closed.set()  # rank 0 freezes: no beat, no liveness beat
        deadline = time.monotonic() + 10
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for part in (standby, *hearts):
            part.close()
            part._thread.join(timeout=10)
    assert exits == [1]
    line = capsys.readouterr().err.strip()
    assert re.fullmatch(r"error: hang at step 6: rank 0 not responding \(no heartbeat\) for \d+ s; rank 1 waiting in "
                        rf"backward \(gradient all-reduce\); stacks in {re.escape(str(tmp_path))}/hang-6", line)
    assert sorted(p.name for p in (tmp_path / "hang-6").iterdir()) == ["rank1.txt"]


def test_the_standby_stands_down_when_the_primary_closes_and_a_done_rank_is_not_watched():
    store = dist.HashStore()
    standby = Watchdog(store, 2, limits=lambda median: LIMITS, stacks_root="d", standby=True)
    store.set("beat/0", Beat(rank=0, step=3, phase="done").encode())
    store.set("beat/1", beat(1, 3, "export").encode())
    assert standby.check(0.0) is None and standby.done == {0} and list(standby.states) == [1]
    store.set(watchdog_module.WATCHDOG_KEY, watchdog_module.CLOSED)
    with pytest.raises(StopIteration):
        standby._poll(1.0)


# --- straggler arithmetic ---------------------------------------------------------------------


def test_a_ranks_ratio_is_to_the_median_of_its_peers():
    assert _ratio_to_peers([0.1, 0.3], 1) == pytest.approx(3.0)
    assert _ratio_to_peers([0.1, 0.1, 0.2, 0.1], 2) == pytest.approx(2.0)
    assert _ratio_to_peers([0.1, 0.1, 0.2, 0.1], 0) == pytest.approx(1.0)


def test_a_straggler_is_reported_once_after_its_windows(capsys):
    report = StragglerReport(threshold=1.5, windows=2, every_n_steps=10)
    for step, (rank, ratio) in zip((10, 20, 30, 40), [(1, 2.0), (0, 2.0), (0, 1.6), (0, 3.0)], strict=True):
        report._note_streak(rank, ratio, step)
    assert capsys.readouterr().out == (
        "litscale: straggler: rank 0 takes 1.60x the median of its peers' forward times, above 1.5x for 2 "
        "windows of 10 steps (to step 30)\n")


def test_skip_collective_needs_ddp():
    class Strategy:
        model = object()

    class Trainer:
        strategy, global_rank, global_step = Strategy(), 0, 0

    with pytest.raises(ValueError, match=r"^callbacks.fault.kind=skip_collective needs a DDP strategy "):
        InjectFault(at_step=0, kind="skip_collective").on_train_batch_start(Trainer(), None, None, 0)


# --- real jobs: 2 CPU ranks ------------------------------------------------------------------

RUN = ("strategy=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "data.batch_size=8", "data.seq_len=32",
       "data.max_bytes=400000", "trainer.max_steps=200", "trainer.val_check_interval=1000",
       "trainer.enable_progress_bar=false")
FAULT = ("+callbacks.fault._target_=litscale.callbacks.faults.InjectFault", "+callbacks.fault.rank=1")
QUICK_LIMIT_S = 8
QUICK = (f"callbacks.watchdog.timeout_s={QUICK_LIMIT_S}",)  # the default is a minute at least (make test-full)
HANG_LINE = re.compile(r"^error: hang at step (\d+): rank 1 (.*?) for (\d+) s; rank 0 waiting in (.*?); stacks in (.*)$")
# The contract: a hang is named once no rank has moved for the limit, within a few of the
# watchdog's 1-second polls after it (each heartbeat also publishes once a second). Timed by
# the watchdog's own "for N s", counted from the hang itself: how long start-up and the steps
# before it took on a loaded machine is no part of the claim.
NAMED_WITHIN_S = 10


def assert_named_after_the_limit(match: re.Match, limit_s: float) -> None:
    stuck_s = int(match.group(3))
    assert limit_s <= stuck_s < limit_s + NAMED_WITHIN_S, (stuck_s, limit_s)


def run(*overrides: str, outputs: Path, timeout: float = 200, launcher: tuple[str, ...] = ()):
    command = [*launcher] if launcher else [sys.executable, str(REPO / "train.py")]
    command += [*RUN, *overrides]
    process, seconds, stray = run_in_own_group(command, outputs=outputs, timeout=timeout)
    assert stray == [], f"outlived the job: {stray}\n{process.stderr[-800:]}"
    return process, seconds


def the_hang_line(process) -> re.Match:
    errors = [line for line in process.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, explain(process)
    match = HANG_LINE.match(errors[0])
    assert match, explain(process)
    return match


def assert_stacks(match: re.Match, *, rank1_frame: str) -> None:
    stacks = Path(match.group(5))
    assert stacks.name == f"hang-{match.group(1)}"
    assert sorted(p.name for p in stacks.iterdir()) == ["rank0.txt", "rank1.txt"]
    assert rank1_frame in (stacks / "rank1.txt").read_text()  # where rank 1's training thread is


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("kind", "doing", "rank1_frame"), [
    ("hang", "stuck in forward", "in on_train_batch_start"),
    # it went on to step 7, whose all-reduce would pair with rank 0's of step 6
    pytest.param("skip_collective", "stuck in backward (gradient all-reduce) at step 7", "in on_before_backward",
                 marks=pytest.mark.soak),  # soak: CI's time
])
def test_a_rank_that_hangs_or_skips_a_collective_is_named_and_the_job_stops_with_its_stacks(
        kind, doing, rank1_frame, tmp_path):
    process, _ = run(*FAULT, f"+callbacks.fault.kind={kind}", "+callbacks.fault.at_step=6", *QUICK,
                     outputs=tmp_path)
    assert process.returncode == 1, explain(process)
    match = the_hang_line(process)
    assert (match.group(1), match.group(2), match.group(4)) == ("6", doing, "backward (gradient all-reduce)")
    assert_stacks(match, rank1_frame=rank1_frame)
    assert_named_after_the_limit(match, QUICK_LIMIT_S)
    assert not summaries(tmp_path)


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_slow_rank_is_reported_as_the_straggler_once(tmp_path):
    """On the rank pool: the report is the ranks' own, no launcher stops anything."""
    process = train_on_pool(*RUN, *FAULT, "+callbacks.fault.kind=slow", "+callbacks.fault.at_step=0",
                            "+callbacks.fault.delay_s=0.1", "trainer.max_steps=40",
                            "callbacks.straggler.every_n_steps=5", "callbacks.straggler.windows=2",
                            outputs=tmp_path, devices=2)
    assert process.returncode == 0, explain(process)
    reports = [line for line in process.stdout.splitlines() if line.startswith("litscale: straggler:")]
    assert len(reports) == 1 and reports[0].startswith("litscale: straggler: rank 1 takes "), explain(process)
    (summary,) = summaries(tmp_path)
    assert summary["health/slowest_rank"] == 1 and summary["health/straggler_ratio"] > 1.2


@pytest.mark.soak  # make test-soak: 2-3 min on a loaded 2-core machine, beyond CI's time
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_slow_first_step_and_a_long_validation_raise_no_alarm(tmp_path):
    """Limits of 3 s for a step; the first step takes 6 s on every rank, and each validation
    (twice) 6 s on rank 1: the first-step and validation limits (20 s) cover them."""
    process, _ = run("+callbacks.fault._target_=litscale.callbacks.faults.InjectFault", "+callbacks.fault.kind=slow",
                     "+callbacks.fault.at_step=0", "+callbacks.fault.delay_s=6", "+callbacks.fault.for_steps=1",
                     "+callbacks.slow_validation._target_=litscale.callbacks.faults.InjectFault",
                     "+callbacks.slow_validation.kind=slow", "+callbacks.slow_validation.during=validation",
                     "+callbacks.slow_validation.at_step=0", "+callbacks.slow_validation.rank=1",
                     "+callbacks.slow_validation.delay_s=3", "trainer.limit_val_batches=2",
                     "trainer.val_check_interval=10", "trainer.max_steps=20", "callbacks.watchdog.timeout_s=3",
                     "callbacks.watchdog.first_step_timeout_s=20", "callbacks.watchdog.validation_timeout_s=20",
                     outputs=tmp_path)
    assert process.returncode == 0, explain(process)
    assert "hang" not in process.stderr
    assert len(summaries(tmp_path)) == 1


@pytest.mark.soak  # make test-full: keeps make test within its time budget
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hang_under_torchrun_is_named_by_rank_zero(tmp_path):
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                "--monitor-interval=0.5", str(REPO / "train.py"))
    process, _ = run(*FAULT, "+callbacks.fault.kind=hang", "+callbacks.fault.at_step=6", *QUICK,
                     f"hydra.run.dir={tmp_path}/torchrun", outputs=tmp_path, launcher=torchrun)
    assert process.returncode != 0, explain(process)
    match = the_hang_line(process)
    assert (match.group(1), match.group(2)) == ("6", "stuck in forward")
    assert_stacks(match, rank1_frame="in on_train_batch_start")
    assert_named_after_the_limit(match, QUICK_LIMIT_S)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_with_the_default_limits_a_hang_is_named_a_minute_after_it_began(tmp_path):
    """The default limit: max(60 s, 20 median steps); the job stops (exit 1, not the run's
    kill at its timeout) well before the process group's own timeout (30 minutes)."""
    process, _ = run(*FAULT, "+callbacks.fault.kind=hang", "+callbacks.fault.at_step=6", outputs=tmp_path)
    assert process.returncode == 1, explain(process)
    hang = the_hang_line(process)
    assert (hang.group(1), hang.group(2)) == ("6", "stuck in forward")
    assert_named_after_the_limit(hang, 60)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_hang_in_a_job_of_the_slurm_launchers_local_twin_is_named(tmp_path):
    multirun = (sys.executable, str(REPO / "train.py"), "-m")
    process, _ = run("hydra/launcher=slurm_local", *FAULT, "+callbacks.fault.kind=hang",
                     "+callbacks.fault.at_step=6", *QUICK, outputs=tmp_path, timeout=300, launcher=multirun)
    assert process.returncode != 0, explain(process)
    logs = "\n".join(p.read_text() for p in tmp_path.rglob("*_log.err"))
    assert re.search(r"^error: hang at step 6: rank 1 stuck in forward for \d+ s; rank 0 waiting in backward "
                     r"\(gradient all-reduce\); stacks in ", logs, re.MULTILINE), explain(process)


# --- rank 0 is watched too, and the work after fit --------------------------------------------


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_frozen_rank_zero_is_named_by_the_standby_on_rank_one(tmp_path):
    """Rank 0 stops its whole process (SIGSTOP) at step 6, its watchdog thread with it: rank 1's
    standby watchdog names it, the stacks of rank 1 (and of rank 0, resumed to take the stop
    order) are written, and the launcher ends every rank."""
    process, _ = run("+callbacks.fault._target_=litscale.callbacks.faults.InjectFault", "+callbacks.fault.rank=0",
                     "+callbacks.fault.kind=freeze", "+callbacks.fault.at_step=6", *QUICK, outputs=tmp_path)
    assert process.returncode == 1, explain(process)
    errors = [line for line in process.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, explain(process)
    match = re.fullmatch(r"error: hang at step 6: rank 0 not responding \(no heartbeat\) for (\d+) s; rank 1 waiting "
                         r"in backward \(gradient all-reduce\); stacks in (.*)/hang-6", errors[0])
    assert match, explain(process)
    assert 8 <= int(match.group(1)) < 30
    stacks = Path(match.group(2)) / "hang-6"
    assert sorted(p.name for p in stacks.iterdir()) == ["rank0.txt", "rank1.txt"]
    assert (stacks / "rank1.txt").read_text().startswith("rank 1 (")
    assert "in backward" in (stacks / "rank1.txt").read_text()  # rank 1 waits in the all-reduce
    assert not summaries(tmp_path)


@pytest.mark.soak  # make test-soak: about 2 min on a loaded 2-core machine, beyond CI's time
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_frozen_rank_zero_that_hosts_the_store_is_named_as_under_srun_and_ray(tmp_path):
    """Two ranks started as srun and Ray start them (each process given its rank and the
    address, no torchelastic agent): rank 0's own process hosts the job's store and freezes with
    it. The standby's reads block; its second thread names rank 0 within the same limit as under
    litscale's launcher, resumes it so that the store answers, and stops the job with every
    rank's stacks."""
    from torch.distributed.elastic.utils.distributed import get_free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SLURM_"))}
    env.update(LITSCALE_OUTPUTS=str(tmp_path), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(get_free_port()),
               WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", GROUP_RANK="0", PYTHONUNBUFFERED="1")
    command = [sys.executable, str(REPO / "train.py"), *RUN, "+callbacks.fault._target_=litscale.callbacks.faults."
               "InjectFault", "+callbacks.fault.rank=0", "+callbacks.fault.kind=freeze", "+callbacks.fault.at_step=6",
               *QUICK, f"hydra.run.dir={tmp_path / 'run'}"]
    ranks = [subprocess.Popen(command, cwd=REPO, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for r in (0, 1)]
    try:
        outputs = [rank.communicate(timeout=200) for rank in ranks]
    finally:
        for rank in ranks:  # whatever is left of a failed test: never a stray
            with contextlib.suppress(ProcessLookupError):
                os.killpg(rank.pid, signal.SIGKILL)
    assert [rank.returncode for rank in ranks] != [0, 0], outputs
    errors = [line for _, err in outputs for line in err.splitlines() if line.startswith("error: hang")]
    assert len(errors) == 1, outputs
    match = re.fullmatch(r"error: hang at step 6: rank 0 not responding \(no heartbeat\) for (\d+) s; rank 1 waiting "
                         r"in backward \(gradient all-reduce\); stacks in (.*)/hang-6", errors[0])
    assert match, errors
    assert 8 <= int(match.group(1)) < 30
    stacks = Path(match.group(2)) / "hang-6"
    assert sorted(p.name for p in stacks.iterdir()) == ["rank0.txt", "rank1.txt"]
    assert "in backward" in (stacks / "rank1.txt").read_text()


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hang_in_the_export_after_fit_is_named_with_its_phase(tmp_path):
    """Rank 1 hangs in the export after fit while rank 0, its model saved, waits in the export's
    barrier: the watch is still on, with the after-fit limit."""
    process, _ = run(*FAULT, "+callbacks.fault.kind=hang", "+callbacks.fault.during=export",
                     "+callbacks.fault.at_step=0", "trainer.max_steps=4", *QUICK,
                     f"callbacks.watchdog.after_fit_timeout_s={QUICK_LIMIT_S}", outputs=tmp_path)
    assert process.returncode == 1, explain(process)
    match = the_hang_line(process)
    assert match.group(1, 2, 4) == ("4", "stuck in after fit (export)", "after fit (export, in barrier)")
    assert_stacks(match, rank1_frame="in on_after_fit")
    assert_named_after_the_limit(match, QUICK_LIMIT_S)
    assert not summaries(tmp_path)
