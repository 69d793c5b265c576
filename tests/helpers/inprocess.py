"""``python train.py <overrides>`` on the ranks of the rank pool (``helpers.distributed``)
instead of new interpreters: for the tests whose claim is about what a run computes and
leaves behind (exact resume, exports, summaries), not about the launcher that starts it.

Each pool rank runs ``train.py`` as its ``__main__``, as ``torchrun`` would start it: the
command line is checked, Hydra composes, ``litscale.app.launch`` sees an external launcher
(the pool sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``) and the rank fits in place, on
the process group the pool created (Lightning's strategies use it). What the run prints
is captured on each rank's file descriptors 1 and 2 and handed back as a finished process:
the exit code ``train.py`` would end with and every rank's stdout and stderr, as a terminal
shows them. With one device the rank is a plain ``python train.py``: the pool's launcher
environment and process group are gone before it starts.

``train_job_on_pool`` skips the command line too: the test composes and validates the job
once, and each rank runs ``litscale.app.run.train`` on it, as litscale's launcher hands its
ranks the resolved config (the combination test, whose claim is what an accepted job computes).

A ``train.py`` subprocess pays 4-7 s of imports, per rank; here the imports are paid once
per pool. Claims about litscale's launcher, ``torchrun``, signals sent to a job from outside,
the hang watchdog stopping a job, or what a fresh interpreter imports stay with
``helpers.cli.run_train``.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

import torch.distributed as dist

from helpers.cli import REPO, cli_env, explain
from helpers.distributed import run_distributed
from litscale.app.launch import RUN_ID_ENV, RUN_ID_TIME_FORMAT

# What the pool sets for a task, as a launcher would (``helpers.distributed._run_task``).
POOL_LAUNCHER_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
)


def train_on_pool(
    *overrides: str, outputs: Path, devices: int = 1, env: dict | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    """``python train.py <overrides>`` on ``devices`` pool ranks, as many as the run's
    ``trainer.devices`` (one for a command line that ends before any rank starts); returns
    it as ``helpers.cli.run_train`` does."""
    # Every rank names the same run dir, as under torchrun; a new one for each run.
    run_id = datetime.now().strftime(f"{RUN_ID_TIME_FORMAT}_%f")
    environment = {**cli_env(outputs, env), RUN_ID_ENV: run_id}
    replies = run_distributed(
        _train_py_on_this_rank, devices, list(overrides), environment, timeout=timeout
    )
    codes = [code for code, _, _ in replies]
    return subprocess.CompletedProcess(
        ["train.py", *overrides],
        max(codes, key=abs),
        "".join(out for _, out, _ in replies),
        "".join(err for _, _, err in replies),
    )


def train_job_on_pool(job: dict, choices: dict[str, str], *, devices: int, timeout: float = 240) -> None:
    """``litscale.app.run.train`` of a job composed and validated in the test process, on
    ``devices`` pool ranks: what a launcher hands its ranks (the resolved config as data, the
    group choices), without the command line's composition on every rank (about a second of
    each rank's time per run, for a claim about what the job computes). What the ranks print is
    kept off the terminal; a rank that fails raises with its traceback."""
    run_distributed(_train_job_on_this_rank, devices, job, choices, timeout=timeout)


def _train_job_on_this_rank(rank: int, world_size: int, job: dict, choices: dict[str, str]) -> None:
    from omegaconf import OmegaConf

    from litscale.app.run import train

    if world_size == 1:  # as train.py on one device: no launcher environment, no process group
        _leave_the_pool_launch()
    with _captured(1), _captured(2):
        try:
            train(OmegaConf.create(job), choices=choices)
        finally:
            _end_threads_an_exit_would_end()


def refusal_on_pool(*overrides: str, outputs: Path) -> str:
    """The one line ``train.py <overrides>`` is refused with: exit code 2, that line alone on
    stderr, and nothing written under ``outputs`` (no rank started)."""
    process = train_on_pool(*overrides, outputs=outputs)
    assert process.returncode == 2, explain(process)
    lines = process.stderr.strip().splitlines()
    assert len(lines) == 1, explain(process)
    assert not outputs.exists() or not any(outputs.iterdir())
    return lines[0]


def _train_py_on_this_rank(
    rank: int, world_size: int, argv: list[str], environment: dict
) -> tuple[int, str, str]:
    """``train.py argv`` as this rank's ``__main__``: (exit code, stdout, stderr)."""
    os.environ.update(environment)  # the pool puts its own environment back after the task
    if world_size == 1:  # not one rank of an external launch: a plain single-process run
        _leave_the_pool_launch()
    saved_argv = sys.argv
    sys.argv = [str(REPO / "train.py"), *argv]
    code = 0
    with _captured(1) as stdout, _captured(2) as stderr:
        try:
            runpy.run_path(str(REPO / "train.py"), run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        finally:
            sys.argv = saved_argv
            _end_threads_an_exit_would_end()
    return code, stdout.read(), stderr.read()


def _leave_the_pool_launch() -> None:
    """This one rank as a plain single process: no launcher environment, no process group (the
    pool puts its environment back after the task)."""
    for name in POOL_LAUNCHER_ENV:
        os.environ.pop(name, None)
    dist.destroy_process_group()


def _end_threads_an_exit_would_end() -> None:
    """Stop what the run left running that its process's exit would have ended: tqdm's
    monitor thread (a tokenizer's progress bar starts it); the pool restarts a worker that
    a task leaves threads in."""
    tqdm = sys.modules.get("tqdm")
    monitor = getattr(getattr(tqdm, "tqdm", None), "monitor", None)
    if monitor is not None:
        monitor.exit()
        tqdm.tqdm.monitor = None


class _Text:
    """What a captured descriptor received, readable once the capture has ended."""

    def __init__(self) -> None:
        self.text = ""

    def read(self) -> str:
        return self.text


@contextlib.contextmanager
def _captured(fd: int):
    """Everything written to file descriptor ``fd`` (Python's stream and any C code or child
    process writing to it) while inside, as a ``_Text`` afterwards."""
    stream = sys.stdout if fd == 1 else sys.stderr
    captured = _Text()
    with tempfile.TemporaryFile(mode="w+b") as file:
        stream.flush()
        saved = os.dup(fd)
        os.dup2(file.fileno(), fd)
        try:
            yield captured
        finally:
            stream.flush()
            os.dup2(saved, fd)
            os.close(saved)
            file.seek(0)
            captured.text = file.read().decode(errors="replace")
