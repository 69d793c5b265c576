"""``train(cfg)``: validate -> predict -> start ranks -> (on each rank) build -> fit -> summary."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from litscale.app.checks.safety import config_without_environment
from litscale.app.checks.validation import only_planned, planning, resume_search_dir, validate
from litscale.app.launch import external_rank, launch, wait_for_the_cause
from litscale.app.plan.description import RunDescription, describe
from litscale.app.prediction import RunPrediction
from litscale.app.run_log import log_printed_lines
from litscale.app.scaling_study import ScalingContext, job_context
from litscale.parallel.layout import RunLayout

if TYPE_CHECKING:
    from litscale.reliability.replica_groups import ReplicaGroup


@dataclass
class RunSpec:
    """What every rank needs: the resolved config (plain data, as the user composed it), the
    group choices, and the layout validation computed from them."""

    config: dict
    layout: RunLayout
    choices: dict[str, str] = field(default_factory=dict)
    loggable_config: dict | None = None  # `config` without values from the environment
    scaling: ScalingContext = field(default_factory=ScalingContext)
    started_at: float = field(default_factory=time.time)
    # fault_tolerance=replicas: this spec's group, and where the groups meet (the replica launcher's)
    replica_group: ReplicaGroup | None = None
    # the planner's prediction for this run, made before launch for rank 0's summary
    prediction: RunPrediction | None = None


def hydra_choices() -> dict[str, str]:
    """Group -> option name of the current Hydra job ({} outside Hydra)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    return {k: v for k, v in HydraConfig.get().runtime.choices.items() if isinstance(v, str)}


def train(cfg: DictConfig, *, choices: dict[str, str] | None = None) -> dict:
    """Validate ``cfg``, start its ranks, and return rank 0's summary."""
    choices = hydra_choices() if choices is None else choices
    layout = validate(cfg, choices=choices, this_machine=not only_planned(cfg))
    say_skipped_checkpoints(cfg, layout.ckpt_path)
    # The run as the planner reads it, once: plan=show|auto ranks it; a run is predicted from it.
    run = describe(cfg, choices, layout, job=job_context(cfg))
    if planning(cfg):
        from litscale.app.plan.ranking import run_plan

        return run_plan(run)
    spec = RunSpec(config=run.config, layout=layout, choices=choices,
                   loggable_config=config_without_environment(cfg), scaling=run.job, prediction=predict_once(run))
    if layout.replica_groups > 1:
        from litscale.app.build import build, trusted_targets
        from litscale.app.replica_launch import launch_replica_groups

        result = launch_replica_groups(run_rank, spec, replicas=build(cfg.fault_tolerance, trusted=trusted_targets(cfg)))
    else:
        result = launch(run_rank, spec, processes=layout.processes_per_node, num_nodes=layout.num_nodes)
        if result.get("preempted"):
            check_every_rank_saved(spec.config["paths"]["output_dir"], layout.world_size)
    if spec.prediction is not None:
        from litscale.app.plan.runs import record_contradiction

        record_contradiction(spec.prediction, result)
    return result


def predict_once(run: RunDescription) -> RunPrediction | None:
    """The planner's prediction for this run, made once per job before its ranks start, in the
    process whose summary holds it (rank 0's under torchrun or srun; None on the others)."""
    from litscale.app.plan.runs import predict_run

    if external_rank() not in (None, 0):
        return None
    try:
        return predict_run(run)
    except Exception as error:  # a prediction is a comparison, never a reason for a run to fail
        return RunPrediction(figures={"plan/error": f"{type(error).__name__}: {error}".splitlines()[0]})


def say_skipped_checkpoints(cfg: DictConfig, chosen: str | None) -> None:
    """Once per job (rank 0 under torchrun or srun): the checkpoints a resume word passed over,
    so that a torn save is not skipped in silence."""
    from litscale.app.launch import external_rank
    from litscale.checkpoint.resume import RESUME_WORDS, skipped_line

    if cfg.get("ckpt_path") not in RESUME_WORDS or external_rank() not in (None, 0):
        return
    line = skipped_line(cfg.ckpt_path, resume_search_dir(cfg), chosen)
    if line:
        print(line, flush=True)


