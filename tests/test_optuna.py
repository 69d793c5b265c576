"""``-m hydra/sweeper=optuna``: the search space in Hydra's syntax, a killed sweep's trials run
again (a live sweep's are left to it), a trial without its objective says why, a study that
could not measure it is refused or validates at the end, the storage URL reaches the jobs only
through the environment, and (full) a 6-trial study of 2-rank jobs killed and resumed, a pruned
trial's ranks stopping together, the best trial printed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers.cli import REPO, cli_env, explain
from helpers.configs import compose_full, compose_job, described, group_options
from omegaconf import OmegaConf

optuna = pytest.importorskip("optuna")

from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

from hydra_plugins.litscale_plugins.optuna_space import parse, split  # noqa: E402
from hydra_plugins.litscale_plugins.optuna_study import (  # noqa: E402
    RETRY_OF,
    NoObjective,
    counted,
    objective_values,
    validation_overrides,
)
from litscale.app.checks.validation import validate  # noqa: E402
from litscale.errors import ConfigError  # noqa: E402


def test_search_space_in_hydra_sweep_syntax():
    space, fixed = split(
        parse(
            [
                "optimizer.lr=tag(log, interval(1e-4, 1e-2))",
                "data.batch_size=choice(4, 8)",
                "trainer.devices=range(1, 5)",
                "model.dropout=interval(0.0, 0.2)",
                "strategy=ddp",
            ]
        )
    )
    assert space == {
        "optimizer.lr": FloatDistribution(1e-4, 1e-2, log=True),
        "data.batch_size": CategoricalDistribution([4, 8]),
        "trainer.devices": IntDistribution(1, 4, step=1),  # range's stop is excluded, as in Hydra
        "model.dropout": FloatDistribution(0.0, 0.2),
    }
    assert fixed == ["strategy=ddp"]


def sweeper_on(sweep_dir, **options):
    """An Optuna sweeper on the study in ``sweep_dir``, as ``setup`` would leave it."""
    from hydra_plugins.litscale_plugins.optuna_sweeper import OptunaSweeper

    made = OptunaSweeper(n_trials=options.pop("n_trials", 4), **options)
    made.sweep_dir = sweep_dir
    made.pruner_spec = None
    return made


def stop_beating(study, trial, database, seconds_ago: int) -> None:
    """Make ``trial``'s last heartbeat ``seconds_ago`` old (its sweep killed that long ago)."""
    import sqlite3

    study._storage.record_heartbeat(trial._trial_id)
    with sqlite3.connect(database) as db:
        db.execute(
            "UPDATE trial_heartbeats SET heartbeat = datetime('now', ?) WHERE trial_id = ?",
            (f"-{seconds_ago} seconds", trial._trial_id),
        )


@pytest.mark.slow
def test_a_killed_sweeps_trial_runs_again_and_a_live_sweeps_trial_is_left_to_it(tmp_path, capsys):
    """A second sweeper on the same study: the trial whose sweep stopped beating is failed and
    its values queued again; the trial a live sweep is running (it beats) stays running."""
    space = {"x": FloatDistribution(0, 1)}
    first = sweeper_on(tmp_path, heartbeat_interval=30)._study()
    done = first.ask(space)
    first.tell(done, 0.5)
    killed, live = first.ask(space), first.ask(space)
    stop_beating(first, killed, tmp_path / "optuna.db", seconds_ago=120)  # past the grace period (2 x 30 s)
    first._storage.record_heartbeat(live._trial_id)

    second = sweeper_on(tmp_path, heartbeat_interval=30)
    study = second._study()
    second._report_start(study)
    assert capsys.readouterr().out == (
        f"litscale: trial {killed.number} stopped beating (its sweep was stopped); its values are "
        "queued again\n"
        f"litscale: study 'litscale' in sqlite:///{tmp_path / 'optuna.db'}: 1 trial(s) done, "
        "2 to run, 1 running in another sweep\n"
    )
    assert study.trials[killed.number].state == TrialState.FAIL
    assert study.trials[live.number].state == TrialState.RUNNING  # the live sweep's, untouched
    assert [t.number for t in counted(study.trials)] == [done.number]  # the killed one: not counted
    again = study.ask(space)
    assert again.params == killed.params and again.user_attrs[RETRY_OF] == killed.number


