"""Figures a run prints that a user can believe: the CPU peak MFU divides by is cached only when
it was probed on a quiet machine (else MFU says it is provisional, and why); a run faster than the
peak is not made the peak (that made every bf16 run on a CPU without bf16 units read 95-97%); a
16-bit run on such a CPU is measured against its own, emulated, peak and says so; and a scaling
efficiency above 100% or timed beside other work is flagged in the run's line and the sweep's
report. The probe is replaced by fixed figures: what is checked is what is kept and said."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from litscale.app import report, summary
from litscale.app.scaling_study import scaling_metrics
from litscale.callbacks.throughput import ThroughputCallback
from litscale.measure import flops

FP32_PEAK, BF16_PEAK = 1e10, 4e8  # a CPU whose bf16 matmuls are 25x slower than its fp32 ones


@pytest.fixture
def cpu(tmp_path, monkeypatch):
    """A 2-core CPU with a fixed probe per dtype, its peak cache in ``tmp_path``; returns a setter
    of the load average the probe sees."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("LITSCALE_MAX_LOAD", raising=False)
    monkeypatch.setattr(flops, "cores", lambda: 2, raising=False)
    probes = {torch.float32: FP32_PEAK, torch.bfloat16: BF16_PEAK}
    monkeypatch.setattr(flops, "probe_matmul_flops", lambda dtype, size=512, seconds=0.5: probes[dtype])
    load = {"now": 0.5, "others": 0.0}
    monkeypatch.setattr(flops, "load_average", lambda: load["now"], raising=False)
    monkeypatch.setattr(flops, "others_load", lambda since: load["others"])

    def set_load(value: float, others: float = 0.0) -> None:
        load["now"], load["others"] = value, others

    return set_load


def test_a_peak_probed_while_another_process_took_a_core_is_not_cached_and_is_provisional(cpu, tmp_path):
    cpu(0.4, others=1.01)  # the load average, a minute behind, saw nothing yet
    peak = flops.cpu_peak(torch.float32, 1)
    assert cache(tmp_path) == {} and peak.provisional == (
        "the CPU's float32 peak was probed at a moment when other processes kept 1.01 of this machine's 2 cores "
        "busy (above 0.25 of a core), so it was not cached")


@pytest.mark.slow  # a neighbour spins for a second and a half
def test_a_process_beside_a_timing_is_seen_in_the_cpu_time_its_cores_gave_others():
    """The real clock: a process spinning beside a timing shows as at least most of a core taken
    by others (read before it is reaped: a reaped child's CPU time counts as this process's own)."""
    import subprocess
    import sys
    import time

    clock = flops.cpu_clock()
    spin = "import time\nend = time.monotonic() + 1.5\nwhile time.monotonic() < end: pass"
    neighbour = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(1.2)
        others = flops.others_load(clock)  # before it is reaped (a reaped child's time is one's own)
    finally:
        neighbour.wait()
    assert others is not None and others > 0.8, others


def cache(tmp_path) -> dict:
    path = tmp_path / "litscale" / "cpu_peak_flops.json"
    return json.loads(path.read_text()) if path.exists() else {}


def test_a_peak_probed_on_a_busy_machine_is_not_cached_and_is_provisional(cpu, tmp_path):
    cpu(5.1)
    assert flops.measured_cpu_peak(torch.float32, 1) == FP32_PEAK
    assert cache(tmp_path) == {}  # a probe beside other work measures that work too: not kept
    busy = flops.cpu_peak(torch.float32, 1)
    assert busy.provisional == ("the CPU's float32 peak was probed at a load average 5.10 above this "
                                "machine's 2 cores, so it was not cached")
    cpu(1.9)
    quiet = flops.cpu_peak(torch.float32, 1)
    assert quiet.provisional is None and list(cache(tmp_path).values()) == [FP32_PEAK]
    cpu(5.1)
    assert flops.cpu_peak(torch.float32, 1) == quiet  # read back, whatever the load now


def test_a_run_faster_than_the_peak_is_not_made_the_peak(cpu, tmp_path):
    flops.cpu_peak(torch.float32, 1)
    corrected = flops.corrected_cpu_peak(torch.float32, 1, achieved=3 * FP32_PEAK)
    assert corrected.flops == FP32_PEAK and list(cache(tmp_path).values()) == [FP32_PEAK]
    assert corrected.provisional == ("this run reached 30 GFLOP/s per rank, above the CPU's probed float32 "
                                     "peak of 10")


def throughput_result(precision: str, achieved: float) -> dict:
    """The callback's figures for one rank that reached ``achieved`` FLOP/s, on the CPU above."""
    callback = ThroughputCallback(warmup_steps=1)
    strategy = SimpleNamespace(root_device=torch.device("cpu"), distributed_sampler_kwargs=None)
    trainer = SimpleNamespace(precision=precision, world_size=1, strategy=strategy)
    callback.on_train_start(trainer, SimpleNamespace(device=torch.device("cpu")))
    callback._start, callback._samples_per_step = (0.0, 0), 1
    callback._flops_per_sample, callback._tokens_per_sample = achieved, None
    return callback._summarise(trainer, 1.0, 1)  # one sample in one second: ``achieved`` FLOP/s


