"""``-m hydra/launcher=skypilot``: each job's task YAML, sized from its trainer settings, passes
SkyPilot's own schema (vendored from skypilot 0.14.1: the check ``sky.Task.from_yaml`` makes
before parsing) and, where skypilot is installed, ``sky.Task.from_yaml`` itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers.configs import compose_full

from hydra_plugins.litscale_plugins.jobs import job_resources
from hydra_plugins.litscale_plugins.skypilot import SCHEMA, task, task_problems


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
        "trainer.num_nodes=2 strategy=fsdp hydra.launcher.infra=aws hydra.run.dir=outputs/x/0"
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
