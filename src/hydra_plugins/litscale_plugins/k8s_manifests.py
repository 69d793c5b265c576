"""Kubeflow manifests for one litscale job, and their check against the operators' CRD schemas.

A Kubeflow Trainer v2 ``TrainJob`` runs on the ``torch-distributed`` runtime, which gives each
node's container ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK`` and
``PET_MASTER_ADDR``/``PORT``: torchrun reads them as its defaults, so the command is
``torchrun train.py <overrides>``. A Training Operator v1 ``PyTorchJob`` sets the ``PET_*``
counts and ``MASTER_ADDR``/``MASTER_PORT``, which torchrun is given explicitly. Either way the
ranks are torchrun's, which litscale already runs under. Outputs go to a shared volume.

An elastic PyTorchJob (``hydra.launcher.min_nodes`` / ``max_nodes``) has Workers only and an
``elasticPolicy``: the operator sets ``PET_NNODES=<min>:<max>`` and a c10d rendezvous endpoint,
torchrun reads them, and the job trains on the pods that are up. A TrainJob has no such policy.

The schemas in ``schemas/`` are the CRDs' published OpenAPI schemas (see each header);
``check_manifest`` validates as the API server does with strict field validation (unknown
fields refused). The CEL rules (``x-kubernetes-validations``) are not evaluated here.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from litscale.errors import ConfigError

SCHEMAS = Path(__file__).with_name("schemas")
TRAINJOB = ("trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob")
PYTORCHJOB = ("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob")
OUTPUTS_VOLUME = "litscale-outputs"


def default_image(variant: str) -> str:
    """The image ``make image`` (``cpu``) or ``make image-cuda`` (``cuda``) builds from
    ``docker/Dockerfile``: this litscale's version, tagged with the variant."""
    from importlib.metadata import version

    return f"litscale:{version('litscale')}-{variant}"


def api_of(kind: str) -> tuple[str, str, str, str]:
    """(group, version, plural, kind) of ``trainjob`` or ``pytorchjob``."""
    return {"trainjob": TRAINJOB, "pytorchjob": PYTORCHJOB}[kind]


def node_resources(params: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Requests and limits of one node's container from the launcher settings."""
    limits: dict[str, Any] = {}
    if params.get("gpus_per_node"):
        limits[params["gpu_resource"]] = int(params["gpus_per_node"])
    for key, name in (("cpu_per_node", "cpu"), ("memory_per_node", "memory")):
        if params.get(key) is not None:
            limits[name] = str(params[key])
    return {"requests": dict(limits), "limits": limits} if limits else {}


def environment(params: dict[str, Any]) -> list[dict[str, str]]:
    return [
        {"name": "LITSCALE_OUTPUTS", "value": params["outputs_mount"]},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]


def _metadata(name: str, params: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": params["namespace"],
        "labels": {"app.kubernetes.io/created-by": "litscale"},
    }


def trainjob(name: str, args: list[str], params: dict[str, Any]) -> dict[str, Any]:
    """A Kubeflow Trainer v2 TrainJob running ``torchrun train.py <args>``."""
    group, version, _, kind = TRAINJOB
    trainer = {
        "image": params["image"],
        "command": ["torchrun", f"{params['working_dir']}/train.py", *args],
        "numNodes": int(params["nodes"]),
        "numProcPerNode": int(params["processes_per_node"]),
        "env": environment(params),
    }
    resources = node_resources(params)
    if resources:
        trainer["resourcesPerNode"] = resources
    pod = {
        "volumes": [
            {
                "name": OUTPUTS_VOLUME,
                "persistentVolumeClaim": {"claimName": params["outputs_claim"]},
            }
        ],
        "containers": [
            {
                "name": "node",
                "volumeMounts": [{"name": OUTPUTS_VOLUME, "mountPath": params["outputs_mount"]}],
            }
        ],
    }
    patch = {
        "manager": "litscale",
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {"name": "node", "template": {"spec": {"template": {"spec": pod}}}}
                    ]
                }
            }
        },
    }
    return {
        "apiVersion": f"{group}/{version}",
        "kind": kind,
        "metadata": _metadata(name, params),
        "spec": {
            "runtimeRef": {
                "apiGroup": group,
                "kind": "ClusterTrainingRuntime",
                "name": params["runtime"],
            },
            "trainer": trainer,
            "runtimePatches": [patch],
        },
    }


