"""Kubernetes (``-m hydra/launcher=k8s``): one Kubeflow ``TrainJob`` (or, with
``hydra.launcher.api=pytorchjob``, a Training Operator ``PyTorchJob``) per job of a sweep.

Each job's nodes, processes per node and GPUs come from its own ``trainer.num_nodes`` /
``trainer.devices`` (the ``hydra.launcher`` node is resolved in each job's config, as for
SLURM). The manifests are written to ``hydra.launcher.manifests_dir`` after being checked
against the vendored CRD schemas; ``hydra.launcher.submit=true`` creates them with the
``kubernetes`` client (imported only then) and waits, printing each change of a job's
condition. The pods run ``torchrun train.py <the job's overrides>`` with the run dir on the
shared outputs volume, where the summary, checkpoints and logs land.

Each run of the command is a launch, with an id of its own in its jobs' names and run dirs
(``<outputs_mount>/<name>/multiruns/<sweep>/<launch>/<job>``): a pod restarted, or a TrainJob
created again, within the launch keeps its arguments, so it resumes its own run dir
(``ckpt_path=here``); the same sweep run again into the same ``hydra.sweep.dir`` is a new launch
and starts fresh in new run dirs, never from the first launch's checkpoints, unless
``hydra.launcher.launch=<its id>`` asks to run that launch's jobs again, resuming.
"""

from __future__ import annotations

import re
import secrets
import string
import time
import uuid
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
    resuming_in_run_dir,
    write_checked,
)
from hydra_plugins.litscale_plugins.k8s_manifests import (
    api_of,
    continued_launch,
    default_image,
    elastic_args,
    elastic_nodes,
    manifest_problems,
    pytorchjob,
    trainjob,
)
from litscale.extras import JSONSCHEMA_K8S, KUBERNETES

# The condition that ends a job, per kind: (success, failure).
TERMINAL = {"TrainJob": ("Complete", "Failed"), "PyTorchJob": ("Succeeded", "Failed")}
NOT_FOUND = 404
# The annotation a job created again carries: the name of its first run.
FIRST_NAME = "litscale.dev/first-name"


def job_name(prefix: str, sweep_dir: Path, number: int, launch: str = "") -> str:
    """A DNS-1035 name for job ``number`` of the sweep in ``sweep_dir`` (the sweep's start time),
    from the launch ``launch`` (a rerun of the same sweep dir is another launch)."""
    stamp = re.sub(r"[^0-9a-z]", "", sweep_dir.name.lower())[-14:]
    name = "-".join(part for part in (prefix, stamp, launch, str(number)) if part)
    return re.sub(r"[^a-z0-9-]", "-", name.lower()).strip("-")[:63]


def launch_token() -> str:
    """Six characters naming one run of the command (a letter, then five hex digits): a rerun of
    a sweep (``hydra.sweep.dir`` given again, an Optuna study resumed) must neither create
    objects under names its first run took nor train in its run dirs."""
    return secrets.choice(string.ascii_lowercase) + uuid.uuid4().hex[:5]


