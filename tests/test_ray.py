"""``-m hydra/launcher=ray`` on a real local Ray cluster, started once by one sweep of 3 jobs:
DDP and FSDP 2-worker jobs train as litscale's own launcher does (the same loss at every step,
the same final validation loss; one basic-launcher sweep of the same 2 jobs is the reference),
each job in the run dir the basic launcher would give it; a third job, a worker killed mid-run,
ends with one ``error: rank 1 failed: ...`` line while the sweep's other jobs finish. A 2-trial
Optuna study runs its trials on Ray two at a time and prints its best trial. Without a cluster:
each worker runs the job's own task function through Hydra's ``run_job``, the driver names a
failed job's ranks in one line, a job's record names its run dir, and Ray starts once however
many threads launch."""

from __future__ import annotations

import importlib.util
import re
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
from helpers.cli import explain, run_train, summaries, train_losses
from helpers.configs import compose_full
from helpers.one_ray import one_ray_at_a_time
from omegaconf import OmegaConf

# Whether Ray is installed, without importing it: the sweeps import it in their own processes,
# and every pytest worker collects this module.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")

STEPS = 2
# The shortest runs that still compare losses: 2 steps, one validation batch at the end, no
# checkpoint or progress-bar callbacks (the CSV logger stays: the losses are read from it).
TINY = (
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "optimizer=sgd",
    "optimizer.lr=0.05",
    f"trainer.max_steps={STEPS}",
    f"trainer.val_check_interval={STEPS}",
    "trainer.limit_val_batches=1",
    "trainer.num_sanity_val_steps=0",
    "trainer.log_every_n_steps=1",
    "data.seq_len=32",
    "data.max_bytes=400000",
    "trainer.enable_progress_bar=false",
    "callbacks=none",
)
# Each job is an experiment file, so that one grid-free sweep holds jobs that differ in more
# than one key (the killed job adds a callback).
JOBS = {
    "ray_ddp": "defaults:\n  - override /strategy: ddp\n",
    "ray_fsdp": "defaults:\n  - override /strategy: fsdp\n",
    "ray_killed": (
        "defaults:\n  - override /strategy: ddp\n"
        "callbacks:\n  fault:\n    _target_: litscale.callbacks.faults.InjectFault\n"
        "    kind: sigkill\n    rank: 1\n    at_step: 1\n"
    ),
    # The same kill at the last step, after a save at step 1, in a job Ray may restart once:
    # the second attempt resumes from that save in the same run dir and finishes.
    "ray_recovered": (
        "defaults:\n  - override /strategy: ddp\n"
        "hydra:\n  launcher:\n    max_failures: 1\n"
        "callbacks:\n  fault:\n    _target_: litscale.callbacks.faults.InjectFault\n"
        f"    kind: sigkill\n    rank: 1\n    at_step: {STEPS}\n"
        "  every_step:\n    _target_: lightning.pytorch.callbacks.ModelCheckpoint\n"
        "    dirpath: ${paths.output_dir}/checkpoints\n    every_n_train_steps: 1\n    save_last: true\n"
    ),
}
# NOTE: each train.py starts a local cluster for its sweep (hydra.launcher.address null), a few
# seconds; a cluster shared by the module (`ray start --head`) was refused to the runs joining
# it here ("Failed to connect to GCS ... InvalidAuthToken"). 4 CPUs: 2 of the 3 jobs run at
# once (a job's wait, as the killed job's peer's, overlaps another's work), at most 4 workers in memory.
RAY = ("hydra/launcher=ray", "hydra.launcher.num_cpus=4")


