"""The study side of litscale's Optuna sweeper: its storage (with heartbeats), which trials
count, a trial's objective read from its job's ``summary.json`` (or why there is none), and
the trainer settings a validation objective needs.

``optuna`` is imported inside the functions (Hydra imports this module when it scans plugins).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from omegaconf import DictConfig, OmegaConf

from hydra_plugins.litscale_plugins.jobs import described
from litscale.errors import ConfigError

# The user attribute of a trial queued again because its sweep stopped beating: the number of
# the trial it repeats (that one, failed, does not count toward n_trials).
RETRY_OF = "retry_of"
# The user attribute that records where a trial's job wrote its summary.
RUN_DIR = "run_dir"
# A SQLite writer waits this long for another (the sweeper's threads, the heartbeats, the
# trials' pruning callbacks) instead of failing with "database is locked".
SQLITE_TIMEOUT_S = 60


class NoObjective(Exception):
    """Why a trial has no objective value, in one line."""


def storage(url: str, *, heartbeat_interval: int, grace_period: int | None) -> Any:
    """The study's storage, where each running trial beats every ``heartbeat_interval`` s; a
    trial silent for ``grace_period`` s (None: twice the interval) is failed and its values
    queued again by whichever sweeper looks next (``fail_stale_trials``)."""
    from optuna.exceptions import ExperimentalWarning
    from optuna.storages import RDBStorage

    # NOTE: Optuna warns that heartbeats are for ``optimize`` (on every ask) and are experimental;
    # ask-and-tell runs the heartbeat itself (``heartbeat``), so neither is news to a user.
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
    warnings.filterwarnings("ignore", category=ExperimentalWarning, message=".*heartbeat")
    return RDBStorage(
        url,
        engine_kwargs={"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
        if url.startswith("sqlite:")
        else None,
        heartbeat_interval=heartbeat_interval,
        grace_period=grace_period,
        heartbeat_stale_trial_callback=queue_again,
    )


def queue_again(study: Any, trial: Any) -> None:
    """A trial whose sweep stopped beating (killed): run its values again."""
    study.enqueue_trial(trial.params, user_attrs={RETRY_OF: trial.number})
    print(f"litscale: trial {trial.number} stopped beating (its sweep was stopped); "
          "its values are queued again", flush=True)


def heartbeat(study: Any, trial: Any) -> Any:
    """A context in which ``trial`` beats (Optuna's own heartbeat thread, as ``optimize`` runs
    it; ask-and-tell has to run it itself)."""
    from optuna.storages._heartbeat import get_heartbeat_thread

    return get_heartbeat_thread(trial._trial_id, study._storage)


def counted(trials: list[Any]) -> list[Any]:
    """Trials that count toward ``n_trials``: completed, pruned, or failed by themselves (not
    a trial that stopped beating, whose values run again)."""
    from optuna.trial import TrialState

    repeated = {t.user_attrs.get(RETRY_OF) for t in trials} - {None}
    return [
        t
        for t in trials
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
        or (t.state == TrialState.FAIL and t.number not in repeated)
    ]


def running(trials: list[Any]) -> list[Any]:
    from optuna.trial import TrialState

    return [t for t in trials if t.state == TrialState.RUNNING]


def shown(url: str) -> str:
    """The storage URL to print or save: its password hidden."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def job_dir(result: JobReturn, sweep_dir: Path, number: int) -> Path:
    """Where a job wrote its ``summary.json``: the run dir its launcher reported, or Hydra's
    default subdir where a launcher reported none."""
    reported = OmegaConf.select(
        result.hydra_cfg or OmegaConf.create(), "hydra.runtime.output_dir", default=None
    )
    return Path(reported) if reported else sweep_dir / str(number)


def objective_values(run_dir: Path, objectives: list[str]) -> list[float]:
    """The objective metrics from a job's ``summary.json``; ``NoObjective`` says which is missing."""
    path = run_dir / "summary.json"
    if not path.is_file():
        raise NoObjective(f"no summary.json in {run_dir}")
    summary = json.loads(path.read_text())
    missing = [name for name in objectives if summary.get(name) is None]
    if missing:
        raise NoObjective(f"{path} has no {', '.join(missing)}")
    return [float(summary[name]) for name in objectives]


def failure(result: JobReturn) -> str | None:
    """Why a launcher's job failed, in one line (None: it completed)."""
    if result.status != JobStatus.FAILED:
        return None
    return f"the job failed: {described(result._return_value)}"


# The trainer settings that decide whether a run validates before it ends.
VALIDATION_KEYS = (
    "trainer.max_steps",
    "trainer.val_check_interval",
    "trainer.check_val_every_n_epoch",
    "trainer.limit_val_batches",
)


def validation_overrides(trainer: DictConfig, objectives: list[str]) -> list[str]:
    """What a trial's trainer needs so that a validation objective (``val/...``) is measured:
    a run that would end at ``max_steps`` before its first validation validates at its last
    step instead. A trainer that validates on no batch is refused (``ConfigError``)."""
    from litscale.app.build import never_validates

    measured = [name for name in objectives if name.startswith("val/")]
    if not measured:
        return []
    limit = trainer.get("limit_val_batches")
    if limit is not None and not isinstance(limit, bool) and float(limit) == 0:
        raise ConfigError(
            f"hydra.sweeper.objective={measured[0]} is measured by validation, which "
            f"trainer.limit_val_batches={limit} turns off; allowed: trainer.limit_val_batches "
            "above 0 (a count of batches, or a fraction up to 1.0)"
        )
    if never_validates(trainer, None):
        return [f"trainer.val_check_interval={int(trainer.max_steps)}"]
    return []
