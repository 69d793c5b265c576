"""Building a run's objects from its resolved config, on each rank.

Each group is instantiated from its ``_target_``; runtime objects that a config cannot hold
(the compression hook for the strategy, optimizer and scheduler factories for the module,
the strategy, callbacks and loggers for the Trainer) are passed as keyword arguments.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import instantiate
from lightning.pytorch import LightningDataModule, LightningModule, Trainer, seed_everything
from omegaconf import DictConfig, OmegaConf


@dataclass
class BuiltRun:
    config: DictConfig
    choices: dict[str, str]
    datamodule: LightningDataModule
    module: LightningModule
    trainer: Trainer


def _build_named(group: DictConfig | None) -> list[Any]:
    """A group that is a mapping of name -> object config (loggers, callbacks)."""
    return [instantiate(node, _convert_="all") for node in (group or {}).values()
            if isinstance(node, DictConfig) and "_target_" in node]


def _share_cpu_threads() -> None:
    """Give each local rank its share of the cores: N ranks x all cores oversubscribes."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // local_ranks))


def build_strategy(cfg: DictConfig):
    compression = instantiate(cfg.compression) if "_target_" in cfg.compression else None
    extra = {"compression": compression} if compression is not None else {}
    return instantiate(cfg.strategy, **extra, _convert_="all")


def build_module(cfg: DictConfig) -> LightningModule:
    scheduler = instantiate(cfg.scheduler) if "_target_" in (cfg.get("scheduler") or {}) else None
    return instantiate(cfg.model, optimizer=instantiate(cfg.optimizer), scheduler=scheduler,
                       _convert_="all")


def build_run(config: dict, choices: dict[str, str]) -> BuiltRun:
    cfg = OmegaConf.create(config)
    _share_cpu_threads()
    seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = instantiate(cfg.data, _convert_="all")
    module = build_module(cfg)
    loggers = _build_named(cfg.get("logger"))
    trainer = instantiate(
        cfg.trainer,
        strategy=build_strategy(cfg),
        precision=cfg.precision.lightning,
        callbacks=_build_named(cfg.get("callbacks")),
        logger=loggers or False,
        # The data modules shard with their own DistributedSampler (see litscale.data.base).
        use_distributed_sampler=False,
        default_root_dir=cfg.paths.output_dir,
        _convert_="all",
    )
    for logger in trainer.loggers:
        logger.log_hyperparams(config)
    return BuiltRun(config=cfg, choices=choices, datamodule=datamodule, module=module, trainer=trainer)
