"""FLOPs for model FLOPs utilisation (MFU): what a training step needs, what a device can do.

A step's FLOPs come from the model's own formula when it has one (``flops_per_token``: the
6N + attention count that MFU figures in the field use), otherwise they are counted once with
``torch.utils.flop_counter`` on a meta-device copy (shapes only, no memory, no compute).
A device's peak comes from Lightning's table of accelerators; a CPU has no table, so its peak
is measured by a matmul probe (in the layout ``nn.Linear`` multiplies in, in the run's dtype: a
CPU without bf16 units has a bf16 peak of its own, far below its fp32 one) and cached per CPU
model, thread count and dtype, but only where the machine was quiet when probed (``disturbed``): a
probe beside other work measures that work too, so it serves the run that took it, which says
its MFU is provisional (``CpuPeak``).
"""

from __future__ import annotations

import copy
import json
import os
import platform
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

# Dense bf16/fp16 peaks missing from Lightning's table (it knows "H200 SXM1", not plain "H200").
_EXTRA_CUDA_PEAKS = {"h200": 989e12, "h100": 989e12, "gh200": 989e12}


def flops_per_sample(net: nn.Module, example: torch.Tensor | None, tokens_per_sample: int | None,
                     attended_length: float | None = None) -> float:
    """Training FLOPs (forward + backward) of one sample: the model's formula for
    ``tokens_per_sample`` tokens, or counted for one sample shaped like ``example``.

    ``attended_length``: the sample is a packed row whose documents attend only within
    themselves, its tokens attending to that many keys on average (``sum(l_i ** 2) / T`` for
    documents of lengths ``l_i`` in a row of ``T``: ``litscale.data.token_batch.attended_tokens``
    over ``T``). Attention is counted whole, causal or not, as PaLM's 6N + 12 L H d T and torch's
    counter count it, so a packed row's is the dense row's with ``T ** 2`` pairs replaced by
    ``sum(l_i ** 2)``: ``12 x layers x heads x head_dim x sum(l_i ** 2)``."""
    if hasattr(net, "flops_per_token") and tokens_per_sample:
        length = tokens_per_sample

        def count(tokens: int) -> float:
            return float(net.flops_per_token(tokens)) * tokens
    else:
        from torch.utils.flop_counter import FlopCounterMode

        meta_net = net if next(net.parameters()).is_meta else copy.deepcopy(net).to("meta")
        length = example.shape[-1]  # a row of tokens, where it packs documents

        def count(tokens: int) -> float:
            sample = torch.zeros_like(example[:1] if tokens == length else example[:1, ..., :tokens], device="meta")
            with FlopCounterMode(display=False) as counter:
                meta_net(sample).float().sum().backward()
            return float(counter.get_total_flops())
    dense = count(length)
    if attended_length is None or attended_length >= length:
        return dense
    # NOTE: torch's FLOP counter counts attention dense whatever the mask: on the meta device SDPA
    # takes the math path, whose T x T matmuls are counted whole with a boolean mask or
    # is_causal alike; the fused CUDA kernels' formulas and FlexAttention's (block mask or not;
    # only a compiled graph's ``sparsity_hint`` lowers it) count the same T x T. (On real CPU
    # tensors SDPA's kernel has no formula at all and counts 0: litscale counts on meta.) So a
    # packed row is corrected here: its FLOPs are a x T + b x T^2 (b x T^2 attention's), b read
    # from the count at half the length, and b x T^2 replaced by b x T x attended_length.
    half = length // 2
    per_pair = (dense / length - count(half) / half) / (length - half)
    return dense - per_pair * length * (length - attended_length)


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


@dataclass(frozen=True)
class CpuPeak:
    """A CPU's peak FLOP/s for one dtype and thread count, and why it is provisional (None: probed
    on a quiet machine and cached, so every run on this machine divides by the same figure)."""

    flops: float
    provisional: str | None = None


def cpu_peak(dtype: torch.dtype, threads: int, siblings: float = 0.0) -> CpuPeak:
    """The cached peak, else a probe now, cached only where the machine is quiet (``siblings``:
    the cores the job's other ranks on this machine keep busy meanwhile, not counted against it)."""
    key = _peak_key(dtype, threads)
    cached = _read_peaks().get(key)
    if cached is not None:
        return CpuPeak(float(cached))
    return _probed(key, dtype, siblings=siblings)


def measured_cpu_peak(dtype: torch.dtype, threads: int) -> float:
    """Best FLOP/s of a matmul on ``threads`` threads (``cpu_peak``'s figure)."""
    return cpu_peak(dtype, threads).flops


def _probed(key: str, dtype: torch.dtype, floor: float = 0.0, siblings: float = 0.0) -> CpuPeak:
    """A probe now (at least ``floor``): cached where the machine was quiet while it ran, but for
    ``siblings`` cores of the job's own other ranks, else provisional."""
    load, clock = load_average(), cpu_clock()
    peak = max(probe_matmul_flops(dtype), floor)
    refused = disturbed(load, others_load(clock), siblings=siblings)
    if refused:
        return CpuPeak(peak, f"the CPU's {str(dtype).removeprefix('torch.')} peak was probed at a {refused}, "
                             "so it was not cached")
    return CpuPeak(_store_peak(key, peak))


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


