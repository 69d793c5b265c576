"""``-m hydra/sweeper=optuna``: the search space in Hydra's syntax, a killed sweep's trials run
again, and (full) a 6-trial study of 2-rank jobs killed and resumed, a pruned trial's ranks
stopping together, the best trial printed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers.cli import REPO, cli_env, explain
from helpers.configs import compose_full, compose_job, group_options
from omegaconf import OmegaConf

optuna = pytest.importorskip("optuna")

from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

from hydra_plugins.litscale_plugins.optuna_space import parse, split  # noqa: E402
from hydra_plugins.litscale_plugins.optuna_sweeper import (  # noqa: E402
    INTERRUPTED,
    finished_trials,
    objective_values,
    retry_interrupted,
)
from litscale.app.validation import validate  # noqa: E402


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


def test_a_trial_left_running_by_a_killed_sweep_runs_again_with_its_values():
    study = optuna.create_study()
    done = study.ask({"x": FloatDistribution(0, 1)})
    study.tell(done, 0.5)
    killed = study.ask({"x": FloatDistribution(0, 1)})  # its sweep died before telling
    assert retry_interrupted(study) == 1
    assert study.trials[killed.number].state == TrialState.FAIL
    assert study.trials[killed.number].user_attrs[INTERRUPTED] is True
    # The killed trial does not count toward n_trials.
    assert [t.number for t in finished_trials(study)] == [done.number]
    again = study.ask({"x": FloatDistribution(0, 1)})
    assert again.params == killed.params and again.user_attrs["retry_of"] == killed.number


def test_objective_read_from_the_jobs_summary(tmp_path):
    (tmp_path / "summary.json").write_text(
        json.dumps({"val/loss": 2.5, "perf/tokens_per_sec": 900})
    )
    assert objective_values(tmp_path, ["val/loss", "perf/tokens_per_sec"]) == [2.5, 900.0]
    assert objective_values(tmp_path, ["val/bpb"]) is None  # a failed trial, not a crash
    assert objective_values(tmp_path / "missing", ["val/loss"]) is None


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
@pytest.mark.full
@pytest.mark.timeout(1200)
def test_killed_study_resumes_to_six_trials_and_prints_the_best(resumed_study):
    study, sweep_dir, killed_output, output = resumed_study
    assert "to run" in killed_output and "trial(s) done" in output
    counted = finished_trials(study)
    assert len(counted) == 6, [(t.number, t.state) for t in study.trials]
    assert {t.state for t in counted} <= {TrialState.COMPLETE, TrialState.PRUNED}
    best = study.best_trial
    assert best.params == {"optimizer.lr": 3e-3}
    assert f"litscale: best trial {best.number}: val/loss {best.value:.6g}" in output
    summary = json.loads((sweep_dir / str(best.number) / "summary.json").read_text())
    assert summary["val/loss"] == best.value and summary["world_size"] == 2
    assert summary["lr_scaling/base_lr"] == 3e-3


@pytest.mark.slow
@pytest.mark.full
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
    from litscale.app import plan as plan_module
    from litscale.app.build import build
    from litscale.planner.cost import predict

    (cache / "cluster_local_cpu.json").write_text(json.dumps({**SLOW_CPU, "memory_bytes": 2**40}))
    cfg, choices = compose_job([*TRIAL, "cluster=local_cpu"], cache / "job")
    layout = validate(cfg, choices=choices, this_machine=False)
    facts = plan_module.facts_of(cfg)
    need = predict(plan_module.configured_plan(cfg, choices, layout), facts, build(cfg.cluster)).peak_bytes
    memory = int(need * fraction_of_given) * SLOW_CPU["cores"]
    (cache / "cluster_local_cpu.json").write_text(json.dumps({**SLOW_CPU, "memory_bytes": memory}))


@pytest.mark.slow  # over a second alone: out of the quick loop
def test_a_trial_keeps_its_layout_unless_it_does_not_fit(tmp_path, monkeypatch, outputs_root):
    """GPT-nano's group ranks below the bar: the trial keeps DDP x 2 at micro batch 16 where it
    fits, and takes the planner's pick (the same global batch) where it would not."""
    from litscale.app.experiment_file import PLAN_KEYS, without
    from litscale.app.plan import pick_layout

    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("LITSCALE_CACHE", str(cache))
    calibrated(cache, 2.0)
    cfg, choices = compose_job([*TRIAL, "cluster=local_cpu"], tmp_path / "fits")
    assert pick_layout(cfg, choices) == ([], (
        "plan=auto: model group GPT-nano's held-out Spearman is 0.456, below 0.9 "
        "(experiments/planner/study.py, 2026-11-24): this job keeps its given layout"))

    calibrated(cache, 0.6)
    cfg, choices = compose_job([*TRIAL, "cluster=local_cpu"], tmp_path / "too_big")
    picked, line = pick_layout(cfg, choices)
    assert line.endswith("below 0.9 (experiments/planner/study.py, 2026-11-24), but the given layout does "
                         "not fit: the planner picks this job's layout")
    assert sorted(o.split("=")[0] for o in picked) == sorted(PLAN_KEYS)
    job = [*without(list(TRIAL), PLAN_KEYS), *picked]
    planned, planned_choices = compose_job(job, tmp_path / "planned")
    layout = validate(planned, choices=planned_choices, this_machine=False)
    assert layout.global_batch == 32 and layout.micro_batch < 16  # the trial's batch, split smaller


@pytest.mark.slow
@pytest.mark.full
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

    from hydra_plugins.litscale_plugins.optuna_sweeper import OptunaSweeper

    space = {"optimizer.lr": FloatDistribution(1e-4, 3e-3, log=True)}

    def sweeper() -> OptunaSweeper:
        made = OptunaSweeper(n_trials=4, sampler=TPESampler(seed=0))
        made.sweep_dir = tmp_path
        return made

    first = sweeper()._study()
    drawn = [first.ask(space) for _ in range(2)]
    for trial in drawn:
        first.tell(trial, 1.0)
    resumed = sweeper()._study()
    again = [resumed.ask(space).params for _ in range(2)]
    assert all(params not in [t.params for t in drawn] for params in again)
