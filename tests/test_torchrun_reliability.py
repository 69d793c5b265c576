"""Elastic restarts and failing ranks under ``torchrun`` (2 CPU ranks, gloo): a killed rank
makes torchrun restart the job, which resumes from its last checkpoint and ends exactly where
an uninterrupted run ends; with no restarts left, every rank stops and the cause is shown once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.cli import REPO, explain, final_weights, run_in_own_group, summaries, train_losses
from helpers.inprocess import train_on_pool

from litscale.app.launch import FRESH_STORE_ENV

pytestmark = pytest.mark.slow  # every test here runs torchrun

SHORT = ("strategy=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "data.batch_size=8",
         "trainer.max_steps=12", "trainer.val_check_interval=4", "trainer.limit_val_batches=2",
         "trainer.log_every_n_steps=1", "data.seq_len=32", "data.max_bytes=400000",
         "model.net.dropout=0.1", "trainer.enable_progress_bar=false")
FAULT = ("+callbacks.fault._target_=litscale.callbacks.faults.InjectFault", "+callbacks.fault.rank=1")
# torch's elastic agent shares its rendezvous store with the workers by default, and a
# restarted worker can then read the previous attempt's process-group addresses; this torch
# setting gives every attempt a fresh store (the README's torchrun instructions set it too).
FRESH_STORE = {FRESH_STORE_ENV: "1"}


def run_torchrun(*overrides: str, outputs: Path, name: str, max_restarts: int,
                 timeout: float = 240) -> tuple[subprocess.CompletedProcess, float]:
    """``torchrun --standalone --nproc-per-node=2 train.py ...`` in its own process group (killed
    whole on a timeout, so no rank outlives a failed test); returns the process and seconds."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               f"--max-restarts={max_restarts}", "--monitor-interval=0.5", str(REPO / "train.py"),
               *overrides, f"name={name}", f"hydra.run.dir={outputs}/{name}/runs/torchrun"]
    completed, seconds, stray = run_in_own_group(command, outputs=outputs, env=FRESH_STORE,
                                                 timeout=timeout)
    assert stray == [], f"outlived torchrun: {stray}\n{completed.stderr[-500:]}"
    return completed, seconds


@pytest.mark.soak
@pytest.mark.timeout(500)
def test_killed_rank_is_restarted_and_resumes_to_the_uninterrupted_result(tmp_path):
    """SIGKILL on rank 1 at step 6 (checkpoint at step 4), --max-restarts=1, ckpt_path=auto:
    the restarted ranks resume at step 4 and end with the clean run's losses and weights,
    dropout included; the fault does not fire again in the resumed run."""
    # The uninterrupted run on the rank pool, whose ranks start train.py as torchrun's do.
    clean = train_on_pool(*SHORT, "name=clean", outputs=tmp_path, devices=2)
    assert clean.returncode == 0, explain(clean)
    killed, _ = run_torchrun(*SHORT, "ckpt_path=auto", *FAULT, "+callbacks.fault.at_step=6",
                             "+callbacks.fault.kind=sigkill", outputs=tmp_path, name="killed",
                             max_restarts=1)
    assert killed.returncode == 0, explain(killed)
    assert "Signal 9 (SIGKILL)" not in killed.stderr  # torchrun's failure report: none left
    output = killed.stdout + killed.stderr
    checkpoint = tmp_path / "killed" / "runs" / "torchrun" / "checkpoints" / "last.ckpt"
    assert output.count("Restored all states from the checkpoint at") == 1, explain(killed)
    assert f"Restored all states from the checkpoint at {checkpoint}" in output
    [reference], [resumed] = summaries(tmp_path / "clean"), summaries(tmp_path / "killed")
    assert resumed["steps"] == reference["steps"] == 12
    expected, actual = train_losses(reference["output_dir"]), train_losses(resumed["output_dir"])
    assert sorted(actual) == list(range(4, 12))  # the steps after the checkpoint, run again
    assert {step: expected[step] for step in actual} == actual
    for name, tensor in final_weights(reference).items():
        assert torch.equal(final_weights(resumed)[name], tensor), name


@pytest.mark.soak
@pytest.mark.timeout(300)
def test_exception_in_validation_stops_every_rank_with_the_cause_shown_once(tmp_path):
    """An exception on rank 1 during validation, no restarts left: torchrun exits 1 well within
    a minute, the traceback of the cause appears once and one ``error:`` line names it; the
    rank that lost its peer says so in one line, without a traceback of its own."""
    process, _ = run_torchrun(*SHORT, "trainer.max_steps=8", *FAULT,
                              "+callbacks.fault.at_step=4", "+callbacks.fault.during=validation",
                              outputs=tmp_path, name="failed", max_restarts=0)
    assert process.returncode == 1, explain(process)  # torchrun's own exit, not the kill at the timeout
    errors = [line for line in process.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: rank 1 failed: InjectedFault: injected fault in validation at step 4 "
                      "on rank 1"], explain(process)
    assert process.stderr.count(", in _fire") == 1, explain(process)  # the cause's traceback, once
    knock_on = [line for line in process.stderr.splitlines() if "stopped: another rank failed" in line]
    assert all(line.startswith("litscale: rank 0 stopped") for line in knock_on)
    assert "ChildFailedError" in process.stderr  # torchrun's own summary of the failed ranks
    assert not (tmp_path / "failed" / "runs" / "torchrun" / "summary.json").exists()


@pytest.mark.soak
@pytest.mark.timeout(300)
def test_killed_again_after_the_restart_fails_once_restarts_are_exhausted(tmp_path):
    """The fault fires in the resumed run too (``after_resume``), with ``--max-restarts=1``:
    the job stops with a non-zero exit after two attempts, torchrun names the killed rank
    once, no rank is left running and no summary claims success."""
    process, _ = run_torchrun(*SHORT, "ckpt_path=auto", *FAULT, "+callbacks.fault.at_step=6",
                              "+callbacks.fault.kind=sigkill", "+callbacks.fault.after_resume=true",
                              outputs=tmp_path, name="exhausted", max_restarts=1)
    assert process.returncode != 0 and not process.stderr.startswith("hang: killed"), explain(process)
    output = process.stdout + process.stderr
    assert output.count("Restored all states from the checkpoint at") == 1, explain(process)
    assert process.stderr.count("Root Cause (first observed failure)") == 1, explain(process)
    assert process.stderr.count("Signal 9 (SIGKILL) received by PID") == 1, explain(process)
    assert not (tmp_path / "exhausted" / "runs" / "torchrun" / "summary.json").exists()
