"""The Ray launcher's settings for a cluster of several hosts, checked on the driver before any
worker starts: where run dirs live (``storage``), what the workers run in (``working_dir``, the
``LITSCALE_*`` environment), and an elastic worker count (``min_workers`` / ``max_workers``).

Each check raises ``ConfigError`` with one line naming the key, its value and what is allowed.
Nothing here imports ``ray`` or ``pyarrow``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra_plugins.litscale_plugins.strategy_kind import is_data_parallel
from litscale.errors import ConfigError
from litscale.user_paths import user_path

# The file systems ``pyarrow.fs.FileSystem.from_uri`` opens (Ray Train's storage uses the same).
STORAGE_SCHEMES = ("s3", "gs", "gcs", "abfs", "abfss", "hdfs", "viewfs", "file")
# What a working dir sent to every worker leaves out: environments, outputs and history the
# workers do not run (Ray refuses a working dir over 500 MiB, and uploads it once per sweep).
WORKING_DIR_EXCLUDES = (".venv", "venv", ".git", "outputs", "multiruns", "__pycache__",
                        ".pytest_cache", ".ruff_cache", "*.ckpt", "wandb")
# Forwarded to the workers of a cluster this sweep did not start (a local one inherits them).
FORWARDED_ENV_PREFIX = "LITSCALE_"
STORAGE_ALLOWED = ("null (the sweep dir), an absolute path every node mounts, or a URI "
                   f"({', '.join(f'{s}://' for s in STORAGE_SCHEMES)})")


def storage_uri_scheme(storage: str) -> str | None:
    """``s3`` for ``s3://bucket/prefix``; None for a path."""
    scheme, separator, _ = storage.partition("://")
    return scheme.lower() if separator else None


def check_storage(storage: Any, address: Any) -> None:
    """``hydra.launcher.storage`` names a place every worker can write, or is null where the
    workers share the driver's disk."""
    if storage is None:
        if str(address or "").startswith("ray://"):
            raise ConfigError(
                f"hydra.launcher.storage=null leaves run dirs, checkpoints and summary.json on the disks of "
                f"the hosts of hydra.launcher.address={address}, where this driver cannot read them; "
                f"allowed: {STORAGE_ALLOWED}")
        return
    text = str(storage)
    scheme = storage_uri_scheme(text)
    if scheme is None and not os.path.isabs(text):
        raise ConfigError(f"hydra.launcher.storage={text!r} is a relative path, which names another dir "
                          f"on each node; allowed: {STORAGE_ALLOWED}")
    if scheme is not None and (scheme not in STORAGE_SCHEMES or not text.split("://", 1)[1].strip("/")):
        raise ConfigError(f"hydra.launcher.storage={text!r} is not a storage URI pyarrow opens; "
                          f"allowed: {STORAGE_ALLOWED}")


def check_uri_storage_strategy(storage: Any, strategy_target: str, workers: int) -> None:
    """A URI storage holds what rank 0 writes alone (one rank's job, or a data-parallel one's):
    a sharded strategy's save, one part from each rank into one directory, needs a path every
    node mounts."""
    if (storage is None or storage_uri_scheme(str(storage)) is None or workers == 1
            or is_data_parallel(strategy_target)):
        return
    raise ConfigError(
        f"hydra.launcher.storage={storage} copies each rank's run dir to the URI after every save, which "
        f"holds the checkpoints that rank 0 writes alone; strategy {strategy_target} saves a part from every "
        "rank into one directory; allowed: a data-parallel strategy (ddp, local_sgd), one rank, or an "
        "absolute path every node mounts")


def elastic_workers(params: dict[str, Any], strategy_target: str) -> tuple[int, int] | None:
    """``(min_workers, max_workers)`` of an elastic job; None where both are null (the job has
    ``nodes x processes_per_node`` workers)."""
    low, high = params.get("min_workers"), params.get("max_workers")
    if low is None and high is None:
        return None
    named = f"hydra.launcher.min_workers={low} / max_workers={high}"
    if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
        raise ConfigError(f"{named} is not an elastic range; allowed: both null (a fixed count from "
                          "trainer.devices x trainer.num_nodes), or two integers with 1 <= min_workers <= max_workers")
    if not is_data_parallel(strategy_target):
        raise ConfigError(f"{named} runs the job on however many workers the cluster has, which needs a "
                          f"replica of the whole model on each; strategy {strategy_target} splits it; allowed: "
                          "a data-parallel strategy (ddp, local_sgd), or min_workers=null max_workers=null")
    return low, high