def test_the_storage_url_reaches_the_jobs_only_through_the_environment(tmp_path):
    """The pruning callback's overrides (saved in the run dir, logged as hparams) hold no URL:
    a database URL can hold a password. The printed and saved URL hides it."""
    from hydra_plugins.litscale_plugins.optuna_study import shown

    sweeper = sweeper_on(tmp_path, storage="postgresql://litscale:s3cret@db.example:5432/studies")
    sweeper.pruner_spec = {"_target_": "optuna.pruners.MedianPruner"}
    study = optuna.create_study()
    overrides = sweeper._pruning(study.ask())
    assert [o.split("=")[0] for o in overrides] == [
        f"+callbacks.optuna_pruning.{key}"
        for key in ("_target_", "pruner", "study_name", "trial_id", "monitor")
    ]
    assert not any("s3cret" in o or "postgresql" in o for o in overrides)
    assert shown(sweeper.storage_url()) == "postgresql://litscale:***@db.example:5432/studies"


def test_the_pruning_callback_is_refused_where_the_storage_is_not_reachable(tmp_path, monkeypatch):
    import socket

    from litscale.callbacks.optuna_pruning import STORAGE_ENV, OptunaPruning

    callback = OptunaPruning(study_name="litscale", trial_id=0, pruner='{"_target_": "optuna.pruners.NopPruner"}')
    allowed = ("allowed: a storage every node reaches (hydra.sweeper.storage=<database URL>, or a sweep "
               "dir on a shared filesystem), or hydra.sweeper.pruner=null")
    monkeypatch.delenv(STORAGE_ENV, raising=False)
    with pytest.raises(ConfigError) as info:
        callback._the_trial()
    assert str(info.value) == (f"callbacks.optuna_pruning: study 'litscale' cannot be reached from "
                               f"{socket.gethostname()} (LITSCALE_OPTUNA_STORAGE is not set); {allowed}")
    missing = tmp_path / "elsewhere" / "optuna.db"  # the sweep dir of another machine
    monkeypatch.setenv(STORAGE_ENV, f"sqlite:///{missing}")
    with pytest.raises(ConfigError) as info:
        callback._the_trial()
    assert str(info.value) == (f"callbacks.optuna_pruning: study 'litscale' cannot be reached from "
                               f"{socket.gethostname()} (no file {missing}); {allowed}")
    assert not missing.parent.exists()  # nothing created on the node

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'optuna.db'}", study_name="litscale")
    trial = study.ask()
    monkeypatch.setenv(STORAGE_ENV, f"sqlite:///{tmp_path / 'optuna.db'}")
    reached = OptunaPruning(study_name="litscale", trial_id=trial._trial_id,
                            pruner='{"_target_": "optuna.pruners.NopPruner"}')
    assert reached._the_trial().number == trial.number


def test_objective_read_from_the_jobs_summary(tmp_path):
    (tmp_path / "summary.json").write_text(
        json.dumps({"val/loss": 2.5, "perf/tokens_per_sec": 900})
    )
    assert objective_values(tmp_path, ["val/loss", "perf/tokens_per_sec"]) == [2.5, 900.0]
    # NOTE: by name, not class: Hydra's plugin scan executes the plugin modules again.
    with pytest.raises(Exception, match=f"^{tmp_path / 'summary.json'} has no val/bpb$") as info:
        objective_values(tmp_path, ["val/bpb"])  # a failed trial, not a crash
    assert info.typename == NoObjective.__name__
    with pytest.raises(Exception, match=f"^no summary.json in {tmp_path / 'missing'}$") as info:
        objective_values(tmp_path / "missing", ["val/loss"])
    assert info.typename == NoObjective.__name__


