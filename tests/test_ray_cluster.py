"""``-m hydra/launcher=ray`` joining a cluster of 2 Ray nodes (``ray.cluster_utils.Cluster``,
1 CPU each, so a 2-worker job has one worker on each): the repo goes to the workers as their
working dir, run dirs go to URI storage (``file://``, through ``pyarrow.fs`` as ``s3://`` would),
and a 2-worker DDP job whose rank 1 is SIGKILLed at step 3 is restarted by Ray
(``max_failures=1``), resumes from the checkpoint copied to storage and ends with the losses of
the same job uninterrupted. The cluster is torn down after the module, whatever happened."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.cli import REPO, cli_env, explain, run_train, train_losses
from helpers.one_ray import one_ray_at_a_time

# Each test reads the module's 3 runs on its cluster: 413 s on 2 idle cores, 712 s in CI's
# make test-full, a quarter of its budget, so `make test-soak`. The Ray launcher's settings, its
# refusals and its one-host sweep are tested in make test (test_ray_settings.py, test_ray.py).
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed"),
              pytest.mark.slow, pytest.mark.soak, pytest.mark.timeout(1500)]

STEPS = 5
KILLED_AT_STEP = 3
JOB = (
    "hydra/launcher=ray", "hydra.launcher.max_failures=1", "trainer.accelerator=cpu",
    "trainer.devices=2", "strategy=ddp", "optimizer=sgd", "optimizer.lr=0.05",
    f"trainer.max_steps={STEPS}", f"trainer.val_check_interval={STEPS}", "trainer.limit_val_batches=1",
    "trainer.num_sanity_val_steps=0", "trainer.log_every_n_steps=1", "data.seq_len=32",
    "data.max_bytes=400000", "trainer.enable_progress_bar=false", "callbacks=none",
    # a save at every step, so that the restart repeats only the step of the kill
    "+callbacks.every_step._target_=lightning.pytorch.callbacks.ModelCheckpoint",
    "+callbacks.every_step.dirpath=${paths.output_dir}/checkpoints",
    "+callbacks.every_step.every_n_train_steps=1", "+callbacks.every_step.save_last=true",
)
KILL = ("+callbacks.fault._target_=litscale.callbacks.faults.InjectFault", "+callbacks.fault.kind=sigkill",
        "+callbacks.fault.rank=1", f"+callbacks.fault.at_step={KILLED_AT_STEP}")
# SIGTERM to rank 1's worker at step 2, as a node drained: the ranks agree at the next step
# (check_every_n_steps=1), save last.ckpt there and Ray starts the job again from it.
SIGTERM = ("+callbacks.fault._target_=litscale.callbacks.faults.InjectFault", "+callbacks.fault.kind=sigterm",
           "+callbacks.fault.rank=1", "+callbacks.fault.at_step=2",
           "+callbacks.preemption._target_=litscale.callbacks.preemption.PreemptionCheckpoint",
           "+callbacks.preemption.dirpath=${paths.output_dir}/checkpoints",
           "+callbacks.preemption.check_every_n_steps=1")
# The reference, elastic: up to 3 workers on a cluster with room for 2 runs on 2.
ELASTIC = ("hydra.launcher.min_workers=1", "hydra.launcher.max_workers=3")
# Up to 2 workers, 2 s a step (long enough to remove a node mid-run), Ray may restart it twice:
# the worker on the lost node, and a start on 2 workers that Ray's view of the cluster still
# counted, which times out (60 s) before it starts on the 1 that is left.
ELASTIC_SHRUNK = ("hydra.launcher.min_workers=1", "hydra.launcher.max_workers=2", "hydra.launcher.max_failures=2",
                  "+callbacks.fault._target_=litscale.callbacks.faults.InjectFault", "+callbacks.fault.kind=slow",
                  "+callbacks.fault.at_step=0", "+callbacks.fault.delay_s=2")
# Each job prints this once per attempt (rank 0's first line).
ATTEMPT_LINE = "litscale: gpt-nano"


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    with one_ray_at_a_time():
        nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        try:
            nodes.second = nodes.add_node(num_cpus=1)
            nodes.wait_for_nodes(timeout=120)
            yield nodes
        finally:
            nodes.shutdown()


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):
    """The job killed, the job preempted (SIGTERM), and the same job uninterrupted (elastic):
    name -> (summary, seconds, process, outputs)."""
    results = {}
    for name, extra in (("killed", KILL), ("preempted", SIGTERM), ("uninterrupted", ELASTIC)):
        outputs = tmp_path_factory.mktemp(name)
        storage = f"file://{outputs / 'storage'}"
        started = time.monotonic()
        process = run_train("-m", *JOB, *extra, f"hydra.launcher.address={cluster.address}",
                            f"hydra.launcher.storage={storage}", outputs=outputs, timeout=600)
        seconds = time.monotonic() - started
        assert process.returncode == 0, explain(process)
        results[name] = (json.loads((run_dir(outputs) / "summary.json").read_text()), seconds, process, outputs)
    return results


@pytest.fixture(scope="module")
def shrunk(cluster, runs, tmp_path_factory):
    """An elastic job (1-2 workers, 2 s a step) whose second node is removed once it has saved
    a checkpoint (after the other runs: the cluster keeps one node): (summary, process)."""
    outputs = tmp_path_factory.mktemp("shrunk")
    storage = outputs / "storage"
    command = [sys.executable, "train.py", "-m", *JOB, *ELASTIC_SHRUNK, f"hydra.launcher.address={cluster.address}",
               f"hydra.launcher.storage=file://{storage}"]
    with open(outputs / "output.txt", "w") as log:
        process = subprocess.Popen(command, cwd=REPO, env=cli_env(outputs), stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while not list(storage.glob("default/multiruns/*/0/checkpoints/last.ckpt")) and time.monotonic() < deadline:
                time.sleep(0.5)
            cluster.remove_node(cluster.second)
            process.wait(timeout=600)
        finally:
            process.kill()
    printed = (outputs / "output.txt").read_text()
    assert process.returncode == 0, printed[-5000:]
    return json.loads((run_dir(outputs) / "summary.json").read_text()), printed


def run_dir(outputs: Path) -> Path:
    """The job's run dir in the driver's sweep dir (where the sweep reads summary.json)."""
    (found,) = (outputs / "default" / "multiruns").glob("*/0")
    return found


def assert_trains_as_uninterrupted(runs, name: str) -> None:
    (summary, _, process, outputs), (reference, _, _, reference_outputs) = runs[name], runs["uninterrupted"]
    assert summary["steps"] == reference["steps"] == STEPS and summary["world_size"] == 2
    assert (process.stdout + process.stderr).count(ATTEMPT_LINE) == 2, explain(process)  # Ray restarted it once
    losses, expected = train_losses(run_dir(outputs)), train_losses(run_dir(reference_outputs))
    assert STEPS - 1 in losses, losses
    torch.testing.assert_close(torch.tensor([losses[s] for s in sorted(losses)]),
                               torch.tensor([expected[s] for s in sorted(losses)]), rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(summary["val/loss"], reference["val/loss"], rtol=1.3e-6, atol=1e-5)


def test_a_worker_killed_on_a_two_node_cluster_is_restarted_from_storage_and_trains_as_uninterrupted(runs):
    assert_trains_as_uninterrupted(runs, "killed")
    _, _, _, outputs = runs["killed"]
    # the driver read summary.json from storage; the checkpoints stayed there
    (stored,) = (outputs / "storage" / "default" / "multiruns").glob("*/0")
    assert (stored / "summary.json").is_file() and (stored / "checkpoints" / "last.ckpt").is_file()
    assert not (run_dir(outputs) / "checkpoints").exists()
    print(f"killed job {runs['killed'][1]:.1f} s, uninterrupted {runs['uninterrupted'][1]:.1f} s")


def test_sigterm_to_a_ray_worker_saves_at_a_step_every_rank_agrees_on_and_the_job_resumes_there(runs):
    assert_trains_as_uninterrupted(runs, "preempted")
    _, seconds, process, _ = runs["preempted"]
    printed = process.stdout + process.stderr
    assert "litscale: stopping at step 3 on a termination signal; saved " in printed, explain(process)
    assert ("litscale: job 0 stopped at step 3 on SIGTERM and saved last.ckpt; Ray starts it again from there "
            "while hydra.launcher.max_failures allows") in printed, explain(process)
    print(f"preempted job {seconds:.1f} s")


def test_an_elastic_job_runs_on_the_workers_the_cluster_has_and_says_what_that_does_to_its_batch(runs):
    summary, _, process, _ = runs["uninterrupted"]
    assert summary["world_size"] == 2 and summary["global_batch"] == 32
    assert ("litscale: job 0 runs on 2 Ray workers (elastic, 1-3): data.batch_size=16 per device is fixed, "
            "so the global batch is 32; optimizer.lr stays as given (lr_scaling=none)") in process.stdout, explain(process)


def test_an_elastic_job_that_loses_a_node_goes_on_with_the_workers_left_from_its_checkpoint(shrunk):
    summary, printed = shrunk
    assert summary["steps"] == STEPS and summary["world_size"] == 1 and summary["global_batch"] == 16, printed[-3000:]
    for workers, batch in ((2, 32), (1, 16)):
        assert (f"litscale: job 0 runs on {workers} Ray workers (elastic, 1-2): data.batch_size=16 per device is "
                f"fixed, so the global batch is {batch}") in printed, printed[-3000:]
    assert "Restored all states from the checkpoint" in printed, printed[-3000:]
