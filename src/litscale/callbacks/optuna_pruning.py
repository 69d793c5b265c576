"""Pruning an Optuna trial that is a multi-process job: rank 0 decides, every rank stops.

Optuna's own Lightning integration asks the pruner on every rank, each with its own view of
the study; ranks that disagree leave some in a collective the others have left. Here rank 0
alone reports the validation metric to the trial (through the study's storage, which the
sweeper reads) and asks the pruner; its decision is broadcast, so every rank stops after the
same validation. The sweeper added this callback to the trial's overrides
(``hydra_plugins.litscale_plugins.optuna_sweeper``); nothing on a rank samples anything.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

# The trial's user attribute that tells the sweeper the trial was pruned, and at which step.
PRUNED_AT_STEP = "pruned_at_step"


class OptunaPruning(Callback):
    """Report ``monitor`` after each validation to trial ``trial_id`` of ``study_name`` in
    ``storage``; stop every rank when ``pruner`` says so.

    ``pruner`` is the sweeper's pruner as JSON (``{"_target_": "optuna.pruners.MedianPruner",
    ...}``): a study's storage keeps its trials but not its pruner."""

    def __init__(
        self,
        *,
        storage: str,
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

            study = optuna.load_study(
                study_name=self.study_name,
                storage=self.storage,
                pruner=build_pruner(json.loads(self.pruner)),
            )
            self._trial = optuna.trial.Trial(study, self.trial_id)
        return self._trial


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
