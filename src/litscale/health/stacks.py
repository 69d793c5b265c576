"""Python stacks of a stuck job, for its hang report."""

from __future__ import annotations

import faulthandler
import os
import shutil
import subprocess


def dump_own_stacks(path: str, header: str) -> None:
    """Every thread of this process (the main thread stuck in its call included), with
    ``faulthandler``: it needs no lock the stuck thread may hold."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        handle.write(header + "\n\n")
        handle.flush()
        faulthandler.dump_traceback(file=handle, all_threads=True)


def dump_stacks_of(pid: int, path: str, header: str, timeout_s: float = 20.0) -> bool:
    """Another process's stacks with py-spy where it is installed (a rank that no longer
    answers cannot dump its own); False where that is not possible."""
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        return False
    try:
        result = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                                timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        handle.write(f"{header}\n\n{result.stdout}{result.stderr}")
    return result.returncode == 0
