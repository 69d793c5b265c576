"""Checkpoint layouts written by the libraries that write them, for the tests of which
checkpoint ``ckpt_path=last`` and ``auto`` resolve to."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def sharded_checkpoint(path: Path, step: int, written_at: float | None = None) -> Path:
    """Lightning's sharded layout (DCP shards and .metadata, then meta.pt), saved by DCP itself;
    with ``written_at``, every file's time set to it (meta.pt a second later)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"state_dict": {"weight": torch.full((4,), float(step))}}, checkpoint_id=str(path))
    torch.save({"global_step": step}, path / "meta.pt")
    if written_at is not None:
        for file in path.iterdir():
            os.utime(file, (written_at, written_at))
        os.utime(path / "meta.pt", (written_at + 1, written_at + 1))
    return path