def corrected_cpu_peak(dtype: torch.dtype, threads: int, achieved: float, siblings: float = 0.0) -> CpuPeak:
    """The CPU peak again, for a run that went faster than the cached one (that one was probed
    while the machine was busy, or in another layout): the larger of a new probe and the cached
    figure, cached where the machine is quiet. Never the run's own figure: a peak set to what a
    run reached made every later run of that kind read about 100% (bf16 on a CPU without bf16
    units read 95-97% so), so a run still faster than the peak is provisional, and says so."""
    key = _peak_key(dtype, threads)
    peak = _probed(key, dtype, _read_peaks().get(key, 0.0), siblings=siblings)
    if achieved > peak.flops and peak.provisional is None:
        return CpuPeak(peak.flops, f"this run reached {achieved / 1e9:.3g} GFLOP/s per rank, above the CPU's "
                                   f"probed {str(dtype).removeprefix('torch.')} peak of {peak.flops / 1e9:.3g}")
    return peak


def probe_matmul_flops(dtype: torch.dtype, size: int = 512, seconds: float = 0.5) -> float:
    """The best of several timed batches of ``size``-square matmuls: a peak, so the max (a
    busy machine still lowers it: ``busy`` says when; delete the cache file to measure again)."""
    # Its own generator: the probe runs inside fit, and drawing from the global one would shift
    # the run's dropout masks on the first run of a machine only, so resumes stop matching.
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, dtype=dtype, generator=generator) for _ in range(2))
    # NOTE: in nn.Linear's layout (the weight transposed): on a CPU without bf16 units, ``a @ b``
    # in bf16 ran 3-4x slower than the same matmul as a Linear layer runs it.
    F.linear(a, b)  # first call allocates and picks kernels
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(4):
            F.linear(a, b)
        best = max(best, 4 * 2 * size**3 / (time.perf_counter() - start))
    return best


# --- how busy the machine is: what a timing on it depends on (the CPU peak here, the planner's
# calibration and profiles in ``litscale.planner``) -------------------------------------------

# A machine whose load is high by design (a shared login node) can accept timings up to this
# load average instead of its core count.
MAX_LOAD_ENV = "LITSCALE_MAX_LOAD"


def cores() -> int:
    """The cores this process may run on (its affinity, which a container or taskset narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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


# The load average lags a minute behind and counts only runnable processes: a neighbour that
# starts during a timing, or a timing's own processes on a 2-core machine, hide in it (a
# calibration whose load average read 0.67 before it began measured two ranks' contention as
# 2.24x beside another job; alone it is 1.05x, and every 2-rank prediction came out 2.2x slow).
# So a timing also counts the CPU time its cores gave to others while it ran (Linux's
# /proc/stat, less this process's and its reaped children's own): above a quarter of a core on
# average, it is not kept.
OTHERS_LIMIT = 0.25


@dataclass(frozen=True)
class CpuClock:
    """At one moment: the CPU seconds every process (and a hypervisor, in its stolen time) had
    spent on the cores this process may run on, and this process's own with its reaped
    children's."""

    everyone_s: float
    own_s: float
    wall_s: float


def cpu_clock() -> CpuClock | None:
    """The clock now; None where the kernel does not say (not Linux)."""
    import resource

    cores_ = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        with open("/proc/stat") as stat:
            lines = [line.split() for line in stat if line.startswith("cpu") and not line.startswith("cpu ")]
    except OSError:
        return None
    # user nice system idle iowait irq softirq steal: all but idle and iowait kept a core busy
    ticks = sum(int(v[1]) + int(v[2]) + int(v[3]) + int(v[6]) + int(v[7]) + int(v[8])
                for v in lines if cores_ is None or int(v[0][3:]) in cores_)
    own = sum(getattr(resource.getrusage(who), part) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for part in ("ru_utime", "ru_stime"))
    return CpuClock(ticks / os.sysconf("SC_CLK_TCK"), own, time.monotonic())


def others_load(since: CpuClock | None) -> float | None:
    """How many cores other processes kept busy on average since ``since``; None where unknown."""
    now = cpu_clock()
    if since is None or now is None or now.wall_s <= since.wall_s:
        return None
    others = (now.everyone_s - since.everyone_s) - (now.own_s - since.own_s)
    return max(0.0, others / (now.wall_s - since.wall_s))


def disturbed(load: float, others: float | None, siblings: float = 0.0) -> str | None:
    """Why a timing that began at load average ``load`` cannot be kept (None: it can): ``busy``
    when it began, or ``others`` (``others_load`` over the timing; None: unknown) above
    ``OTHERS_LIMIT`` of a core beyond ``siblings``, the cores the job's own other ranks on this
    machine take meanwhile (``LITSCALE_MAX_LOAD`` raises both limits)."""
    refused = busy(load)
    if refused:
        return refused
    limit = float(os.environ.get(MAX_LOAD_ENV) or OTHERS_LIMIT)
    if others is None or others <= limit + siblings:
        return None
    where = f"{MAX_LOAD_ENV}={limit:g}" if os.environ.get(MAX_LOAD_ENV) else f"{limit:g} of a core"
    beyond = f" beyond the {siblings:g} of the job's other ranks" if siblings else ""
    return (f"moment when other processes kept {others:.2f} of this machine's {cores()} cores busy "
            f"(above {where}{beyond})")