# What ``k8s.launch_token`` draws: a letter first, so that Hydra reads it back as a string (not 123456, 1e5000).
LAUNCH_ID = re.compile(r"[a-z][0-9a-f]{5}")


def continued_launch(params: dict[str, Any]) -> str | None:
    """``hydra.launcher.launch``: the earlier launch whose run dirs the jobs run in again, each
    resuming from its own newest checkpoint; None: a new launch, in run dirs of its own. One
    ``ConfigError`` line for a value that cannot be a launch's id."""
    launch = params.get("launch")
    if launch is None or (isinstance(launch, str) and LAUNCH_ID.fullmatch(launch)):
        return launch
    raise ConfigError(f"hydra.launcher.launch={launch!r} is not a launch's id; allowed: null (a new launch, its "
                      "jobs in run dirs of their own) or the id of an earlier launch of this sweep (a letter "
                      "and 5 hex digits), as its first line names it (its jobs run again in its run dirs, resuming)")


def elastic_nodes(params: dict[str, Any], strategy_target: str) -> tuple[int, int] | None:
    """``(min_nodes, max_nodes)`` of an elastic PyTorchJob; None where both are null (the job
    has ``nodes`` pods). One ``ConfigError`` line for a range that cannot work."""
    low, high = params.get("min_nodes"), params.get("max_nodes")
    if low is None and high is None:
        return None
    named = f"hydra.launcher.min_nodes={low} / max_nodes={high}"
    api, nodes = params.get("api"), params.get("nodes")
    if api != "pytorchjob":
        raise ConfigError(f"{named} needs an elastic policy, which a Kubeflow TrainJob (hydra.launcher.api={api}) "
                          "does not have; allowed: hydra.launcher.api=pytorchjob, or min_nodes=null max_nodes=null")
    counts = (low, high, nodes)
    if not (all(isinstance(n, int) and not isinstance(n, bool) for n in counts) and 1 <= low <= nodes <= high):
        raise ConfigError(f"{named} is not an elastic range around the job's {nodes} nodes (trainer.num_nodes); "
                          "allowed: both null, or two integers with 1 <= min_nodes <= trainer.num_nodes <= max_nodes")
    from hydra_plugins.litscale_plugins.strategy_kind import is_data_parallel

    if not is_data_parallel(strategy_target):
        raise ConfigError(f"{named} runs the job on however many pods are up, which needs a replica of the whole "
                          f"model on each; strategy {strategy_target} splits it; allowed: a data-parallel strategy "
                          "(ddp, local_sgd), or min_nodes=null max_nodes=null")
    return low, high


# An elastic job's node count is the pods that met at the rendezvous, which torchrun gives its
# ranks as GROUP_WORLD_SIZE (a fixed trainer.num_nodes would refuse any other count).
NODES_AT_RENDEZVOUS = "trainer.num_nodes='${oc.decode:${oc.env:GROUP_WORLD_SIZE}}'"
# A start on other pods than the save's skips to a sample position their ranks can share out.
ELASTIC = "elastic=true"


def elastic_args(args: list[str]) -> list[str]:
    """An elastic job's arguments: its node count read at each start, not fixed, and its
    resume's position moved to one the new count shares out (``elastic=true``)."""
    fixed = ("trainer.num_nodes", "elastic")
    return [a for a in args if a.split("=", 1)[0].lstrip("+~") not in fixed] + [NODES_AT_RENDEZVOUS, ELASTIC]


