"""Fault injection: preemption and exact resume, failing and killed ranks, NaN losses,
untrusted targets and secrets (each scenario as a short CPU run through train.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import sharded_checkpoint
from helpers.cli import (
    REPO,
    cli_env,
    explain,
    final_weights,
    run_in_own_group,
    run_train,
    summaries,
    train_losses,
)
from helpers.inprocess import train_on_pool

from litscale.checkpoint.resume import (
    is_complete_checkpoint,
    newest_last_checkpoint,
    resolve_ckpt_path,
    skipped_line,
)
from litscale.errors import ConfigError

SHORT = ("trainer.max_steps=8", "trainer.val_check_interval=4", "trainer.limit_val_batches=2",
         "trainer.log_every_n_steps=1", "data.seq_len=32", "data.max_bytes=400000",
         "trainer.enable_progress_bar=false", "trainer.accelerator=cpu")
FAULT = "+callbacks.fault._target_=litscale.callbacks.faults.InjectFault"


def fault(at_step: int, kind: str, rank: int | None = None) -> tuple[str, ...]:
    extra = (f"+callbacks.fault.rank={rank}",) if rank is not None else ()
    return (FAULT, f"+callbacks.fault.at_step={at_step}", f"+callbacks.fault.kind={kind}", *extra)


def run_dirs(outputs: Path, name: str) -> list[Path]:
    return sorted((outputs / name / "runs").iterdir())


# A 2-rank job long enough to be stopped from outside once its first checkpoint (validation at
# step 15) shows that training is under way.
TWO_RANKS = (*SHORT, "trainer.max_steps=40", "trainer.val_check_interval=15", "strategy=ddp",
             "trainer.devices=2", "data.batch_size=8", "callbacks.preemption.check_every_n_steps=2",
             "model.net.dropout=0.1")
ONE_PROCESS = (*SHORT, "trainer.max_steps=10", "strategy=single", "model.net.dropout=0.1")


def max_steps_of(setup: tuple[str, ...]) -> int:
    return int(next(o for o in reversed(setup) if o.startswith("trainer.max_steps=")).split("=")[1])


def devices_of(setup: tuple[str, ...]) -> int:
    return 2 if "trainer.devices=2" in setup else 1


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The summary of the uninterrupted run of a setup, run once per module and on the rank
    pool: what the stopped-and-resumed runs must reproduce (the claim is the resume's; the
    stops themselves go through train.py's own launcher)."""
    runs: dict[tuple[str, ...], dict] = {}

    def run(setup: tuple[str, ...]) -> dict:
        if setup not in runs:
            outputs = tmp_path_factory.mktemp("clean")
            clean = train_on_pool(*setup, "name=clean", outputs=outputs, devices=devices_of(setup))
            assert clean.returncode == 0, explain(clean)
            runs[setup] = summaries(outputs)[0]
        return runs[setup]

    return run


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(500)
@pytest.mark.parametrize(("setup", "stop_signal"), [
    pytest.param(ONE_PROCESS, "sigterm", marks=pytest.mark.soak),  # soak: ddp's case takes the same path
    (TWO_RANKS, "sigterm"),
    pytest.param(TWO_RANKS, "sigusr1", marks=pytest.mark.soak)],  # soak: the same path as sigterm
    ids=["single-sigterm", "ddp-sigterm", "ddp-sigusr1"])
