"""``-m hydra/launcher=skypilot``: each job's task YAML, sized from its trainer settings, passes
SkyPilot's own schema (vendored from skypilot 0.14.1: the check ``sky.Task.from_yaml`` makes
before parsing) and, where skypilot is installed, ``sky.Task.from_yaml`` itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers.configs import compose_full

from hydra_plugins.litscale_plugins.jobs import job_resources
from hydra_plugins.litscale_plugins.skypilot import SCHEMA, launch_command, task, task_problems
from litscale.app.preflight import check_cluster_resources
from litscale.errors import ConfigError


def task_for(*overrides: str) -> dict:
    config = compose_full(["hydra/launcher=skypilot", *overrides])
    return task(
        "litscale-20261125185329-0",
        [*overrides, "hydra.run.dir=outputs/x/0"],
        job_resources(config),
        cpu=config.trainer.accelerator == "cpu",
    )


def test_gpu_task_sized_from_the_trainer_passes_skypilots_schema():
    document = task_for(
        "trainer.devices=8", "trainer.num_nodes=2", "strategy=fsdp", "hydra.launcher.infra=aws"
    )
    assert task_problems(document) == []
    assert document["num_nodes"] == 2
    assert document["resources"] == {"accelerators": "H100:8", "infra": "aws"}
    run = document["run"].splitlines()
    assert run[0] == 'MASTER_ADDR=$(echo "$SKYPILOT_NODE_IPS" | head -n1)'
    assert run[1] == (
        "torchrun --nnodes=$SKYPILOT_NUM_NODES --nproc-per-node=8 --node-rank=$SKYPILOT_NODE_RANK "
        '--master-addr="$MASTER_ADDR" --master-port=29500 train.py trainer.devices=8 '
        "trainer.num_nodes=2 strategy=fsdp hydra.launcher.infra=aws hydra.run.dir=outputs/x/0 "
        "checkpoint.publish=pointer"
    )


def test_cpu_task_asks_for_cpus_and_bad_fields_are_named():
    document = task_for("trainer.accelerator=cpu", "trainer.devices=2")
    assert document["resources"] == {"cpus": "2+"} and task_problems(document) == []
    document["num_nodes"] = "two"
    document["resources"]["acelerators"] = "H100:8"
    problems = task_problems(document)
    assert problems[0] == "num_nodes: 'two' is not of type 'integer'"
    assert any(
        p.startswith("resources.<root>: Additional properties are not allowed ('acelerators'")
        for p in problems
    )
    assert "skypilot 0.14.1" in SCHEMA.read_text()[:400]


def test_sky_task_from_yaml_reads_the_written_task(tmp_path):
    sky = pytest.importorskip("sky")  # skypilot: an optional extra, not in dev (see pyproject.toml)
    path = Path(tmp_path / "task.yaml")
    path.write_text(yaml.safe_dump(task_for("trainer.devices=4", "trainer.num_nodes=3")))
    parsed = sky.Task.from_yaml(str(path))
    assert parsed.num_nodes == 3
    assert [r.accelerators for r in parsed.resources] == [{"H100": 4}]


@pytest.mark.slow
def test_the_default_task_mounts_a_bucket_for_its_outputs_and_passes_the_schema():
    document = task_for("trainer.devices=8", "trainer.num_nodes=2", "strategy=fsdp")
    assert document["file_mounts"] == {"/litscale-outputs": {"name": "litscale-outputs", "mode": "MOUNT"}}
    assert document["envs"] == {"LITSCALE_OUTPUTS": "/litscale-outputs"}
    assert task_problems(document) == []
    existing = task_for("hydra.launcher.outputs_bucket=s3://team/runs", "hydra.launcher.outputs=/runs")
    assert existing["file_mounts"] == {"/runs": {"source": "s3://team/runs", "mode": "MOUNT"}}
    named = task_for("hydra.launcher.outputs_store=gcs")
    assert named["file_mounts"]["/litscale-outputs"] == {"name": "litscale-outputs", "store": "gcs", "mode": "MOUNT"}


@pytest.mark.slow  # over half a second alone
def test_a_job_on_the_mounted_bucket_publishes_sharded_checkpoints_by_a_pointer():
    """A directory's rename on a MOUNT-mode bucket is a copy of its files, one by one: each job
    says checkpoint.publish=pointer (litscale.checkpoint.atomic), unless it chooses itself."""
    assert task_for("trainer.devices=2")["run"].splitlines()[1].endswith(" checkpoint.publish=pointer")
    chosen = task_for("trainer.devices=2", "checkpoint.publish=rename")["run"]
    assert "checkpoint.publish=rename" in chosen and "checkpoint.publish=pointer" not in chosen
    on_disks = task_for("hydra.launcher.outputs_bucket=null", "hydra.launcher.down=false")
    assert "checkpoint.publish" not in on_disks["run"]


@pytest.mark.parametrize(("overrides", "line"), [
    (["hydra.launcher.outputs_bucket=null"],
     "hydra.launcher.down=true tears each job's cluster down with its checkpoints, summary.json and logs, which "
     "hydra.launcher.outputs_bucket=null leaves on the nodes' disks; allowed: hydra.launcher.outputs_bucket=<a "
     "bucket name, or an s3://, gs:// or r2:// URI>, mounted at hydra.launcher.outputs on every node, or "
     "hydra.launcher.down=false"),
    (["hydra.launcher.outputs_bucket=null", "hydra.launcher.down=false", "hydra.launcher.use_spot=true"],
     "hydra.launcher.use_spot=true recovers a preempted job on new nodes, which find no checkpoint on the lost "
     "nodes' disks (hydra.launcher.outputs_bucket=null); allowed: hydra.launcher.outputs_bucket=<a bucket name, "
     "or an s3://, gs:// or r2:// URI>, mounted at hydra.launcher.outputs on every node, or "
     "hydra.launcher.use_spot=false"),
])
def test_settings_that_would_lose_the_outputs_with_the_nodes_are_refused_in_one_line(overrides, line):
    config = compose_full(["hydra/launcher=skypilot", "trainer.devices=2", *overrides])
    with pytest.raises(ConfigError) as info:
        check_cluster_resources(config)
    assert str(info.value) == line
    check_cluster_resources(compose_full(["hydra/launcher=skypilot", "trainer.devices=2"]))  # the default


@pytest.mark.slow
def test_a_spot_job_is_a_managed_job_that_resumes_from_its_newest_checkpoint():
    params = job_resources(compose_full(["hydra/launcher=skypilot", "hydra.launcher.use_spot=true"]))
    assert launch_command(Path("t.yaml"), "job-0", params) == ["sky", "jobs", "launch", "--yes", "--name", "job-0",
                                                               "t.yaml"]
    document = task_for("hydra.launcher.use_spot=true", "trainer.devices=2")
    assert document["resources"]["use_spot"] is True and task_problems(document) == []
    assert document["run"].splitlines()[1].endswith("hydra.run.dir=outputs/x/0 checkpoint.publish=pointer ckpt_path=here")
    given = task_for("hydra.launcher.use_spot=true", "ckpt_path=last")
    assert "ckpt_path=here" not in given["run"]
    on_demand = job_resources(compose_full(["hydra/launcher=skypilot"]))
    assert launch_command(Path("t.yaml"), "job-0", on_demand) == ["sky", "launch", "--yes", "--cluster", "job-0",
                                                                  "--down", "t.yaml"]
