"""Kubernetes (``-m hydra/launcher=k8s``): one Kubeflow ``TrainJob`` (or, with
``hydra.launcher.api=pytorchjob``, a Training Operator ``PyTorchJob``) per job of a sweep.

Each job's nodes, processes per node and GPUs come from its own ``trainer.num_nodes`` /
``trainer.devices`` (the ``hydra.launcher`` node is resolved in each job's config, as for
SLURM). The manifests are written to ``hydra.launcher.manifests_dir`` after being checked
against the vendored CRD schemas; ``hydra.launcher.submit=true`` creates them with the
``kubernetes`` client (imported only then) and waits, printing each change of a job's
condition. The pods run ``torchrun train.py <the job's overrides>`` with the run dir on the
shared outputs volume, where the summary, checkpoints and logs land.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from hydra.core.utils import JobReturn
from omegaconf import DictConfig

from hydra_plugins.litscale_plugins.jobs import (
    ClusterLauncher,
    job_resources,
    job_return,
    write_checked,
)
from hydra_plugins.litscale_plugins.k8s_manifests import (
    api_of,
    manifest_problems,
    pytorchjob,
    trainjob,
)

# The condition that ends a job, per kind: (success, failure).
TERMINAL = {"TrainJob": ("Complete", "Failed"), "PyTorchJob": ("Succeeded", "Failed")}


def job_name(prefix: str, sweep_dir: Path, number: int) -> str:
    """A DNS-1035 name for job ``number`` of the sweep in ``sweep_dir`` (the sweep's start time)."""
    stamp = re.sub(r"[^0-9a-z]", "", sweep_dir.name.lower())[-14:]
    return re.sub(r"[^a-z0-9-]", "-", f"{prefix}-{stamp}-{number}".lower()).strip("-")[:63]


class KubernetesLauncher(ClusterLauncher):
    """Writes (and with ``submit=true`` applies) one Kubeflow manifest per job."""

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        jobs = []
        for number, job_config, overrides in self.job_configs(job_overrides, initial_job_idx):
            manifest, params = self.manifest(job_config, overrides, sweep_dir, number)
            path = Path(params["manifests_dir"]) / f"{manifest['metadata']['name']}.yaml"
            write_checked(
                path,
                yaml.safe_dump(manifest, sort_keys=False),
                manifest_problems(manifest),
                f"job {number}: {manifest['kind']}",
            )
            jobs.append((job_config, overrides, manifest, path))
        if not self.params.get("submit"):
            return [
                job_return(config, overrides, value=str(path))
                for config, overrides, _, path in jobs
            ]
        errors = submit_and_wait([manifest for _, _, manifest, _ in jobs], self.params)
        return [
            job_return(config, overrides, error=error, value=str(path))
            for (config, overrides, _, path), error in zip(jobs, errors, strict=True)
        ]

    @staticmethod
    def manifest(job_config: DictConfig, overrides: list[str], sweep_dir: Path, number: int):
        """Job ``number``'s manifest, from its own resolved launcher settings."""
        params = job_resources(job_config)
        if str(job_config.trainer.get("accelerator")) == "cpu":
            params["gpus_per_node"] = None
        run_dir = f"{params['outputs_mount']}/{job_config.name}/multiruns/{sweep_dir.name}/{number}"
        build = {"trainjob": trainjob, "pytorchjob": pytorchjob}[params["api"]]
        name = job_name(params["name_prefix"], sweep_dir, number)
        return build(name, [*overrides, f"hydra.run.dir={run_dir}"], params), params


def submit_and_wait(manifests: list[dict], params: dict[str, Any]) -> list[BaseException | None]:
    """Create every manifest, then (with ``wait``) poll each until its terminal condition."""
    from kubernetes import client, config

    api = client.CustomObjectsApi(
        config.new_client_from_config(
            config_file=params.get("kubeconfig"), context=params.get("context")
        )
    )
    for manifest in manifests:
        group, version, plural, kind = api_of(manifest["kind"].lower())
        api.create_namespaced_custom_object(
            group, version, params["namespace"], plural, body=manifest
        )
        print(
            f"litscale: created {kind} {params['namespace']}/{manifest['metadata']['name']}",
            flush=True,
        )
    if not params.get("wait", True):
        return [None] * len(manifests)
    results: dict[int, BaseException | None] = {}
    seen: dict[int, str] = {}
    while len(results) < len(manifests):
        for index, manifest in enumerate(manifests):
            if index not in results:
                outcome = _poll(api, manifest, params["namespace"], seen, index)
                if outcome is not None:
                    results[index] = outcome if isinstance(outcome, BaseException) else None
        if len(results) < len(manifests):
            time.sleep(float(params.get("poll_s", 10)))
    return [results[i] for i in range(len(manifests))]


def _poll(api: Any, manifest: dict, namespace: str, seen: dict[int, str], index: int) -> Any:
    """True when the job succeeded, an exception when it failed, None while it runs; prints
    each new condition."""
    group, version, plural, kind = api_of(manifest["kind"].lower())
    name = manifest["metadata"]["name"]
    status = (
        api.get_namespaced_custom_object(group, version, namespace, plural, name).get("status")
        or {}
    )
    conditions = [c for c in status.get("conditions") or [] if c.get("status") == "True"]
    if not conditions:
        return None
    latest = conditions[-1]
    line = f"{latest['type']}" + (
        f" ({latest.get('reason')}: {latest.get('message')})" if latest.get("reason") else ""
    )
    if seen.get(index) != line:
        seen[index] = line
        print(f"litscale: {kind} {name}: {line}", flush=True)
    success, failure = TERMINAL[kind]
    types = {c["type"] for c in conditions}
    if failure in types:
        return RuntimeError(
            f"{kind} {name} failed: {latest.get('message') or latest.get('reason')}"
        )
    return True if success in types else None
