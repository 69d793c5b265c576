"""What litscale's launchers share: each job's own launcher settings, and its result record.

NOTE: Hydra imports every module under ``hydra_plugins`` on each command to find plugins, and
prints a warning for each that fails. An engine's package (submitit, ray, kubernetes,
skypilot, jsonschema, optuna) is imported inside the methods that use it, never at the top of
a module here, so that a base install (no extras) starts quietly.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

# NOTE: an Optuna sweep with n_jobs > 1 calls a launcher from several threads; Hydra's config
# loader keeps caches that are not guarded for that.
_COMPOSING = threading.Lock()


def compose_job(hydra_context: Any, sweep_config: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """One job's config, as Hydra's launchers compose it, one composition at a time."""
    with _COMPOSING:
        return hydra_context.config_loader.load_sweep_config(sweep_config, list(overrides))


def job_resources(job_config: DictConfig) -> dict[str, Any]:
    """The ``hydra.launcher`` settings of one job, resolved against its own config (so that
    ``${trainer.devices}`` there is this job's device count, not the sweep's first)."""
    params = OmegaConf.to_container(job_config.hydra.launcher, resolve=True)
    params.pop("_target_", None)
    return params


def sweep_run_dir(job_config: DictConfig) -> str:
    """The run dir Hydra's ``run_job`` gives a job of a sweep: ``hydra.sweep.dir/subdir``."""
    sweep = job_config.hydra.sweep
    return os.path.abspath(os.path.join(str(sweep.dir), str(sweep.subdir)))


def resuming_in_run_dir(args: list[str]) -> list[str]:
    """A cluster job's arguments when the engine may run it again in the same run dir (a pod
    restarted, a managed job recovered): it resumes from the newest complete checkpoint of that
    dir (``ckpt_path=here``; never another job's of the same name), unless it names one."""
    if any(a.split("=", 1)[0].lstrip("+~") == "ckpt_path" for a in args):
        return args
    return [*args, "ckpt_path=here"]


def described(error: BaseException) -> str:
    """``<Type>: <first line>`` of an error, as litscale's one-line reports name it."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def job_return(
    job_config: DictConfig,
    overrides: list[str],
    run_dir: str,
    *,
    error: BaseException | None = None,
    value: Any = None,
) -> JobReturn:
    """The record of a job that ran elsewhere (a cluster), failed with ``error`` or not, as
    Hydra's basic launcher makes it: ``cfg`` without the ``hydra`` node, and ``hydra_cfg``'s
    ``hydra.runtime.output_dir`` the job's run dir (where a sweeper reads its summary)."""
    hydra_cfg = OmegaConf.masked_copy(job_config, "hydra")
    with read_write(hydra_cfg), open_dict(hydra_cfg):
        hydra_cfg.hydra.runtime.output_dir = str(run_dir)
    cfg = OmegaConf.masked_copy(job_config, [k for k in job_config if k != "hydra"])
    result = JobReturn(
        overrides=list(overrides),
        cfg=cfg,
        hydra_cfg=hydra_cfg,
        working_dir=os.getcwd(),
        task_name=str(job_config.hydra.job.name),
        status=JobStatus.FAILED if error is not None else JobStatus.COMPLETED,
    )
    result._return_value = error if error is not None else value
    return result


class ClusterLauncher(Launcher):
    """A launcher whose settings are its ``hydra.launcher`` node, read in each job's config.

    Before a sweep, ``litscale.app.preflight`` finds the class from ``hydra.launcher._target_``
    and asks it about each job (``runs_jobs_elsewhere``, ``check_job``): the app names no launcher.
    """

    # Whether each job runs on other machines, whose devices are not this machine's (this
    # machine's device checks are then skipped, and the job is sized by ``check_job``).
    runs_jobs_elsewhere: ClassVar[bool] = True
    # How messages name the launcher: ``hydra/launcher=<option>``, a ``<engine>`` job of
    # ``trainer.devices`` ``<ranks_are>`` per node.
    option: ClassVar[str] = ""
    engine: ClassVar[str] = ""
    ranks_are: ClassVar[str] = "processes"

    @classmethod
    def check_job(cls, params: dict[str, Any], *, devices: Any, strategy_target: str) -> bool:
        """Whether one job's ``hydra.launcher`` settings (``params``, resolved) can run it: one
        ``ConfigError`` line for the first that cannot. The job is sized from ``trainer.devices``
        (``devices``: processes and GPUs per node) and ``trainer.num_nodes``, so it must be a
        count. True where the settings make the job elastic (its rank count then changes on
        its own)."""
        from litscale.errors import ConfigError

        text = str(devices).strip()
        if isinstance(devices, bool) or not text.isdigit() or int(text) < 1:
            raise ConfigError(
                f"trainer.devices={devices!r} cannot size a {cls.engine} job: hydra/launcher={cls.option} asks "
                f"for trainer.devices {cls.ranks_are} and GPUs per node; give a count, e.g. trainer.devices=4")
        return False

    def __init__(self, **params: Any) -> None:
        self.params = params

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.task_function = task_function

    def job_config(self, overrides: Sequence[str], number: int | None = None) -> DictConfig:
        """One job's config (its ``hydra.job.num`` set where ``number`` is given)."""
        job_config = compose_job(self.hydra_context, self.config, overrides)
        if number is not None:
            with open_dict(job_config):
                job_config.hydra.job.num = number
        return job_config

    def job_configs(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> list[tuple[int, DictConfig, list[str]]]:
        """(job number, its config, its overrides) of each job of a batch."""
        return [
            (initial_job_idx + i, self.job_config(o, initial_job_idx + i), list(o))
            for i, o in enumerate(job_overrides)
        ]


def write_checked(path: Path, text: str, problems: list[str], what: str) -> None:
    """Write a job's file for the cluster, or stop the sweep with one line on its first problem."""
    from litscale.app.preflight import fail

    if problems:
        fail(f"hydra.launcher: {what} breaks its schema: {problems[0]}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"litscale: {what}: {path}", flush=True)