# The done-when study: 2 trials of 1-device DDP on Ray, both at once; 20 steps end before the
# default first validation (step 100), so each trial validates at its last step.
STUDY = ("hydra/launcher=ray", "hydra.launcher.num_cpus=2", "hydra/sweeper=optuna",
         "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=2", "strategy=ddp",
         "trainer.accelerator=cpu", "trainer.devices=1", "trainer.max_steps=20",
         "trainer.limit_val_batches=1", "data.seq_len=32", "data.max_bytes=400000",
         "trainer.enable_progress_bar=false", "callbacks=none")


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    """The Ray sweep of the 3 jobs (ddp, fsdp, killed), the basic launcher's of the first 2, and
    the 2-trial Optuna study on Ray."""
    conf = tmp_path_factory.mktemp("conf")
    (conf / "experiment").mkdir()
    for name, text in JOBS.items():
        (conf / "experiment" / f"{name}.yaml").write_text(f"# @package _global_\n{text}")
    searchpath = f"hydra.searchpath=[file://{conf}]"
    runs = {}
    with one_ray_at_a_time():
        for launcher, jobs in (("ray", "ray_ddp,ray_fsdp,ray_killed,ray_recovered"), ("basic", "ray_ddp,ray_fsdp")):
            outputs = tmp_path_factory.mktemp(launcher)
            extra = RAY if launcher == "ray" else ()
            process = run_train(
                "-m", *extra, searchpath, f"experiment={jobs}", *TINY, outputs=outputs, timeout=1000
            )
            runs[launcher] = (outputs, process)
        outputs = tmp_path_factory.mktemp("optuna")
        runs["optuna"] = (outputs, run_train("-m", *STUDY, outputs=outputs, timeout=1000))
    return runs