def test_mfu_says_when_it_is_provisional(cpu):
    cpu(5.1)
    result = throughput_result("32-true", 0.2 * FP32_PEAK)
    assert result["perf/mfu"] == pytest.approx(0.2) and result["perf/peak_flops_per_device"] == FP32_PEAK
    assert result["machine/load_average_start"] == 5.1 and result["machine/cores"] == 2
    assert summary.mfu_caveats(result) == (" | provisional: the CPU's float32 peak was probed at a load average "
                                           "5.10 above this machine's 2 cores, so it was not cached")
    cpu(0.5)
    assert "perf/mfu_provisional" not in throughput_result("32-true", 0.2 * FP32_PEAK)


def test_a_ranks_probe_does_not_count_its_jobs_other_ranks_as_another_programs_load(cpu, monkeypatch):
    """Every rank probes at the start of fit: on 2 cores, a 2-rank job's other rank takes the
    other core meanwhile, which is the job's own, not a neighbour's."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    cpu(1.9, others=1.01)  # the other rank, probing on its own core
    assert "perf/mfu_provisional" not in throughput_result("32-true", 0.2 * FP32_PEAK)
    cpu(1.9, others=1.6)  # and a neighbour beside both
    assert throughput_result("bf16-mixed", 0.2 * BF16_PEAK)["perf/mfu_provisional"] == (
        "the CPU's bfloat16 peak was probed at a moment when other processes kept 1.60 of this machine's 2 cores "
        "busy (above 0.25 of a core beyond the 1 of the job's other ranks), so it was not cached")


def test_a_bf16_run_on_a_cpu_without_bf16_units_has_its_own_peak_and_says_so(cpu):
    result = throughput_result("bf16-mixed", 0.5 * BF16_PEAK)
    assert result["perf/peak_flops_per_device"] == BF16_PEAK  # not fp32's, not the run's own figure
    assert result["perf/mfu"] == pytest.approx(0.5) and result["perf/peak_vs_fp32"] == pytest.approx(0.04)
    assert summary.mfu_caveats(result) == (" | of this CPU's 16-bit peak, 25x below its fp32 one (no 16-bit "
                                           "units: emulated, so fp32 runs faster here)")
    faster = throughput_result("bf16-mixed", 2 * BF16_PEAK)  # part of the step ran in fp32
    assert faster["perf/mfu"] == pytest.approx(2.0)  # said, not clamped to the run's own figure
    assert faster["perf/mfu_provisional"].startswith("this run reached 0.8 GFLOP/s per rank, above")


def summaries(run_load: float, baseline_load: float, throughput: float) -> tuple[dict, dict]:
    def one(devices: int, samples: float, load: float) -> dict:
        return {"world_size": devices, "perf/samples_per_sec": samples, "overrides": [f"trainer.devices={devices}"],
                "machine/load_average_start": load, "machine/load_average_end": load, "machine/cores": 2,
                "run_dir": f"runs/{devices}", "scaling/mode": "weak"}

    return one(2, throughput, run_load), one(1, 100.0, baseline_load)


def test_an_efficiency_above_100_percent_or_a_baseline_timed_beside_other_work_is_flagged(capsys):
    run, baseline = summaries(run_load=1.8, baseline_load=5.1, throughput=524.8)
    metrics = scaling_metrics(run, baseline)
    assert metrics["scaling/efficiency"] == pytest.approx(2.624)
    assert metrics["scaling/flags"] == ["efficiency 262.4% is above 100%",
                                        "the baseline was timed at a load average 5.10 above its machine's 2 cores"]
    summary._print_end({**run, **metrics, "steps": 12, "wall_time_s": 3.0, "output_dir": "runs/2"})
    assert ("litscale: scaling: 5.25x speedup on 2 devices = 262.4% efficiency (weak); not a measurement to "
            "trust: efficiency 262.4% is above 100%; the baseline was timed at a load average 5.10 above its "
            "machine's 2 cores") in capsys.readouterr().out.splitlines()
    rows = report.scaling_rows([baseline, run])
    flagged = next(row for row in rows if row["devices"] == 2)
    assert flagged["not to be believed"] == "; ".join(metrics["scaling/flags"])
    assert "efficiency 262.4% is above 100%" in report.markdown_table(rows)
    quiet_run, quiet_baseline = summaries(run_load=1.8, baseline_load=1.0, throughput=180.0)
    assert "scaling/flags" not in scaling_metrics(quiet_run, quiet_baseline)  # 90%, both quiet: nothing to say


def test_why_mfu_is_provisional_reaches_the_summary_not_tensorboard(cpu, tmp_path):
    """TensorBoard's logger refuses a string: the provisional note is kept out of the loggers."""
    from lightning.pytorch.loggers import TensorBoardLogger

    from litscale.loggers import log_to_loggers

    cpu(5.1)
    result = throughput_result("32-true", 0.2 * FP32_PEAK)
    assert isinstance(result["perf/mfu_provisional"], str)
    log_to_loggers(SimpleNamespace(loggers=[TensorBoardLogger(tmp_path / "tb")], global_step=2), result)
