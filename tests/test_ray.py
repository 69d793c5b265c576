"""``-m hydra/launcher=ray`` on a real local Ray cluster, started once by one sweep of 3 jobs:
DDP and FSDP 2-worker jobs train as litscale's own launcher does (the same loss at every step,
the same final validation loss; one basic-launcher sweep of the same 2 jobs is the reference),
each job in the run dir the basic launcher would give it; a third job, a worker killed mid-run,
ends with one ``error: rank 1 failed: ...`` line while the sweep's other jobs finish."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers.cli import explain, run_train, summaries, train_losses

# Whether Ray is installed, without importing it: the sweeps import it in their own processes,
# and every pytest worker collects this module.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")

STEPS = 2
# The shortest runs that still compare losses: 2 steps, one validation batch at the end, no
# checkpoint or progress-bar callbacks (the CSV logger stays: the losses are read from it).
TINY = (
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "optimizer=sgd",
    "optimizer.lr=0.05",
    f"trainer.max_steps={STEPS}",
    f"trainer.val_check_interval={STEPS}",
    "trainer.limit_val_batches=1",
    "trainer.num_sanity_val_steps=0",
    "trainer.log_every_n_steps=1",
    "data.seq_len=32",
    "data.max_bytes=400000",
    "trainer.enable_progress_bar=false",
    "callbacks=none",
)
# Each job is an experiment file, so that one grid-free sweep holds jobs that differ in more
# than one key (the killed job adds a callback).
JOBS = {
    "ray_ddp": "defaults:\n  - override /strategy: ddp\n",
    "ray_fsdp": "defaults:\n  - override /strategy: fsdp\n",
    "ray_killed": (
        "defaults:\n  - override /strategy: ddp\n"
        "callbacks:\n  fault:\n    _target_: litscale.callbacks.faults.InjectFault\n"
        "    kind: sigkill\n    rank: 1\n    at_step: 1\n"
    ),
}
# NOTE: each train.py starts a local cluster for its sweep (hydra.launcher.address null), a few
# seconds; a cluster shared by the module (`ray start --head`) was refused to the runs joining
# it here ("Failed to connect to GCS ... InvalidAuthToken"). 4 CPUs: 2 of the 3 jobs run at
# once (a job's wait, as the killed job's peer's, overlaps another's work), at most 4 workers in memory.
RAY = ("hydra/launcher=ray", "hydra.launcher.num_cpus=4")


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    """The Ray sweep of the 3 jobs (ddp, fsdp, killed) and the basic launcher's of the first 2."""
    conf = tmp_path_factory.mktemp("conf")
    (conf / "experiment").mkdir()
    for name, text in JOBS.items():
        (conf / "experiment" / f"{name}.yaml").write_text(f"# @package _global_\n{text}")
    searchpath = f"hydra.searchpath=[file://{conf}]"
    runs = {}
    for launcher, jobs in (("ray", "ray_ddp,ray_fsdp,ray_killed"), ("basic", "ray_ddp,ray_fsdp")):
        outputs = tmp_path_factory.mktemp(launcher)
        extra = RAY if launcher == "ray" else ()
        process = run_train(
            "-m", *extra, searchpath, f"experiment={jobs}", *TINY, outputs=outputs, timeout=1000
        )
        runs[launcher] = (outputs, process)
    return runs


@pytest.mark.slow
@pytest.mark.full  # 3 Ray jobs and 2 basic-launcher jobs of 2 ranks: a minute or two on 2 cores
@pytest.mark.timeout(2400)
def test_ray_jobs_train_as_litscales_own_launcher(sweeps):
    (ray_outputs, ray_process), (basic_outputs, basic_process) = sweeps["ray"], sweeps["basic"]
    assert basic_process.returncode == 0, explain(basic_process)
    ray_runs = {Path(s["output_dir"]).name: s for s in summaries(ray_outputs)}
    basic_runs = {Path(s["output_dir"]).name: s for s in summaries(basic_outputs)}
    # Job 0: ddp, job 1: fsdp; job 2 (killed) left no summary.
    assert sorted(ray_runs) == sorted(basic_runs) == ["0", "1"], explain(ray_process)
    for job in ("0", "1"):
        ray_run, basic_run = ray_runs[job], basic_runs[job]
        assert ray_run["world_size"] == basic_run["world_size"] == 2
        ray_losses, basic_losses = (
            train_losses(ray_run["output_dir"]),
            train_losses(basic_run["output_dir"]),
        )
        assert sorted(ray_losses) == sorted(basic_losses) == list(range(STEPS))
        torch.testing.assert_close(
            torch.tensor([ray_losses[s] for s in range(STEPS)]),
            torch.tensor([basic_losses[s] for s in range(STEPS)]),
            rtol=1.3e-6,
            atol=1e-5,
        )
        torch.testing.assert_close(
            ray_run["val/loss"], basic_run["val/loss"], rtol=1.3e-6, atol=1e-5
        )
        # The run dir as the basic launcher lays it out: .hydra/ once (rank 0), both ranks recorded.
        run_dir = Path(ray_run["output_dir"])
        assert run_dir.parent.parent.name == "multiruns"
        assert sorted(p.name for p in (run_dir / ".hydra").iterdir()) == [
            "config.yaml",
            "hydra.yaml",
            "overrides.yaml",
        ]
        assert sorted(p.name for p in (run_dir / "ranks").iterdir()) == ["rank0.json", "rank1.json"]
    # Each line litscale prints reaches the driver once: Ray Train's own print, which also logs
    # every line through the root logger, is off in the jobs.
    printed = ray_process.stdout + ray_process.stderr
    assert printed.count("litscale: outputs: ") == 2 and "][root][INFO] - litscale: " not in printed, explain(ray_process)


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.timeout(2400)
def test_a_killed_ray_worker_ends_its_job_with_one_line(sweeps):
    _, process = sweeps["ray"]
    assert process.returncode == 1, explain(process)
    lines = [line for line in process.stderr.splitlines() if line.startswith("error:")]
    # One line, for the killed job alone (Ray's own log may say "controller error:" while a job
    # waits, which starts otherwise); the sweep's other 2 jobs finished (test above).
    assert len(lines) == 1 and lines[0].startswith("error: rank 1 failed: "), explain(process)
    assert "litscale: job 2 on Ray: experiment=ray_killed" in process.stdout, explain(process)
