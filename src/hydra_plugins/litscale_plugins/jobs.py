"""What litscale's launchers share: each job's own launcher settings, and its result record."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, OmegaConf


def job_resources(job_config: DictConfig) -> dict[str, Any]:
    """The ``hydra.launcher`` settings of one job, resolved against its own config (so that
    ``${trainer.devices}`` there is this job's device count, not the sweep's first)."""
    params = OmegaConf.to_container(job_config.hydra.launcher, resolve=True)
    params.pop("_target_", None)
    return params


def job_return(
    job_config: DictConfig,
    overrides: list[str],
    *,
    error: BaseException | None = None,
    value: Any = None,
) -> JobReturn:
    """The record Hydra keeps of a job that ran elsewhere (a cluster), failed with ``error`` or not."""
    result = JobReturn(
        overrides=list(overrides),
        cfg=job_config,
        hydra_cfg=job_config,
        working_dir=str(job_config.hydra.sweep.dir),
        task_name=str(job_config.hydra.job.name),
        status=JobStatus.FAILED if error is not None else JobStatus.COMPLETED,
    )
    result._return_value = error if error is not None else value
    return result


class ClusterLauncher(Launcher):
    """A launcher whose settings are its ``hydra.launcher`` node, read in each job's config."""

    def __init__(self, **params: Any) -> None:
        self.params = params

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context

    def job_configs(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> list[tuple[int, DictConfig, list[str]]]:
        """(job number, its config, its overrides) of each job of a batch."""
        loader = self.hydra_context.config_loader
        return [
            (initial_job_idx + i, loader.load_sweep_config(self.config, list(o)), list(o))
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
