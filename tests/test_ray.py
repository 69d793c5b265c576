"""``-m hydra/launcher=ray`` on a real local Ray cluster (2 CPUs, started by the sweep): a 2-job sweep of DDP and FSDP 2-worker jobs trains as litscale's own launcher
does (the same loss at every step, the same final validation loss), each job in the run dir
the basic launcher would give it; a worker killed mid-run ends its job with one
``error: rank 1 failed: ...`` line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.cli import explain, run_train, summaries, train_losses

pytest.importorskip("ray")

TINY = (
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "optimizer=sgd",
    "optimizer.lr=0.05",
    "trainer.max_steps=4",
    "trainer.val_check_interval=4",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "data.seq_len=32",
    "data.max_bytes=400000",
    "trainer.enable_progress_bar=false",
)


# NOTE: each train.py starts a local cluster of 2 CPUs for its sweep (hydra.launcher.address
# null), a few seconds each. A cluster shared by the module (`ray start --head`) was refused
# to the runs joining it here ("Failed to connect to GCS ... InvalidAuthToken").
RAY = ("hydra/launcher=ray", "hydra.launcher.num_cpus=2")


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    """The same 2-job sweep (DDP, FSDP; 2 ranks each) through Ray and through the basic launcher."""
    runs = {}
    for launcher in ("ray", "basic"):
        outputs = tmp_path_factory.mktemp(launcher)
        extra = RAY if launcher == "ray" else ()
        process = run_train("-m", *extra, "strategy=ddp,fsdp", *TINY, outputs=outputs, timeout=1500)
        assert process.returncode == 0, explain(process)
        runs[launcher] = (outputs, process)
    return runs


@pytest.mark.slow
@pytest.mark.full  # 4 jobs of 2 ranks and a Ray cluster: minutes on 2 cores
@pytest.mark.timeout(3000)
def test_ray_jobs_train_as_litscales_own_launcher(sweeps):
    (ray_outputs, ray_process), (basic_outputs, _) = sweeps["ray"], sweeps["basic"]
    ray_runs = {Path(s["output_dir"]).name: s for s in summaries(ray_outputs)}
    basic_runs = {Path(s["output_dir"]).name: s for s in summaries(basic_outputs)}
    assert sorted(ray_runs) == sorted(basic_runs) == ["0", "1"]  # job 0: ddp, job 1: fsdp
    for job in ("0", "1"):
        ray_run, basic_run = ray_runs[job], basic_runs[job]
        assert ray_run["world_size"] == basic_run["world_size"] == 2
        ray_losses, basic_losses = (
            train_losses(ray_run["output_dir"]),
            train_losses(basic_run["output_dir"]),
        )
        assert sorted(ray_losses) == sorted(basic_losses) == [0, 1, 2, 3]
        torch.testing.assert_close(
            torch.tensor([ray_losses[s] for s in range(4)]),
            torch.tensor([basic_losses[s] for s in range(4)]),
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
    # No job failed (Ray's own log may say "controller error:" while a job waits for room).
    assert not [line for line in ray_process.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.timeout(600)
def test_a_killed_ray_worker_ends_its_job_with_one_line(tmp_path):
    process = run_train(
        "-m",
        *RAY,
        "strategy=ddp",
        *TINY,
        "+callbacks.fault._target_=litscale.callbacks.faults.InjectFault",
        "+callbacks.fault.kind=sigkill",
        "+callbacks.fault.rank=1",
        "+callbacks.fault.at_step=2",
        outputs=tmp_path,
        timeout=500,
    )
    assert process.returncode == 1, explain(process)
    lines = [line for line in process.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: rank 1 failed: "), explain(process)
    assert not summaries(tmp_path)