@pytest.mark.slow
# make test-soak: the module's sweeps (4 Ray jobs, 2 basic-launcher jobs of 2 ranks, a 2-trial
# study on Ray) take 5-8 min on 2 cores, beyond CI's time.
@pytest.mark.soak
@pytest.mark.timeout(2400)
def test_ray_jobs_train_as_litscales_own_launcher(sweeps):
    (ray_outputs, ray_process), (basic_outputs, basic_process) = sweeps["ray"], sweeps["basic"]
    assert basic_process.returncode == 0, explain(basic_process)
    ray_runs = {Path(s["output_dir"]).name: s for s in summaries(ray_outputs)}
    basic_runs = {Path(s["output_dir"]).name: s for s in summaries(basic_outputs)}
    # Job 0: ddp, job 1: fsdp; job 2 (killed) left no summary; job 3 (recovered): below.
    assert sorted(ray_runs) == ["0", "1", "3"] and sorted(basic_runs) == ["0", "1"], explain(ray_process)
    for job in ("0", "1"):
        ray_run, basic_run = ray_runs[job], basic_runs[job]
        assert ray_run["world_size"] == basic_run["world_size"] == 2
        ray_losses, basic_losses = (
            train_losses(ray_run["output_dir"]),
            train_losses(basic_run["output_dir"]),
        )
        assert sorted(ray_losses) == sorted(basic_losses) == list(range(STEPS))
        torch.testing.assert_close(
            torch.tensor([ray_losses[s] for s in range(STEPS)]),
            torch.tensor([basic_losses[s] for s in range(STEPS)]),
            rtol=1.3e-6,
            atol=1e-5,
        )
        torch.testing.assert_close(
            ray_run["val/loss"], basic_run["val/loss"], rtol=1.3e-6, atol=1e-5
        )
        # The run dir as the basic launcher lays it out: .hydra/ once (rank 0), both ranks recorded.
        run_dir = Path(ray_run["output_dir"])
        assert run_dir.parent.parent.name == "multiruns"
        assert sorted(p.name for p in (run_dir / ".hydra").iterdir()) == [
            "config.yaml",
            "hydra.yaml",
            "overrides.yaml",
        ]
        assert sorted(p.name for p in (run_dir / "ranks").iterdir()) == ["rank0.json", "rank1.json"]
    # Each line litscale prints reaches the driver once: Ray Train's own print, which also logs
    # every line through the root logger, is off in the jobs.
    printed = ray_process.stdout + ray_process.stderr
    # A job waiting for CPUs the others hold waits quietly, not through Ray's start timeouts.
    assert "WorkerGroupStartupTimeoutError" not in printed, explain(ray_process)
    assert printed.count("litscale: outputs: ") == 3 and "][root][INFO] - litscale: " not in printed, explain(ray_process)


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(2400)
def test_a_ray_job_restarted_after_a_killed_worker_resumes_its_own_save_and_trains_as_uninterrupted(sweeps):
    """``max_failures: 1``: rank 1 killed at the last step; Ray starts the job's workers again,
    and the second attempt resumes from its step-1 save (``ckpt_path=here``: its own run dir,
    not job 0's, which has the same name) and ends with job 0's losses."""
    (ray_outputs, ray_process), (basic_outputs, _) = sweeps["ray"], sweeps["basic"]
    runs = {Path(s["output_dir"]).name: s for s in summaries(ray_outputs)}
    recovered, reference = runs["3"], {Path(s["output_dir"]).name: s for s in summaries(basic_outputs)}["0"]
    assert recovered["steps"] == STEPS and recovered["world_size"] == 2, recovered
    assert "litscale: job 3 on Ray: experiment=ray_recovered" in ray_process.stdout, explain(ray_process)
    checkpoints = Path(recovered["output_dir"]) / "checkpoints"
    # the restart said in one line (from Ray's controller, under its prefix), with what it resumes
    restarted = re.findall(r"litscale: job 3: rank 1's Ray worker died; Ray restarts the job's workers \(restart 1 "
                           rf"of hydra.launcher.max_failures=1\), resuming from {re.escape(str(checkpoints))}/"
                           r"\S+\.ckpt \(step (\d+)\)", ray_process.stdout + ray_process.stderr)
    assert restarted in (["1"], ["2"]), explain(ray_process)
    assert (checkpoints / "last.ckpt").exists(), sorted(checkpoints.iterdir())
    losses, expected = train_losses(recovered["output_dir"]), train_losses(reference["output_dir"])
    assert STEPS - 1 in losses, losses  # the step after the resume (the first attempt's rows may be rewritten)
    torch.testing.assert_close(torch.tensor([losses[s] for s in sorted(losses)]),
                               torch.tensor([expected[s] for s in sorted(losses)]), rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(recovered["val/loss"], reference["val/loss"], rtol=1.3e-6, atol=1e-5)


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(2400)
def test_a_killed_ray_worker_ends_its_job_with_one_line(sweeps):
    _, process = sweeps["ray"]
    assert process.returncode == 1, explain(process)
    lines = [line for line in process.stderr.splitlines() if line.startswith("error:")]
    # One line, for the killed job alone (Ray's own log may say "controller error:" while a job
    # waits, which starts otherwise); the sweep's other 2 jobs finished (test above).
    assert len(lines) == 1 and lines[0].startswith("error: rank 1 failed: "), explain(process)
    assert "litscale: job 2 on Ray: experiment=ray_killed" in process.stdout, explain(process)


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(2400)
def test_an_optuna_study_runs_its_trials_on_ray_and_prints_the_best(sweeps):
    """Each trial's summary is read from the run dir Ray's job reported (the first trial's
    record used to hold Hydra's ``???`` there, and the sweep died after it)."""
    import optuna

    outputs, process = sweeps["optuna"]
    assert process.returncode == 0, explain(process)
    (sweep_dir,) = (outputs / "default" / "multiruns").iterdir()
    study = optuna.load_study(study_name="litscale", storage=f"sqlite:///{sweep_dir / 'optuna.db'}")
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2, explain(process)
    assert ("litscale: trainer.max_steps=20 ends before the first validation "
            "(trainer.val_check_interval=100): each trial validates at step 20 to measure val/loss"
            in process.stdout), explain(process)
    best = study.best_trial
    assert (f"litscale: best trial {best.number}: val/loss {best.value:.6g} "
            f"(optimizer.lr={best.params['optimizer.lr']}); run dir {sweep_dir / str(best.number)}"
            in process.stdout), explain(process)
    for trial in study.trials:
        assert trial.user_attrs["run_dir"] == str(sweep_dir / str(trial.number))


# --- without a cluster ---------------------------------------------------------------------------


def test_ray_starts_once_however_many_threads_launch(monkeypatch):
    """An Optuna study with n_jobs=2 launches from two threads at once: one ``ray.init``."""
    from hydra_plugins.litscale_plugins import ray_launcher

    calls, both_in = [], threading.Barrier(4)
    fake = types.SimpleNamespace(is_initialized=lambda: bool(calls),
                                 init=lambda **options: calls.append(options))
    monkeypatch.setitem(sys.modules, "ray", fake)

    def launch():
        both_in.wait()
        ray_launcher.connect({"num_cpus": 2})

    threads = [threading.Thread(target=launch) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # "local": its own cluster, never the newest one started on this machine (RAY_ADDRESS, `ray start`)
    assert calls == [{"address": "local", "num_cpus": 2, "num_gpus": None, "include_dashboard": False}]


def test_a_ray_jobs_record_names_its_run_dir(tmp_path):
    from hydra_plugins.litscale_plugins.jobs import job_return, sweep_run_dir

    config = compose_full(["hydra/launcher=ray", f"hydra.sweep.dir={tmp_path}"])
    OmegaConf.set_struct(config, False)
    config.hydra.job.num = 4
    record = job_return(config, ["optimizer.lr=0.001"], sweep_run_dir(config))
    assert record.hydra_cfg.hydra.runtime.output_dir == str(tmp_path / "4")
    assert "hydra" not in record.cfg and record.cfg.trainer.max_steps == config.trainer.max_steps


@pytest.mark.slow
def test_each_worker_runs_the_jobs_own_task_function_through_hydra(tmp_path, monkeypatch):
    """The worker runs ``train.py``'s task function (its error lines are the ones a torchrun
    rank prints); an exception it raises fails the worker, and so does its exit."""
    import hydra.core.utils
    from hydra._internal.callbacks import Callbacks
    from hydra.core.singleton import Singleton
    from hydra.types import HydraContext

    from hydra_plugins.litscale_plugins import ray_launcher

    monkeypatch.setattr(ray_launcher, "leave_rays_process_group", lambda: None)
    monkeypatch.setattr(hydra.core.utils, "configure_log", lambda *args, **kwargs: None)
    monkeypatch.setenv("RANK", "0")
    config = compose_full([f"hydra.sweep.dir={tmp_path}"])
    OmegaConf.set_struct(config, False)
    config.hydra.job.num = 0
    seen = []

    def job(task_config):
        seen.append(task_config)
        return 1.5

    def payload(task_function):
        context = HydraContext(config_loader=None, callbacks=Callbacks())
        return {"job": (context, task_function, config.copy(), Singleton.get_state(), str(tmp_path))}

    ray_launcher.run_rank(payload(job))
    assert len(seen) == 1 and "hydra" not in seen[0] and (tmp_path / "0" / ".hydra" / "config.yaml").is_file()

    def failing(_):
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        ray_launcher.run_rank(payload(failing))

    def exiting(_):
        raise SystemExit(2)  # train.py's task function after printing its error line

    with pytest.raises(SystemExit):
        ray_launcher.run_rank(payload(exiting))


class WorkerGroupFailed(Exception):
    def __init__(self, worker_failures):
        super().__init__("Training failed")
        self.worker_failures = worker_failures


def test_the_driver_names_a_silent_workers_death_and_points_to_the_ranks_own_lines(capsys):
    from hydra_plugins.litscale_plugins.ray_launcher import reported

    died = WorkerGroupFailed({0: SystemExit(1), 1: ConnectionError("worker process died\nmore")})
    assert str(reported(died, 2)) == "rank 1 failed: ConnectionError: worker process died"
    assert capsys.readouterr().err == "error: rank 1 failed: ConnectionError: worker process died\n"
    exited = WorkerGroupFailed({1: SystemExit(1), 0: SystemExit(1)})
    reported(exited, 2)
    assert capsys.readouterr().err == "error: job 2: rank(s) 0, 1 exited with 1; their lines above say why\n"


def test_a_job_that_cannot_start_at_once_says_what_it_waits_for_and_one_that_never_can_is_refused():
    from hydra_plugins.litscale_plugins.ray_launcher import resources_line

    cluster = ({"CPU": 4.0, "GPU": 0.0}, {"CPU": 1.0})
    assert resources_line(0, 1, {"CPU": 1.0}, cluster) is None  # starts now
    assert resources_line(2, 2, {"CPU": 2.0}, cluster) == (
        "litscale: job 2 waits for Ray: its 2 workers need 2 CPUs (1 of 4 free now)")
    assert resources_line(3, 8, {"CPU": 8.0}, cluster) == (
        "error: job 3 needs 8 CPUs for its 8 Ray workers, the cluster has 4; allowed: fewer trainer.devices x "
        "trainer.num_nodes, a smaller hydra.launcher.cpus_per_worker, or a larger cluster")
    assert resources_line(4, 2, {"CPU": 2.0, "GPU": 2.0}, cluster).startswith("error: job 4 needs 2 GPUs")


@pytest.mark.slow  # over half a second alone
def test_a_ray_restart_names_the_rank_the_restart_and_the_checkpoint_it_resumes_from(tmp_path, capsys):
    """Ray's controller hands ``after_exception`` the failed workers' errors before it restarts
    them (``max_failures``): one line per restart names the rank whose worker died (not the peer
    that only lost it), the restart's number and the checkpoint ``ckpt_path=here`` resumes from;
    none once the restarts are spent (the driver's ``error:`` line then), none for a preemption
    (Ray's own budget)."""
    from ray.exceptions import ActorDiedError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    from hydra_plugins.litscale_plugins._ray_restarts import RayRestartReport

    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    torch.save({"global_step": 4}, checkpoints / "step000004.ckpt")
    torch.save({"global_step": 8}, checkpoints / "last.ckpt")
    died = WorkerHealthCheckFailedError("Worker health check failed.", ActorDiedError())
    lost_peer = RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:4242")
    report = RayRestartReport(number=3, max_failures=2, run_dir=str(tmp_path), ckpt_path="here")
    report.after_exception(None, {0: lost_peer, 1: died})
    report.after_exception(None, {0: ValueError("bad batch\nat step 9"), 1: lost_peer})
    report.after_exception(None, {1: died})  # the third: past max_failures=2
    assert capsys.readouterr().out.splitlines() == [
        "litscale: job 3: rank 1's Ray worker died; Ray restarts the job's workers (restart 1 of "
        f"hydra.launcher.max_failures=2), resuming from {checkpoints / 'last.ckpt'} (step 8)",
        "litscale: job 3: rank 0 failed (ValueError: bad batch); Ray restarts the job's workers (restart 2 of "
        f"hydra.launcher.max_failures=2), resuming from {checkpoints / 'last.ckpt'} (step 8)"]

    preempted = ActorDiedError()
    preempted._preempted = True  # as Ray sets it from the node's death cause (no public setter)
    fresh = RayRestartReport(number=0, max_failures=1, run_dir=str(tmp_path / "empty"), ckpt_path="here")
    fresh.after_exception(None, {1: WorkerHealthCheckFailedError("Worker health check failed.", preempted)})
    assert capsys.readouterr().out == "" and fresh.failures == 0
    fresh.after_exception(None, {0: died, 1: died})
    assert capsys.readouterr().out == (
        "litscale: job 0: the Ray workers of ranks 0, 1 died; Ray restarts the job's workers (restart 1 of "
        f"hydra.launcher.max_failures=1), starting again from step 0 (no complete checkpoint in {tmp_path / 'empty'} "
        "yet)\n")
