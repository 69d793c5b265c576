"""Where a SkyPilot job's outputs live: a bucket mounted on every node, and the settings refused
without one (apart from the launcher: preflight checks them before Hydra starts a job, and
imports nothing of the launchers' own)."""

from __future__ import annotations

from typing import Any

# A bucket given as a URI (an existing one); any other value names a bucket SkyPilot creates.
BUCKET_SCHEMES = ("s3://", "gs://", "r2://", "https://", "cos://", "oci://")


def outputs_problem(params: dict[str, Any]) -> str | None:
    """The one-line refusal of settings that would lose a job's outputs with its nodes."""
    if params.get("outputs_bucket"):
        return None
    kept = ("allowed: hydra.launcher.outputs_bucket=<a bucket name, or an s3://, gs:// or r2:// URI>, "
            "mounted at hydra.launcher.outputs on every node")
    if params.get("down"):
        return ("hydra.launcher.down=true tears each job's cluster down with its checkpoints, summary.json and "
                f"logs, which hydra.launcher.outputs_bucket=null leaves on the nodes' disks; {kept}, or "
                "hydra.launcher.down=false")
    if params.get("use_spot"):
        return ("hydra.launcher.use_spot=true recovers a preempted job on new nodes, which find no checkpoint "
                f"on the lost nodes' disks (hydra.launcher.outputs_bucket=null); {kept}, or "
                "hydra.launcher.use_spot=false")
    return None


def outputs_mount(params: dict[str, Any]) -> dict[str, Any]:
    """``file_mounts``: the outputs bucket at ``outputs`` on every node ({} without a bucket)."""
    bucket = params.get("outputs_bucket")
    if not bucket:
        return {}
    storage: dict[str, Any] = ({"source": bucket} if str(bucket).startswith(BUCKET_SCHEMES)
                               else {"name": bucket, **({"store": params["outputs_store"]}
                                                        if params.get("outputs_store") else {})})
    return {"file_mounts": {params["outputs"]: {**storage, "mode": "MOUNT"}}}


def published_by_pointer(args: list[str], params: dict[str, Any]) -> list[str]:
    """A job's arguments with ``checkpoint.publish=pointer`` where its outputs are a mounted
    bucket, unless the job chooses: in MOUNT mode a directory's rename is a copy of its files
    one by one (or fails), so a sharded checkpoint is published by a pointer file
    (``litscale.checkpoint.atomic``). Said on the command line rather than left to ``auto``'s
    look at the mount: the task reads as what it does, whatever the mount's type is called."""
    if not params.get("outputs_bucket") or any(a.split("=", 1)[0].lstrip("+~") == "checkpoint.publish"
                                               for a in args):
        return args
    return [*args, "checkpoint.publish=pointer"]