def test_a_trial_without_its_objective_says_why(tmp_path, capsys):
    """A job that ran but never validated (no ``val/loss`` in its summary): its line says so."""
    from hydra.core.utils import JobReturn, JobStatus

    run_dir = tmp_path / "0"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"train/loss": 5.1, "steps": 10}))
    result = JobReturn(hydra_cfg=OmegaConf.create({"hydra": {"runtime": {"output_dir": str(run_dir)}}}),
                       status=JobStatus.COMPLETED)
    sweeper = sweeper_on(tmp_path)
    study = optuna.create_study()
    trial = study.ask({"optimizer.lr": CategoricalDistribution([1e-3])})
    sweeper._tell(study, trial, result, None, ["optimizer.lr=0.001"])
    assert capsys.readouterr().out == (
        f"litscale: trial 0 (optimizer.lr=0.001): failed: {run_dir / 'summary.json'} has no val/loss\n"
    )
    failed = JobReturn(hydra_cfg=result.hydra_cfg, status=JobStatus.FAILED)
    failed._return_value = RuntimeError("rank 1 failed: ValueError: boom\ntraceback...")
    trial = study.ask({"optimizer.lr": CategoricalDistribution([1e-3])})
    sweeper._tell(study, trial, failed, None, ["optimizer.lr=0.001"])
    assert capsys.readouterr().out == ("litscale: trial 1 (optimizer.lr=0.001): failed: the job failed: "
                                       "RuntimeError: rank 1 failed: ValueError: boom\n")


def test_a_launchers_record_without_a_run_dir_reads_the_default_subdir(tmp_path):
    """A launcher whose record still has Hydra's ``???`` for the run dir: the sweeper reads the
    job's default subdir instead of dying (MissingMandatoryValue) after the first trial."""
    from hydra.core.utils import JobReturn

    from hydra_plugins.litscale_plugins.optuna_study import job_dir

    unset = JobReturn(hydra_cfg=OmegaConf.create({"hydra": {"runtime": {"output_dir": "???"}}}))
    assert job_dir(unset, tmp_path, 3) == tmp_path / "3"
    assert job_dir(JobReturn(), tmp_path, 3) == tmp_path / "3"


@pytest.mark.slow
def test_a_run_ending_before_its_first_validation_validates_at_its_last_step():
    trainer = compose_full(["trainer.max_steps=10"]).trainer  # val_check_interval 100
    assert validation_overrides(trainer, ["val/loss"]) == ["trainer.val_check_interval=10"]
    assert validation_overrides(trainer, ["perf/tokens_per_sec"]) == []  # no validation needed
    assert validation_overrides(compose_full(["trainer.max_steps=200"]).trainer, ["val/loss"]) == []
    epochs = compose_full(["trainer.max_steps=10", "trainer.check_val_every_n_epoch=1"]).trainer
    assert validation_overrides(epochs, ["val/loss"]) == []  # each epoch's end: not known here


def test_a_study_whose_trials_validate_on_no_batch_is_refused():
    trainer = compose_full(["trainer.limit_val_batches=0"]).trainer
    with pytest.raises(ConfigError) as info:
        validation_overrides(trainer, ["val/loss"])
    assert str(info.value) == (
        "hydra.sweeper.objective=val/loss is measured by validation, which "
        "trainer.limit_val_batches=0 turns off; allowed: trainer.limit_val_batches above 0 "
        "(a count of batches, or a fraction up to 1.0)"
    )


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_study_is_refused_in_one_line_before_its_first_trial(tmp_path):
    completed = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=4",
         "strategy=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=10",
         "trainer.limit_val_batches=0", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        cwd=REPO, env=cli_env(tmp_path), capture_output=True, text=True, timeout=240)
    assert completed.returncode == 2, explain(completed)
    assert completed.stderr.splitlines()[-1] == (
        "error: hydra.sweeper.objective=val/loss is measured by validation, which "
        "trainer.limit_val_batches=0 turns off; allowed: trainer.limit_val_batches above 0 "
        "(a count of batches, or a fraction up to 1.0)"), explain(completed)
    assert "litscale: trial" not in completed.stdout and not list(tmp_path.glob("sweep/*/summary.json"))


# --- a 6-trial study of 2-rank jobs, killed and resumed ------------------------------------------

