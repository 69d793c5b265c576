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
from typing import TYPE_CHECKING, Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch import LightningDataModule, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ProgressBar
from omegaconf import DictConfig, ListConfig, OmegaConf

from litscale.app.checks.safety import allowed_prefixes, check_targets, locate_target
from litscale.arguments import signature_annotations
from litscale.parallel.layout import RunLayout
from litscale.precision import PrecisionDtypes

if TYPE_CHECKING:
    from litscale.reliability.replica_groups import ReplicaGroup


@dataclass
class BuiltRun:
    config: DictConfig
    choices: dict[str, str]
    layout: RunLayout
    datamodule: LightningDataModule
    module: LightningModule
    trainer: Trainer
    replica_group: ReplicaGroup | None = None  # fault_tolerance=replicas: this rank's group


def build(node: DictConfig, *, trusted: tuple[str, ...] = allowed_prefixes(), **runtime: Any) -> Any:
    """``instantiate`` that raises the constructor's own error, not Hydra's multi-line wrapper,
    and builds only ``trusted`` targets (checked again here: callers may skip validation).

    ``runtime``: objects a config cannot hold (a strategy, the run layout), passed to the
    constructor as they are. NOTE: given to a partial, not to ``instantiate``, whose
    ``_convert_="all"`` would turn a dataclass such as the layout into a dict."""
    check_targets(node, "", trusted)
    try:
        if runtime:
            return instantiate(node, _partial_=True, _convert_="all")(**runtime)
        return instantiate(node, _convert_="all")
    except InstantiationException as error:
        if error.__cause__ is not None:
            raise error.__cause__ from None
        raise


def trusted_targets(cfg: DictConfig) -> tuple[str, ...]:
    """The packages a run may build from: litscale's trusted ones and its ``allowed_targets``."""
    return allowed_prefixes(cfg.get("allowed_targets") or ())


def _build_named(group: DictConfig | None, *, trusted: tuple[str, ...] = allowed_prefixes(),
                 extra: dict[str, dict] | None = None) -> list[Any]:
    """A group that is a mapping of name -> object config (loggers, callbacks); ``extra``
    holds runtime keyword arguments by name."""
    return [build(node, trusted=trusted, **(extra or {}).get(name, {}))
            for name, node in (group or {}).items()
            if isinstance(node, DictConfig) and "_target_" in node]


def _build_callbacks(cfg: DictConfig, layout: RunLayout | None = None) -> list[Any]:
    trusted = trusted_targets(cfg)
    callbacks = _build_named(cfg.get("callbacks"), trusted=trusted)
    if "_target_" in (cfg.get("lr_scaling") or {}):
        # An LR-scaling rule is a callback; it scales from the layout's global batch.
        runtime = {"layout": layout} if layout is not None else {}
        callbacks.append(build(cfg.lr_scaling, trusted=trusted, **runtime))
    if cfg.trainer.get("enable_progress_bar") is False:
        # Lightning refuses a progress-bar callback with the bar turned off; the flag wins.
        callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
    return callbacks


