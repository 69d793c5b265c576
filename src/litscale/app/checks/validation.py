"""Validation of a composed config, before any process or process group exists; it
returns the run layout (``litscale.parallel.layout.RunLayout``), computed here once.

The schema is the code itself: every ``_target_`` is a typed keyword-only constructor, so a
node's keys and values are checked against that constructor's signature (pydantic, through
``litscale.arguments``, with the ranges of ``litscale.constraints``). Keys that are not
constructor arguments (``seed``, ``ckpt_path``, the precision group) are described by the
dataclasses of ``schemas``. Cross-group rules follow, in ``validate``'s order: task pairing,
widths, the strategy's own refusals (``contract``), devices vs the machine (``devices``), the
layout (checked by the strategy's contract), the checkpoint resumed (``checkpoint``), the run
modes (determinism, ``fault_tolerance``), the packages the ranks import (``extras``).

Every problem is a ``ConfigError`` whose message is one line naming the key, the bad value
and what is allowed.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import fields
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from litscale.app.checks.checkpoint import (
    check_checkpoint_moves,
    check_checkpoint_network,
    check_resume_position,
)
from litscale.app.checks.contract import check_network_accepted, check_strategy_accepts
from litscale.app.checks.devices import check_devices
from litscale.app.checks.extras import check_job_extras
from litscale.app.checks.fault_tolerance import check_fault_tolerance, replica_groups
from litscale.app.checks.safety import allowed_prefixes, check_targets, locate_target
from litscale.app.checks.schemas import (
    CheckpointSchema,
    LauncherSchema,
    OptimizerSchema,
    PlanSchema,
    PrecisionSchema,
    PreflightSchema,
    RunSchema,
    ScalingSchema,
)
from litscale.app.checks.width import check_declared_widths, check_width_options
from litscale.arguments import (
    check_value,
    describe,
    forwards_unknown_kwargs,
    invalid_message,
    signature_annotations,
)
from litscale.checkpoint.resume import resolve_ckpt_path
from litscale.errors import ConfigError
from litscale.parallel.contract import validate_setup
from litscale.parallel.layout import MeshSizes, RunLayout, mesh_of, micro_batch_for, world_size_of
from litscale.user_paths import user_path

__all__ = ["ConfigError", "validate"]


# Groups whose value is one object built from `_target_` / a dict of named objects.
TARGET_GROUPS = ("trainer", "data", "model", "strategy", "optimizer", "scheduler", "compression",
                 "lr_scaling", "cluster", "determinism", "fault_tolerance")
NAMED_TARGET_GROUPS = ("logger", "callbacks")


def validate(cfg: DictConfig, *, choices: dict[str, str] | None = None,
             this_machine: bool = True) -> RunLayout:
    """Raise ``ConfigError`` for the first problem found in a composed config; return the
    run's layout (processes, mesh, batch, the resolved ``ckpt_path``).

    ``choices`` maps group -> chosen option name (Hydra's runtime choices), used to name
    options in messages; without it messages fall back to key paths. ``this_machine=False``
    when the job will run on another machine (SLURM): devices are then not counted here, nor
    is data prepared (a data module with ``prepare_before_launch`` does so last, after every
    check has passed).
    """
    choices = choices or {}
    check_schema("", cfg, RunSchema)
    # First, before any _target_ is imported: importing a module runs its code.
    check_targets(cfg, "", allowed_prefixes(cfg.get("allowed_targets") or ()))
    check_schema("precision", cfg.precision, PrecisionSchema)
    check_schema("optimizer", cfg.optimizer, OptimizerSchema)
    if cfg.get("scaling") is not None:
        check_schema("scaling", cfg.scaling, ScalingSchema)
    if cfg.get("plan") is not None:
        check_schema("plan", cfg.plan, PlanSchema)
        check_calibrate_from(cfg.plan)
    if cfg.get("launcher") is not None:
        check_schema("launcher", cfg.launcher, LauncherSchema)
    if cfg.get("preflight") is not None:
        check_schema("preflight", cfg.preflight, PreflightSchema)
    if cfg.get("checkpoint") is not None:
        check_schema("checkpoint", cfg.checkpoint, CheckpointSchema)
    # Before the nodes are resolved: a model interpolates sizes from data of its own task.
    check_task_pairing(cfg, choices)
    check_width_options(cfg, choices)
    check_data_tokenizer(cfg)
    for group in TARGET_GROUPS:
        if cfg.get(group) is not None and "_target_" in cfg[group]:
            check_target_node(group, cfg[group])
    for group in NAMED_TARGET_GROUPS:
        for name, node in (cfg.get(group) or {}).items():
            if isinstance(node, DictConfig) and "_target_" in node:
                check_target_node(f"{group}.{name}", node)
    # The strategy's own refusals first: more specific than the machine's (fp16 under FSDP is
    # refused for FSDP's reason whether or not this machine has a GPU).
    strategy = built_strategy(cfg)
    check_strategy_accepts(cfg, choices, strategy)
    processes = check_devices(cfg, choices, this_machine=this_machine, planned=planning(cfg))
    check_data_paths(cfg)
    layout = run_layout(cfg, processes, strategy, choices=choices)
    check_determinism(cfg, choices, layout)
    check_fault_tolerance(cfg, choices, layout, this_machine=this_machine)
    check_resume_position(cfg, layout)
    check_baseline(cfg)
    check_warmup(cfg)
    check_declared_widths(cfg, choices)
    check_export_hf(cfg, choices)
    if this_machine:  # the ranks start here: the packages they will import are here
        check_job_extras(cfg, choices)
        # last: it may take a while, and every cheaper check has passed
        prepare_data_before_launch(cfg)
    return layout


def planning(cfg: DictConfig) -> bool:
    """``plan=show|auto``: the planner picks the strategy; the configured one is only compared."""
    return (cfg.get("plan") or {}).get("mode", "none") != "none"


def only_planned(cfg: DictConfig) -> bool:
    """``plan=show|auto`` without ``plan.verify``: nothing runs, so the devices the config names
    (``trainer.devices=256``) need not be on this machine."""
    return planning(cfg) and not cfg.plan.get("verify")


def calibrate_from_paths(value) -> list[str]:
    """``plan.calibrate_from`` (one directory or a list) as a list, ``~`` expanded."""
    paths = value if isinstance(value, (list, tuple, ListConfig)) else [value]
    return [user_path(str(path)) for path in paths]


def check_calibrate_from(plan: DictConfig) -> None:
    """``plan.calibrate_from`` is read by a plan, and names directories that exist."""
    value = plan.get("calibrate_from")
    if value is None:
        return
    paths = calibrate_from_paths(value)
    if plan.mode == "none":
        raise ConfigError(f"plan.calibrate_from={value} refits the planner for plan=show|auto; with plan=none "
                          f"nothing is planned: add plan=show, or drop plan.calibrate_from")
    for path in paths:
        if not os.path.isdir(path):
            raise ConfigError(f"plan.calibrate_from={path}: no such directory; allowed: run dirs or sweep dirs "
                              f"(a run's summary.json lies in its dir)")


def check_schema(prefix: str, node: DictConfig, schema: type) -> None:
    """Check the keys of ``node`` that ``schema`` (a dataclass) describes."""
    annotations = signature_annotations(schema)
    for field in fields(schema):
        if field.name in node:
            _check_key(prefix, node, field.name, annotations[field.name])


def check_target_node(path: str, node: DictConfig) -> None:
    """Check a node's keys and values against its ``_target_``'s signature, recursively."""
    target = locate_target(node["_target_"], path)
    annotations, accepts_any = signature_annotations(target), forwards_unknown_kwargs(target)
    for key in node:
        if key.startswith("_") and key.endswith("_"):
            continue
        value = node._get_node(key)
        if isinstance(value, DictConfig) and "_target_" in value:
            check_target_node(f"{path}.{key}", value)
        elif key in annotations:
            _check_key(path, node, key, annotations[key])
        elif not accepts_any:
            allowed = ", ".join(sorted(annotations)) or "no keys"
            raise ConfigError(
                f"{path}.{key} is not an argument of {node['_target_']}; allowed: {allowed}"
            )


def _check_key(prefix: str, node: DictConfig, key: str, annotation: Any) -> None:
    full_key = f"{prefix}.{key}" if prefix else key
    if OmegaConf.is_missing(node, key):
        raise ConfigError(f"{full_key} is required: expected {describe(annotation)}")
    value = node[key]
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    problem = check_value(value, annotation)
    if problem:
        raise ConfigError(invalid_message(full_key, value, problem))


def check_task_pairing(cfg: DictConfig, choices: dict[str, str]) -> None:
    """A model trains on data of its task: a causal LM on token data, a classifier on images."""
    model_task = getattr(locate_target(cfg.model._target_, "model"), "task", None)
    data_task = cfg.data.get("task") or getattr(locate_target(cfg.data._target_, "data"), "task", None)
    if model_task and data_task and model_task != data_task:
        model, data = choices.get("model", cfg.model._target_), choices.get("data", cfg.data._target_)
        suggestion = {
            "classification": "data=digits (or experiment=digits_mlp / digits_resnet)",
            "causal_lm": "data=stdlib_code, data=text_files or data=synthetic",
        }[model_task]
        raise ConfigError(
            f"model={model} trains on {model_task} data but data={data} provides {data_task}; "
            f"use {suggestion}"
        )


def check_determinism(cfg: DictConfig, choices: dict[str, str], layout: RunLayout) -> None:
    """``determinism=layout_invariant`` holds only for data-parallel layouts it can split, and
    networks whose training is their loss and gradient (``litscale.reliability.determinism_checks``)."""
    if "_target_" not in (cfg.get("determinism") or {}):
        return
    from litscale.reliability.determinism_checks import check_layout, check_network

    compression = cfg.get("compression") or {}
    partition = (cfg.get("data") or {}).get("partition", "iid")
    if partition != "iid":
        raise ConfigError(f"determinism=layout_invariant cuts one shared order into chunks, not "
                          f"data.partition={partition}; allowed: data.partition=iid")
    try:
        check_layout(data_parallel=layout.mesh.data, accumulation=layout.accumulation,
                     micro_batch=layout.micro_batch, chunks=int(cfg.determinism.chunks),
                     compression=choices.get("compression", "on") if "_target_" in compression else None,
                     context_parallel=layout.mesh.context, precision=str(cfg.precision.lightning),
                     precision_name=choices.get("precision"))
        check_network(meta_net(cfg), model_name=choices.get("model"))
    except ValueError as error:
        raise ConfigError(str(error)) from None


def built_strategy(cfg: DictConfig) -> Any:
    """The strategy, built once (cheap: no process group) so that its constructor's checks run
    now. Convention: a strategy constructor raises ``ValueError`` with a one-line message
    naming ``strategy.<key>``."""
    from litscale.app.build import build_strategy

    try:
        return build_strategy(cfg)
    except (ValueError, TypeError) as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(str(error).splitlines()[0]) from None


def run_layout(cfg: DictConfig, processes: int, strategy: Any, *,
               choices: dict[str, str] | None = None) -> RunLayout:
    """Lay the run out on the strategy's mesh, build the model on the meta device (no memory)
    and let the strategy check both (its contract's ``validate_setup``)."""
    num_nodes = int(cfg.trainer.get("num_nodes", 1))
    world_size = world_size_of(num_nodes=num_nodes, processes_per_node=processes)
    accumulation = int(cfg.trainer.get("accumulate_grad_batches") or 1)
    global_batch = (cfg.get("scaling") or {}).get("global_batch")
    try:
        mesh = mesh_of(strategy, world_size)
        if mesh.world_size < world_size and planning(cfg):  # strategy=single, the default: the
            mesh = MeshSizes(data_replicate=world_size)  # planner compares data parallel over the world
        micro_batch = micro_batch_for(global_batch, data_parallel_size=mesh.data, accumulation=accumulation) \
            if global_batch else int(cfg.data.get("batch_size") or 1)
        # For every strategy, not only those that check the model: building it is where a
        # model's own config errors (a missing checkpoint, an unknown model type) are raised,
        # and here they are one line before any rank starts.
        net = meta_net(cfg)
        validate_setup(strategy, world_size=world_size, net=net, seq_len=cfg.data.get("seq_len"),
                       micro_batch=micro_batch)
        check_network_accepted(cfg, choices or {}, strategy, net)
        check_packed_documents(cfg.data, net, choices.get("model") if choices else None)
    except (ValueError, TypeError) as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(str(error).splitlines()[0]) from None
    ckpt_path = resolve_ckpt_path(cfg.ckpt_path, search_dir=resume_search_dir(cfg))
    check_checkpoint_network(cfg, ckpt_path, net, choices or {})
    check_checkpoint_moves(cfg, ckpt_path, strategy, world_size, choices or {})
    return RunLayout(num_nodes=num_nodes, processes_per_node=processes, mesh=mesh,
                     micro_batch=micro_batch, accumulation=accumulation, ckpt_path=ckpt_path,
                     strong_scaling=bool(global_batch), replica_groups=replica_groups(cfg))


def check_packed_documents(data: DictConfig, net: Any, model: str | None) -> None:
    """Packed rows (``data.pack``, ``data.document_mask``) need a network that keeps attention
    inside each document (``attends_within_documents``): any other would let them see each other."""
    from litscale.data.token_batch import packs_documents

    key = packs_documents(data)
    if key and not getattr(net, "attends_within_documents", False):
        raise ValueError(f"{key}=true packs documents into a row, which model={model or type(net).__name__} would "
                         "let attend to each other (it takes no position ids); allowed: model=llama, moe or hf, "
                         f"or {key}=false")


def resume_search_dir(cfg: DictConfig) -> str:
    """Where ``ckpt_path=auto``/``last`` look (every run named ``name``), and ``here`` (this run's dir)."""
    return cfg.paths.output_dir if cfg.ckpt_path == "here" else os.path.join(user_path(cfg.paths.root_dir), cfg.name)


def check_baseline(cfg: DictConfig) -> None:
    """A named scaling baseline exists."""
    from litscale.app.scaling_study import baseline_summary_path

    scaling = cfg.get("scaling") or {}
    if scaling.get("baseline"):
        baseline_summary_path(scaling.baseline)


def check_warmup(cfg: DictConfig) -> None:
    """``warmup_steps`` and ``warmup_fraction`` are two ways to say one ramp: one at most."""
    from litscale.optim.schedulers import check_warmup_keys

    for group in ("scheduler", "lr_scaling"):
        node = cfg.get(group)
        if node is not None and "_target_" in node:
            try:
                check_warmup_keys(group, node.get("warmup_steps"), node.get("warmup_fraction"))
            except ValueError as error:
                raise ConfigError(str(error)) from None


def meta_net(cfg: DictConfig):
    """The zoo network of ``cfg.model.net`` with shapes but no storage."""
    import torch
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    with torch.device("meta"):
        try:
            return instantiate(cfg.model.net, _convert_="all")
        except InstantiationException as error:  # Hydra's several lines around the one that matters
            if isinstance(error.__cause__, (ValueError, TypeError)):
                raise error.__cause__ from None
            raise


# The factories of the zoo's networks that have a Hugging Face form (litscale.models.hf_writing).
HF_EXPORTABLE = {"litscale.models.llama.build_llama", "litscale.models.moe.build_moe", "litscale.models.hf.build_hf"}


def check_export_hf(cfg: DictConfig, choices: dict[str, str]) -> None:
    """``export_hf=true`` needs a network with a Hugging Face form (every layout gathers the
    whole network on rank 0 at the end, a pipeline's stages included)."""
    if not cfg.get("export_hf"):
        return
    net = cfg.model.get("net")
    target = net.get("_target_") if isinstance(net, DictConfig) else None
    if target not in HF_EXPORTABLE:
        raise ConfigError(f"export_hf=true needs model=llama, model=moe or model=hf (got model={choices.get('model', target)})")


def check_data_tokenizer(cfg: DictConfig) -> None:
    """``data.tokenizer``, where a data option has one, names a tokenizer that exists: checked
    before ``${data.vocab_size}`` asks it for its size, since an error raised inside an
    interpolation reaches the user as OmegaConf's several lines."""
    if "tokenizer" in cfg.data and not OmegaConf.is_missing(cfg.data, "tokenizer"):
        from litscale.data.tokenizer import tokenizer_error

        message = tokenizer_error(cfg.data.tokenizer)
        if message:
            raise ConfigError(message)


def prepare_data_before_launch(cfg: DictConfig) -> None:
    """A data module that asks for it (``prepare_before_launch``: data=tokens tokenizes its
    corpus) is built, prepares its data and sets up its splits here, once, before any rank
    starts: a bad file or a corpus too small is one line, and the ranks find the cache
    instead of waiting on rank 0 to write it."""
    if not getattr(locate_target(cfg.data._target_, "data"), "prepare_before_launch", False):
        return
    from litscale.app.build import build, trusted_targets

    try:
        datamodule = build(cfg.data, trusted=trusted_targets(cfg))
        datamodule.prepare_data()
        datamodule.setup("fit")
    except ValueError as error:
        raise ConfigError(str(error).splitlines()[0]) from None


def check_data_paths(cfg: DictConfig) -> None:
    target = locate_target(cfg.data._target_, "data")
    missing = getattr(inspect.getmodule(target), "missing_paths_error", None)
    if missing is not None and "paths" in cfg.data:
        message = missing(OmegaConf.to_container(cfg.data, resolve=True)["paths"])
        if message:
            raise ConfigError(message)
