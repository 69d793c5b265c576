"""Scaling efficiency: the arithmetic, FLOPs and MFU, multirun sweeps over devices and
strategies (one dir per job, each its own world size), the sweep's report, W&B offline runs,
a resumed run continuing its W&B run, and the notebook that reads the summaries."""

from __future__ import annotations

import json
import os
import re
import statistics
from pathlib import Path

import pytest
import torch
from helpers.cli import REPO, explain, run_train, summaries

from litscale.app.scaling_study import (
    ScalingContext,
    efficiency,
    find_baseline,
    scaling_metrics,
    speedup,
    variant_of,
)
from litscale.errors import ConfigError
from litscale.measure import flops
from litscale.measure.flops import flops_per_sample, measured_cpu_peak
from litscale.models.gpt import build_gpt
from litscale.parallel.layout import micro_batch_for

TINY = ("optimizer=sgd", "optimizer.lr=0.05", "trainer.max_steps=12", "trainer.val_check_interval=12",
        "trainer.limit_val_batches=2", "trainer.accelerator=cpu", "data.seq_len=32",
        "data.max_bytes=400000", "trainer.enable_progress_bar=false", "data.batch_size=4")
# A described cluster of CPU-like links (gloo on one machine: about 1 GB/s, 0.4 ms) whose peak is
# far above this machine's (2 TFLOP/s per device): each job's planner error is large, and
# plan.calibrate_from has something to refit.
DESCRIBED_CLUSTER = ("cluster=h100_8x", "cluster.peak_flops.float32=2e12", "cluster.intra_node.bandwidth_bytes_s=1e9",
                     "cluster.intra_node.latency_s=4e-4", "cluster.overlap=0")
NO_WANDB_KEY = {"WANDB_API_KEY": "", "NETRC": "/nonexistent", "WANDB_SILENT": "true"}

# --- arithmetic ------------------------------------------------------------------------------


def test_efficiency_is_throughput_over_n_times_baseline():
    assert speedup(300.0, 100.0) == 3.0
    assert efficiency(300.0, 4, 100.0) == 0.75
    metrics = scaling_metrics({"world_size": 4, "perf/samples_per_sec": 300.0},
                              {"world_size": 1, "perf/samples_per_sec": 100.0})
    assert metrics["scaling/speedup"] == 3.0 and metrics["scaling/efficiency"] == 0.75
    # A baseline with 2 devices counts per device: 300 / (4 x 160 / 2) = 0.9375
    metrics = scaling_metrics({"world_size": 4, "perf/samples_per_sec": 300.0},
                              {"world_size": 2, "perf/samples_per_sec": 160.0})
    assert metrics["scaling/efficiency"] == 0.9375
    assert scaling_metrics({"world_size": 2, "perf/samples_per_sec": 1.0}, None) == {}
    assert scaling_metrics({"world_size": 1, "perf/samples_per_sec": 7.0}, None)["scaling/efficiency"] == 1.0


def test_variant_ignores_device_count_and_order():
    a = variant_of(["trainer.devices=2", "strategy=fsdp", "optimizer.lr=0.1"])
    assert a == variant_of(["optimizer.lr=0.1", "strategy=fsdp", "trainer.devices=1", "name=x"])
    assert a != variant_of(["strategy=ddp", "optimizer.lr=0.1"])


def test_strong_scaling_splits_the_global_batch():
    assert micro_batch_for(64, data_parallel_size=4, accumulation=2) == 8
    with pytest.raises(ConfigError, match=r"^scaling.global_batch=6 does not split over 4 "
                                          r"data-parallel rank\(s\) x 1 accumulation step\(s\); "
                                          r"allowed: multiples of 4$"):
        micro_batch_for(6, data_parallel_size=4, accumulation=1)


def test_flops_counted_for_any_net_and_from_the_gpt_formula():
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    forward = 2 * (64 * 128 + 128 * 10)
    # backward: weight grads of both layers (2x forward each), input grad of the second only
    assert flops_per_sample(net, torch.zeros(8, 64), None) == 3 * forward - 2 * 64 * 128
    gpt = build_gpt(preset="nano")
    c, n = gpt.config, gpt.num_params(exclude_embeddings=True)
    assert flops_per_sample(gpt, None, 32) == (6 * n + 12 * c.n_layer * c.n_embd * 32) * 32