TRIAL = (
    "strategy=ddp",
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "trainer.max_steps=4",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=2",
    "trainer.num_sanity_val_steps=0",
    "data.seq_len=32",
    "data.max_bytes=400000",
    "trainer.enable_progress_bar=false",
    "callbacks=none",
    "logger=none",
)
# Two learning rates: at step 2 the smaller one's validation loss is still above the threshold
# (it barely moves from the initial 5.59), so those trials are pruned there, on both ranks.
SEARCH = (
    "hydra/sweeper=optuna",
    "hydra.sweeper.n_trials=6",
    "optimizer.lr=choice(1e-5,3e-3)",
    "hydra.sweeper.pruner._target_=optuna.pruners.ThresholdPruner",
    "+hydra.sweeper.pruner.upper=5.5",
    "~hydra.sweeper.pruner.n_startup_trials",
    "~hydra.sweeper.pruner.n_warmup_steps",
    # The killed sweep's trial is seen stopped 2 s after its last beat, not a minute.
    "hydra.sweeper.heartbeat_interval=1",
)


def start_sweep(sweep_dir, outputs):
    return subprocess.Popen(
        [
            sys.executable,
            str(REPO / "train.py"),
            "-m",
            *SEARCH,
            *TRIAL,
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=REPO,
        env=cli_env(outputs),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@pytest.fixture(scope="module")
def resumed_study(tmp_path_factory):
    """The sweep killed (its whole process group) once 2 trials are told, then run again."""
    outputs = tmp_path_factory.mktemp("optuna")
    sweep_dir = outputs / "sweep"
    first = start_sweep(sweep_dir, outputs)
    deadline = time.monotonic() + 400
    # The third summary: two trials told, the third being told or the fourth started. Killed
    # at once: the trial it interrupts has spent little, and runs again on resume.
    while len(list(sweep_dir.glob("*/summary.json"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    os.killpg(first.pid, signal.SIGKILL)
    killed_output = first.communicate()[0]
    second = start_sweep(sweep_dir, outputs)
    output = second.communicate(timeout=600)[0]
    assert second.returncode == 0, explain(
        subprocess.CompletedProcess([], second.returncode, output, "")
    )
    study = optuna.load_study(study_name="litscale", storage=f"sqlite:///{sweep_dir / 'optuna.db'}")
    return study, sweep_dir, killed_output, output


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(1200)
def test_killed_study_resumes_to_six_trials_and_prints_the_best(resumed_study):
    study, sweep_dir, killed_output, output = resumed_study
    assert "to run" in killed_output and "trial(s) done" in output
    finished = counted(study.trials)
    assert len(finished) == 6, [(t.number, t.state) for t in study.trials]
    assert {t.state for t in finished} <= {TrialState.COMPLETE, TrialState.PRUNED}
    best = study.best_trial
    assert best.params == {"optimizer.lr": 3e-3}
    assert f"litscale: best trial {best.number}: val/loss {best.value:.6g}" in output
    summary = json.loads((sweep_dir / str(best.number) / "summary.json").read_text())
    assert summary["val/loss"] == best.value and summary["world_size"] == 2
    assert summary["lr_scaling/base_lr"] == 3e-3


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(1200)
def test_pruned_trials_stop_every_rank_at_the_same_step(resumed_study):
    study, sweep_dir, killed_output, output = resumed_study
    pruned = [t for t in study.trials if t.state == TrialState.PRUNED]
    assert pruned and all(t.params == {"optimizer.lr": 1e-5} for t in pruned)
    for trial in pruned:
        assert trial.user_attrs["pruned_at_step"] == 2 and list(trial.intermediate_values) == [2]
        summary = json.loads((sweep_dir / str(trial.number) / "summary.json").read_text())
        # Stopped after the validation at step 2; the job ended cleanly.
        assert summary["steps"] == 2
        assert f"litscale: trial {trial.number} pruned at step 2" in killed_output + output
    assert "error:" not in output and "terminate called" not in output


def test_the_trials_pruner_is_built_from_the_sweepers_config():
    from litscale.callbacks.optuna_pruning import build_pruner

    pruner = build_pruner(
        {
            "_target_": "optuna.pruners.PatientPruner",
            "patience": 2,
            "wrapped_pruner": {"_target_": "optuna.pruners.ThresholdPruner", "upper": 5.5},
        }
    )
    assert isinstance(pruner, optuna.pruners.PatientPruner) and pruner._patience == 2
    assert (
        isinstance(pruner._wrapped_pruner, optuna.pruners.ThresholdPruner)
        and pruner._wrapped_pruner._upper == 5.5
    )
    with pytest.raises(ValueError, match="an optuna.pruners class is expected"):
        build_pruner({"_target_": "os.system", "command": "true"})


@pytest.mark.slow
@pytest.mark.parametrize("option", group_options("sweeps"))
def test_each_example_search_composes_and_its_trials_validate(option, tmp_path, outputs_root):
    full = compose_full(["hydra/sweeper=optuna", f"+sweeps={option}", "trainer.accelerator=cpu"])
    sweeper = full.hydra.sweeper
    assert sweeper._target_.endswith("OptunaSweeper") and len(sweeper.params) >= 2
    space, fixed = split(parse([f"{k}={v}" for k, v in sweeper.params.items()]))
    assert len(space) >= 2
    first = [f"{k}={d.choices[0]}" for k, d in space.items() if hasattr(d, "choices")]
    cfg, choices = compose_job(
        [f"+sweeps={option}", "trainer.accelerator=cpu", *fixed, *first], tmp_path / "run"
    )
    validate(cfg, choices=choices)  # a trial's job with the first of each choice


# --- hydra.sweeper.plan=auto: the planner picks each trial's layout before it is launched --------

# A made-up calibration of this machine (``cluster=local_cpu``): 2 cores, and a matmul peak so low
# that no plan's forward-backward is timed (FLOPs alone predict): planning costs no profile.
SLOW_CPU = {"cores": 2, "peak_flops": {"float32": 1e6, "bfloat16": 2e6}, "bandwidth_bytes_s": 1e9,
            "latency_s": 1e-4, "measured": "test"}


def calibrated(cache, fraction_of_given: float) -> None:
    """Write ``SLOW_CPU`` into ``cache`` with device memory ``fraction_of_given`` of what the
    trial's given layout (``TRIAL``: DDP, 2 ranks, micro batch 16) is predicted to need."""
    from litscale.app.build import build
    from litscale.app.plan import ranking as plan_module
    from litscale.planner.cost import predict

    (cache / "cluster_local_cpu.json").write_text(json.dumps({**SLOW_CPU, "memory_bytes": 2**40}))
    cfg, choices = compose_job([*TRIAL, "cluster=local_cpu"], cache / "job")
    layout = validate(cfg, choices=choices, this_machine=False)
    run = described(cfg, choices, layout)
    need = predict(plan_module.configured_plan(run), plan_module.facts_of(run), build(cfg.cluster)).peak_bytes
    memory = int(need * fraction_of_given) * SLOW_CPU["cores"]
    (cache / "cluster_local_cpu.json").write_text(json.dumps({**SLOW_CPU, "memory_bytes": memory}))


@pytest.mark.full
@pytest.mark.slow  # over a second alone: out of the quick loop
def test_a_trial_keeps_its_layout_unless_it_does_not_fit(tmp_path, monkeypatch, outputs_root):
    """A group ranked below the bar: the trial keeps DDP x 2 at micro batch 16 where it fits, and
    takes the planner's pick (the same global batch) where it would not."""
    from litscale.app.experiment_file import PLAN_KEYS, without
    from litscale.app.plan.ranking import pick_layout
    from litscale.planner import trust

    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("LITSCALE_CACHE", str(cache))
    calibrated(cache, 2.0)
    shipped = trust.load_accuracy()  # the study's recording, GPT-nano's held-out interval put below the bar
    shipped["groups"]["GPT-nano"]["held_out"] = {"date": "2026-12-01", "configurations": 8, "spearman": 0.952,
                                                 "spearman_interval": [0.685, 1.0]}
    monkeypatch.setattr(trust, "load_accuracy", lambda path=trust.ACCURACY_FILE: shipped)
    cfg, choices = compose_job([*TRIAL, "cluster=local_cpu"], tmp_path / "fits")
    assert pick_layout(cfg, choices) == ([], (
        "plan=auto: model group GPT-nano's held-out Spearman is 0.952, 95% interval 0.685 to 1.000 over 8 "
        "configurations it was not developed on: its lower end is below 0.9 (experiments/planner/study.py "
        "--held-out, 2026-12-01): this job keeps its given layout"))

    calibrated(cache, 0.6)
    cfg, choices = compose_job([*TRIAL, "cluster=local_cpu"], tmp_path / "too_big")
    picked, line = pick_layout(cfg, choices)
    assert line.endswith("below 0.9 (experiments/planner/study.py --held-out, 2026-12-01), but the given layout "
                         "does not fit: the planner picks this job's layout")
    assert sorted(o.split("=")[0] for o in picked) == sorted(PLAN_KEYS)
    job = [*without(list(TRIAL), PLAN_KEYS), *picked]
    planned, planned_choices = compose_job(job, tmp_path / "planned")
    layout = validate(planned, choices=planned_choices, this_machine=False)
    assert layout.global_batch == 32 and layout.micro_batch < 16  # the trial's batch, split smaller


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(600)
def test_a_planned_study_trains_each_trial_with_the_layout_picked_for_it(tmp_path):
    """``hydra.sweeper.plan=auto`` with a given layout that would not fit: each trial is
    launched with the planner's layout, trains it, and is scored."""
    cache = tmp_path / "cache"
    cache.mkdir()
    os.environ["LITSCALE_CACHE"] = str(cache)  # for calibrated(), in this process
    try:
        calibrated(cache, 0.6)
    finally:
        del os.environ["LITSCALE_CACHE"]
    sweep_dir = tmp_path / "sweep"
    completed = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2",
         "hydra.sweeper.plan=auto", "optimizer.lr=choice(1e-3,3e-3)", "hydra.sweeper.pruner=null",
         *TRIAL, "cluster=local_cpu", f"hydra.sweep.dir={sweep_dir}"],
        cwd=REPO, env=cli_env(tmp_path, {"LITSCALE_CACHE": str(cache)}), capture_output=True, text=True,
        timeout=540)
    assert completed.returncode == 0, explain(completed)
    study = optuna.load_study(study_name="litscale", storage=f"sqlite:///{sweep_dir / 'optuna.db'}")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    for trial in study.trials:
        picked = trial.user_attrs["plan"]
        assert picked and f"litscale: trial {trial.number}: plan=auto: " in completed.stdout
        job = OmegaConf.load(sweep_dir / str(trial.number) / ".hydra" / "overrides.yaml")
        assert [o for o in job if o in picked] == picked  # launched with the picked layout
        assert "strategy=ddp" not in job or "strategy=ddp" in picked
        summary = json.loads((sweep_dir / str(trial.number) / "summary.json").read_text())
        assert trial.values == [summary["val/loss"]]
        micro = int(next(o for o in picked if o.startswith("data.batch_size=")).split("=")[1])
        assert summary["micro_batch"] == micro < 16 and summary["global_batch"] == 32


def test_an_unknown_sweeper_plan_is_refused_in_one_line(capsys):
    from hydra_plugins.litscale_plugins.optuna_sweeper import OptunaSweeper

    sweeper = OptunaSweeper(n_trials=1, plan="fastest")
    sweeper.launcher = object()
    with pytest.raises(SystemExit) as info:
        sweeper._check()
    assert info.value.code == 2
    assert capsys.readouterr().err == "error: hydra.sweeper.plan=fastest is not an option; allowed: none, auto\n"


def test_a_resumed_study_samples_new_values_not_the_first_runs_again(tmp_path):
    """The sampler is seeded from the config (``seed``): resumed, it must not propose the first
    run's values again (a killed 6-trial search re-ran its first three learning rates)."""
    from optuna.samplers import TPESampler

    space = {"optimizer.lr": FloatDistribution(1e-4, 3e-3, log=True)}

    first = sweeper_on(tmp_path, sampler=TPESampler(seed=0))._study()
    drawn = [first.ask(space) for _ in range(2)]
    for trial in drawn:
        first.tell(trial, 1.0)
    resumed = sweeper_on(tmp_path, sampler=TPESampler(seed=0))._study()
    again = [resumed.ask(space).params for _ in range(2)]
    assert all(params not in [t.params for t in drawn] for params in again)
