"""Which process is which rank: as it starts, each rank writes ``<run dir>/ranks/rank<N>.json``
(global and local rank, host, pid), so that one rank of a running job can be signalled,
inspected or profiled (``kill -TERM``, ``py-spy dump --pid``) without guessing among the
launcher's children, whose command lines are all alike."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path


def record_rank(output_dir: str, **extra: object) -> Path:
    """Write this process's ``ranks/rank<N>.json`` under ``output_dir`` (with ``extra``, e.g.
    the checkpoint a preempted rank saved); return its path."""
    rank = int(os.environ.get("RANK", 0))
    path = Path(output_dir) / "ranks" / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
              "host": socket.gethostname(), "pid": os.getpid(), **extra}
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(record))
    os.replace(partial, path)  # a reader sees the whole record or none
    return path


def ranks_without_preemption_checkpoint(output_dir: str, ranks: range) -> list[int]:
    """The ranks among ``ranks`` whose record says no ``last.ckpt`` was saved when the run was
    preempted (or that left no record): the checkpoint is then incomplete."""
    missing = []
    for rank in ranks:
        path = Path(output_dir) / "ranks" / f"rank{rank}.json"
        record = json.loads(path.read_text()) if path.exists() else {}
        if not record.get("preemption_checkpoint"):
            missing.append(rank)
    return missing
