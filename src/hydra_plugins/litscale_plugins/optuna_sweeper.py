"""Optuna search over litscale jobs (``-m hydra/sweeper=optuna``), each trial a whole job.

Why not Hydra's Optuna sweeper (hydra-optuna-sweeper 1.3): it requires optuna < 3, has no
pruning, and runs trials in blocking batches. Why not sampling inside the job, as
lightning-hydra-template's Optuna search does: every rank of a DDP job would draw its own
values. Here the sweeper asks the study for a trial, passes its values to the launcher as
overrides (so every rank of the job, on any launcher, trains with the same ones), reads the
objective from the job's ``summary.json`` and tells the study. With pruning on, the job
carries ``litscale.callbacks.optuna_pruning.OptunaPruning`` (rank 0 reports each validation
loss through the study's storage; the decision is broadcast so all ranks stop together).

Trials start as launcher slots free (``n_jobs`` at a time, each asked when it starts), not in
batches. The study lives in SQLite in the sweep dir: run the same command again with
``hydra.sweep.dir=<that dir>`` after a kill and it goes on; a trial that was running when
the sweep died is marked failed and run again with the same values.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf, open_dict

from hydra_plugins.litscale_plugins.optuna_space import parse, split

# A trial that was running when its sweep died: failed, and retried with the same values.
INTERRUPTED = "interrupted"
PRUNING_CALLBACK = "litscale.callbacks.optuna_pruning.OptunaPruning"


class OptunaSweeper(Sweeper):
    """Ask-and-tell Optuna search; see the module docstring."""

    def __init__(
        self,
        *,
        n_trials: int,
        n_jobs: int = 1,
        objective: str | list[str] = "val/loss",
        direction: str | list[str] = "minimize",
        study_name: str = "litscale",
        storage: str | None = None,
        sampler: Any = None,
        pruner: Any = None,
        params: dict[str, str] | None = None,
        plan: str = "none",
    ) -> None:
        self.n_trials, self.n_jobs = n_trials, n_jobs
        self.objectives = [objective] if isinstance(objective, str) else list(objective)
        self.directions = [direction] if isinstance(direction, str) else list(direction)
        self.study_name, self.storage = study_name, storage
        self.sampler, self.pruner = sampler, pruner
        self.params = dict(params or {})
        self.plan = plan
        self._lock = threading.Lock()

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )
        self.sweep_dir = Path(str(config.hydra.sweep.dir))
        # The pruner as configured, for the trials' callback (the study's storage does not keep it).
        pruner = config.hydra.sweeper.get("pruner")
        self.pruner_spec = None if pruner is None else OmegaConf.to_container(pruner, resolve=True)

    def sweep(self, arguments: list[str]) -> list[JobReturn]:
        self._check()
        given = {
            o.get_key_element(): o.input_line for o in parse(arguments)
        }  # the command line wins
        space, fixed = split(
            parse(
                [*(f"{k}={v}" for k, v in self.params.items() if k not in given), *given.values()]
            )
        )
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        study = self._study()
        retried = retry_interrupted(study)
        remaining = max(0, self.n_trials - len(finished_trials(study)))
        print(
            f"litscale: study {self.study_name!r} in {self.storage_url()}: "
            f"{len(finished_trials(study))} trial(s) done, {remaining} to run"
            + (f" ({retried} interrupted, run again)" if retried else ""),
            flush=True,
        )
        if self.n_jobs == 1:  # in the main thread: litscale's own launcher handles signals there
            returns = [self._run_trial(study, space, fixed) for _ in range(remaining)]
        else:
            with ThreadPoolExecutor(max_workers=self.n_jobs) as pool:
                returns = list(
                    pool.map(lambda _: self._run_trial(study, space, fixed), range(remaining))
                )
        self._report_best(study)
        return returns

    def _check(self) -> None:
        from hydra._internal.core_plugins.basic_launcher import BasicLauncher

        from litscale.app.preflight import fail

        if len(self.objectives) != len(self.directions):
            fail(
                f"hydra.sweeper.objective has {len(self.objectives)} metric(s) but "
                f"hydra.sweeper.direction has {len(self.directions)}: give one direction per metric"
            )
        if self.plan not in ("none", "auto"):
            fail(f"hydra.sweeper.plan={self.plan} is not an option; allowed: none, auto")
        if self.n_jobs > 1 and isinstance(self.launcher, BasicLauncher):
            fail(
                f"hydra.sweeper.n_jobs={self.n_jobs} needs a launcher that runs jobs apart "
                "(hydra/launcher=ray or slurm_local); the basic launcher runs one job at a time"
            )

    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{(self.sweep_dir / 'optuna.db').resolve()}"

    def _study(self):
        import optuna

        study = optuna.create_study(
            storage=self.storage_url(),
            study_name=self.study_name,
            load_if_exists=True,
            directions=self.directions,
            sampler=self.sampler,
            pruner=self.pruner,
        )
        if study.trials and self.sampler is not None:
            # A resumed study: the sampler, seeded as in the first run, would propose that run's
            # values again (its random start-up trials, re-run one for one).
            study.sampler.reseed_rng()
        return study

    def _run_trial(self, study: Any, space: dict[str, Any], fixed: list[str]) -> JobReturn | None:
        with self._lock:
            trial = study.ask(space)
        sampled = [
            f"{key}={value!r}" if isinstance(value, float) else f"{key}={value}"
            for key, value in trial.params.items()
        ]
        try:
            job = self._planned(trial, fixed + sampled)
            (result,) = self.launcher.launch(
                [job + self._pruning(trial)], initial_job_idx=trial.number
            )
        except SystemExit:  # the job printed its error line; the search goes on
            result = None
        with self._lock:
            self._tell(study, trial, result, sampled)
        return result

    def _planned(self, trial: Any, overrides: list[str]) -> list[str]:
        """The trial's overrides, with the layout litscale's planner picks for the trial's own
        model where ``plan=auto`` (its strategy, devices, nodes and batch split replaced)."""
        if self.plan != "auto":
            return overrides
        from litscale.app.experiment_file import PLAN_KEYS, without
        from litscale.app.plan import pick_layout
        from litscale.app.preflight import fail
        from litscale.errors import ConfigError

        with self._lock:  # one trial's planning at a time: each may time the model on this machine
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
            choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if isinstance(v, str)}
            with open_dict(cfg):
                del cfg.hydra  # as the job's own config is: Hydra's node is not the run's
            try:
                picked, line = pick_layout(cfg, choices)
            except ConfigError as error:
                fail(str(error))  # as the job would: its error line, and the trial fails
        trial.set_user_attr("plan", picked)
        print(f"litscale: trial {trial.number}: {line}" + (f": {' '.join(picked)}" if picked else ""),
              flush=True)
        return [*without(overrides, PLAN_KEYS), *picked] if picked else overrides

    def _pruning(self, trial: Any) -> list[str]:
        """The overrides that attach the pruning callback (single objective, a pruner set)."""
        if self.pruner_spec is None or len(self.objectives) != 1:
            return []
        key = "+callbacks.optuna_pruning"
        return [
            f"{key}._target_={PRUNING_CALLBACK}",
            f"{key}.storage='{self.storage_url()}'",
            f"{key}.pruner='{json.dumps(self.pruner_spec)}'",
            f"{key}.study_name='{self.study_name}'",
            f"{key}.trial_id={trial._trial_id}",
            f"{key}.monitor='{self.objectives[0]}'",
        ]

    def _tell(self, study: Any, trial: Any, result: JobReturn | None, sampled: list[str]) -> None:
        from optuna.trial import TrialState

        from litscale.callbacks.optuna_pruning import PRUNED_AT_STEP

        values = (
            objective_values(job_dir(result, self.sweep_dir, trial.number), self.objectives)
            if result is not None and result.status == JobStatus.COMPLETED
            else None
        )
        pruned_at = study._storage.get_trial(trial._trial_id).user_attrs.get(PRUNED_AT_STEP)
        if pruned_at is not None:
            study.tell(trial, state=TrialState.PRUNED)
            outcome = f"pruned at step {pruned_at}"
        elif values is None:
            study.tell(trial, state=TrialState.FAIL)
            outcome = "failed"
        else:
            study.tell(trial, values)
            outcome = ", ".join(
                f"{k} {v:.6g}" for k, v in zip(self.objectives, values, strict=True)
            )
        print(f"litscale: trial {trial.number} ({' '.join(sampled)}): {outcome}", flush=True)

    def _report_best(self, study: Any) -> None:
        from optuna.trial import TrialState

        if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            print(f"litscale: no trial of study {self.study_name!r} completed", flush=True)
            return
        best = [study.best_trial] if len(self.objectives) == 1 else study.best_trials
        results = {
            "name": self.study_name,
            "storage": self.storage_url(),
            "best": [
                {
                    "trial": t.number,
                    "params": t.params,
                    "values": dict(zip(self.objectives, t.values, strict=True)),
                }
                for t in best
            ],
        }
        OmegaConf.save(OmegaConf.create(results), self.sweep_dir / "optimization_results.yaml")
        for entry in results["best"]:
            values = ", ".join(f"{k} {v:.6g}" for k, v in entry["values"].items())
            params = " ".join(f"{k}={v}" for k, v in entry["params"].items())
            print(
                f"litscale: best trial {entry['trial']}: {values} ({params}); "
                f"run dir {self.sweep_dir / str(entry['trial'])}",
                flush=True,
            )


def finished_trials(study: Any) -> list[Any]:
    """Trials that count toward ``n_trials``: completed, pruned, or failed by themselves."""
    from optuna.trial import TrialState

    return [
        t
        for t in study.get_trials(deepcopy=False)
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
        or (t.state == TrialState.FAIL and not t.user_attrs.get(INTERRUPTED))
    ]


def retry_interrupted(study: Any) -> int:
    """Mark the trials left running by a killed sweep failed, and queue their values again."""
    from optuna.trial import TrialState

    stale = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    for trial in stale:
        study._storage.set_trial_user_attr(trial._trial_id, INTERRUPTED, True)
        study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})
    return len(stale)


def job_dir(result: JobReturn, sweep_dir: Path, number: int) -> Path:
    """Where a job wrote its ``summary.json``."""
    try:
        return Path(result.hydra_cfg.hydra.runtime.output_dir)
    except AttributeError:  # a launcher that hands back no Hydra config: the default subdir
        return sweep_dir / str(number)


def objective_values(run_dir: Path, objectives: list[str]) -> list[float] | None:
    """The objective metrics from a job's ``summary.json``; None where any is missing."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    values = [summary.get(name) for name in objectives]
    return None if any(v is None for v in values) else [float(v) for v in values]
