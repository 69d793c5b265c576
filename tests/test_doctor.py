"""The collective doctor: Flight Recorder dumps of real gloo ranks matched across ranks, and
real 2-rank jobs whose rank skips a collective, hangs or all-reduces the wrong shape
(``InjectFault``), each named by the doctor's line."""

from __future__ import annotations

import os
import pickle
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers.cli import REPO, explain, run_in_own_group
from helpers.distributed import run_distributed

from litscale.doctor import main as doctor_main
from litscale.health import flight_recorder
from litscale.health.doctor import UnsafeDumpError, diagnose, load_dumps

THIS_FILE = "tests/test_doctor.py"


def _line_of(marker: str) -> int:
    """The line of this file that holds ``marker`` (a comment at a call the doctor names)."""
    lines = Path(__file__).read_text().splitlines()
    return next(number for number, text in enumerate(lines, 1) if text.rstrip().endswith(marker))


def _issue_and_dump(rank: int, world_size: int, run_dir: str, mismatch: str) -> None:
    """A few collectives, the third with rank 1's shape or dtype differing where ``mismatch``
    says (the same bytes: gloo, as NCCL, completes it and corrupts nothing it can see)."""
    dist.all_reduce(torch.ones(8))
    dist.broadcast(torch.ones(3), src=0)
    tensor = torch.ones(6)
    if rank == 1 and mismatch == "shape":
        tensor = torch.ones(2, 3)
    if rank == 1 and mismatch == "dtype":
        tensor = torch.ones(6, dtype=torch.int32)
    dist.all_reduce(tensor)  # the third collective
    dist.all_reduce(torch.ones(8))
    flight_recorder.dump(run_dir, rank, reason="test")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mismatch", "rank1_call"),
    [("shape", "all_reduce float32[2, 3]"), ("dtype", "all_reduce int32[6]")],
)
def test_a_shape_or_dtype_that_differs_on_one_rank_is_named_with_each_ranks_line(
    mismatch, rank1_call, tmp_path
):
    run_distributed(_issue_and_dump, 2, str(tmp_path), mismatch)
    diagnosis = diagnose(load_dumps(tmp_path))
    where = f"{THIS_FILE}:{_line_of('# the third collective')} in _issue_and_dump"
    assert re.fullmatch(
        rf"collective mismatch at all_reduce #(\d+) of default_pg: rank 0 in all_reduce "
        rf"float32\[6\] \(at {where}\); rank 1 in {re.escape(rank1_call)} \(at {where}\)",
        diagnosis.line,
    ), diagnosis.line
    assert diagnosis.mismatch and sorted(diagnosis.stacks) == [0, 1]
    # the whole stack of the call, innermost first
    assert diagnosis.stacks[1][0]["name"] == "all_reduce"


@pytest.mark.slow
def test_ranks_that_agree_are_said_to_and_the_command_exits_zero(tmp_path, capsys):
    run_distributed(_issue_and_dump, 2, str(tmp_path), "none")
    assert doctor_main([str(tmp_path)]) == 0
    assert (
        capsys.readouterr().out
        == "no collective mismatch: ranks 0,1 agree on their last 4 collectives\n"
    )


# --- the matching, on dumps written by hand ------------------------------------------------------


def entry(
    seq: int,
    *,
    size: int = 4,
    record: int | None = None,
    group: str = "0",
    line: int = 10,
    created: int | None = None,
) -> dict:
    return {
        "record_id": seq if record is None else record,
        "process_group": (group, "default_pg" if group == "0" else "undefined"),
        "collective_seq_id": seq,
        "is_p2p": False,
        "profiling_name": "gloo:all_reduce",
        "input_sizes": [[size]],
        "input_dtypes": ["Float"],
        "time_created_ns": created or seq,
        "frames": [{"name": "step", "filename": "/job/train_loop.py", "line": line}],
    }


def dump(*entries: dict, now_line: int = 99) -> dict:
    return {
        "entries": list(entries),
        flight_recorder.STACK_KEY: [
            {"name": "wait_here", "filename": "/job/train_loop.py", "line": now_line}
        ],
    }


