"""Pruning an Optuna trial that is a multi-process job: rank 0 decides, every rank stops.

Optuna's own Lightning integration asks the pruner on every rank, each with its own view of
the study; ranks that disagree leave some in a collective the others have left. Here rank 0
alone reports the validation metric to the trial (through the study's storage, which the
sweeper reads) and asks the pruner; its decision is broadcast, so every rank stops after the
same validation. The sweeper added this callback to the trial's overrides
(``hydra_plugins.litscale_plugins.optuna_sweeper``); nothing on a rank samples anything.

The study's storage URL comes from the environment (``LITSCALE_OPTUNA_STORAGE``, set by the
sweeper), not from the config: a database URL can hold a password, and the config is saved in
the run dir and logged as hyperparameters.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from litscale.errors import ConfigError

# The trial's user attribute that tells the sweeper the trial was pruned, and at which step.
PRUNED_AT_STEP = "pruned_at_step"
# Where a trial's job finds the study's storage URL.
STORAGE_ENV = "LITSCALE_OPTUNA_STORAGE"


class OptunaPruning(Callback):
    """Report ``monitor`` after each validation to trial ``trial_id`` of ``study_name`` in
    ``storage`` (None: the URL in ``LITSCALE_OPTUNA_STORAGE``); stop every rank when
    ``pruner`` says so.

    ``pruner`` is the sweeper's pruner as JSON (``{"_target_": "optuna.pruners.MedianPruner",
    ...}``): a study's storage keeps its trials but not its pruner."""

    def __init__(
        self,
        *,
        storage: str | None = None,
        study_name: str,
        trial_id: int,
        pruner: str,
        monitor: str = "val/loss",
    ) -> None:
        self.storage = storage
        self.study_name = study_name
        self.trial_id = trial_id
        self.pruner = pruner
        self.monitor = monitor
        self._trial = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Rank 0 opens the trial before training: a node that cannot reach the study's storage
        is refused in one line now, not at its first validation."""
        if trainer.is_global_zero:
            self._the_trial()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        prune = False
        if trainer.is_global_zero and self.monitor in trainer.callback_metrics:
            prune = self._report(float(trainer.callback_metrics[self.monitor]), trainer.global_step)
        if trainer.strategy.broadcast(prune, src=0):
            trainer.should_stop = True

    def _report(self, value: float, step: int) -> bool:
        trial = self._the_trial()
        trial.report(value, step)
        if not trial.should_prune():
            return False
        trial.set_user_attr(PRUNED_AT_STEP, step)
        print(
            f"litscale: trial {trial.number} pruned at step {step} ({self.monitor} {value:.4f}); "
            "every rank stops",
            flush=True,
        )
        return True

    def _the_trial(self):
        if self._trial is None:
            import optuna

            storage = self.storage or os.environ.get(STORAGE_ENV)
            problem = unreachable(storage)
            try:
                study = None if problem else optuna.load_study(
                    study_name=self.study_name,
                    storage=storage,
                    pruner=build_pruner(json.loads(self.pruner)),
                )
            except Exception as error:  # noqa: BLE001 - the storage's driver's many errors
                problem = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
            if problem:
                raise ConfigError(
                    f"callbacks.optuna_pruning: study {self.study_name!r} cannot be reached from "
                    f"{socket.gethostname()} ({problem}); allowed: a storage every node reaches "
                    "(hydra.sweeper.storage=<database URL>, or a sweep dir on a shared "
                    "filesystem), or hydra.sweeper.pruner=null"
                )
            self._trial = optuna.trial.Trial(study, self.trial_id)
        return self._trial


def unreachable(storage: str | None) -> str | None:
    """Why ``storage`` cannot hold the study here (None: it may): no URL, or a SQLite file that
    is not on this node (opening it would create an empty database)."""
    if not storage:
        return f"{STORAGE_ENV} is not set"
    prefix = "sqlite:///"
    if storage.startswith(prefix) and not os.path.isfile(storage[len(prefix):]):
        return f"no file {storage[len(prefix):]}"
    return None


def build_pruner(spec: dict[str, Any]) -> Any:
    """An Optuna pruner from ``{"_target_": "optuna.pruners.<Name>", **arguments}``, nested
    pruners (``PatientPruner``'s ``wrapped_pruner``) included; only ``optuna.pruners`` classes."""
    module, _, name = spec["_target_"].rpartition(".")
    if module != "optuna.pruners":
        raise ValueError(
            f"hydra.sweeper.pruner._target_={spec['_target_']!r}: an optuna.pruners class is expected"
        )
    arguments = {
        k: build_pruner(v) if isinstance(v, dict) and "_target_" in v else v
        for k, v in spec.items()
        if k != "_target_"
    }
    return getattr(importlib.import_module(module), name)(**arguments)