def test_cpu_peak_is_probed_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(flops, "load_average", lambda: 0.0)  # a quiet machine: the probe is kept
    rng_before = torch.get_rng_state()
    first = measured_cpu_peak(torch.float32, torch.get_num_threads())
    assert torch.equal(torch.get_rng_state(), rng_before)  # a run's dropout masks stay the same
    assert first > 1e8  # any CPU does more than 0.1 GFLOP/s
    assert measured_cpu_peak(torch.float32, torch.get_num_threads()) == first  # from the cache
    assert (tmp_path / "litscale" / "cpu_peak_flops.json").is_file()


@pytest.mark.slow  # over a second alone: out of the quick loop
def test_a_cpu_peak_that_a_run_beat_is_measured_again_and_never_set_to_the_run(tmp_path, monkeypatch):
    """A peak probed while the machine was busy reads low, and MFU above 100%: a run faster than
    the cached peak replaces it with a new probe (on a quiet machine). Never with what the run
    reached: that made every later run of its kind read 100% (bf16 on a CPU without bf16 units
    read 95-97%); a run still faster than the new probe is provisional, and says so."""
    from litscale.measure.flops import corrected_cpu_peak

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(flops, "load_average", lambda: 0.0)  # a quiet machine: probes are kept
    threads = torch.get_num_threads()
    stale = measured_cpu_peak(torch.float32, threads) / 1000  # as if probed under heavy load
    cache = tmp_path / "litscale" / "cpu_peak_flops.json"
    cache.write_text(json.dumps({key: stale for key in json.loads(cache.read_text())}))
    corrected = corrected_cpu_peak(torch.float32, threads, achieved=2 * stale)
    assert corrected.flops > 2 * stale and corrected.provisional is None
    assert measured_cpu_peak(torch.float32, threads) == corrected.flops
    beaten = corrected_cpu_peak(torch.float32, threads, achieved=1e30)
    assert beaten.flops < 1e30 and measured_cpu_peak(torch.float32, threads) == beaten.flops  # not the run's
    assert beaten.provisional.startswith("this run reached 1e+21 GFLOP/s per rank, above the CPU's probed")