def test_a_rank_that_never_entered_a_collective_is_named_with_where_it_is_instead():
    dumps = {0: dump(entry(1), entry(2)), 1: dump(entry(1), entry(2), entry(3, line=12))}
    assert diagnose(dumps).line == (
        "collective mismatch at all_reduce #3 of default_pg: rank 0 never entered it (now at /job/train_loop.py:99 "
        "in wait_here); rank 1 in all_reduce float32[4] (at /job/train_loop.py:12 in step)"
    )


def test_a_wrapped_buffer_is_compared_from_what_every_rank_still_holds_and_a_rank_without_dump_is_named():
    dumps = {0: dump(*(entry(s) for s in range(5, 9))), 1: dump(*(entry(s) for s in range(2, 9)))}
    assert diagnose(dumps, world_size=3).line == (
        "no collective mismatch: ranks 0,1 agree on their last 7 collectives (no dump from rank 2)"
    )


def test_the_earliest_difference_over_process_groups_is_the_one_named():
    dumps = {
        0: dump(entry(1, created=1), entry(1, group="1", record=2, created=5, size=2)),
        1: dump(
            entry(1, created=1),
            entry(1, group="1", record=2, created=5, size=3),
            entry(2, record=3, created=9),
        ),
    }
    assert diagnose(dumps).line.startswith(
        "collective mismatch at all_reduce #1 of group 1: rank 0 in all_reduce float32[2] "
    )


def test_a_group_created_again_under_the_same_name_is_compared_from_its_new_start():
    old = [entry(s, size=100 + s) for s in (1, 2, 3)]  # another job's group "0" in the same process
    dumps = {0: dump(*old, *(entry(s, record=10 + s) for s in (1, 2))), 1: dump(entry(1), entry(2))}
    assert (
        diagnose(dumps).line
        == "no collective mismatch: ranks 0,1 agree on their last 2 collectives"
    )


def test_the_command_says_when_there_is_nothing_to_read(tmp_path, capsys):
    assert doctor_main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"error: no Flight Recorder dumps in {tmp_path} (flight_recorder/rank<N>): a "
        "run writes them when the hang watchdog stops it or a rank fails\n"
    )


class _RunsACommand:
    """What a hostile dump holds: unpickling it calls ``os.system`` (a pickle may name any
    importable function)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        import os

        return os.system, (self.command,)


def test_a_dump_that_would_run_code_is_refused_in_one_line_and_nothing_runs(tmp_path, capsys):
    marker = tmp_path / "ran"
    directory = tmp_path / flight_recorder.DUMP_DIR
    directory.mkdir()
    (directory / "rank0").write_bytes(pickle.dumps(dump(entry(1))))
    hostile = pickle.dumps({"entries": [_RunsACommand(f"touch {marker}")]})
    (directory / "rank1").write_bytes(hostile)
    assert doctor_main([str(tmp_path)]) == 2
    assert not marker.exists()
    refused = f"{os.system.__module__}.system"  # posix.system on Linux
    assert capsys.readouterr().err == (
        f"error: {directory / 'rank1'} refers to {refused}, which a Flight Recorder dump never holds; allowed: "
        "plain data (dict, list, tuple, str, int, float, bool, bytes, set, None); nothing of the file was run\n"
    )
    with pytest.raises(UnsafeDumpError):
        load_dumps(tmp_path)
    assert not marker.exists()


def test_plain_data_of_every_allowed_kind_loads(tmp_path):
    data = {"entries": [], "sizes": [(1, 2.5)], "flags": {True, None}, "raw": b"\x00", "name": "pg"}
    for protocol in range(3, pickle.HIGHEST_PROTOCOL + 1):  # 0-2 spell bytes as a call of _codecs
        (tmp_path / "rank0").write_bytes(pickle.dumps(data, protocol=protocol))
        assert load_dumps(tmp_path) == {0: data}, protocol


# --- real jobs: 2 CPU ranks, a fault on one ------------------------------------------------------

RUN = (
    "strategy=ddp",
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "data.batch_size=8",
    "data.seq_len=32",
    "data.max_bytes=400000",
    "trainer.max_steps=200",
    "trainer.val_check_interval=1000",
    "trainer.enable_progress_bar=false",
    "callbacks.watchdog.timeout_s=8",
    "+callbacks.fault._target_=litscale.callbacks.faults.InjectFault",
    "+callbacks.fault.at_step=6",
)
DOCTOR_LINE = re.compile(r"^doctor: (collective mismatch at .*)$", re.MULTILINE)
LIGHTNING_BACKWARD = (
    r"lightning/pytorch/core/module\.py:\d+ in backward"  # where loss.backward() is
)
FAULTS = "src/litscale/callbacks/faults.py"


def faulty_run(kind: str, rank: int, tmp_path: Path) -> tuple[str, Path]:
    """A 2-rank job with fault ``kind`` on ``rank``, stopped by the hang watchdog (exit 1, not
    the kill at the timeout): the doctor's line and the run dir."""
    command = [
        sys.executable,
        str(REPO / "train.py"),
        *RUN,
        f"+callbacks.fault.kind={kind}",
        f"+callbacks.fault.rank={rank}",
        f"hydra.run.dir={tmp_path}/run",
    ]
    process, _, stray = run_in_own_group(command, outputs=tmp_path, timeout=250)
    assert stray == [], f"outlived the job: {stray}\n{process.stderr[-800:]}"
    assert process.returncode == 1, explain(process)
    match = DOCTOR_LINE.search(process.stderr)
    assert match, explain(process)
    return match.group(1), tmp_path / "run"


