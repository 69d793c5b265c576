"""This machine as a timing depends on it: which machine it is (``fingerprint``), and how busy
it was (``litscale.measure.flops.busy``, which the CPU peak below MFU obeys too).

A calibration or a profile timed on one machine, or under another program's load, describes
that machine and that moment: read back on another host sharing the cache directory, or taken
while a test suite ran beside it, it made every later prediction of a run several times off.
So each timing carries the machine's fingerprint and the load average it saw, and one timed
above the core count is not kept.
"""

from __future__ import annotations

import os
import platform

from litscale.measure import flops


def fingerprint() -> dict:
    """What a timing on this machine depends on: the processor, the cores this process may use
    and the memory (the host's name is left out: identical hosts share what they timed)."""
    return {"cpu": _cpu_model(), "arch": platform.machine(), "cores": flops.cores(),
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