# --- a sweep over devices and strategies, through train.py --------------------------------------


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    outputs = tmp_path_factory.mktemp("sweep")
    # Listed 2,1 on purpose: train.py runs the 1-device baseline first.
    process = run_train("-m", "trainer.devices=2,1", "strategy=ddp,fsdp", *TINY, *DESCRIBED_CLUSTER, "logger=wandb",
                        "name=sweep", outputs=outputs, env=NO_WANDB_KEY, timeout=400)
    assert process.returncode == 0, explain(process)
    sweeps = list((outputs / "sweep" / "multiruns").iterdir())
    return process, outputs, sweeps


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_multirun_runs_each_job_once_with_its_own_world_size(sweep):
    process, outputs, sweeps = sweep
    assert len(sweeps) == 1, sweeps  # no sweep re-launched by a child rank
    jobs = sorted(p.name for p in sweeps[0].iterdir() if p.is_dir() and p.name.isdigit())
    assert jobs == ["0", "1", "2", "3"]
    assert not (outputs / "sweep" / "runs").exists()
    found = sorted((s["choices"]["strategy"], s["world_size"]) for s in summaries(outputs))
    assert found == [("ddp", 1), ("ddp", 2), ("fsdp", 1), ("fsdp", 2)]
    assert process.stdout.count("litscale: done:") == 4  # one summary per job, from rank 0
    # like for like: each 1-device job ran on the threads each rank of the 2-device jobs had
    assert len({s["threads_per_rank"] for s in summaries(outputs)}) == 1


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_each_job_logs_efficiency_against_its_one_device_job(sweep):
    _, outputs, _ = sweep
    runs = {(s["choices"]["strategy"], s["world_size"]): s for s in summaries(outputs)}
    for strategy in ("ddp", "fsdp"):
        one, two = runs[(strategy, 1)], runs[(strategy, 2)]
        expected = two["perf/samples_per_sec"] / (2 * one["perf/samples_per_sec"])
        assert two["scaling/efficiency"] == pytest.approx(expected, rel=1e-12)
        assert two["scaling/speedup"] == pytest.approx(2 * expected, rel=1e-12)
        assert one["scaling/efficiency"] == 1.0 and two["scaling/mode"] == "weak"
        for run in (one, two):
            assert 0 < run["perf/mfu"] < 1, run["perf/mfu"]
            assert run["perf/samples_per_sec_per_device"] == pytest.approx(
                run["perf/samples_per_sec"] / run["world_size"])
        if strategy == "ddp":  # from DDP's reducer statistics; FSDP keeps none
            assert 0 <= two["perf/comm_exposed_share"] <= two["perf/comm_share"] and two["perf/comm_share"] > 0
        wandb_files = list(Path(two["output_dir"]).glob("wandb/offline-run-*/run-*.wandb"))
        assert len(wandb_files) == 1, wandb_files  # one W&B run per job, not per rank
        assert b"scaling/efficiency" in wandb_files[0].read_bytes()


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_sweep_writes_report_and_logs_it_to_wandb(sweep):
    process, _, sweeps = sweep
    sweep_dir = sweeps[0]
    for name in ("scaling_report.md", "scaling_report.json", "scaling_report.png"):
        assert (sweep_dir / name).is_file(), name
    table = (sweep_dir / "scaling_report.md").read_text()
    assert "| strategy=ddp | 2 |" in table and "| strategy=fsdp | 1 |" in table
    assert f"litscale: scaling report: {sweep_dir}" in process.stdout
    report_runs = list(sweep_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(report_runs) == 1 and b"scaling/report" in report_runs[0].read_bytes()
    group = f"sweep-{sweep_dir.name}".encode()  # every W&B run of the sweep in one group
    job_runs = list(sweep_dir.glob("*/wandb/offline-run-*/run-*.wandb"))
    assert len(job_runs) == 4 and all(group in path.read_bytes() for path in job_runs + report_runs)


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_report_shows_the_planners_error_and_calibrate_from_refits_it_from_the_sweep(sweep, tmp_path):
    _, outputs, sweeps = sweep
    sweep_dir = sweeps[0]
    runs = {(s["choices"]["strategy"], s["world_size"]): s for s in summaries(outputs)}
    report = json.loads((sweep_dir / "scaling_report.json").read_text())
    for row in report:
        run = runs[(row["variant"].split("=")[1], row["devices"])]
        assert row["planner error"] == pytest.approx(run["plan/predicted_step_s"] / run["perf/step_time_s"] - 1)
    assert "| planner error |" in (sweep_dir / "scaling_report.md").read_text()

    process = run_train("plan=show", f"plan.calibrate_from={sweep_dir}", "trainer.devices=2", *TINY,
                        *DESCRIBED_CLUSTER, outputs=tmp_path, timeout=300)
    assert process.returncode == 0, explain(process)
    assert f"litscale: calibrate_from: 4 run(s) on cluster=h100_8x under {sweep_dir}\n" in process.stdout
    # Whether two constants explain this machine's steps better than the cluster file's depends on
    # how loaded the machine was during the sweep (a 2-rank CPU step under contention is not half
    # a 1-rank one, as the planner's model has it); the fit on planted constants is
    # test_planner_refit's. Here: the decision printed follows the figures printed and recorded.
    found = re.search(r"calibrate_from: held-out MAPE ([\d.]+)% \(the cluster file's\) -> ([\d.]+)% \(4-fold over 4 "
                      r"runs\)(; the ranking below uses them; to keep them: cluster.achieved_fraction=(\S+) "
                      r"cluster.overhead_per_microbatch_s=(\S+)|: no better, so the ranking keeps the cluster "
                      r"file's constants)\n", process.stdout)
    assert found, process.stdout
    before, after, kept = float(found[1]), float(found[2]), found[4] is not None
    assert kept == (after < before), process.stdout
    (record_path,) = tmp_path.glob("**/plan/calibration.json")
    record = json.loads(record_path.read_text())
    if kept:
        assert record["fitted"]["achieved_fraction"] == pytest.approx(float(found[4]), rel=1e-3)
    assert len(record["runs"]) == 4 and record["mape_held_out"] == pytest.approx(after / 100, abs=5e-4)
    assert record["mape_given"] == pytest.approx(before / 100, abs=5e-4)
    fitted_mape = statistics.fmean(abs(run["predicted_fitted_s"] / run["measured_step_s"] - 1) for run in record["runs"])
    assert fitted_mape <= record["mape_given"] + 1e-12  # on the runs it saw, the fit is never worse
    for run in record["runs"]:  # the runs as their own summaries predicted them, with the cluster file's constants
        summary = json.loads((Path(run["run_dir"]) / "summary.json").read_text())
        assert run["predicted_given_s"] == pytest.approx(summary["plan/predicted_step_s"], rel=1e-9)
        assert run["measured_step_s"] == summary["perf/step_time_s"]


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_notebook_reads_the_sweep_and_runs(sweep, tmp_path):
    nbclient, nbformat = pytest.importorskip("nbclient"), pytest.importorskip("nbformat")
    notebook = nbformat.read(REPO / "notebooks" / "scaling_efficiency.ipynb", as_version=4)
    os.environ["LITSCALE_RUNS"] = str(sweep[2][0])
    try:
        nbclient.NotebookClient(notebook, timeout=120, resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        del os.environ["LITSCALE_RUNS"]
    text = "".join(o.get("text", "") for cell in notebook.cells for o in cell.get("outputs", []))
    assert "4 runs under" in text and "fsdp N=2" in text
    assert (tmp_path / "scaling_efficiency.png").is_file()


# --- a single run: a named baseline, and a resumed run continuing its W&B run --------------------


@pytest.mark.soak  # make test-full: keeps make test within its time budget
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resumed_run_continues_its_wandb_run_and_compares_with_a_named_baseline(tmp_path):
    secret = "wandb-secret-0123456789abcdef"
    first = run_train(*TINY, "logger=wandb", "name=w", "+api_key=${oc.env:LITSCALE_TEST_SECRET}",
                      outputs=tmp_path, env={**NO_WANDB_KEY, "LITSCALE_TEST_SECRET": secret})
    assert first.returncode == 0, explain(first)
    leaked = [p for p in tmp_path.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert leaked == []  # not in .hydra/, W&B's config and files, checkpoints or logs
    (summary,) = summaries(tmp_path)
    second = run_train(*TINY, "logger=wandb", "name=w", "ckpt_path=last", "trainer.max_steps=16",
                       f"scaling.baseline={summary['output_dir']}", outputs=tmp_path, env=NO_WANDB_KEY)
    assert second.returncode == 0, explain(second)
    resumed = summaries(tmp_path)[-1]
    ids = [p.name.rsplit("-", 1)[1] for s in (summary, resumed)
           for p in Path(s["output_dir"]).glob("wandb/offline-run-*")]
    assert len(ids) == 2 and ids[0] == ids[1], ids
    assert resumed["scaling/efficiency"] == pytest.approx(
        resumed["perf/samples_per_sec"] / summary["perf/samples_per_sec"])
    assert find_baseline(ScalingContext(baseline=os.path.join(summary["output_dir"], "summary.json")))


def test_device_sweeps_run_their_baseline_first():
    from litscale.app.scaling_study import baseline_first

    assert baseline_first(["-m", "trainer.devices=4,1,2", "strategy=ddp,fsdp"]) == \
        ["-m", "trainer.devices=1,2,4", "strategy=ddp,fsdp"]
    assert baseline_first(["trainer.devices=2", "data.batch_size=4,8"]) == \
        ["trainer.devices=2", "data.batch_size=4,8"]
