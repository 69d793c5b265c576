"""Running ``train.py`` in a subprocess, as a user would, and reading what a run leaves behind
(``summary.json``, the last checkpoint, the CSV logger's ``metrics.csv``)."""

from __future__ import annotations

import csv
import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from helpers.configs import REPO_ROOT

REPO = REPO_ROOT  # where train.py is, and where runs start


def check_command(overrides: list[str], capsys) -> tuple[int, str, str]:
    """``check_command_line(overrides)`` in this process, as ``train.py`` runs it before Hydra:
    (exit code, stdout, stderr)."""
    from helpers.configs import CONF_DIR
    from litscale.app.preflight import check_command_line

    code = 0
    try:
        check_command_line(overrides, config_dir=str(CONF_DIR), config_name="train")
    except SystemExit as exit_info:
        code = exit_info.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_train(*overrides: str, outputs: Path, timeout: float = 240, env: dict | None = None):
    """``python train.py <overrides>`` with outputs under ``outputs``; returns the process."""
    return subprocess.run(
        [sys.executable, str(REPO / "train.py"), *overrides],
        cwd=REPO, env=cli_env(outputs, env), capture_output=True, text=True, timeout=timeout,
    )


def cli_env(outputs: Path, env: dict | None = None) -> dict:
    """The environment of a run whose outputs go under ``outputs``, plus ``env``."""
    return {**os.environ, "LITSCALE_OUTPUTS": str(outputs), "PYTHONUNBUFFERED": "1", **(env or {})}


# A process the job's end has already stopped may take a moment to finish exiting on a loaded
# machine (its arguments gone, not yet a zombie): only what still runs after this is a stray.
# 2 s was too short at a load average of 15 (a DDP rank still exiting after a clean run).
EXIT_GRACE_S = 5.0


def run_in_own_group(command: list[str], *, outputs: Path, env: dict | None = None,
                     timeout: float, cwd: Path = REPO) -> tuple[subprocess.CompletedProcess, float, list[str]]:
    """Run ``command`` from the repo (or ``cwd``) in a process group of its own, so that nothing
    it started can outlive it: returns the process (a hang, killed at ``timeout``, says so in
    stderr), its seconds, and the processes of its group still running when it ended (then killed)."""
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=cwd, env=cli_env(outputs, env), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = "", f"hang: killed after {timeout} s"
    seconds = time.monotonic() - started
    stray = live_processes(process.pid)
    deadline = time.monotonic() + EXIT_GRACE_S
    while stray and time.monotonic() < deadline:  # a rank still exiting (ps shows "[python]")
        time.sleep(0.1)
        stray = live_processes(process.pid)
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the launcher and its ranks, whatever happened
    except ProcessLookupError:
        pass
    process.wait()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr), seconds, stray


def summaries(outputs: Path) -> list[dict]:
    """Every ``summary.json`` under ``outputs``, oldest run first."""
    paths = sorted(glob.glob(str(outputs / "**" / "summary.json"), recursive=True), key=os.path.getmtime)
    return [json.loads(Path(p).read_text()) for p in paths]


def final_weights(summary: dict) -> dict[str, torch.Tensor]:
    """The network weights of a run's last checkpoint."""
    checkpoint = torch.load(summary["checkpoint"], map_location="cpu", weights_only=True)
    return {k: v for k, v in checkpoint["state_dict"].items() if k.startswith("net.")}


def explain(process: subprocess.CompletedProcess) -> str:
    return f"exit {process.returncode}\nstdout:\n{process.stdout[-3000:]}\nstderr:\n{process.stderr[-3000:]}"


def live_processes(group: int) -> list[str]:
    """The processes of process group ``group`` still running; an exited one that its parent
    has not reaped yet (a zombie, as the multiprocessing resource tracker briefly is) is not."""
    listing = subprocess.run(["ps", "-e", "-o", "pgid=,stat=,args="], capture_output=True,
                             text=True, check=True).stdout
    rows = [line.split(None, 2) for line in listing.splitlines()]
    return [row[2] if len(row) > 2 else "" for row in rows
            if row[0] == str(group) and not row[1].startswith("Z")]


def metrics_rows(run_dir: str | Path) -> list[dict[str, str]]:
    """The rows of a run's ``csv/metrics.csv`` (the CSV logger, ``logger=csv``), as written."""
    with open(Path(run_dir) / "csv" / "metrics.csv") as handle:
        return list(csv.DictReader(handle))


def train_losses(run_dir: str | Path) -> dict[int, float]:
    """``train/loss`` by the step it is logged at (Lightning's 0-based logger step)."""
    return {int(row["step"]): float(row["train/loss"]) for row in metrics_rows(run_dir)
            if row.get("train/loss")}


def comm_metrics(summary: dict) -> list[dict[str, float]]:
    """The ``comm/*`` figures of each logged row that has them, oldest first."""
    return [{k: float(v) for k, v in row.items() if k.startswith("comm/") and v}
            for row in metrics_rows(summary["output_dir"]) if row.get("comm/bytes_per_step")]