def check_every_rank_saved(output_dir: str, world_size: int) -> None:
    """Raise ``RankFailure`` unless every rank of this launch recorded the ``last.ckpt`` it saved
    when preempted (under torchrun or srun, this process's own rank)."""
    from litscale.app.launch import RankFailure, external_rank
    from litscale.app.ranks import ranks_without_preemption_checkpoint

    rank = external_rank()
    ranks = range(world_size) if rank is None else range(rank, rank + 1)
    missing = ranks_without_preemption_checkpoint(output_dir, ranks)
    if missing:
        from litscale.checkpoint.resume import newest_last_checkpoint

        names = ("rank " if len(missing) == 1 else "ranks ") + ",".join(map(str, missing))
        newest = newest_last_checkpoint(output_dir)
        kept = (f"the newest complete checkpoint is {newest} (ckpt_path=auto resumes from it)" if newest
                else "there is no complete checkpoint: a rerun starts from step 0")
        raise RankFailure(f"stopped, but {names} saved no checkpoint at the stop; {kept}")


def run_rank(spec: RunSpec) -> dict:
    """Build everything from the resolved config and fit; runs once on every rank."""
    # A rank the launcher started has no Hydra logging: it appends its lines to train.log itself.
    with log_printed_lines(os.path.join(spec.config["paths"]["output_dir"], "train.log")):
        try:
            return _fit_on_this_rank(spec)
        except Exception as error:
            wait_for_the_cause(error)  # a peer's failure, not ours: let the peer's be reported
            raise


def preemption_checkpoint(trainer) -> str | None:
    """The ``last.ckpt`` this rank's ``PreemptionCheckpoint`` saved, if it saved one."""
    from litscale.callbacks.preemption import PreemptionCheckpoint

    saved = [c.saved_path for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)]
    return next((path for path in saved if path and os.path.exists(path)), None)


def _fit_on_this_rank(spec: RunSpec) -> dict:
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from litscale.app.build import build_run
    from litscale.app.ranks import record_rank
    from litscale.app.summary import finish_loggers, print_start, summarize
    from litscale.callbacks.watchdog import end_watch
    from litscale.checkpoint.export import export_model
    from litscale.health import flight_recorder
    from litscale.health.beats import after_fit
    from litscale.strategies.lifecycle import destroy_process_group

    if spec.layout.world_size > 1:
        flight_recorder.enable()  # before the process group exists: torch reads it then
    built = build_run(spec.config, spec.choices, spec.layout, loggable_config=spec.loggable_config,
                      sweep_dir=spec.scaling.sweep_dir, replica_group=spec.replica_group)
    outcome = "failed"
    try:
        record_rank(built.config.paths.output_dir)
        print_start(built)
        try:
            # weights_only: a checkpoint holds tensors and plain data; loading one never runs code.
            built.trainer.fit(built.module, datamodule=built.datamodule,
                              ckpt_path=spec.layout.ckpt_path, weights_only=True)
        except SIGTERMException:
            outcome = "preempted"
            # what this rank saved, for the launcher to check that every rank did
            record_rank(built.config.paths.output_dir, preemption_checkpoint=preemption_checkpoint(built.trainer))
            return {"preempted": True, "steps": built.trainer.global_step}
        except Exception as error:
            # before the group is destroyed: `python -m litscale.doctor <run dir>` reads it
            flight_recorder.dump(built.config.paths.output_dir, built.trainer.global_rank,
                                 reason=f"{type(error).__name__}: {error}".splitlines()[0])
            raise
        after_fit(built.trainer, "export")  # the hang watchdog watches this work too
        export = export_model(built.trainer, built.module, built.config.paths.output_dir,
                              hugging_face=bool(spec.config.get("export_hf", False)),
                              save_tokenizer=getattr(built.datamodule, "save_tokenizer", None))
        after_fit(built.trainer, "summary")
        summary = summarize(built, started_at=spec.started_at, export=export, scaling=spec.scaling,
                            prediction=spec.prediction)
        outcome = "success"
        return summary
    finally:
        end_watch(built.trainer)
        finish_loggers(built.trainer, outcome)
        destroy_process_group()
