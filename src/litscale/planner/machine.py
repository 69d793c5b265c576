"""This machine as a timing depends on it: which machine it is, and how busy it was.

A calibration or a profile timed on one machine, or under another program's load, describes
that machine and that moment: read back on another host sharing the cache directory, or taken
while a test suite ran beside it, it made every later prediction of a run several times off.
So each timing carries the machine's fingerprint and the load average it saw, and one timed
above the core count is not kept.
"""

from __future__ import annotations

import os
import platform

# A machine whose load is high by design (a shared login node) can accept timings up to this
# load average instead of its core count.
MAX_LOAD_ENV = "LITSCALE_MAX_LOAD"


def cores() -> int:
    """The cores this process may run on (its affinity, which a container or taskset narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def fingerprint() -> dict:
    """What a timing on this machine depends on: the processor, the cores this process may use
    and the memory (the host's name is left out: identical hosts share what they timed)."""
    return {"cpu": _cpu_model(), "arch": platform.machine(), "cores": cores(),
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> float:
    """The last minute's load average (runnable processes, all users), 0 where unknown."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def busy(load: float) -> str | None:
    """Why a timing taken at ``load`` cannot be kept (None: it can): more runnable processes
    than cores, so the timed work shared its cores with someone else's."""
    limit = float(os.environ.get(MAX_LOAD_ENV) or cores())
    if load <= limit:
        return None
    where = f"{MAX_LOAD_ENV}={limit:g}" if os.environ.get(MAX_LOAD_ENV) else f"this machine's {cores()} cores"
    return f"load average {load:.2f} above {where}"