class KubernetesLauncher(ClusterLauncher):
    """Writes (and with ``submit=true`` applies) one Kubeflow manifest per job."""

    # litscale.extras: checked before the sweep dir exists
    requires = (JSONSCHEMA_K8S,)
    requires_when = {"submit": KUBERNETES}
    option, engine = "k8s", "k8s"

    @classmethod
    def check_job(cls, params: dict[str, Any], *, devices: Any, strategy_target: str) -> bool:
        """The job's count, the launch it continues and its elastic range (``k8s_manifests``);
        elastic where ``min_nodes`` / ``max_nodes`` are set."""
        super().check_job(params, devices=devices, strategy_target=strategy_target)
        continued_launch(params)
        return elastic_nodes(params, strategy_target) is not None

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self.launch_token = launch_token()
        # The run dirs' launch: this one, or the earlier one the user asked to run again.
        self.continued = continued_launch(self.params)
        self.run_launch = self.continued or self.launch_token
        self._announced = False

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        jobs = []
        for number, job_config, overrides in self.job_configs(job_overrides, initial_job_idx):
            manifest, params, run_dir = self.manifest(
                job_config, overrides, sweep_dir, number, self.launch_token, self.run_launch
            )
            if not self._announced:  # once per launch (an Optuna sweep launches batch after batch)
                self._announced = True
                print(launch_line(self.run_launch, self.continued is not None, run_dir.rsplit("/", 1)[0]),
                      flush=True)
            path = Path(params["manifests_dir"]) / f"{manifest['metadata']['name']}.yaml"
            write_checked(
                path,
                yaml.safe_dump(manifest, sort_keys=False),
                manifest_problems(manifest),
                f"job {number}: {manifest['kind']}",
            )
            jobs.append((job_config, overrides, manifest, path, run_dir))
        errors = (
            submit_and_wait([job[2] for job in jobs], self.params)
            if self.params.get("submit")
            else [None] * len(jobs)
        )
        return [
            job_return(config, overrides, run_dir, error=error, value=str(path))
            for (config, overrides, _, path, run_dir), error in zip(jobs, errors, strict=True)
        ]

    @staticmethod
    def manifest(
        job_config: DictConfig, overrides: list[str], sweep_dir: Path, number: int, launch: str,
        run_launch: str | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any], str]:
        """Job ``number``'s manifest, named from the launch ``launch``, its resolved launcher
        settings, and its run dir on the shared outputs volume: that of the launch ``run_launch``
        (default: ``launch``)."""
        params = job_resources(job_config)
        elastic = elastic_nodes(params, str((job_config.get("strategy") or {}).get("_target_", "")))
        cpu = str(job_config.trainer.get("accelerator")) == "cpu"
        if cpu:
            params["gpus_per_node"] = None
        params["image"] = params.get("image") or default_image("cpu" if cpu else "cuda")
        run_dir = (f"{params['outputs_mount']}/{job_config.name}/multiruns/{sweep_dir.name}/"
                   f"{run_launch or launch}/{number}")
        build = {"trainjob": trainjob, "pytorchjob": pytorchjob}[params["api"]]
        name = job_name(params["name_prefix"], sweep_dir, number, launch)
        args = resuming_in_run_dir([*overrides, f"hydra.run.dir={run_dir}"])
        if elastic:
            args = elastic_args(args)
        return build(name, args, params), params, run_dir


def launch_line(launch: str, again: bool, run_dirs: str) -> str:
    """The line that says which run dirs a launch trains in, and from what."""
    if again:
        return (f"litscale: k8s launch {launch} run again (hydra.launcher.launch={launch}): each job resumes from "
                f"the newest complete checkpoint of its run dir, {run_dirs}/<job> (ckpt_path=here), unless it "
                "names a ckpt_path")
    return (f"litscale: k8s launch {launch}: a new launch, in run dirs of its own ({run_dirs}/<job>): its jobs "
            "start fresh there unless they name a ckpt_path, and a pod restarted within the launch resumes its "
            f"own; hydra.launcher.launch={launch} runs them again, resuming")


class JobFailed(RuntimeError):
    """A job whose operator reported it failed (not one deleted, nor one still running)."""


def submit_and_wait(manifests: list[dict], params: dict[str, Any]) -> list[BaseException | None]:
    """Create every manifest, then (with ``wait``) poll each until its terminal condition or
    ``wait_timeout_min``."""
    from kubernetes import client, config

    api = client.CustomObjectsApi(
        config.new_client_from_config(
            config_file=params.get("kubeconfig"), context=params.get("context")
        )
    )
    for manifest in manifests:
        _create(api, manifest, params)
    if not params.get("wait", True):
        return [None] * len(manifests)
    return wait_for(api, manifests, params)


def _create(api: Any, manifest: dict, params: dict[str, Any]) -> None:
    group, version, plural, kind = api_of(manifest["kind"].lower())
    api.create_namespaced_custom_object(group, version, params["namespace"], plural, body=manifest)
    print(f"litscale: created {kind} {params['namespace']}/{manifest['metadata']['name']}", flush=True)


