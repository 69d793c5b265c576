"""Which process is which rank: as it starts, each rank writes ``<run dir>/ranks/rank<N>.json``
(global and local rank, host, pid), so that one rank of a running job can be signalled,
inspected or profiled (``kill -TERM``, ``py-spy dump --pid``) without guessing among the
launcher's children, whose command lines are all alike."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path


def record_rank(output_dir: str) -> Path:
    """Write this process's ``ranks/rank<N>.json`` under ``output_dir``; return its path."""
    rank = int(os.environ.get("RANK", 0))
    path = Path(output_dir) / "ranks" / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
              "host": socket.gethostname(), "pid": os.getpid()}
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(record))
    os.replace(partial, path)  # a reader sees the whole record or none
    return path