def test_stop_signal_saves_checkpoint_and_auto_resume_reproduces_losses(tmp_path, uninterrupted,
                                                                        setup, stop_signal):
    """Mid-epoch preemption (the job gets SIGTERM, or SLURM's SIGUSR1, after step 5; not a
    checkpoint step), then ckpt_path=auto: the resumed steps have the uninterrupted run's
    losses and final weights, dropout included. With 2 ranks they agree every 2 steps."""
    stopped = run_train(*setup, "name=resumed", *fault(5, stop_signal, rank=0), outputs=tmp_path)
    assert stopped.returncode == 0, explain(stopped)
    assert "preempted" in stopped.stdout
    (interrupted,) = run_dirs(tmp_path, "resumed")
    # The signal is handled at the next step boundary every rank agrees on.
    saved_step = torch.load(interrupted / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 5 <= saved_step < 10, explain(stopped)
    assert_resume_reproduces_the_uninterrupted_run(tmp_path, setup, saved_step, uninterrupted(setup))


def assert_resume_reproduces_the_uninterrupted_run(tmp_path: Path, setup: tuple[str, ...],
                                                   saved_step: int, reference: dict) -> None:
    """``ckpt_path=auto`` continues run ``resumed`` from ``saved_step``: every later step's
    loss and the final weights equal those of the uninterrupted run (``reference``, its
    summary) bit for bit."""
    resumed = train_on_pool(*setup, "name=resumed", "ckpt_path=auto", outputs=tmp_path,
                            devices=devices_of(setup))
    assert resumed.returncode == 0, explain(resumed)
    continued = summaries(tmp_path / "resumed")[0]
    expected, actual = train_losses(reference["output_dir"]), train_losses(continued["output_dir"])
    assert sorted(actual) == list(range(saved_step, max_steps_of(setup)))  # Lightning's 0-based step index
    for step in actual:
        assert actual[step] == expected[step], step
    for name, tensor in final_weights(reference).items():
        assert torch.equal(final_weights(continued)[name], tensor), name


def run_in_a_terminals_group(*overrides: str, outputs: Path) -> subprocess.CompletedProcess:
    """``train.py`` in a process group of its own, as a terminal runs it (a Ctrl-C reaches every
    process of the job); nothing of it may outlive it."""
    process, _, stray = run_in_own_group([sys.executable, "train.py", *overrides], outputs=outputs, timeout=300)
    assert not stray, stray
    return process


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("setup", [ONE_PROCESS, TWO_RANKS], ids=["single", "ddp"])
def test_ctrl_c_saves_at_a_step_every_rank_agrees_on_and_exits_0(tmp_path, setup):
    """A terminal's Ctrl-C (SIGINT to the launcher and every rank, which the launcher's agent
    passes on once more) stops the run as a preemption does: last.ckpt at the agreed step."""
    stopped = run_in_a_terminals_group(*setup, "name=stopped", *fault(5, "ctrl_c", rank=0), outputs=tmp_path)
    assert stopped.returncode == 0, explain(stopped)
    printed = stopped.stdout + stopped.stderr
    assert ("litscale: Ctrl-C: stopping after a step every rank agrees on and saving last.ckpt; Ctrl-C again "
            "to stop at once without saving") in printed
    (interrupted,) = run_dirs(tmp_path, "stopped")
    saved_step = torch.load(interrupted / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 5 <= saved_step < 10, explain(stopped)


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_second_ctrl_c_stops_at_once_and_names_the_checkpoint_that_remains(tmp_path):
    stopped = run_in_a_terminals_group(*ONE_PROCESS, "trainer.val_check_interval=2", "name=stopped",
                                       *fault(3, "ctrl_c_twice", rank=0), "+callbacks.fault.delay_s=1.5",
                                       outputs=tmp_path)
    assert stopped.returncode == 1, explain(stopped)
    (interrupted,) = run_dirs(tmp_path, "stopped")
    newest = newest_last_checkpoint(str(interrupted))
    assert torch.load(newest, weights_only=True)["global_step"] == 2  # the step-2 validation's checkpoint
    assert (f"litscale: stopped at step 3 by a second Ctrl-C, without saving; the newest complete checkpoint is "
            f"{newest} (ckpt_path=auto resumes from it)") in stopped.stdout + stopped.stderr, explain(stopped)


# Validation every 4 steps, the ranks agreeing on a stop every 4: a signal during the validation
# at step 4 is agreed on at step 8, itself a validation step.
VALIDATING_STOP = (*SHORT, "trainer.max_steps=12", "strategy=ddp", "trainer.devices=2", "data.batch_size=8",
                   "callbacks.preemption.check_every_n_steps=4", "model.net.dropout=0.1")


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_stop_signalled_during_validation_and_agreed_on_a_validation_step_resumes_exactly(tmp_path,
                                                                                          uninterrupted):
    """The job gets SIGTERM during the validation at step 4; the ranks agree at step 8, which
    validates too, and save there. The resumed run logs every step at the uninterrupted run's
    index with its loss, and ends with its weights. (Saved after step 8 rather than at the end
    of its validation, the resumed run logged each step one index late.)"""
    stopped = run_train(*VALIDATING_STOP, "name=resumed", *fault(4, "sigterm", rank=0),
                        "+callbacks.fault.during=validation", outputs=tmp_path)
    assert stopped.returncode == 0, explain(stopped)
    assert "stopping at step 8 on a termination signal" in stopped.stderr, explain(stopped)
    assert_resume_reproduces_the_uninterrupted_run(tmp_path, VALIDATING_STOP, 8, uninterrupted(VALIDATING_STOP))


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(500)
def test_sigterm_to_rank_one_alone_stops_every_rank_at_one_step_and_resumes_exactly(tmp_path,
                                                                                   uninterrupted):
    """A real 2-rank job; SIGTERM goes to rank 1's process only (not through the launcher)
    once a first checkpoint shows that training is under way. Every rank stops after the same
    step and saves with the others, the job exits 0, and resuming reproduces the uninterrupted
    run bit for bit."""
    max_steps = max_steps_of(TWO_RANKS)
    job = subprocess.Popen([sys.executable, str(REPO / "train.py"), *TWO_RANKS, "name=resumed"], cwd=REPO,
                           env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        while not list((tmp_path / "resumed").glob("runs/*/checkpoints/last.ckpt")):  # the test's timeout bounds it
            assert job.poll() is None, "the job ended before its first checkpoint"
            time.sleep(0.2)
        (record,) = (tmp_path / "resumed").glob("runs/*/ranks/rank1.json")
        pid = json.loads(record.read_text())["pid"]
        assert pid != job.pid and os.getpgid(pid) == job.pid  # a worker of this job, not its launcher
        os.kill(pid, signal.SIGTERM)
        stdout, stderr = job.communicate(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    stopped = subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)
    assert stopped.returncode == 0, explain(stopped)
    (interrupted,) = run_dirs(tmp_path, "resumed")
    last = interrupted / "checkpoints" / "last.ckpt"
    assert is_complete_checkpoint(str(last))
    saved_step = torch.load(last, weights_only=True)["global_step"]
    assert saved_step % 2 == 0 and 15 < saved_step < max_steps, explain(stopped)
    # One agreed step: the one message, from rank 0, names the step the checkpoint holds.
    assert f"stopping at step {saved_step} on a termination signal" in stopped.stderr, explain(stopped)
    assert "litscale: preempted" in stopped.stdout  # stopped, not finished: no summary
    assert summaries(tmp_path / "resumed") == []
    assert_resume_reproduces_the_uninterrupted_run(tmp_path, TWO_RANKS, saved_step,
                                                   uninterrupted(TWO_RANKS))


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize(("kind", "expected"), [
    ("exception", "error: rank 1 failed: InjectedFault: injected fault at step 2 on rank 1"),
    pytest.param("sigkill", "error: rank 1 failed: Signal 9 (SIGKILL) received by PID",
                 marks=pytest.mark.soak),  # soak: CI's time; the same path as the exception's line
])
def test_failing_rank_stops_every_rank_with_one_error(tmp_path, kind, expected):
    # Stopped by the launcher, not by the run's timeout (180 s, far short of the process
    # group's 30 minutes that a rank waiting on its dead peer would take).
    process = run_train(*SHORT, "strategy=ddp", "trainer.devices=2", *fault(2, kind, rank=1),
                        outputs=tmp_path, timeout=180)
    assert process.returncode == 1, explain(process)
    errors = [line for line in process.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(expected), explain(process)
    if kind == "exception":
        assert process.stderr.count("Traceback") == 1  # the root cause's traceback, once


@pytest.mark.slow
@pytest.mark.soak  # make test-full: make test's time budget
@pytest.mark.timeout(400)
def test_a_rank_killed_inside_a_sharded_save_leaves_the_last_complete_checkpoint_to_resume(tmp_path, uninterrupted):
    """Rank 1 of an FSDP job dies as the step-8 save begins, while rank 0 is inside it (the
    save's directory staged beside ``last.ckpt``, published only once every rank has written):
    the job stops with one error, ``last.ckpt`` is still step 4's, whole, and ``ckpt_path=auto``
    continues from it to the uninterrupted run's losses and weights, bit for bit."""
    setup = (*SHORT, "strategy=fsdp", "trainer.devices=2")
    killed = run_train(*setup, "name=resumed", *fault(8, "sigkill", rank=1), "+callbacks.fault.during=save",
                       outputs=tmp_path, timeout=240)
    assert killed.returncode == 1, explain(killed)
    errors = [line for line in killed.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1 failed: Signal 9 (SIGKILL)"), explain(killed)
    (interrupted,) = run_dirs(tmp_path, "resumed")
    last = interrupted / "checkpoints" / "last.ckpt"
    assert is_complete_checkpoint(str(last)) and newest_last_checkpoint(str(tmp_path / "resumed")) == str(last)
    resumed = train_on_pool(*setup, "name=resumed", "ckpt_path=auto", outputs=tmp_path, devices=2)
    assert resumed.returncode == 0, explain(resumed)
    reference, continued = uninterrupted(setup), summaries(tmp_path / "resumed")[0]
    expected, actual = train_losses(reference["output_dir"]), train_losses(continued["output_dir"])
    assert sorted(actual) == [4, 5, 6, 7]  # from step 4's checkpoint (Lightning's 0-based step index)
    assert all(actual[step] == expected[step] for step in actual), (actual, expected)
    # A sharded checkpoint is a directory: the runs' whole-model exports are compared.
    exported, expected_weights = torch.load(continued["export"]), torch.load(reference["export"])
    assert all(torch.equal(exported[name], tensor) for name, tensor in expected_weights.items())


@contextlib.contextmanager
def adopting_orphans():
    """This process as the child subreaper of its descendants (``PR_SET_CHILD_SUBREAPER``), so that
    the ranks of a launcher that dies become its children and their exit codes can be read."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    set_child_subreaper = 36
    assert prctl(set_child_subreaper, 1, 0, 0, 0) == 0
    try:
        yield
    finally:
        prctl(set_child_subreaper, 0, 0, 0, 0)


def exit_code_within(pid: int, seconds: float) -> int | None:
    """The exit code of child ``pid`` once it has ended, waiting up to ``seconds`` (None: it still runs)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    return None


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(500)
def test_a_lost_launcher_is_named_and_its_ranks_save_and_exit_promptly(tmp_path):
    """SIGKILL to the launcher of a 2-rank job (train.py's process: the torch elastic agent, host of
    the job's TCPStore) once training is under way. Its ranks get its death signal, a SIGINT: they
    must name the lost launcher and store in one line, not a Ctrl-C, stop after one step they agree
    on and save last.ckpt (they still reach each other), and exit at once with the code of a stop
    that saved (75). On 0bedc2d they said "Ctrl-C: ... saving last.ckpt", saved nothing (the
    straggler report's write to the lost store failed first) and lingered for tens of seconds."""
    from litscale.app.launch import PREEMPTED_EXIT_CODE

    others = ""
    with adopting_orphans():
        job = subprocess.Popen([sys.executable, str(REPO / "train.py"), *TWO_RANKS, "name=lost",
                                "callbacks.straggler.every_n_steps=4"], cwd=REPO, env=cli_env(tmp_path),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            while not list((tmp_path / "lost").glob("runs/*/checkpoints/last.ckpt")):  # the test's timeout bounds it
                assert job.poll() is None, "the job ended before its first checkpoint"
                time.sleep(0.2)
            (run_dir,) = run_dirs(tmp_path, "lost")
            ranks = [json.loads((run_dir / "ranks" / f"rank{r}.json").read_text())["pid"] for r in (0, 1)]
            others = subprocess.run(["ps", "-o", "pid=", "-g", str(job.pid)], capture_output=True, text=True).stdout
            os.kill(job.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            job.wait(timeout=30)  # gone: its ranks are this process's children now
            codes = [exit_code_within(pid, 120) for pid in ranks]
            seconds = time.monotonic() - killed_at
            stdout, stderr = job.communicate(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
            for pid in {int(p) for p in others.split()} - {job.pid}:
                with contextlib.suppress(ChildProcessError):
                    exit_code_within(pid, 10)  # the job's other orphans (the resource tracker), reaped
    stopped = subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)
    # NOTE: counted in the text, not by line: torch's C++ warnings about the lost store share the
    # ranks' stderr and may split a line of theirs.
    printed = stdout + stderr
    named = (f"litscale: launcher lost: the process that started the ranks (pid {job.pid}) is gone, and the job's "
             "store with it (their SIGINT is its death signal, not a Ctrl-C); stopping after a step every rank agrees "
             "on to save last.ckpt, then exiting")
    assert printed.count(named) == 1 and printed.count("Ctrl-C") == 1, explain(stopped)
    last = run_dir / "checkpoints" / "last.ckpt"
    saved_step = torch.load(last, weights_only=True)["global_step"]
    assert saved_step > 15 and saved_step % 2 == 0 and is_complete_checkpoint(str(last))
    assert (f"litscale: stopping at step {saved_step} after its launcher was lost; saved {last} (resume with "
            "ckpt_path=auto)") in printed, explain(stopped)
    # at once: a step or two, the save and the interpreter's exit (10.8 s here at a load average of 17)
    assert codes == [PREEMPTED_EXIT_CODE] * 2 and seconds < 45, (codes, seconds, explain(stopped))


def test_the_launchers_death_signal_is_not_a_ctrl_c_and_a_save_it_cannot_make_is_said(tmp_path, monkeypatch,
                                                                                       capsys):
    """The SIGINT a rank gets when its launcher dies (its parent pid changed) stops the ranks to save
    like SIGTERM, named as the launcher's loss; a save that then fails says so in one line naming the
    checkpoint that remains, and the failing rank does not wait for a peer's report no one will read."""
    from types import SimpleNamespace

    from torch.distributed import DistNetworkError

    from litscale.app import launch
    from litscale.callbacks import preemption
    from litscale.callbacks.preemption import PreemptionCheckpoint
    from litscale.health import launcher

    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    torch.save({"global_step": 8}, checkpoints / "step000008.ckpt")

    class Strategy:
        launcher = None

        def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
            return decision

    def failing_save(path, weights_only):
        raise DistNetworkError("Broken pipe")

    flag = SimpleNamespace(received_sigterm=False)
    trainer = SimpleNamespace(world_size=2, global_step=0, sanity_checking=False, local_rank=0,
                              strategy=Strategy(), _signal_connector=flag, save_checkpoint=failing_save)
    monkeypatch.setattr(launcher, "_launcher_pid", os.getppid())  # the launcher alive: a Ctrl-C
    ctrl_c = PreemptionCheckpoint(dirpath=str(checkpoints), check_every_n_steps=2)
    ctrl_c._on_signal(signal.SIGINT, None)
    assert ctrl_c.signalled and not ctrl_c.launcher_lost and ctrl_c._first_ctrl_c is not None

    monkeypatch.setattr(launcher, "_launcher_pid", os.getppid() + 100_000)  # this rank has another parent now
    # the signal came as the launcher began to exit (its main thread first): named as its loss
    ctrl_c.on_train_batch_end(SimpleNamespace(**{**vars(trainer), "global_step": 1}), None, None, None, 0)
    assert ctrl_c.launcher_lost and ctrl_c._first_ctrl_c is None
    assert capsys.readouterr().err.startswith("litscale: launcher lost: ")
    callback = PreemptionCheckpoint(dirpath=str(checkpoints), check_every_n_steps=2)
    monkeypatch.setattr(preemption, "SAME_CTRL_C_S", 0.0)  # any second SIGINT would be the user's
    callback._on_signal(signal.SIGINT, None)
    callback._on_signal(signal.SIGINT, None)  # not a second Ctrl-C, to stop at once without saving
    assert callback.signalled and callback.launcher_lost and callback._first_ctrl_c is None
    for step in (9, 10):
        trainer.global_step = step
        callback.on_train_batch_end(trainer, None, None, None, step)
    assert flag.received_sigterm  # every rank stops after step 10, to save
    with pytest.raises(DistNetworkError):
        callback.on_validation_end(trainer, None)
    assert callback.saved_path is None
    callback.on_exception(trainer, None, DistNetworkError("Broken pipe"))  # said once
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"litscale: launcher lost: the process that started the ranks (pid {os.getppid() + 100_000}) is gone, and the "
        "job's store with it (their SIGINT is its death signal, not a Ctrl-C); stopping after a step every rank "
        "agrees on to save last.ckpt, then exiting",
        "litscale: launcher lost, and no save is possible at step 10 without it (DistNetworkError: Broken pipe); the "
        f"newest complete checkpoint is {checkpoints / 'step000008.ckpt'} (ckpt_path=auto resumes from it); exiting "
        "with code 1"]

    monkeypatch.setattr(time, "sleep", lambda seconds: pytest.fail("waited for a peer's report"))
    launch.wait_for_the_cause(RuntimeError("Connection reset by peer"))


@pytest.mark.slow  # a Python process importing litscale: 3-5 s
@pytest.mark.timeout(60)
def test_a_rank_waiting_for_its_peers_report_leaves_on_the_launchers_sigterm():
    """A rank whose error only says a peer died waits for the peer's report, and the launcher's
    SIGTERM (sent once it has seen the failure) ends that wait at once, though the rank's own
    SIGTERM handler, as the preemption one, only notes the signal. It slept its 20 s out before,
    and the agent killed it only after its 30 s shutdown wait: a killed rank's replica group
    came back 30 s late and every other group's step waited as long."""
    from litscale.app import launch

    code = ("import signal, sys\n"
            "from litscale.app.launch import wait_for_the_cause\n"
            "signal.signal(signal.SIGTERM, lambda signum, frame: None)  # noted for a step boundary\n"
            "print('waiting', flush=True)\n"
            "wait_for_the_cause(RuntimeError('Connection closed by peer'))\n"
            "print('left', flush=True)\n"
            "assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the handler is back\n")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "waiting\n"
    time.sleep(0.5)  # into the sleep
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=30)
    assert (process.returncode, out) == (0, "left\n")
    assert time.monotonic() - sent < launch.KNOCK_ON_GRACE_S / 4


def test_a_rank_told_to_stop_before_its_failure_waits_for_no_peers_report(monkeypatch):
    """The launcher's SIGTERM can land while the rank is still in its failing collective (the
    preemption handler notes it for the step boundary): the wait after the failure is then
    skipped, as the launcher has the report already."""
    from litscale.app import launch
    from litscale.health import launcher

    monkeypatch.setattr(launcher, "_told_to_stop", False)
    monkeypatch.setattr(launch, "launcher_lost", lambda: False)
    monkeypatch.setattr(time, "sleep", lambda seconds: pytest.fail("waited for a peer's report"))
    launcher.note_told_to_stop()
    launch.wait_for_the_cause(RuntimeError("Connection reset by peer"))


@pytest.mark.slow  # a Python process importing litscale: 3-5 s
@pytest.mark.timeout(60)
def test_a_failing_rank_with_a_thread_it_cannot_stop_exits_once_its_failure_is_recorded(tmp_path):
    """A rank that fails while a library's thread waits on a lost peer (torchft's quorum
    thread) records its error for the agent and exits with code 1 at once: Python would join
    that thread at exit, and the agent killed the rank only 30 s later."""
    error_file = tmp_path / "error.json"
    code = ("import threading\n"
            "from litscale.app.launch import _run_rank\n"
            "from litscale.health.launcher import leave_behind_on_failure\n"
            "threading.Thread(target=threading.Event().wait, name='quorum').start()  # never ends\n"
            "def fit(payload):\n"
            "    leave_behind_on_failure('the quorum thread')\n"
            "    raise RuntimeError('Connection closed by peer')\n"
            "_run_rank(fit, None)\n")
    started = time.monotonic()
    process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                             env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert process.returncode == 1, process.stderr
    assert time.monotonic() - started < 20
    assert json.loads(error_file.read_text())["message"]["message"] == "RuntimeError: Connection closed by peer"


def test_an_agent_that_restarts_its_ranks_gives_each_attempt_a_fresh_store(monkeypatch):
    """torch's agent shares its rendezvous store with every attempt's ranks, its keys not scoped
    by attempt (pytorch/pytorch#135712): a replica group's restarted rank 1 read its peer's
    address of the attempt before and failed to connect. An agent that restarts ranks (a
    replica group's) turns the sharing off; one that does not, or restarts one process (whose
    torchft manager meets at the agent's store: no process group hosts one), keeps it."""
    import torch.distributed.launcher.api as launcher_api

    from litscale.app import launch

    seen = []

    def elastic_launch(config, entrypoint):
        seen.append((config.max_restarts, os.environ.get(launch.FRESH_STORE_ENV)))
        return lambda *args: {0: {"steps": 1}}

    monkeypatch.setattr(launcher_api, "elastic_launch", elastic_launch)
    monkeypatch.delenv(launch.FRESH_STORE_ENV, raising=False)
    monkeypatch.setattr(launch, "launched_externally", lambda: False)
    launch.launch(print, None, processes=2)
    launch.launch(print, None, processes=1, max_restarts=3, agent=True)
    assert seen == [(0, None), (3, None)]
    launch.launch(print, None, processes=2, max_restarts=3, agent=True)
    assert seen[-1] == (3, "1")


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_persistent_nan_loss_stops_after_saving_a_checkpoint(tmp_path):
    process = train_on_pool(*SHORT, *fault(2, "nan_weights"), "callbacks.nonfinite_guard.patience=2",
                            "callbacks.nonfinite_guard.check_every_n_steps=2", outputs=tmp_path)
    assert process.returncode == 1, explain(process)
    errors = [line for line in process.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, explain(process)
    assert errors[0].startswith("error: NonFiniteLossError: train/loss was NaN/inf for 2 "
                                "consecutive steps up to step 4")
    (run_dir,) = run_dirs(tmp_path, "default")
    assert (run_dir / "checkpoints" / "nonfinite-step4.ckpt").is_file()
    assert not (run_dir / "summary.json").exists()


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_untrusted_target_is_refused_before_anything_runs(tmp_path):
    process = run_train("+callbacks.evil._target_=os.system", outputs=tmp_path)
    assert process.returncode == 2
    assert process.stderr.strip() == (
        "error: callbacks.evil._target_='os.system' is not allowed: targets must come from "
        "litscale, torch, lightning, pytorch_optimizer (trust another package with "
        "allowed_targets=[<package>])")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_values_from_the_environment_never_reach_logs_or_checkpoints(tmp_path):
    secret = "sk-litscale-test-0123456789"
    process = train_on_pool(*SHORT, "trainer.max_steps=2", "trainer.val_check_interval=2",
                            "+notes=${oc.env:LITSCALE_TEST_SECRET}", "+copied_notes=${notes}",
                            "logger=tensorboard", outputs=tmp_path,
                            env={"LITSCALE_TEST_SECRET": secret, "WANDB_API_KEY": secret})
    assert process.returncode == 0, explain(process)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.suffix == ".ckpt" for p in files) and any("events" in p.name for p in files)
    leaks = [p for p in files if secret.encode() in p.read_bytes()]
    assert leaks == []
    assert secret not in process.stdout + process.stderr


# Complete checkpoints only for ckpt_path=auto/last: each layout, written for real where it
# needs no process group, then cut short the way a crash during the save leaves it.

def _save(path: Path, step: int, written_at: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {}, "global_step": step}, path)  # a Lightning checkpoint: auto reads what it chose
    os.utime(path, (written_at, written_at))
    return path


def _truncate(path: Path) -> None:
    stat = path.stat()
    path.write_bytes(path.read_bytes()[: stat.st_size // 2])
    os.utime(path, (stat.st_mtime + 60, stat.st_mtime + 60))  # the interrupted save is newer


def test_auto_skips_a_truncated_last_ckpt_and_never_resumes_from_nonfinite(tmp_path):
    older = _save(tmp_path / "runs" / "a" / "checkpoints" / "last.ckpt", 4, 1000)
    best = _save(tmp_path / "runs" / "b" / "checkpoints" / "step000008.ckpt", 8, 2000)
    last = _save(tmp_path / "runs" / "b" / "checkpoints" / "last.ckpt", 8, 2000)
    _save(tmp_path / "runs" / "b" / "checkpoints" / "nonfinite-step12.ckpt", 12, 3000)
    assert newest_last_checkpoint(str(tmp_path)) == str(last)  # ties go to last.ckpt
    _truncate(last)  # killed while overwriting last.ckpt in place
    assert not is_complete_checkpoint(str(last))
    assert resolve_ckpt_path("auto", search_dir=str(tmp_path)) == str(best)
    _truncate(best)
    assert resolve_ckpt_path("auto", search_dir=str(tmp_path)) == str(older)
    _truncate(older)
    assert resolve_ckpt_path("auto", search_dir=str(tmp_path)) is None
    with pytest.raises(ConfigError, match="^ckpt_path=last but no complete checkpoints/"):
        resolve_ckpt_path("last", search_dir=str(tmp_path))


def test_a_resume_says_which_torn_checkpoints_it_skipped(tmp_path):
    older = _save(tmp_path / "runs" / "a" / "checkpoints" / "step000004.ckpt", 4, 1000)
    last = _save(tmp_path / "runs" / "a" / "checkpoints" / "last.ckpt", 8, 2000)
    assert skipped_line("auto", str(tmp_path), str(last)) is None
    _truncate(last)
    chosen = resolve_ckpt_path("auto", search_dir=str(tmp_path))
    assert chosen == str(older)
    assert skipped_line("auto", str(tmp_path), chosen) == (
        f"litscale: ckpt_path=auto skipped {last}: incomplete (a save cut short, or a copy truncated); "
        f"resuming from {older}")
    _truncate(older)
    assert skipped_line("here", str(tmp_path), None) == (
        f"litscale: ckpt_path=here skipped {last}, {older}: incomplete (a save cut short, or a copy truncated); "
        "starting afresh")


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group, overwriting
def test_auto_skips_a_sharded_directory_whose_overwrite_did_not_finish(tmp_path):
    checkpoints = tmp_path / "runs" / "a" / "checkpoints"
    assert is_complete_checkpoint(str(sharded_checkpoint(tmp_path / "fresh", 1)))
    previous = _save(checkpoints / "step000004.ckpt", 4, 500)
    last = sharded_checkpoint(checkpoints / "last.ckpt", 8, 1000)
    assert resolve_ckpt_path("auto", search_dir=str(tmp_path)) == str(last)
    (shard,) = last.glob("*.distcp")
    os.utime(shard, (2000, 2000))  # the next save rewrote a shard, then died before .metadata
    assert resolve_ckpt_path("auto", search_dir=str(tmp_path)) == str(previous)
    sharded_checkpoint(last, 12, 1000)
    os.utime(last / "meta.pt", (999, 999))  # died after .metadata, before meta.pt
    assert resolve_ckpt_path("auto", search_dir=str(tmp_path)) == str(previous)
    sharded_checkpoint(last, 12, 1000)
    _truncate(last / "meta.pt")  # died while writing meta.pt
    assert resolve_ckpt_path("auto", search_dir=str(tmp_path)) == str(previous)
    sharded_checkpoint(last, 12, 1000)
    (last / ".metadata").unlink()  # the first save into the directory died before .metadata
    assert resolve_ckpt_path("auto", search_dir=str(tmp_path)) == str(previous)


def test_auto_skips_a_deepspeed_directory_whose_save_did_not_finish(tmp_path):
    checkpoints = tmp_path / "runs" / "a" / "checkpoints"
    previous = _save(checkpoints / "step000004.ckpt", 4, 500)
    last = checkpoints / "last.ckpt"
    tag = last / "checkpoint"
    files = [_save(tag / name, 8, 1000) for name in (
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt")]
    (last / "latest").write_text("checkpoint")
    os.utime(last / "latest", (1000, 1000))
    assert resolve_ckpt_path("auto", search_dir=str(tmp_path)) == str(last)
    os.utime(files[1], (1500, 1500))  # rank 0 rewrote its partition, died before `latest`
    assert resolve_ckpt_path("auto", search_dir=str(tmp_path)) == str(previous)
    os.utime(files[1], (1000, 1000))
    _truncate(files[2])  # rank 1 died while writing its partition
    assert resolve_ckpt_path("auto", search_dir=str(tmp_path)) == str(previous)
    _save(files[2], 8, 1000)
    (last / "latest").write_text("missing-tag")
    assert resolve_ckpt_path("auto", search_dir=str(tmp_path)) == str(previous)


def test_ranks_agree_on_a_stop_signal_every_n_optimizer_steps():
    from types import SimpleNamespace

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from litscale.callbacks.preemption import (
        PreemptionCheckpoint,
        disable_lightning_sigterm_broadcast,
    )

    class Strategy:
        launcher, agreed_at = None, []

        def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
            assert not all  # any rank's signal stops every rank
            self.agreed_at.append(trainer.global_step)
            return decision

    flag = SimpleNamespace(received_sigterm=False)  # what Lightning reads to stop
    saved = []
    trainer = SimpleNamespace(world_size=2, global_step=0, sanity_checking=False,
                              strategy=Strategy(), _signal_connector=flag,
                              save_checkpoint=lambda path, weights_only: saved.append((path, trainer.global_step)))
    callback = PreemptionCheckpoint(dirpath="unused", check_every_n_steps=10)
    callback._checked_at_step = 0
    for batch in range(50):  # 2 batches of gradient accumulation per optimizer step
        trainer.global_step = (batch + 1) // 2
        if trainer.global_step == 13:
            callback._on_signal(signal.SIGTERM, None)  # on this rank only
        callback.on_train_batch_end(trainer, None, None, None, batch)
        if flag.received_sigterm:
            break
    assert trainer.strategy.agreed_at == [10, 20]  # once per 10 steps, not per batch
    assert (callback.stopping, trainer.global_step) == (True, 20)
    callback.on_validation_start(trainer, None)  # a validation due now runs to its end
    assert not flag.received_sigterm
    callback.on_validation_end(trainer, None)
    assert flag.received_sigterm
    # saved at the end of that validation, where Lightning's restore expects a validated step's
    # checkpoint; not again when Lightning then stops
    assert saved == [(os.path.join("unused", "last.ckpt"), 20)]
    callback.on_exception(trainer, None, SIGTERMException())
    assert saved == [(os.path.join("unused", "last.ckpt"), 20)]

    class EpochLoop:
        def _broadcast_sigterm_tensor(self) -> None:  # Lightning's per-batch collective
            raise AssertionError("called")

    loop = EpochLoop()
    disable_lightning_sigterm_broadcast(SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=loop)))
    loop._broadcast_sigterm_tensor()
