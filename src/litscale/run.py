"""``train(cfg)``: validate -> start ranks -> (on each rank) build -> fit -> summary."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from litscale.checkpoints import resolve_ckpt_path
from litscale.config import count_devices, machine_device_count, resolve_accelerator, validate
from litscale.launch import launch, wait_for_the_cause
from litscale.loggers import prepare_wandb
from litscale.safety import config_without_environment
from litscale.scaling import ScalingContext, apply_strong_scaling, job_context


@dataclass
class RunSpec:
    """What every rank needs: the resolved config (plain data) and the group choices."""

    config: dict
    choices: dict[str, str] = field(default_factory=dict)
    loggable_config: dict | None = None  # `config` without values from the environment
    scaling: ScalingContext = field(default_factory=ScalingContext)
    started_at: float = field(default_factory=time.time)


def hydra_choices() -> dict[str, str]:
    """Group -> option name of the current Hydra job ({} outside Hydra)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    return {k: v for k, v in HydraConfig.get().runtime.choices.items() if isinstance(v, str)}


def train(cfg: DictConfig, *, choices: dict[str, str] | None = None) -> dict:
    """Validate ``cfg``, start its ranks, and return rank 0's summary."""
    choices = hydra_choices() if choices is None else choices
    validate(cfg, choices=choices)
    config = OmegaConf.to_container(cfg, resolve=True)
    config["ckpt_path"] = resolve_ckpt_path(cfg.ckpt_path, search_dir=os.path.join(cfg.paths.root_dir, cfg.name))
    accelerator = resolve_accelerator(str(cfg.trainer.accelerator))
    processes = count_devices(cfg.trainer.devices, machine_device_count(accelerator), accelerator)
    if accelerator == "cpu":
        config["trainer"]["devices"] = processes  # Lightning takes only a count on CPU (no -1/auto)
    apply_strong_scaling(config, cfg, processes * int(cfg.trainer.num_nodes))
    scaling = job_context(cfg)
    prepare_wandb(config, sweep_dir=scaling.sweep_dir)
    spec = RunSpec(config=config, choices=choices, loggable_config=config_without_environment(cfg),
                   scaling=scaling)
    return launch(run_rank, spec, processes=processes, num_nodes=int(cfg.trainer.num_nodes))


def run_rank(spec: RunSpec) -> dict:
    """Build everything from the resolved config and fit; runs once on every rank."""
    try:
        return _fit_on_this_rank(spec)
    except Exception as error:
        wait_for_the_cause(error)  # a peer's failure, not ours: let the peer's be reported
        raise


def _fit_on_this_rank(spec: RunSpec) -> dict:
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from litscale.build import build_run
    from litscale.export import export_model
    from litscale.strategies.lifecycle import destroy_process_group
    from litscale.summary import finish_loggers, print_start, summarize

    built = build_run(spec.config, spec.choices, loggable_config=spec.loggable_config)
    outcome = "failed"
    try:
        print_start(built)
        try:
            # weights_only: a checkpoint holds tensors and plain data; loading one never runs code.
            built.trainer.fit(built.module, datamodule=built.datamodule,
                              ckpt_path=spec.config["ckpt_path"], weights_only=True)
        except SIGTERMException:
            outcome = "preempted"
            return {"preempted": True, "steps": built.trainer.global_step}
        export = export_model(built.trainer, built.module, built.config.paths.output_dir)
        summary = summarize(built, started_at=spec.started_at, export=export, scaling=spec.scaling)
        outcome = "success"
        return summary
    finally:
        finish_loggers(built.trainer, outcome)
        destroy_process_group()
