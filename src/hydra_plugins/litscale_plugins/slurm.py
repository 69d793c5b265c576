"""SLURM through Hydra's submitit launcher (``-m hydra/launcher=slurm``), with each job's
resources taken from that job's own trainer settings.

hydra-submitit-launcher reads ``hydra.launcher`` once, from the sweep's base config, and
submits all jobs as one array with those resources, so a scaling sweep
(``trainer.devices=1,2,4,8``) would give every job the first job's allocation. Here the
``hydra.launcher`` node (whose ``nodes``/``tasks_per_node``/``gpus_per_node`` interpolate
``trainer.num_nodes``/``trainer.devices``) is resolved in each job's config, and jobs are
submitted as one array per distinct set of resources, all before waiting on any.

Inside an allocation every SLURM task runs the job as one rank (``litscale.app.launch`` sees
``srun``'s environment). Task 0 alone writes ``.hydra/``. A requeued job (after a time-out
signal, which submitit answers by requeueing, or a preemption) resumes from the newest
``checkpoints/last.ckpt`` in its own run dir.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, run_job, setup_globals
from omegaconf import OmegaConf, open_dict

from hydra_plugins.litscale_plugins.jobs import (
    ClusterLauncher,
    job_resources,
    job_return,
    sweep_run_dir,
)
from litscale.extras import SUBMITIT_LAUNCHER

# Executor settings that submitit takes at construction rather than as parameters.
_EXECUTOR_INIT_KEYS = ("submitit_folder", "max_num_timeout")


def group_by_resources(resources: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[int]]]:
    """Job indices grouped by equal launcher settings (one SLURM array each), in first-seen order."""
    groups: dict[str, list[int]] = {}
    for index, params in enumerate(resources):
        groups.setdefault(json.dumps(params, sort_keys=True), []).append(index)
    return [(json.loads(key), indices) for key, indices in groups.items()]


def resume_checkpoint(job_dir: str, restart_count: int) -> str | None:
    """The checkpoint a requeued job resumes from: its own newest ``last.ckpt``, if any."""
    from litscale.checkpoint.resume import newest_last_checkpoint

    if restart_count < 1 or not os.path.isdir(job_dir):
        return None
    return newest_last_checkpoint(job_dir)


class SlurmLauncher(ClusterLauncher):
    """hydra-submitit-launcher's SLURM launcher with per-job resources and rank-aware jobs.

    NOTE: not a subclass of the plugin's class, which would import hydra-submitit-launcher
    whenever Hydra scans its plugins; its ``submitit_slurm`` config (this one's defaults) and
    ``submitit`` are used only once the launcher is chosen."""

    _EXECUTOR = "slurm"
    requires = (SUBMITIT_LAUNCHER,)  # litscale.extras: checked before the sweep dir exists
    option, engine, ranks_are = "slurm", "SLURM", "tasks"

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        jobs = self.job_configs(job_overrides, initial_job_idx)
        submitted: list[Any] = [None] * len(jobs)
        for params, indices in group_by_resources([job_resources(config) for _, config, _ in jobs]):
            arguments = [(jobs[i][2], "hydra.sweep.dir", jobs[i][0], f"job_id_for_{jobs[i][0]}",
                          Singleton.get_state()) for i in indices]
            for index, job in zip(indices, self._executor(params).map_array(self, *zip(*arguments, strict=True)),
                                  strict=True):
                submitted[index] = job
        return [self._result(job, config, overrides)
                for job, (_, config, overrides) in zip(submitted, jobs, strict=True)]

    @staticmethod
    def _result(job: Any, job_config: Any, overrides: list[str]) -> JobReturn:
        """Task 0's record of its job; a failed record, with the job's run dir, where the job
        ended without one (an error that left Hydra's ``run_job``, a killed task)."""
        try:
            return job.results()[0]
        except Exception as error:  # noqa: BLE001 - submitit's failure types: the job failed
            return job_return(job_config, overrides, sweep_run_dir(job_config), error=error)

    def _executor(self, params: dict[str, Any]):
        """A submitit executor with these settings (as the plugin builds it)."""
        import submitit
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

        init = {f"{self._EXECUTOR}_max_num_timeout": params["max_num_timeout"]} \
            if "max_num_timeout" in params else {}  # a SLURM setting only
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=params["submitit_folder"], **init)
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{
            key if key in shared else f"{self._EXECUTOR}_{key}": value
            for key, value in params.items() if key not in _EXECUTOR_INIT_KEYS})
        return executor

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Resubmit this call with its arguments (submitit's requeue on a time-out), as the
        plugin's launcher does."""
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)

    def __call__(self, sweep_overrides: list[str], job_dir_key: str, job_num: int, job_id: str,
                 singleton_state: dict[type, Singleton]) -> JobReturn:
        """One SLURM task of one job (the plugin's, plus rank 0 alone writing ``.hydra/`` and
        a requeued job resuming from its own last checkpoint)."""
        import submitit

        from litscale.app import resolvers  # noqa: F401  (the run dir's ${user_path:...}, resolved below)

        assert self.hydra_context is not None and self.config is not None
        Singleton.set_state(singleton_state)
        setup_globals()
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, sweep_overrides)
        environment = submitit.JobEnvironment()
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = environment.job_id
            sweep_config.hydra.job.num = job_num
            if environment.global_rank != 0:
                sweep_config.hydra.output_subdir = None
            job_dir = os.path.join(str(sweep_config.hydra.sweep.dir), str(sweep_config.hydra.sweep.subdir))
            resume = resume_checkpoint(job_dir, int(os.environ.get("SLURM_RESTART_COUNT") or 0))
            if resume is not None:
                sweep_config.ckpt_path = resume
        return run_job(hydra_context=self.hydra_context, task_function=self.task_function,
                       config=sweep_config, job_dir_key=job_dir_key, job_subdir_key="hydra.sweep.subdir")


class LocalLauncher(SlurmLauncher):
    """The same launcher on submitit's local executor: each job a subprocess of this machine
    (``-m hydra/launcher=slurm_local``), for trying a SLURM sweep without SLURM."""

    _EXECUTOR = "local"
    runs_jobs_elsewhere = False  # subprocesses of this machine: its device checks hold
