"""FLOPs for model FLOPs utilisation (MFU): what a training step needs, what a device can do.

A step's FLOPs come from the model's own formula when it has one (``flops_per_token``: the
6N + attention count that MFU figures in the field use), otherwise they are counted once with
``torch.utils.flop_counter`` on a meta-device copy (shapes only, no memory, no compute).
A device's peak comes from Lightning's table of accelerators; a CPU has no table, so its peak
is measured once by a matmul probe and cached per CPU model, thread count and dtype.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import time
import warnings
from pathlib import Path

import torch
from torch import nn

# Dense bf16/fp16 peaks missing from Lightning's table (it knows "H200 SXM1", not plain "H200").
_EXTRA_CUDA_PEAKS = {"h200": 989e12, "h100": 989e12, "gh200": 989e12}


def flops_per_sample(net: nn.Module, example: torch.Tensor | None, tokens_per_sample: int | None) -> float:
    """Training FLOPs (forward + backward) of one sample: the model's formula for
    ``tokens_per_sample`` tokens, or counted for one sample shaped like ``example``."""
    if hasattr(net, "flops_per_token") and tokens_per_sample:
        return float(net.flops_per_token(tokens_per_sample)) * tokens_per_sample
    from torch.utils.flop_counter import FlopCounterMode

    meta_net = net if next(net.parameters()).is_meta else copy.deepcopy(net).to("meta")
    sample = torch.zeros_like(example[:1], device="meta")
    with FlopCounterMode(display=False) as counter:
        meta_net(sample).float().sum().backward()
    return float(counter.get_total_flops())


def peak_flops_per_device(device: torch.device, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of one device (one rank's share of the cores on a CPU)."""
    if device.type == "cpu":
        return measured_cpu_peak(dtype, torch.get_num_threads())
    if device.type != "cuda":
        return None
    from lightning.fabric.utilities.throughput import get_available_flops

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unknown chip is reported by the fallback below
        peak = get_available_flops(device, dtype)
    if peak is None and dtype in (torch.bfloat16, torch.float16):
        name = torch.cuda.get_device_name(device).lower()
        peak = next((v for chip, v in _EXTRA_CUDA_PEAKS.items() if chip in name.split()), None)
    return None if peak is None else float(peak)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "litscale" / "cpu_peak_flops.json"


def measured_cpu_peak(dtype: torch.dtype, threads: int) -> float:
    """Best FLOP/s of a square matmul on ``threads`` threads, measured once and cached."""
    key = _peak_key(dtype, threads)
    cached = _read_peaks().get(key)
    return float(cached) if cached is not None else _store_peak(key, probe_matmul_flops(dtype))


def _peak_key(dtype: torch.dtype, threads: int) -> str:
    return f"{_cpu_model()}|threads={threads}|{dtype}"


def _read_peaks() -> dict[str, float]:
    try:
        return json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _store_peak(key: str, peak: float) -> float:
    path = _cache_path()
    cache = {**_read_peaks(), key: peak}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, indent=1))
    os.replace(tmp, path)  # ranks probing at once never leave a torn file
    return peak


def corrected_cpu_peak(dtype: torch.dtype, threads: int, achieved: float) -> float:
    """The CPU peak again, for a run that went faster than the cached one: that one was probed
    while the machine was busy. The larger of a new probe and what the run achieved replaces it
    (a peak is never below what was reached), so MFU never reads above 100%."""
    peak = max(probe_matmul_flops(dtype), achieved, measured_cpu_peak(dtype, threads))
    return _store_peak(_peak_key(dtype, threads), peak)


def probe_matmul_flops(dtype: torch.dtype, size: int = 512, seconds: float = 0.5) -> float:
    """The best of several timed batches of ``size``-square matmuls: a peak, so the max (a
    busy machine still lowers it; delete the cache file to measure again)."""
    # Its own generator: the probe runs inside fit, and drawing from the global one would shift
    # the run's dropout masks on the first run of a machine only, so resumes stop matching.
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, dtype=dtype, generator=generator) for _ in range(2))
    a @ b  # first call allocates and picks kernels
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 4 * 2 * size**3 / (time.perf_counter() - start))
    return best