def _share_cpu_threads() -> None:
    """Give each local rank its share of the cores: N ranks x all cores oversubscribes. In a
    device sweep every job gets the largest job's share (``scaling_study.THREADS_ENV``)."""
    from litscale.app.scaling_study import THREADS_ENV
    from litscale.measure.flops import cores

    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = int(os.environ.get(THREADS_ENV) or max(1, cores() // local_ranks))
    torch.set_num_threads(threads)
    # NOTE: Lightning's launchers set torch's threads to cores / processes again unless
    # OMP_NUM_THREADS is set: a sweep's 1-device job ran on 2 threads beside ranks on 1.
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def build_strategy(cfg: DictConfig):
    """The strategy, given the runtime objects its constructor asks for by name:
    ``compression`` (a ``CommHook`` from the compression group) and ``precision_dtypes``."""
    accepts = signature_annotations(locate_target(cfg.strategy._target_, "strategy"))
    extra: dict[str, Any] = {}
    if "compression" in accepts and "_target_" in cfg.compression:
        extra["compression"] = build(cfg.compression, trusted=trusted_targets(cfg))
    if "precision_dtypes" in accepts:
        extra["precision_dtypes"] = PrecisionDtypes.from_names(
            **{k: cfg.precision[k] for k in ("param_dtype", "compute_dtype", "reduce_dtype")})
    return build(cfg.strategy, trusted=trusted_targets(cfg), **extra)


def build_module(cfg: DictConfig) -> LightningModule:
    trusted = trusted_targets(cfg)
    scheduler = build(cfg.scheduler, trusted=trusted) if "_target_" in (cfg.get("scheduler") or {}) else None
    # the layout-invariant step keeps a copy of the net as built, before any strategy wraps it
    extra = {"determinism": build(cfg.determinism, trusted=trusted)} if "_target_" in (cfg.get("determinism") or {}) else {}
    return build(cfg.model, trusted=trusted, optimizer=build(cfg.optimizer, trusted=trusted),
                 scheduler=scheduler, **extra)


def build_datamodule(cfg: DictConfig, layout: RunLayout) -> LightningDataModule:
    """The data module, with the layout's micro batch (a strong-scaling run derives it)."""
    extra = {"batch_size": layout.micro_batch} if "batch_size" in cfg.data else {}
    return build(cfg.data, trusted=trusted_targets(cfg), **extra)


def trainer_devices(devices: Any, layout: RunLayout) -> Any:
    """What the Trainer gets for ``devices``: the layout's process count (Lightning takes only
    a count on CPU, not -1 or auto), unless the user named device indices."""
    names_indices = isinstance(devices, (list, ListConfig)) or (isinstance(devices, str) and "," in devices)
    return devices if names_indices else layout.processes_per_node


def wandb_run(node: DictConfig, *, name: str, sweep_dir: str | None, ckpt_path: str | None) -> dict:
    """Runtime arguments of the W&B logger: a sweep's runs share one group, and a resumed run
    continues the W&B run its checkpoint was written under (unless the config says)."""
    from litscale.loggers import wandb_run_id_in_checkpoint

    extra = {}
    if sweep_dir and not node.get("group"):
        extra["group"] = f"{name}-{os.path.basename(sweep_dir.rstrip('/'))}"
    if ckpt_path and not node.get("id"):
        extra["id"] = wandb_run_id_in_checkpoint(ckpt_path)
    return extra


def _quiet_lightning() -> None:
    """Drop Lightning's advertisement and a deprecation warning it raises against itself;
    neither is something a litscale user can act on."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: not str(record.msg).startswith("💡 Tip"))
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    # litscale's samplers skip the batches a mid-epoch checkpoint already trained on
    # (litscale.data.base.resume_position), which this warning does not know.
    warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before")


def never_validates(trainer: DictConfig, ckpt_path: str | None) -> bool:
    """Whether a run ends before its first validation: a fresh run whose ``max_steps`` is below
    a ``val_check_interval`` counted in steps (validation then runs at no epoch end). Its
    starting validation loss (the sanity pass over the whole limited val set) would be compared
    with nothing, so it is skipped: ``trainer.max_steps=1`` does not pay for 16 batches of it."""
    interval, steps = trainer.get("val_check_interval"), int(trainer.get("max_steps", -1))
    return (ckpt_path is None and trainer.get("check_val_every_n_epoch") is None and 0 < steps
            and isinstance(interval, int) and not isinstance(interval, bool) and steps < interval)


def _replica_groups(cfg: DictConfig, datamodule: LightningDataModule, layout: RunLayout,
                    group: ReplicaGroup | None) -> Any:
    """``fault_tolerance=replicas`` on a rank of one group (``group``, handed in by the replica
    launcher): the callback that averages across groups, and the group's block of the data order."""
    from litscale.reliability.replica_groups import ReplicaFaultTolerance

    datamodule.replica_group = (group.group, group.groups) if group is not None else (0, layout.replica_groups)
    return ReplicaFaultTolerance(run_dir=cfg.paths.output_dir, group=group,
                                 replicas=build(cfg.fault_tolerance, trusted=trusted_targets(cfg)))


def build_run(config: dict, choices: dict[str, str], layout: RunLayout, *,
              loggable_config: dict | None = None, sweep_dir: str | None = None,
              replica_group: ReplicaGroup | None = None) -> BuiltRun:
    cfg = OmegaConf.create(config)
    trusted = trusted_targets(cfg)
    _quiet_lightning()
    _share_cpu_threads()
    seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = build_datamodule(cfg, layout)
    module = build_module(cfg)
    if getattr(module, "determinism", None) is not None:  # each rank's share of a step, in one block
        datamodule.rank_block = layout.micro_batch * layout.accumulation
    if cfg.get("elastic"):  # a resume the new rank count cannot share out skips ahead (validation let it)
        datamodule.elastic = True
    loggers_cfg = cfg.get("logger") or {}
    wandb = {name: wandb_run(node, name=cfg.name, sweep_dir=sweep_dir, ckpt_path=layout.ckpt_path)
             for name, node in loggers_cfg.items()
             if isinstance(node, DictConfig) and node.get("_target_") == "litscale.loggers.wandb_logger"}
    loggers = _build_named(loggers_cfg, trusted=trusted, extra=wandb)
    strategy, callbacks = build_strategy(cfg), _build_callbacks(cfg, layout)
    checkpoint = cfg.get("checkpoint") or {}
    if checkpoint.get("async_save"):  # validation refused a strategy without it
        strategy.async_save = True
    strategy.checkpoint_publish = checkpoint.get("publish", "auto")
    if getattr(strategy, "compression", None) is not None:
        from litscale.callbacks.communication import CommunicationCallback

        callbacks.append(CommunicationCallback(compression=strategy.compression))
    if cfg.precision.get("float8"):
        from litscale.callbacks.float8 import Float8Training

        callbacks.append(Float8Training(recipe=cfg.precision.float8))
    if layout.replica_groups > 1:
        # NOTE: first, so that every other callback sees a step the groups dropped as no step
        # (Lightning counts it; the replicas' callback sets the count back at the batch's end).
        callbacks.insert(0, _replica_groups(cfg, datamodule, layout, replica_group))
    from litscale.callbacks.loss_curve import LossCurve

    callbacks.append(LossCurve())  # loss_curve.png beside summary.json
    if any(type(logger).__name__ == "WandbLogger" for logger in loggers):
        from litscale.loggers import WandbRunId

        callbacks.append(WandbRunId())  # the W&B run id travels in checkpoints
    trainer = build(
        cfg.trainer,
        trusted=trusted,
        **({"num_sanity_val_steps": 0} if never_validates(cfg.trainer, layout.ckpt_path) else {}),
        devices=trainer_devices(cfg.trainer.get("devices", 1), layout),
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
    if getattr(module, "determinism", None) is not None:  # before fit's first CUDA op
        module.determinism.use_device(trainer.strategy.root_device)
    return BuiltRun(config=cfg, choices=choices, layout=layout, datamodule=datamodule, module=module,
                    trainer=trainer, replica_group=replica_group)
