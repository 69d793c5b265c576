"""Optuna search over litscale jobs (``-m hydra/sweeper=optuna``), each trial a whole job.

Why not Hydra's Optuna sweeper (hydra-optuna-sweeper 1.3): it requires optuna < 3, has no
pruning, and runs trials in blocking batches. Why not sampling inside the job, as
lightning-hydra-template's Optuna search does: every rank of a DDP job would draw its own
values. Here the sweeper asks the study for a trial, passes its values to the launcher as
overrides (so every rank of the job, on any launcher, trains with the same ones), reads the
objective from the job's ``summary.json`` and tells the study. With pruning on, the job
carries ``litscale.callbacks.optuna_pruning.OptunaPruning`` (rank 0 reports each validation
loss through the study's storage; the decision is broadcast so all ranks stop together). The
storage URL reaches the jobs in ``LITSCALE_OPTUNA_STORAGE``, never in their overrides: it can
hold a password, and overrides are saved in run dirs and logged.

Trials start as launcher slots free (``n_jobs`` at a time, each asked when it starts), not in
batches. The study lives in SQLite in the sweep dir (or at ``storage``): run the same command
again with ``hydra.sweep.dir=<that dir>`` after a kill and it goes on. Each running trial
beats (Optuna's heartbeat); a trial whose sweep stopped beating for ``grace_period`` is failed
and its values run again, while the trials of a sweeper still alive on the same study are left
to it (they count toward ``n_trials``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf

# NOTE: optuna_study.NoObjective is looked up where it is caught: Hydra's plugin scan executes
# the plugin modules again (load_module), which replaces the class a name imported earlier holds.
from hydra_plugins.litscale_plugins import optuna_study
from hydra_plugins.litscale_plugins.jobs import compose_job
from hydra_plugins.litscale_plugins.optuna_space import parse, split
from hydra_plugins.litscale_plugins.optuna_study import counted, running, shown
from litscale.errors import ConfigError
from litscale.extras import OPTUNA

PRUNING_CALLBACK = "litscale.callbacks.optuna_pruning.OptunaPruning"


class OptunaSweeper(Sweeper):
    """Ask-and-tell Optuna search; see the module docstring."""

    requires = (OPTUNA,)  # litscale.extras: checked before the sweep dir exists

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
        heartbeat_interval: int = 30,
        grace_period: int | None = None,
    ) -> None:
        self.n_trials, self.n_jobs = n_trials, n_jobs
        self.objectives = [objective] if isinstance(objective, str) else list(objective)
        self.directions = [direction] if isinstance(direction, str) else list(direction)
        self.study_name, self.storage = study_name, storage
        self.sampler, self.pruner = sampler, pruner
        self.params = dict(params or {})
        self.plan = plan
        self.heartbeat_interval, self.grace_period = heartbeat_interval, grace_period
        self._lock = threading.Lock()
        self._mine: set[int] = set()  # the numbers of the trials this sweeper asked

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
        from litscale.callbacks.optuna_pruning import STORAGE_ENV

        self._check()
        space, fixed = self._space(arguments)
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        # Before the first job: a local Ray cluster's workers take the environment it starts with.
        os.environ[STORAGE_ENV] = self.storage_url()
        fixed = self._measured(fixed, refuse=True)
        self._searched_validation = bool(set(optuna_study.VALIDATION_KEYS) & set(space))
        study = self._study()
        self._report_start(study)
        if self.n_jobs == 1:  # in the main thread: litscale's own launcher handles signals there
            returns = self._run_trials(study, space, fixed)
        else:
            with ThreadPoolExecutor(max_workers=self.n_jobs) as pool:
                slots = [pool.submit(self._run_trials, study, space, fixed) for _ in range(self.n_jobs)]
                returns = [r for slot in slots for r in slot.result()]
        self._report_best(study)
        return returns

    def _space(self, arguments: list[str]) -> tuple[dict[str, Any], list[str]]:
        """The search space and the fixed overrides; the command line wins over ``params``."""
        given = {o.get_key_element(): o.input_line for o in parse(arguments)}
        return split(
            parse(
                [*(f"{k}={v}" for k, v in self.params.items() if k not in given), *given.values()]
            )
        )

    def _report_start(self, study: Any) -> None:
        """Fail the trials of a sweep that stopped beating (their values queued again), then
        say where the study stands."""
        from optuna.storages import fail_stale_trials

        fail_stale_trials(study)
        trials = study.get_trials(deepcopy=False)
        done, others = len(counted(trials)), len(running(trials))
        print(
            f"litscale: study {self.study_name!r} in {shown(self.storage_url())}: "
            f"{done} trial(s) done, {max(0, self.n_trials - done - others)} to run"
            + (f", {others} running in another sweep" if others else ""),
            flush=True,
        )

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
            storage=optuna_study.storage(
                self.storage_url(),
                heartbeat_interval=self.heartbeat_interval,
                grace_period=self.grace_period,
            ),
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

    def _measured(self, overrides: list[str], *, refuse: bool = False) -> list[str]:
        """``overrides`` with what makes their job measure a validation objective (it validates
        at its last step where ``max_steps`` ends it before its first validation). A trainer
        that cannot measure it: with ``refuse``, the sweep stops in one line before any trial;
        otherwise ``NoObjective`` (the trial fails with that line)."""
        from litscale.app.experiment_file import without
        from litscale.app.preflight import fail

        trainer = compose_job(self.hydra_context, self.config, overrides).trainer
        try:
            added = optuna_study.validation_overrides(trainer, self.objectives)
        except ConfigError as error:
            if refuse:
                fail(str(error))
            raise optuna_study.NoObjective(str(error)) from None
        if added and refuse:
            print(
                f"litscale: trainer.max_steps={trainer.max_steps} ends before the first validation "
                f"(trainer.val_check_interval={trainer.val_check_interval}): each trial validates "
                f"at step {trainer.max_steps} to measure {', '.join(self.objectives)}",
                flush=True,
            )
        return [*without(overrides, ("trainer.val_check_interval",)), *added] if added else overrides

    def _run_trials(self, study: Any, space: dict[str, Any], fixed: list[str]) -> list[JobReturn]:
        """One launcher slot: trials, one after another, while the study wants more."""
        returns = []
        while (trial := self._next_trial(study, space)) is not None:
            returns.append(self._run_trial(study, trial, fixed))
        return [r for r in returns if r is not None]

    def _next_trial(self, study: Any, space: dict[str, Any]) -> Any:
        """The next trial to run, or None once every trial of ``n_trials`` is done or running
        here. Trials running in another sweep count: this one waits for them to end, or to
        stop beating (failed, their values queued again, and run here)."""
        from optuna.storages import fail_stale_trials

        while True:
            with self._lock:
                fail_stale_trials(study)
                trials = study.get_trials(deepcopy=False)
                busy = running(trials)
                if len(counted(trials)) + len(busy) < self.n_trials:
                    trial = study.ask(space)
                    self._mine.add(trial.number)
                    return trial
                if all(t.number in self._mine for t in busy):
                    return None
            time.sleep(self.heartbeat_interval)

    def _run_trial(self, study: Any, trial: Any, fixed: list[str]) -> JobReturn | None:
        sampled = [
            f"{key}={value!r}" if isinstance(value, float) else f"{key}={value}"
            for key, value in trial.params.items()
        ]
        result, reason = None, None
        with optuna_study.heartbeat(study, trial):
            try:
                job = self._planned(trial, fixed + sampled)
                if self._searched_validation:
                    job = self._measured(job)
                (result,) = self.launcher.launch(
                    [job + self._pruning(trial)], initial_job_idx=trial.number
                )
            except optuna_study.NoObjective as error:
                reason = str(error)
            except SystemExit as error:  # the job printed its error line; the search goes on
                reason = f"the job exited with {error.code} (its error line above)"
        with self._lock:
            self._tell(study, trial, result, reason, sampled)
        return result

    def _planned(self, trial: Any, overrides: list[str]) -> list[str]:
        """The trial's overrides, with the layout litscale's planner picks for the trial's own
        model where ``plan=auto`` (its strategy, devices, nodes and batch split replaced)."""
        if self.plan != "auto":
            return overrides
        from litscale.app.experiment_file import PLAN_KEYS, without
        from litscale.app.plan.ranking import pick_layout
        from litscale.app.preflight import as_job_config, fail
        from litscale.errors import ConfigError

        with self._lock:  # one trial's planning at a time: each may time the model on this machine
            cfg = compose_job(self.hydra_context, self.config, overrides)
            choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if isinstance(v, str)}
            cfg = as_job_config(cfg)  # as the job's own config is: no Hydra node, a run dir not made yet
            try:
                picked, line = pick_layout(cfg, choices)
            except ConfigError as error:
                fail(str(error))  # as the job would: its error line, and the trial fails
        trial.set_user_attr("plan", picked)
        print(f"litscale: trial {trial.number}: {line}" + (f": {' '.join(picked)}" if picked else ""),
              flush=True)
        return [*without(overrides, PLAN_KEYS), *picked] if picked else overrides

    def _pruning(self, trial: Any) -> list[str]:
        """The overrides that attach the pruning callback (single objective, a pruner set); the
        callback finds the storage in ``LITSCALE_OPTUNA_STORAGE``."""
        if self.pruner_spec is None or len(self.objectives) != 1:
            return []
        key = "+callbacks.optuna_pruning"
        return [
            f"{key}._target_={PRUNING_CALLBACK}",
            f"{key}.pruner='{json.dumps(self.pruner_spec)}'",
            f"{key}.study_name='{self.study_name}'",
            f"{key}.trial_id={trial._trial_id}",
            f"{key}.monitor='{self.objectives[0]}'",
        ]

    def _tell(
        self, study: Any, trial: Any, result: JobReturn | None, reason: str | None, sampled: list[str]
    ) -> None:
        from optuna.trial import TrialState

        from litscale.callbacks.optuna_pruning import PRUNED_AT_STEP

        values = None
        if result is not None:
            run_dir = optuna_study.job_dir(result, self.sweep_dir, trial.number)
            study._storage.set_trial_user_attr(trial._trial_id, optuna_study.RUN_DIR, str(run_dir))
            try:
                reason = optuna_study.failure(result)
                values = None if reason else optuna_study.objective_values(run_dir, self.objectives)
            except optuna_study.NoObjective as error:
                reason = str(error)
        pruned_at = study._storage.get_trial(trial._trial_id).user_attrs.get(PRUNED_AT_STEP)
        if pruned_at is not None:
            study.tell(trial, state=TrialState.PRUNED)
            outcome = f"pruned at step {pruned_at}"
        elif values is None:
            study.tell(trial, state=TrialState.FAIL)
            outcome = f"failed: {reason}"
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
            "storage": shown(self.storage_url()),
            "best": [
                {
                    "trial": t.number,
                    "params": t.params,
                    "values": dict(zip(self.objectives, t.values, strict=True)),
                    "run_dir": t.user_attrs.get(optuna_study.RUN_DIR, str(self.sweep_dir / str(t.number))),
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
                f"run dir {entry['run_dir']}",
                flush=True,
            )