def wait_for(api: Any, manifests: list[dict], params: dict[str, Any]) -> list[BaseException | None]:
    """Each job's outcome: None when it succeeded, an error when it failed, was deleted, or
    was still running at ``wait_timeout_min`` (null: no limit). A failed TrainJob is created
    again, up to ``max_restarts`` times (a PyTorchJob's pods are restarted by its operator)."""
    timeout_min = params.get("wait_timeout_min")
    deadline = None if timeout_min is None else time.monotonic() + 60 * float(timeout_min)
    manifests, restarts = list(manifests), [0] * len(manifests)
    results: dict[int, BaseException | None] = {}
    seen: dict[int, str] = {}
    while len(results) < len(manifests):
        for index, manifest in enumerate(manifests):
            if index in results:
                continue
            outcome = _poll(api, manifest, params["namespace"], seen, index)
            if isinstance(outcome, JobFailed) and manifest["kind"] == "TrainJob" and (
                    restarts[index] < int(params.get("max_restarts") or 0)):
                restarts[index] += 1
                manifests[index] = _again(manifest, restarts[index], int(params["max_restarts"]))
                seen.pop(index, None)
                _create(api, manifests[index], params)
            elif outcome is not None:
                results[index] = outcome if isinstance(outcome, BaseException) else None
        if len(results) == len(manifests):
            break
        if deadline is not None and time.monotonic() >= deadline:
            for index, manifest in enumerate(manifests):
                if index not in results:
                    results[index] = _timed_out(manifest, timeout_min)
            break
        time.sleep(float(params.get("poll_s", 10)))
    return [results[i] for i in range(len(manifests))]


def _again(manifest: dict, restart: int, limit: int) -> dict:
    """``manifest`` under the name of its ``restart``-th run (``<name>-r<k>``; the same args, so
    the same run dir, from whose newest complete checkpoint it resumes)."""
    import copy

    first = manifest["metadata"].get("annotations", {}).get(FIRST_NAME) or manifest["metadata"]["name"]
    suffix = f"-r{restart}"
    again = copy.deepcopy(manifest)
    again["metadata"]["name"] = first[: 63 - len(suffix)].rstrip("-") + suffix
    again["metadata"].setdefault("annotations", {})[FIRST_NAME] = first
    print(f"litscale: {manifest['kind']} {manifest['metadata']['name']} failed; creating it again as "
          f"{again['metadata']['name']} (restart {restart} of hydra.launcher.max_restarts={limit}): it resumes "
          "from the newest complete checkpoint of its run dir (ckpt_path=here)", flush=True)
    return again


def _timed_out(manifest: dict, timeout_min: Any) -> BaseException:
    line = (f"{manifest['kind']} {manifest['metadata']['name']} had not ended after "
            f"hydra.launcher.wait_timeout_min={timeout_min}; it goes on in the cluster")
    print(f"litscale: {line}", flush=True)
    return TimeoutError(line)


def _status(api: Any, manifest: dict, namespace: str) -> dict | None:
    """The job's ``status`` (``{}`` before the operator writes one); None while the API server
    answers 404: the object not yet visible (a cached read after the create), or deleted."""
    from kubernetes.client.exceptions import ApiException

    group, version, plural, _ = api_of(manifest["kind"].lower())
    try:
        found = api.get_namespaced_custom_object(
            group, version, namespace, plural, manifest["metadata"]["name"]
        )
    except ApiException as error:
        if error.status == NOT_FOUND:
            return None
        raise
    return found.get("status") or {}


def _poll(api: Any, manifest: dict, namespace: str, seen: dict[int, str], index: int) -> Any:
    """True when the job succeeded, an exception when it failed or was deleted, None while it
    runs (or is not yet visible); prints each new condition."""
    kind, name = manifest["kind"], manifest["metadata"]["name"]
    status = _status(api, manifest, namespace)
    if status is None:
        if index in seen:  # it was there: someone deleted it
            return RuntimeError(f"{kind} {name} was deleted before it ended")
        return None
    seen.setdefault(index, "")
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
        return JobFailed(
            f"{kind} {name} failed: {latest.get('message') or latest.get('reason')}"
        )
    return True if success in types else None
