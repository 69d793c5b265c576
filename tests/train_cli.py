"""Running ``train.py`` in a subprocess, as a user would, for end-to-end tests."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def run_train(*overrides: str, outputs: Path, timeout: float = 240, env: dict | None = None):
    """``python train.py <overrides>`` with outputs under ``outputs``; returns the process."""
    full_env = {**os.environ, "LITSCALE_OUTPUTS": str(outputs), "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, str(REPO / "train.py"), *overrides],
        cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout,
    )


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