def _replica_specs(template: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """A Master and ``nodes - 1`` Workers; an elastic job's ``nodes`` are all Workers (the
    operator's elastic mode rendezvouses them through the first Worker)."""
    nodes = int(params["nodes"])
    spec = {"restartPolicy": "OnFailure", "template": template}
    if params.get("min_nodes") is not None:
        return {"Worker": {"replicas": nodes, **spec}}
    replicas = {"Master": {"replicas": 1, **spec}}
    if nodes > 1:
        replicas["Worker"] = {"replicas": nodes - 1, **spec}
    return replicas


def pytorchjob(name: str, args: list[str], params: dict[str, Any]) -> dict[str, Any]:
    """A Training Operator v1 PyTorchJob: a Master replica and ``nodes - 1`` Workers, or with
    ``min_nodes`` / ``max_nodes`` (checked by ``elastic_nodes``) an elastic job of Workers."""
    group, version, _, kind = PYTORCHJOB
    elastic = params.get("min_nodes") is not None
    # $(VAR): expanded by Kubernetes from the environment the operator sets. An elastic job's
    # torchrun reads its node range and rendezvous from the operator's PET_* variables.
    rendezvous = [] if elastic else ["--master-addr=$(MASTER_ADDR)", "--master-port=$(MASTER_PORT)"]
    container = {
        "name": "pytorch",
        "image": params["image"],
        "workingDir": params["working_dir"],
        "command": ["torchrun", *rendezvous, "train.py", *args],
        "env": environment(params),
        "volumeMounts": [{"name": OUTPUTS_VOLUME, "mountPath": params["outputs_mount"]}],
    }
    resources = node_resources(params)
    if resources:
        container["resources"] = resources
    template = {
        "spec": {
            "containers": [container],
            "volumes": [
                {
                    "name": OUTPUTS_VOLUME,
                    "persistentVolumeClaim": {"claimName": params["outputs_claim"]},
                }
            ],
        }
    }
    restarts = int(params.get("max_restarts") or 0)
    spec: dict[str, Any] = {
        "nprocPerNode": str(params["processes_per_node"]),
        "pytorchReplicaSpecs": _replica_specs(template, params),
        # The operator restarts a failed pod in place this many times; the job's
        # ckpt_path=here resumes it from its run dir on the volume.
        "runPolicy": {"backoffLimit": restarts},
    }
    if elastic:
        # maxRestarts: torchrun's --max-restarts, the restarts of every worker when a pod goes or comes
        spec["elasticPolicy"] = {"rdzvBackend": "c10d", "minReplicas": int(params["min_nodes"]),
                                 "maxReplicas": int(params["max_nodes"]), "maxRestarts": restarts}
    return {
        "apiVersion": f"{group}/{version}",
        "kind": kind,
        "metadata": _metadata(name, params),
        "spec": spec,
    }


@cache
def schema(kind: str) -> dict[str, Any]:
    """The vendored OpenAPI schema of ``TrainJob`` or ``PyTorchJob``, made strict."""
    vendored = yaml.safe_load((SCHEMAS / f"{kind.lower()}.yaml").read_text())
    return _strict(vendored["openAPIV3Schema"])


def _strict(node: Any) -> Any:
    """Refuse fields a schema does not name, as ``kubectl apply`` (strict field validation) does."""
    if isinstance(node, list):
        return [_strict(v) for v in node]
    if not isinstance(node, dict):
        return node
    strict = {k: _strict(v) for k, v in node.items()}
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        strict["additionalProperties"] = False
    return strict


def manifest_problems(manifest: dict[str, Any]) -> list[str]:
    """Where ``manifest`` breaks its CRD's schema, one line each (none: it is valid)."""
    from jsonschema import Draft7Validator

    errors = Draft7Validator(schema(manifest["kind"])).iter_errors(manifest)
    return [
        f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
        for e in sorted(errors, key=lambda e: list(map(str, e.absolute_path)))
    ]
