"""``-m hydra/launcher=ray`` joining a cluster of 2 Ray nodes (``ray.cluster_utils.Cluster``,
1 CPU each, so a 2-worker job has one worker on each): the repo goes to the workers as their
working dir, run dirs go to URI storage (``file://``, through ``pyarrow.fs`` as ``s3://`` would),
and a 2-worker DDP job whose rank 1 is SIGKILLed at step 3 is restarted by Ray
(``max_failures=1``), resumes from the checkpoint copied to storage and ends with the losses of
the same job uninterrupted. The cluster is torn down after the module, whatever happened."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch
from helpers.cli import explain, run_train, train_losses

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")

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


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        nodes.add_node(num_cpus=1)
        nodes.wait_for_nodes(timeout=120)
        yield nodes
    finally:
        nodes.shutdown()


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):
    """The job killed and restarted, and the same job uninterrupted: (summary, seconds, process)."""
    results = {}
    for name, extra in (("killed", KILL), ("uninterrupted", ())):
        outputs = tmp_path_factory.mktemp(name)
        storage = f"file://{outputs / 'storage'}"
        started = time.monotonic()
        process = run_train("-m", *JOB, *extra, f"hydra.launcher.address={cluster.address}",
                            f"hydra.launcher.storage={storage}", outputs=outputs, timeout=600)
        seconds = time.monotonic() - started
        assert process.returncode == 0, explain(process)
        (summary,) = (outputs / "default" / "multiruns").glob("*/0/summary.json")
        results[name] = (json.loads(summary.read_text()), seconds, process, outputs)
    return results


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.timeout(1500)
def test_a_worker_killed_on_a_two_node_cluster_is_restarted_from_storage_and_trains_as_uninterrupted(runs):
    (killed, killed_s, _, outputs), (reference, reference_s, _, _) = runs["killed"], runs["uninterrupted"]
    assert killed["steps"] == reference["steps"] == STEPS and killed["world_size"] == 2
    # the driver read summary.json from storage; the checkpoints stayed there
    (stored,) = (outputs / "storage" / "default" / "multiruns").glob("*/0")
    assert (stored / "summary.json").is_file() and (stored / "checkpoints" / "last.ckpt").is_file()
    losses, expected = train_losses(_local_run_dir(outputs)), train_losses(_local_run_dir(runs["uninterrupted"][3]))
    assert STEPS - 1 in losses, losses
    torch.testing.assert_close(torch.tensor([losses[s] for s in sorted(losses)]),
                               torch.tensor([expected[s] for s in sorted(losses)]), rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(killed["val/loss"], reference["val/loss"], rtol=1.3e-6, atol=1e-5)
    print(f"killed job {killed_s:.1f} s, uninterrupted {reference_s:.1f} s")


def _local_run_dir(outputs: Path) -> Path:
    (run_dir,) = (outputs / "default" / "multiruns").glob("*/0")
    return run_dir
