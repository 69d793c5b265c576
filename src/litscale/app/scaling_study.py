"""Scaling efficiency against a 1-device baseline, measured rather than guessed.

    speedup    = throughput(N) / throughput(1)
    efficiency = throughput(N) / (N x throughput(1))

Throughput is samples/s, N the number of devices (world size). Weak scaling keeps the
per-device micro batch (``data.batch_size``) fixed; strong scaling keeps the global batch
fixed (``scaling.global_batch``), so every device gets a smaller share as N grows.

The baseline is a 1-device run's ``summary.json``: named with ``scaling.baseline``, or, in a
Hydra sweep over ``trainer.devices``, the sweep's 1-device job with the same other overrides.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

from litscale.errors import ConfigError
from litscale.user_paths import user_path

THROUGHPUT = "perf/samples_per_sec"
# Overrides that set the device count; jobs differing only in these form one scaling curve.
DEVICE_KEYS = ("trainer.devices", "trainer.num_nodes")
# Overrides that do not change what is trained.
NOT_A_VARIANT = (*DEVICE_KEYS, "name", "scaling.baseline", "trainer.enable_progress_bar")


def speedup(throughput: float, baseline_throughput: float) -> float:
    return throughput / baseline_throughput


def efficiency(throughput: float, devices: int, baseline_throughput: float) -> float:
    return throughput / (devices * baseline_throughput)


@dataclass
class ScalingContext:
    """What a job knows about its place in a scaling study (computed before ranks start)."""

    overrides: list[str] = field(default_factory=list)  # this job's command-line overrides
    sweep_dir: str | None = None  # the Hydra sweep dir, when this job is part of a multirun
    baseline: str | None = None  # a baseline summary.json named by the user

    @property
    def variant(self) -> str:
        return variant_of(self.overrides)


def variant_of(overrides: list[str]) -> str:
    """The overrides that define a scaling curve: all but the device count (and `name`).
    A sweep writes booleans as Python does (``False``), a command line as YAML (``false``)."""
    kept = []
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+~") not in NOT_A_VARIANT:
            kept.append(f"{key}={value.lower() if value in ('True', 'False') else value}")
    return " ".join(sorted(kept)) or "default"


def baseline_summary_path(value: str) -> str:
    """``scaling.baseline`` (a summary.json or the run dir holding one) as a summary path."""
    path = user_path(value)
    if os.path.isdir(path):
        path = os.path.join(path, "summary.json")
    if not os.path.isfile(path):
        raise ConfigError(
            f"scaling.baseline={value!r} has no summary.json; give a finished 1-device run's "
            "summary.json or its run dir, or null"
        )
    return path


def _read(path: str) -> dict | None:
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def find_baseline(context: ScalingContext) -> dict | None:
    """The baseline summary for this job, or None when there is none (yet)."""
    if context.baseline:
        return _read(context.baseline)
    if not context.sweep_dir:
        return None
    found = [s for s in map(_read, glob.glob(os.path.join(glob.escape(context.sweep_dir), "*",
                                                          "summary.json")))
             if s and s.get("world_size") == 1 and variant_of(s.get("overrides", [])) == context.variant]
    return max(found, key=lambda s: s.get("wall_time_s", 0), default=None) if found else None


def scaling_metrics(summary: dict, baseline: dict | None) -> dict[str, float | list[str]]:
    """``scaling/*`` for a finished run's summary; empty without a usable baseline. ``scaling/flags``
    lists why the figure is not to be believed, where it is not (``scaling_flags``)."""
    devices = summary.get("world_size", 1)
    if devices == 1 and baseline is None:
        baseline = summary  # a 1-device job is its own baseline
    if baseline is None or THROUGHPUT not in summary or not baseline.get(THROUGHPUT):
        return {}
    base = baseline[THROUGHPUT] / baseline.get("world_size", 1)  # per device, if N_base > 1
    metrics = {
        "scaling/speedup": speedup(summary[THROUGHPUT], base),
        "scaling/efficiency": efficiency(summary[THROUGHPUT], devices, base),
        "scaling/baseline_samples_per_sec": base,
        "scaling/devices": float(devices),
    }
    flags = scaling_flags(summary, baseline, metrics["scaling/efficiency"])
    return {**metrics, "scaling/flags": flags} if flags else metrics


def scaling_flags(summary: dict, baseline: dict, efficiency: float) -> list[str]:
    """Why an efficiency is not a measurement of scaling: above 100% (N devices cannot do more
    than N times one's work: the baseline was slowed, or the run sped up, by something else), or
    the baseline or the run timed while the machine had more runnable processes than cores."""
    flags = [f"efficiency {efficiency:.1%} is above 100%"] if efficiency > 1 else []
    for who, timed in (("the baseline", baseline), ("this run", summary)):
        load = load_beyond_cores(timed)
        if load:
            flags.append(f"{who} was timed at a {load}")
    return flags


def load_beyond_cores(summary: dict) -> str | None:
    """The load a run was timed under, where it was above its machine's cores (None: it was not,
    or the run did not record it): the larger of the last minute's load average as its timed steps
    began and as they ended (``machine/*``, the throughput callback's)."""
    loads = [summary.get(key) for key in ("machine/load_average_start", "machine/load_average_end")]
    cores = summary.get("machine/cores")
    if cores is None or not any(load is not None for load in loads):
        return None
    load = max(load for load in loads if load is not None)
    return f"load average {load:.2f} above its machine's {cores} cores" if load > cores else None


def job_context(cfg) -> ScalingContext:
    """This Hydra job's overrides and sweep dir (empty outside Hydra), and the named baseline."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    scaling = cfg.get("scaling") or {}
    baseline = baseline_summary_path(scaling.baseline) if scaling.get("baseline") else None
    if not HydraConfig.initialized():
        return ScalingContext(baseline=baseline)
    from omegaconf import OmegaConf

    hydra = HydraConfig.get()
    sweep_dir = hydra.sweep.dir if hydra.mode == RunMode.MULTIRUN else None
    # Unresolved: an override like `+key=${oc.env:SECRET}` must stay an interpolation.
    overrides = OmegaConf.to_container(hydra.overrides.task, resolve=False)
    return ScalingContext(overrides=overrides, sweep_dir=sweep_dir, baseline=baseline)


def baseline_first(arguments: list[str]) -> list[str]:
    """A sweep's ``trainer.devices=4,1,2`` as ``trainer.devices=1,2,4``: Hydra runs jobs in the
    order listed, and each job can compare with its 1-device baseline only once that has run."""
    ordered = []
    for argument in arguments:
        key, _, value = argument.partition("=")
        counts = value.split(",")
        if key.lstrip("+") == "trainer.devices" and len(counts) > 1 and all(c.isdigit() for c in counts):
            argument = f"{key}={','.join(sorted(counts, key=int))}"
        ordered.append(argument)
    return ordered


# Threads each rank of a device sweep gets (read by ``app.build``): the same for every job.
THREADS_ENV = "LITSCALE_THREADS_PER_RANK"


def threads_per_rank_of_sweep(arguments: list[str], cores: int) -> int | None:
    """Threads per rank that keep a sweep over ``trainer.devices`` like for like: the share of
    the largest job. NOTE: without it a CPU sweep's 1-device baseline uses every core while each
    of N ranks gets 1/N of them, so efficiency compares unlike runs (58% read on 2 cores where
    equal threads give about 92%). None when the command line sweeps no device count."""
    for argument in arguments:
        key, _, value = argument.partition("=")
        counts = value.split(",")
        if key.lstrip("+") == "trainer.devices" and len(counts) > 1 and all(c.isdigit() for c in counts):
            return max(1, cores // max(int(c) for c in counts))
    return None
