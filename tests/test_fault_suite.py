"""``experiments/reliability/faults.py`` keeps working: how it reads the verdict a user gets from a
job's lines, and its fastest scenarios run through its own functions (a Kubernetes pod deleted,
seen through the stub API server; a torn checkpoint, then ``ckpt_path=auto``), graded."""

from __future__ import annotations

import importlib
import json
import re
import sys
import time

import pytest
from helpers.cli import REPO

sys.path.insert(0, str(REPO / "experiments" / "reliability"))
faults = importlib.import_module("faults")
fault_runs = importlib.import_module("fault_runs")


def test_the_verdict_is_the_first_line_of_its_kind_after_the_fault():
    lines = [(1.0, "error: from before the fault"), (5.0, "litscale: gpt-nano, 2 ranks"),
             (6.5, "Traceback (most recent call last):"), (7.0, "error: rank 1 failed: Signal 9 (SIGKILL)"),
             (9.0, "error: rank 1 failed: again")]
    said = fault_runs.verdict(lines, 5.0, re.compile(r"^error: rank 1 failed"))
    assert (said.line, said.detected, said.seconds) == ("error: rank 1 failed: Signal 9 (SIGKILL)", True, 2.0)
    other = fault_runs.verdict(lines, 5.0, re.compile(r"^litscale: straggler"))
    assert (other.line, other.detected) == ("error: rank 1 failed: Signal 9 (SIGKILL)", False)  # shown, not counted
    assert fault_runs.verdict(lines, 10.0, re.compile("x")) == fault_runs.Verdict("(nothing)", False, None)


def test_a_fault_records_the_time_it_acts_once(tmp_path):
    from litscale.callbacks.faults import InjectFault

    class Trainer:
        global_step, global_rank = 7, 1

    record = tmp_path / "fault.jsonl"
    injected = InjectFault(at_step=7, kind="nan_weights", record=str(record))
    before = time.time()
    injected._record_firing(Trainer())
    injected._record_firing(Trainer())  # a slow rank's every step: the first one counts
    (line,) = record.read_text().splitlines()
    acted = fault_runs.fault_record(record)
    assert (acted["kind"], acted["step"], acted["rank"]) == ("nan_weights", 7, 1) and before <= acted["time"] <= time.time()
    assert json.loads(line) == acted


@pytest.mark.full
@pytest.mark.slow  # a stub API server, the kubernetes client's waits
def test_a_deleted_pod_is_seen_by_the_k8s_launcher_which_creates_its_job_again(tmp_path):
    pytest.importorskip("kubernetes")
    row = faults.pod_deleted(faults.Context(tmp_path, 0.0, 0))
    assert row["detected"] and row["finished"] and row["created"] == ["litscale-faults-0", "litscale-faults-0-r1"]
    assert row["verdict"].startswith("litscale: TrainJob litscale-faults-0 failed; creating it again as ")
    assert 0 <= row["seconds"] <= 2 * 2.0  # the launcher's next poll (poll_s=2)


@pytest.mark.slow
@pytest.mark.soak  # make test-soak: two short 2-rank runs, about 1-2 min on a loaded 2-core machine
@pytest.mark.timeout(600)
def test_a_torn_checkpoint_is_skipped_with_a_line_and_the_job_finishes_from_the_one_before(tmp_path):
    (row,), _ = faults.run_scenarios(["torn"], tmp_path)
    assert row["verdict"].startswith("litscale: ckpt_path=auto skipped "), row
    assert row["detected"] and row["finished"] and row["data_lost"].startswith("none") and not row["stray"], row
    assert (row["resumed_from_step"], row["steps_lost"]) == (faults.STEPS - faults.CHECKPOINT_EVERY,
                                                             faults.CHECKPOINT_EVERY)
    assert faults.table({"machine": "m", "command": "c", "date": "d", "step_s": 0.1, "faults": [row]}).count(
        "| torn checkpoint") == 1