def check_settings(params: dict[str, Any], strategy_target: str) -> None:
    """Every setting here, for one job (``litscale.app.preflight`` asks before the sweep, the
    launcher again per job): one ``ConfigError`` line for the first that cannot work."""
    storage = params.get("storage")
    check_storage(storage, params.get("address"))
    check_uri_storage_strategy(storage, strategy_target, int(params["nodes"]) * int(params["processes_per_node"]))
    elastic_workers(params, strategy_target)
    check_working_dir(params.get("working_dir", "auto"))


def check_working_dir(value: Any) -> None:
    if value not in ("auto", None) and not os.path.isdir(user_path(str(value))):
        raise ConfigError(f"hydra.launcher.working_dir={value!r} is not a directory; allowed: auto (the dir "
                          "of train.py when joining a cluster), null, or a directory to send to every worker")


def project_dir(task_function: Any) -> str:
    """The dir of the script whose task function the sweep runs (``train.py``'s: the project)."""
    import inspect

    try:
        return str(Path(inspect.getfile(task_function)).resolve().parent)
    except (TypeError, OSError):
        return os.getcwd()


def working_dir(params: dict[str, Any], task_function: Any) -> str | None:
    """The dir sent to every worker (``runtime_env.working_dir``): ``auto`` is the project's
    when joining a cluster (whose hosts lack the driver's paths), none for a local one, which
    shares this disk; a path is itself; null: none."""
    value = params.get("working_dir", "auto")
    if value == "auto":
        return project_dir(task_function) if params.get("address") else None
    if value is None:
        return None
    check_working_dir(value)
    return os.path.abspath(user_path(str(value)))


def runtime_env(directory: str | None, environment: dict[str, str]) -> dict[str, Any]:
    """Ray's ``runtime_env`` for the sweep's workers: the working dir (less what they never
    run) and the ``LITSCALE_*`` variables."""
    forwarded = {k: v for k, v in environment.items() if k.startswith(FORWARDED_ENV_PREFIX)}
    env: dict[str, Any] = {"env_vars": forwarded}
    if directory is not None:
        env.update(working_dir=directory, excludes=list(WORKING_DIR_EXCLUDES))
    return env


def relative_cwd(directory: str | None, cwd: str) -> str | None:
    """Where a worker started in the sent working dir goes so that relative paths mean what
    they mean to the driver: the driver's cwd relative to that dir ('.' outside it); None
    without a working dir (the worker goes to the driver's own cwd)."""
    if directory is None:
        return None
    relative = os.path.relpath(cwd, directory)
    return "." if relative.startswith("..") else relative


def storage_run_root(storage: str, sweep_dir: str, root_dir: str) -> str:
    """The sweep's dir in ``storage``: the sweep dir's path under the outputs root
    (``<name>/multiruns/<time>``), or its last name where it is elsewhere."""
    sweep, root = Path(sweep_dir).resolve(), Path(root_dir).resolve()
    relative = sweep.relative_to(root) if sweep.is_relative_to(root) else Path(sweep.name)
    return f"{str(storage).rstrip('/')}/{relative.as_posix()}"


@dataclass
class JobSettings:
    """One job's checked settings: its worker count (fixed, or an elastic range), and where
    its run dir is: in the sweep dir or a storage path (``run_sweep_dir``), or in URI storage
    (``storage_uri``), written on each node under ``staging`` in its temp dir and copied back
    to the driver's ``local_run_dir``."""

    workers: int
    elastic: tuple[int, int] | None
    run_sweep_dir: str
    ray_storage_path: str
    local_run_dir: str
    storage_uri: str | None = None
    staging: str | None = None
