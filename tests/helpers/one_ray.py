"""One Ray cluster on this machine at a time, across the test processes.

The Ray sweeps (``test_ray.py``) and the two-node cluster (``test_ray_cluster.py``) each start
Ray workers that import torch and train; on the 2 xdist workers of a whole ``make test-soak``
they ran at once (2026-12-07) and the node ran out of memory (22.3 of 23.5 GB): Ray killed 7
workers and the cluster's four tests erred in set-up. Each module fixture that starts Ray holds
this lock while its Ray runs; the other worker's fixture waits for it (CI's soak slices hold
them in different slices, where nothing waits)."""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
from collections.abc import Iterator
from pathlib import Path

LOCK = Path(tempfile.gettempdir()) / "litscale-tests-one-ray.lock"


@contextlib.contextmanager
def one_ray_at_a_time() -> Iterator[None]:
    with open(LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file is closed
        yield
