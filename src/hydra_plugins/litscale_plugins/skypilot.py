"""SkyPilot (``-m hydra/launcher=skypilot``): one SkyPilot task YAML per job of a sweep.

Each job asks for ``trainer.num_nodes`` nodes with ``<gpu>:<trainer.devices>`` accelerators
(CPU jobs ask for ``trainer.devices`` CPUs); its ``run:`` starts torchrun on every node from
the environment SkyPilot gives it (``SKYPILOT_NODE_RANK``, the first of
``SKYPILOT_NODE_IPS`` as the rendezvous host, ``SKYPILOT_NUM_NODES``). The YAML is checked
against SkyPilot's own schema (vendored in ``schemas/``, the check ``sky.Task.from_yaml``
makes first) and written to ``hydra.launcher.tasks_dir``; ``submit=true`` runs
``sky launch`` on it (SkyPilot's CLI: ``pip install litscale[skypilot]``), one job after another.

Outputs (checkpoints, ``summary.json``, logs) go to a bucket mounted on every node at
``LITSCALE_OUTPUTS`` (``file_mounts`` in MOUNT mode): they outlive the cluster (``down``), and
every node of a sharded save writes into the same directory; as a directory's rename there is
a copy of its files, a sharded save is published by a pointer file (``checkpoint.publish=pointer``
on each job's command line, unless it says otherwise). Without a bucket they stay on
the nodes' disks, so ``down=true`` and ``use_spot=true`` are refused in one line. With
``use_spot=true`` the task is a managed job (``sky jobs launch``): SkyPilot recovers it on new
nodes after a preemption, and its run resumes from the newest complete checkpoint in the
bucket (``ckpt_path=here``, unless the job names one).
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from hydra.core.utils import JobReturn

from hydra_plugins.litscale_plugins.jobs import (
    ClusterLauncher,
    job_resources,
    job_return,
    resuming_in_run_dir,
    write_checked,
)
from hydra_plugins.litscale_plugins.k8s import job_name
from hydra_plugins.litscale_plugins.skypilot_outputs import (
    outputs_mount,
    outputs_problem,
    published_by_pointer,
)
from litscale.extras import JSONSCHEMA_SKYPILOT, SKYPILOT

SCHEMA = Path(__file__).with_name("schemas") / "skypilot_task.yaml"
RENDEZVOUS_PORT = 29500


def task(name: str, args: list[str], params: dict[str, Any], *, cpu: bool) -> dict[str, Any]:
    """The SkyPilot task of one job: nodes, accelerators, workdir, the outputs bucket, setup and
    torchrun."""
    processes = int(params["processes_per_node"])
    args = published_by_pointer(args, params)
    resources: dict[str, Any] = (
        {"cpus": f"{processes}+"} if cpu else {"accelerators": f"{params['gpu']}:{processes}"}
    )
    resources.update(
        {k: params[k] for k in ("infra", "image_id", "use_spot") if params.get(k) is not None}
    )
    torchrun = [
        "torchrun",
        "--nnodes=$SKYPILOT_NUM_NODES",
        f"--nproc-per-node={processes}",
        "--node-rank=$SKYPILOT_NODE_RANK",
        '--master-addr="$MASTER_ADDR"',
        f"--master-port={RENDEZVOUS_PORT}",
        "train.py",
        *map(shlex.quote, resuming_in_run_dir(args) if params.get("use_spot") else args),
    ]
    return {
        "name": name,
        "num_nodes": int(params["nodes"]),
        "resources": resources,
        "workdir": params["workdir"],
        **outputs_mount(params),
        "envs": {"LITSCALE_OUTPUTS": params["outputs"]},
        "setup": params["setup"],
        "run": 'MASTER_ADDR=$(echo "$SKYPILOT_NODE_IPS" | head -n1)\n' + " ".join(torchrun) + "\n",
    }


class _BlockDumper(yaml.SafeDumper):
    """Writes multi-line strings (``run:``) as literal blocks, as one writes them by hand."""


_BlockDumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar(
        "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None
    ),
)


@cache
def _schemas() -> dict[str, Any]:
    return yaml.safe_load(SCHEMA.read_text())


def task_problems(document: dict[str, Any]) -> list[str]:
    """Where a task breaks SkyPilot's schema (its task, then its resources), one line each."""
    from jsonschema import Draft202012Validator

    problems = []
    for part, instance in (("task", document), ("resources", document.get("resources") or {})):
        for error in Draft202012Validator(_schemas()[part]).iter_errors(instance):
            where = ".".join(str(p) for p in error.absolute_path) or "<root>"
            problems.append(
                f"{'resources.' if part == 'resources' else ''}{where}: {error.message}"
            )
    return problems


class SkyPilotLauncher(ClusterLauncher):
    """Writes (and with ``submit=true`` launches) one SkyPilot task per job."""

    # litscale.extras: checked before the sweep dir exists
    requires = (JSONSCHEMA_SKYPILOT,)
    requires_when = {"submit": SKYPILOT}
    option, engine = "skypilot", "skypilot"

    @classmethod
    def check_job(cls, params: dict[str, Any], *, devices: Any, strategy_target: str) -> bool:
        """The job's count, and outputs that outlive its nodes (``skypilot_outputs``)."""
        from litscale.errors import ConfigError

        super().check_job(params, devices=devices, strategy_target=strategy_target)
        problem = outputs_problem(params)
        if problem:
            raise ConfigError(problem)
        return False

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        results = []
        for number, job_config, overrides in self.job_configs(job_overrides, initial_job_idx):
            params = job_resources(job_config)
            name = job_name(params["name_prefix"], sweep_dir, number)
            run_dir = f"{params['outputs']}/{job_config.name}/multiruns/{sweep_dir.name}/{number}"
            cpu = str(job_config.trainer.get("accelerator")) == "cpu"
            document = task(name, [*overrides, f"hydra.run.dir={run_dir}"], params, cpu=cpu)
            path = Path(params["tasks_dir"]) / f"{name}.yaml"
            text = yaml.dump(document, Dumper=_BlockDumper, sort_keys=False)
            write_checked(path, text, task_problems(document), f"job {number}: SkyPilot task")
            error = launch_task(path, name, params) if params.get("submit") else None
            results.append(job_return(job_config, overrides, run_dir, error=error, value=str(path)))
        return results


def launch_command(path: Path, name: str, params: dict[str, Any]) -> list[str]:
    """``sky launch`` on a cluster of its own (torn down after it with ``down``), or for a spot
    job ``sky jobs launch``: a managed job, recovered after a preemption and torn down after."""
    if params.get("use_spot"):
        return ["sky", "jobs", "launch", "--yes", "--name", name, str(path)]
    return ["sky", "launch", "--yes", "--cluster", name, *(["--down"] if params.get("down") else []), str(path)]


def launch_task(path: Path, name: str, params: dict[str, Any]) -> BaseException | None:
    command = launch_command(path, name, params)
    print(f"litscale: {shlex.join(command)}", flush=True)
    try:
        code = subprocess.run(command, check=False).returncode
    except FileNotFoundError:
        return RuntimeError("`sky` is not installed: pip install 'litscale[skypilot]'")
    return None if code == 0 else RuntimeError(f"sky launch {name} exited with {code}")
