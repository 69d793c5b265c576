"""Building a run's objects from its resolved config, on each rank.

Each group is instantiated from its ``_target_``; runtime objects that a config cannot hold
(the compression hook for the strategy, optimizer and scheduler factories for the module,
the strategy, callbacks and loggers for the Trainer) are passed as keyword arguments.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch import LightningDataModule, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ProgressBar
from omegaconf import DictConfig, OmegaConf

from litscale.precision import PrecisionDtypes
from litscale.safety import allowed_prefixes, check_targets
from litscale.typecheck import locate_target, signature_annotations


@dataclass
class BuiltRun:
    config: DictConfig
    choices: dict[str, str]
    datamodule: LightningDataModule
    module: LightningModule
    trainer: Trainer


_ALLOWED_TARGETS: list[str] = []  # the run's `allowed_targets`, set by build_run


def build(node: DictConfig, **kwargs: Any) -> Any:
    """``instantiate`` that raises the constructor's own error, not Hydra's multi-line wrapper,
    and builds only trusted targets (checked again here: library users may skip validation)."""
    check_targets(node, "", allowed_prefixes(_ALLOWED_TARGETS))
    try:
        return instantiate(node, **kwargs, _convert_="all")
    except InstantiationException as error:
        if error.__cause__ is not None:
            raise error.__cause__ from None
        raise


def _build_named(group: DictConfig | None) -> list[Any]:
    """A group that is a mapping of name -> object config (loggers, callbacks)."""
    return [build(node) for node in (group or {}).values()
            if isinstance(node, DictConfig) and "_target_" in node]


def _build_callbacks(cfg: DictConfig) -> list[Any]:
    callbacks = _build_named(cfg.get("callbacks"))
    if "_target_" in (cfg.get("lr_scaling") or {}):
        callbacks.append(build(cfg.lr_scaling))  # an LR-scaling rule is a callback
    if cfg.trainer.get("enable_progress_bar") is False:
        # Lightning refuses a progress-bar callback with the bar turned off; the flag wins.
        callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
    return callbacks


def _share_cpu_threads() -> None:
    """Give each local rank its share of the cores: N ranks x all cores oversubscribes."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // local_ranks))


def build_strategy(cfg: DictConfig):
    """The strategy, given the runtime objects its constructor asks for by name:
    ``compression`` (a ``CommHook`` from the compression group) and ``precision_dtypes``."""
    accepts = signature_annotations(locate_target(cfg.strategy._target_, "strategy"))
    extra: dict[str, Any] = {}
    if "compression" in accepts and "_target_" in cfg.compression:
        extra["compression"] = build(cfg.compression)
    if "precision_dtypes" in accepts:
        extra["precision_dtypes"] = PrecisionDtypes.from_names(
            **{k: cfg.precision[k] for k in ("param_dtype", "compute_dtype", "reduce_dtype")})
    # NOTE: passed to the partial, not to instantiate, which would turn the PrecisionDtypes
    # dataclass into a dict.
    return build(cfg.strategy, _partial_=True)(**extra)


def build_module(cfg: DictConfig) -> LightningModule:
    scheduler = build(cfg.scheduler) if "_target_" in (cfg.get("scheduler") or {}) else None
    return build(cfg.model, optimizer=build(cfg.optimizer), scheduler=scheduler)


def _quiet_lightning() -> None:
    """Drop Lightning's advertisement and a deprecation warning it raises against itself;
    neither is something a litscale user can act on."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: not str(record.msg).startswith("💡 Tip"))
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    # litscale's samplers skip the batches a mid-epoch checkpoint already trained on
    # (litscale.data.base.resume_position), which this warning does not know.
    warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before")


def build_run(config: dict, choices: dict[str, str], *, loggable_config: dict | None = None) -> BuiltRun:
    cfg = OmegaConf.create(config)
    _ALLOWED_TARGETS[:] = cfg.get("allowed_targets") or []
    _quiet_lightning()
    _share_cpu_threads()
    seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = build(cfg.data)
    module = build_module(cfg)
    loggers = _build_named(cfg.get("logger"))
    strategy, callbacks = build_strategy(cfg), _build_callbacks(cfg)
    if getattr(strategy, "compression", None) is not None:
        from litscale.callbacks.communication import CommunicationCallback

        callbacks.append(CommunicationCallback(compression=strategy.compression))
    if any(type(logger).__name__ == "WandbLogger" for logger in loggers):
        from litscale.loggers import WandbRunId

        callbacks.append(WandbRunId())  # the W&B run id travels in checkpoints
    trainer = build(
        cfg.trainer,
        strategy=strategy,
        precision=cfg.precision.lightning,
        callbacks=callbacks,
        logger=loggers or False,
        # The data modules shard with their own DistributedSampler (see litscale.data.base).
        use_distributed_sampler=False,
        default_root_dir=cfg.paths.output_dir,
    )
    for logger in trainer.loggers:  # never values from the environment (API keys)
        logger.log_hyperparams(loggable_config if loggable_config is not None else config)
    return BuiltRun(config=cfg, choices=choices, datamodule=datamodule, module=module, trainer=trainer)
