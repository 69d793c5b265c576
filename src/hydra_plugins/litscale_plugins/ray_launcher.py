"""Ray (``-m hydra/launcher=ray``): each job of a sweep is a Ray Train job.

A ``TorchTrainer`` with ``nodes x devices`` workers (from the job's own ``trainer.num_nodes``
/ ``trainer.devices``, resolved in its config as for SLURM) runs the Hydra job on every
worker, as one rank of it: Ray sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``NODE_RANK``
and ``MASTER_ADDR``/``PORT`` as torchrun does, so litscale sees an external launch and starts
no ranks itself. Ray's own process group is handed back before litscale's strategy makes its
own, so every strategy runs as under torchrun. Jobs are submitted together (one thread
each) and run at once where the cluster has room; each job's run dir is the one the basic
launcher would use. Every worker runs the job's own task function (``train.py``'s) through
Hydra's ``run_job``, so a rank that fails reports itself as under torchrun; a worker that dies
without a word (killed) is named by the driver in one ``error: rank N failed: ...`` line. The
sweep goes on. With ``max_failures: N``, Ray Train starts a failed job's workers again up to N
times, each attempt resuming from the newest complete checkpoint of the job's run dir
(``ckpt_path=here``, unless the job names one); each restart is said in one line naming the
rank that failed and what the job resumes from (``_ray_restarts``). On a cluster of several hosts the workers get
the project dir and the ``LITSCALE_*`` variables (``working_dir``), run dirs go to ``storage``
(a path every node mounts, or a URI), ``min_workers``/``max_workers`` make a data-parallel job
elastic, and a SIGTERM to a worker saves ``last.ckpt`` first (``ray_settings``, ``ray_worker``).
``ray`` is imported only inside the functions that use it.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, run_job, setup_globals
from omegaconf import DictConfig, open_dict

from hydra_plugins.litscale_plugins import ray_worker
from hydra_plugins.litscale_plugins.jobs import (
    ClusterLauncher,
    described,
    job_resources,
    job_return,
    sweep_run_dir,
)
from hydra_plugins.litscale_plugins.ray_settings import (
    JobSettings,
    check_settings,
    elastic_workers,
    relative_cwd,
    runtime_env,
    storage_run_root,
    storage_uri_scheme,
    working_dir,
)
from hydra_plugins.litscale_plugins.ray_worker import has_preemption_checkpoint
from litscale.extras import RAY

# NOTE: Ray Train replaces ``print`` in its workers with one that also logs each line through
# the root logger; litscale copies its printed lines to train.log itself, and Hydra's console
# handler on the root logger printed every line a second time. Ray passes this variable from
# the driver to its workers.
RAY_PRINT_PATCH_ENV = "RAY_TRAIN_ENABLE_PRINT_PATCH"
# NOTE: a job whose workers wait for CPUs other jobs hold hit Ray Train's worker-group start
# timeout (60 s) and printed a traceback at every retry; the job waits quietly instead, and the
# launcher says in one line what it waits for (``resources_line``). Passed to the workers as above.
RAY_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
WAIT_FOR_RESOURCES_S = 7 * 24 * 3600
# NOTE: an Optuna sweep with n_jobs > 1 launches from several threads; two ``ray.init`` at
# once would start two clusters, or fail in the second.
_CONNECTING = threading.Lock()
WORKER_CALLBACK = "hydra_plugins.litscale_plugins._ray_worker_callback.RayWorkerCallback"


class RayLauncher(ClusterLauncher):
    """Runs each job as a Ray Train ``TorchTrainer`` on the cluster at ``address``."""

    requires = (RAY,)  # litscale.extras: checked before the sweep dir exists
    option, engine = "ray", "ray"

    @classmethod
    def check_job(cls, params: dict[str, Any], *, devices: Any, strategy_target: str) -> bool:
        """The job's count, storage, working dir and elastic range (``ray_settings``); elastic
        where ``min_workers`` / ``max_workers`` are set."""
        super().check_job(params, devices=devices, strategy_target=strategy_target)
        check_settings(params, strategy_target)
        return elastic_workers(params, strategy_target) is not None

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        os.environ.setdefault(RAY_PRINT_PATCH_ENV, "0")
        # Pinned here: ${now:...} in the sweep dir would name another dir in each worker.
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        jobs = []
        for number, job_config, overrides in self.job_configs(job_overrides, initial_job_idx):
            with open_dict(job_config):
                job_config.hydra.job.id = number
                job_config.hydra.sweep.dir = str(sweep_dir)
            jobs.append((job_config, overrides, checked_settings(job_config)))  # before any worker starts
        if not any(settings.elastic for _, _, settings in jobs):
            # NOTE: an elastic job keeps Ray's start timeout: after a node is lost, Ray's view of
            # the cluster still counted its CPUs, and the job waited for them (seen: for good)
            # instead of starting again on the workers that are left.
            os.environ.setdefault(RAY_START_TIMEOUT_ENV, str(WAIT_FOR_RESOURCES_S))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        directory = working_dir(self.params, self.task_function)
        connect(self.params, runtime_env(directory, dict(os.environ)))
        self.relative_cwd = relative_cwd(directory, os.getcwd())
        with ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
            results = list(pool.map(lambda job: self._run(*job), jobs))
        if any(r.status == JobStatus.FAILED for r in results):
            raise SystemExit(1)  # each failure has had its line; every other job of the batch ran
        return results

    def _run(self, job_config: DictConfig, overrides: list[str], settings: JobSettings) -> JobReturn:
        """One job on the cluster: its return, with its run dir; failed where a rank failed."""
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        from hydra_plugins.litscale_plugins._ray_restarts import RayRestartReport

        params = job_resources(job_config)
        number = int(job_config.hydra.job.num)
        max_failures = int(params.get("max_failures") or 0)
        prepare_job_config(job_config, settings, max_failures)
        gpu = use_gpu(params, str(job_config.trainer.get("accelerator")))
        payload = (
            self.hydra_context, self.task_function, job_config, Singleton.get_state(), os.getcwd()
        )
        worker = {"relative_cwd": self.relative_cwd, "storage_uri": settings.storage_uri,
                  "elastic": settings.elastic, "number": number, "staging": settings.staging,
                  "stop_handler": has_preemption_checkpoint(job_config)}
        workers = settings.elastic or settings.workers
        # Said on Ray's controller, before it starts the workers again: one line per restart.
        restarts = RayRestartReport(number=number, max_failures=max_failures, ckpt_path=job_config.get("ckpt_path"),
                                    run_dir=None if settings.storage_uri else settings.local_run_dir)
        trainer = TorchTrainer(
            run_rank,
            train_loop_config={"job": payload, "worker": worker},
            scaling_config=ScalingConfig(
                num_workers=workers,
                use_gpu=gpu,
                resources_per_worker={"CPU": params["cpus_per_worker"]},
            ),
            torch_config=TorchConfig(backend="nccl" if gpu else "gloo"),
            run_config=RunConfig(
                name=f"job{number}",
                storage_path=settings.ray_storage_path,
                failure_config=FailureConfig(max_failures=max_failures),
                callbacks=[restarts] if max_failures else [],
            ),
        )
        print(f"litscale: job {number} on Ray: {' '.join(overrides)}", flush=True)
        run_dir = sweep_run_dir(job_config) if settings.storage_uri is None else settings.local_run_dir
        fewest = settings.elastic[0] if settings.elastic else settings.workers
        needed = {"CPU": fewest * float(params["cpus_per_worker"]), **({"GPU": float(fewest)} if gpu else {})}
        line = resources_line(number, fewest, needed, cluster_resources())
        if line is not None:
            print(line, file=sys.stderr if line.startswith("error:") else sys.stdout, flush=True)
            if line.startswith("error:"):
                return job_return(job_config, overrides, run_dir, error=RuntimeError(line[len("error: "):]))
        try:
            trainer.fit()
        except Exception as error:  # noqa: BLE001 - Ray's several failure types
            fetch_results(settings)
            return job_return(job_config, overrides, run_dir, error=reported(error, number))
        fetch_results(settings)
        return job_return(job_config, overrides, run_dir)


def connect(params: dict[str, Any], environment: dict[str, Any] | None = None) -> None:
    """Join the cluster at ``params['address']`` (``auto``, ``ray://...``) with the sweep's
    ``runtime_env`` (its working dir, the ``LITSCALE_*`` variables), or start a local one (whose
    workers inherit this process's environment and share its disk); once per process,
    whichever thread asks first."""
    import ray

    environment = environment or {}
    with _CONNECTING:
        if ray.is_initialized():
            return
        if params.get("address"):
            ray.init(address=params["address"], runtime_env=environment)
            return
        # NOTE: address "local" starts this sweep's own cluster. Without it, ray.init joins the
        # newest cluster started on this machine (RAY_ADDRESS, or Ray's record of the last
        # `ray start`) and then refuses num_cpus with a traceback: a test's two-node cluster on
        # the other pytest worker failed three sweeps here that way.
        local = {"address": "local", "num_cpus": params.get("num_cpus"), "num_gpus": params.get("num_gpus"),
                 "include_dashboard": False}
        if "working_dir" in environment:  # sent even to a local cluster where it is named
            local["runtime_env"] = environment
        ray.init(**local)


def cluster_resources() -> tuple[dict[str, float], dict[str, float]]:
    """The cluster's resources, all of them and those free now."""
    import ray

    return ray.cluster_resources(), ray.available_resources()


def resources_line(number: int, workers: int, needed: dict[str, float],
                   resources: tuple[dict[str, float], dict[str, float]]) -> str | None:
    """One line where job ``number`` cannot start at once: an ``error:`` where the cluster has
    fewer of a resource than its ``workers`` need in all, else what it waits for; None: it starts."""
    total, free = resources
    for name, amount in needed.items():
        if total.get(name, 0) < amount:
            return (f"error: job {number} needs {amount:g} {name}s for its {workers} Ray workers, the cluster has "
                    f"{total.get(name, 0):g}; allowed: fewer trainer.devices x trainer.num_nodes, a smaller "
                    "hydra.launcher.cpus_per_worker, or a larger cluster")
    short = [f"{amount:g} {name}s ({free.get(name, 0):g} of {total[name]:g} free now)"
             for name, amount in needed.items() if free.get(name, 0) < amount]
    if short:
        return f"litscale: job {number} waits for Ray: its {workers} workers need {', '.join(short)}"
    return None


def use_gpu(params: dict[str, Any], accelerator: str) -> bool:
    """Whether the job's workers each take a GPU: ``use_gpu: auto`` follows the accelerator."""
    if params.get("use_gpu") != "auto":
        return bool(params.get("use_gpu"))
    if accelerator == "cpu":
        return False
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def reported(error: BaseException, number: int) -> BaseException:
    """Job ``number``'s failure in one ``error:`` line. A rank whose task function raised has
    reported itself (its ``error:`` line, or that a peer failed) and exited: the line points
    there. A worker that died without a word (killed, out of memory) is named here."""
    failures = {
        rank: unwrapped(cause)
        for rank, cause in (getattr(error, "worker_failures", None) or {}).items()
    }
    silent = {rank: cause for rank, cause in failures.items() if not isinstance(cause, SystemExit)}
    if silent:
        rank, cause = min(silent.items())
        line = f"rank {rank} failed: {described(cause)}"
    elif failures:
        codes = sorted({str(cause.code) for cause in failures.values()})
        line = (f"job {number}: rank(s) {', '.join(map(str, sorted(failures)))} exited with "
                f"{', '.join(codes)}; their lines above say why")
    else:  # Ray's own failure, no worker's
        line = described(error)
    print(f"error: {line}", file=sys.stderr, flush=True)
    return RuntimeError(line)


def unwrapped(cause: BaseException) -> BaseException:
    """The worker's own exception inside Ray Train's wrapper (which keeps its traceback)."""
    return getattr(cause, "_base_exc", None) or cause


def prepare_job_config(job_config: DictConfig, settings: JobSettings, max_failures: int) -> None:
    """What the driver adds to a job's config for Ray: its run dir's place, ``ckpt_path=here``
    where Ray may restart it, ``elastic=true`` where Ray picks its worker count, and the
    callback that hands it a worker's SIGTERM."""
    with open_dict(job_config):
        job_config.hydra.sweep.dir = settings.run_sweep_dir
        if max_failures and job_config.get("ckpt_path") is None:
            job_config.ckpt_path = "here"  # a restarted attempt resumes this job's own last save
        if settings.elastic:  # an attempt on fewer workers skips to a position they can share out
            job_config.elastic = True
        if job_config.get("callbacks") is None:
            job_config.callbacks = {}
        job_config.callbacks.ray_worker = {"_target_": WORKER_CALLBACK}
        job_config.allowed_targets = [*(job_config.get("allowed_targets") or []), WORKER_CALLBACK]


def fetch_results(settings: JobSettings) -> None:
    """A job's run dir in URI storage, less its checkpoints, copied into the sweep dir (where
    the sweep reads its summary); where storage cannot be read, one line says so."""
    if settings.storage_uri is None:
        return
    from hydra_plugins.litscale_plugins.ray_storage import CHECKPOINTS, StoredRunDir

    try:
        StoredRunDir(settings.storage_uri, settings.local_run_dir).download(skip=(CHECKPOINTS,))
    except Exception as error:  # noqa: BLE001 - pyarrow's file systems raise several types
        print(f"error: could not copy {settings.storage_uri} to {settings.local_run_dir}: {described(error)}",
              file=sys.stderr, flush=True)


def run_rank(config: dict[str, Any]) -> None:
    """On each Ray Train worker: this rank of the Hydra job, through Hydra's ``run_job`` and the
    job's own task function (rank 0 alone writes ``.hydra/``)."""
    hydra_context, task_function, job_config, singleton_state, cwd = config["job"]
    worker = config.get("worker") or {}
    enter_working_dir(cwd, worker.get("relative_cwd"))
    if worker.get("storage_uri"):  # while Ray's process group is up: its barrier
        with open_dict(job_config):
            job_config.hydra.sweep.dir = os.path.join(tempfile.gettempdir(), "litscale-ray", worker["staging"])
        ray_worker.start_stored_run_dir(worker["storage_uri"], sweep_run_dir(job_config))
    leave_rays_process_group()
    # Lightning recognises a torchrun-style launch by GROUP_RANK (Ray names it NODE_RANK).
    os.environ.setdefault("GROUP_RANK", os.environ.get("NODE_RANK", "0"))
    if worker.get("elastic"):
        take_elastic_size(job_config, worker["number"], tuple(worker["elastic"]))
    Singleton.set_state(singleton_state)
    setup_globals()
    if int(os.environ["RANK"]) != 0:
        with open_dict(job_config):
            job_config.hydra.output_subdir = None
    ray_worker.state.stopped_at_step = None
    if worker.get("stop_handler"):
        ray_worker.on_main_thread(ray_worker.install_stop_handler)
    try:
        result = run_job(
            hydra_context=hydra_context,
            task_function=task_function,
            config=job_config,
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )
    finally:
        if worker.get("stop_handler"):
            ray_worker.on_main_thread(ray_worker.restore_stop_handler)
        ray_worker.finish_stored_run_dir()
    if result.status == JobStatus.FAILED:
        raise result._return_value
    if ray_worker.state.stopped_at_step is not None:
        raise_preempted(worker.get("number"), ray_worker.state.stopped_at_step)


def raise_preempted(number: Any, step: int) -> None:
    """A rank stopped by SIGTERM fails on purpose once its ``last.ckpt`` is saved: Ray Train then
    starts the job again (``max_failures``) and it resumes there. Rank 0 says so in one line."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"litscale: job {number} stopped at step {step} on SIGTERM and saved last.ckpt; Ray starts "
              "it again from there while hydra.launcher.max_failures allows", flush=True)
    raise ray_worker.RayWorkerPreempted(f"rank {os.environ.get('RANK', '0')} stopped at step {step} on SIGTERM "
                                        "and saved last.ckpt")


def enter_working_dir(driver_cwd: str, relative: str | None) -> None:
    """Where relative paths in the config mean what they meant to the sweep: the driver's own
    cwd, or, in a working dir Ray sent to this worker (which starts in it), its counterpart."""
    os.chdir(driver_cwd if relative is None else os.path.join(os.getcwd(), relative))


def take_elastic_size(job_config: DictConfig, number: int, bounds: tuple[int, int]) -> None:
    """An elastic job runs on the workers Ray gave it: ``trainer.devices x trainer.num_nodes``
    becomes their count (the per-device batch stays, so the global batch follows it)."""
    world = int(os.environ["WORLD_SIZE"])
    devices, nodes = ray_worker.elastic_trainer_shape(world, int(os.environ.get("LOCAL_WORLD_SIZE", "0")))
    with open_dict(job_config):
        job_config.trainer.devices, job_config.trainer.num_nodes = devices, nodes
    if int(os.environ["RANK"]) == 0:
        choices = job_config.hydra.runtime.get("choices") or {}
        print(ray_worker.elastic_line(
            number, world, bounds, int(job_config.data.batch_size),
            int(job_config.trainer.get("accumulate_grad_batches") or 1), str(choices.get("lr_scaling", "none"))),
            flush=True)


def leave_rays_process_group() -> None:
    """Destroy the group Ray Train made, after agreeing on a fresh port for litscale's own.

    NOTE: Lightning would adopt an existing group, but then the strategies would run on Ray's
    settings (its timeout, no device binding) rather than as under torchrun; and reusing
    Ray's port could meet its store still closing."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    from torch.distributed.elastic.utils.distributed import get_free_port

    port = [get_free_port() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port[0])


def checked_settings(job_config: Any) -> JobSettings:
    """One job's Ray settings, each checked (one-line ``ConfigError``) before any worker starts.

    NOTE: here, not in ray_settings, which preflight imports: this reads the job's resources
    through jobs, which imports preflight."""
    params = job_resources(job_config)
    strategy = str((job_config.get("strategy") or {}).get("_target_", ""))
    storage = params.get("storage")
    check_settings(params, strategy)
    workers = int(params["nodes"]) * int(params["processes_per_node"])
    elastic = elastic_workers(params, strategy)
    sweep_dir, subdir = str(job_config.hydra.sweep.dir), str(job_config.hydra.sweep.subdir)
    local_run_dir = sweep_run_dir(job_config)
    if storage is None:
        return JobSettings(workers, elastic, sweep_dir, str(Path(sweep_dir) / ".ray"), local_run_dir)
    root = storage_run_root(str(storage), sweep_dir, str(job_config.paths.root_dir))
    if storage_uri_scheme(str(storage)) is None:
        return JobSettings(workers, elastic, root, f"{root}/.ray", os.path.join(root, subdir))
    staging = root[len(str(storage).rstrip("/")) + 1:]
    return JobSettings(workers, elastic, sweep_dir, f"{root}/.ray", local_run_dir,
                       storage_uri=f"{root}/{subdir}", staging=staging)