def _faults_line(function: str, code: str) -> str:
    """``faults.py:<line> in <function>``: the first line of ``function`` that starts with ``code``."""
    lines = (REPO / FAULTS).read_text().splitlines()
    start = next(n for n, text in enumerate(lines) if text.strip().startswith(f"def {function}("))
    number = next(
        n for n, text in enumerate(lines[start:], start + 1) if text.strip().startswith(code)
    )
    return f"{FAULTS}:{number} in {function}"


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rank_zero_skipping_its_all_reduce_is_named_by_the_doctor(tmp_path, capsys):
    line, run_dir = faulty_run("skip_collective", 0, tmp_path)
    rank0_waits = re.escape(_faults_line("on_before_backward", "time.sleep(HANG_S)"))
    assert re.fullmatch(
        rf"collective mismatch at all_reduce #\d+ of default_pg: rank 0 never entered it \(now at "
        rf"{rank0_waits}\); rank 1 in all_reduce float32\[\d+\] \(at {LIGHTNING_BACKWARD}\)",
        line,
    ), line
    assert sorted(p.name for p in (run_dir / "flight_recorder").iterdir()) == ["rank0", "rank1"]
    assert doctor_main([str(run_dir)]) == 1  # the command prints the same line, then the stacks
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == line and printed[1] == "  rank 0:"


def _hang_line() -> str:
    sleeps = re.escape(_faults_line("on_train_batch_start", "time.sleep(HANG_S)"))
    return (
        rf"rank 0 in all_reduce float32\[\d+\] \(at {LIGHTNING_BACKWARD}\); rank 1 never entered it "
        rf"\(now at {sleeps}\)"
    )


def _wrong_shape_line() -> str:
    """The hang line blames rank 0 (it waits outside any declared collective); the doctor
    names rank 1's empty all-reduce."""
    sync = re.escape(_faults_line("_sync_a_metric_of_the_wrong_shape", "dist.all_reduce("))
    return rf"rank 0 in all_reduce float32\[4\] \(at {sync}\); rank 1 in all_reduce float32\[0\] \(at {sync}\)"


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("kind", "expected"),
    # make test-full names a hang; the wrong shape (about 100 s) is make test-soak's, beyond CI's time.
    [pytest.param("hang", _hang_line, marks=pytest.mark.full),
     pytest.param("wrong_shape", _wrong_shape_line, marks=pytest.mark.soak)],
)
def test_a_rank_that_hangs_or_all_reduces_the_wrong_shape_is_named_by_the_doctor(
    kind, expected, tmp_path
):
    line, _ = faulty_run(kind, 1, tmp_path)
    assert re.fullmatch(
        rf"collective mismatch at all_reduce #\d+ of default_pg: {expected()}", line
    ), line
