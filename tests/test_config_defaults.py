"""An option file repeats its ``_target_``'s defaults or says why it differs.

A YAML value that differs from the constructor's default is a second source of truth: the
same object built in Python would behave differently. So each value an option file gives is
either the default of the same-named parameter of its ``_target_``, or listed in
``DELIBERATE`` with the reason the config wants something else. A value is checked in the
file that gives it (``trainer/cpu`` answers for ``accelerator``, ``trainer/default`` for
what ``trainer/cpu`` takes from it). Interpolations (``${...}``), required values (``???``),
Hydra's own keys and parameters without a default are not compared.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import pytest
from helpers.configs import CONF_DIR, compose_options, config_groups, group_options
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

TODO = "TODO: differs from constructor default without a stated reason"

# (group/option, key under the group's node) -> why the config differs from the constructor.
DELIBERATE: dict[tuple[str, str], str] = {
    # callbacks: checkpoints a run and its resumes find by step, next to the best by val/loss
    ("callbacks/default", "model_checkpoint.filename"):
        "checkpoints named by their step (step000005.ckpt), so one is found by step",
    ("callbacks/default", "model_checkpoint.auto_insert_metric_name"):
        "the filename spells the step itself; Lightning would add a `step=` prefix",
    ("callbacks/default", "model_checkpoint.monitor"):
        "the run dir keeps the best checkpoint by val/loss beside last.ckpt (README)",
    ("callbacks/default", "model_checkpoint.save_last"):
        "last.ckpt is what ckpt_path=last and auto resume from",
    ("callbacks/default", "model_checkpoint.save_on_train_epoch_end"):
        "saved after each validation, when val/loss is fresh: runs count steps, not epochs",
    ("callbacks/default", "progress_bar.refresh_rate"): TODO,
    ("callbacks/checkpoints", "model_checkpoint.filename"): "named by step, as callbacks/default names them",
    ("callbacks/checkpoints", "model_checkpoint.auto_insert_metric_name"): "as callbacks/default",
    ("callbacks/checkpoints", "model_checkpoint.every_n_train_steps"):
        "a save every step: the option exists to save often (a combination's 2 steps, a timing of saves)",
    ("callbacks/checkpoints", "model_checkpoint.save_last"): "last.ckpt is what ckpt_path=last and auto resume from",
    # clusters: published hardware differs from the generic defaults
    ("cluster/h100_8x", "achieved_fraction"): "H100 LLM runs reach 40-55% MFU (the file's sources)",
    ("cluster/h100_8x", "overlap"): "NCCL on its own SMs hides most gradient traffic behind backward",
    ("cluster/h100_8x", "optimizer_s_per_param"): "derived from the datasheet's HBM3 bandwidth (the file says how)",
    ("cluster/h100_8x", "source"): "where the figures come from, shown with every plan",
    ("cluster/h100_8x", "memory_bandwidth_bytes_s"): "the datasheet's HBM3 bandwidth: what float8's casts cost",
    ("cluster/h100_8x", "grouped_matmul_fractions"):
        "a published H100 benchmark of the experts' grouped matmuls by size (the file cites it)",
    # loggers: files under the run dir that Hydra already made for this one run
    ("logger/csv", "csv.name"): "metrics in <run dir>/csv/metrics.csv, where tests and notebooks read them",
    ("logger/csv", "csv.version"): "one run per Hydra run dir: no version_<n> folder under it",
    ("logger/tensorboard", "tensorboard.name"): "event files in <run dir>/tensorboard",
    ("logger/tensorboard", "tensorboard.version"): "one run per Hydra run dir: no version_<n> folder under it",
    # LR scaling
    ("lr_scaling/linear", "base_batch_size"):
        "the global batch optimizer.lr is tuned for: 16, the default data.batch_size (README)",
    ("lr_scaling/linear", "warmup_fraction"):
        "the scaled rules bring their own warmup, replacing the scheduler's (README, Goyal et al.)",
    ("lr_scaling/none", "rule"): "the option is the rule it names",
    ("lr_scaling/none", "base_batch_size"):
        "the batch the printed line names as optimizer.lr's: 16, the default data.batch_size",
    ("lr_scaling/sqrt", "rule"): "the option is the rule it names (the rest is linear's)",
    ("lr_scaling/mup", "base_width"):
        "the option is µP, which needs a base width: 128, model=gpt's and llama's default preset width",
    # model and optimizers
    ("model/gpt", "weight_decay"): TODO,
    ("model/gpt", "net.dropout"):
        "the presets' 0.0 (null keeps the preset's), given so model.net.dropout=0.1 needs no +",
    ("model/llama", "weight_decay"):
        "AdamW's decoupled decay of 0.1 on matrices, as Llama 1 and 2 were trained (Touvron et al. 2023)",
    ("model/moe", "weight_decay"):
        "AdamW's decoupled decay of 0.1 on matrices, as model=llama, whose decoder the experts extend",
    ("model/hf", "weight_decay"):
        "AdamW's decoupled decay of 0.1 on matrices, as model=llama: the decoders it builds train that way",
    ("optimizer/adamw", "betas"): TODO,
    ("optimizer/sgd", "lr"): TODO,
    ("optimizer/sgd", "momentum"): "the option is SGD with momentum (its comment); torch's 0 is plain SGD",
    ("scheduler/cosine", "warmup_steps"): "the option is a linear warmup, then decay (its comment)",
    ("scheduler/linear", "warmup_steps"): "the option is a linear warmup, then decay (its comment)",
    # trainer: runs counted in optimizer steps, one rank unless asked
    ("trainer/default", "devices"):
        "one rank unless asked, as the default strategy (single) runs; Lightning's auto takes every GPU",
    ("trainer/default", "max_steps"): "the default run trains for 300 steps (README)",
    ("trainer/default", "max_epochs"): "runs end at trainer.max_steps, never at an epoch count",
    ("trainer/default", "val_check_interval"):
        "validation, and so checkpoints, every 100 steps rather than once an epoch",
    ("trainer/default", "check_val_every_n_epoch"):
        "Lightning counts val_check_interval across epochs only with this null",
    ("trainer/default", "limit_val_batches"): TODO,
    ("trainer/default", "num_sanity_val_steps"):
        "the whole (limited) val set before training, so the starting loss is comparable (its comment)",
    ("trainer/default", "log_every_n_steps"): TODO,
    ("trainer/default", "gradient_clip_val"): TODO,
    ("trainer/default", "deterministic"): TODO,
    ("trainer/default", "enable_model_summary"):
        "litscale prints its own one-line model summary at start (README)",
    ("trainer/default", "enable_progress_bar"):
        "Lightning's null means true; given so trainer.enable_progress_bar=false needs no +",
    ("trainer/cpu", "accelerator"): "the option is CPU processes (its comment)",
    ("trainer/gpu", "accelerator"): "the option is CUDA devices (its comment)",
    ("trainer/gpu", "devices"): "every visible GPU (its comment)",
    ("trainer/gpu", "benchmark"): "cuDNN autotuning on GPUs (experiment gpt2_small_h100 relies on it)",
    ("trainer/debug", "max_steps"): "a few steps end to end, to check a config quickly (its comment)",
    ("trainer/debug", "val_check_interval"): "a few steps end to end, to check a config quickly (its comment)",
    ("trainer/debug", "limit_val_batches"): "a few steps end to end, to check a config quickly (its comment)",
    ("trainer/debug", "log_every_n_steps"): "a few steps end to end, to check a config quickly (its comment)",
}

# Groups whose options carry no constructor arguments of their own: Hydra's settings, and
# experiments, which set other groups' values (test_configs.test_experiment checks those).
UNTARGETED_GROUPS = ("hydra", "experiment", "sweeps")
OPTIONS = [(group, option) for group in config_groups() if group not in UNTARGETED_GROUPS
           for option in group_options(group)]


@functools.cache
def composed() -> DictConfig:
    return compose_options(OPTIONS)


def constructor_defaults(target: Any) -> dict[str, Any]:
    """Each parameter's default; a class whose ``__init__`` takes ``**kwargs`` is followed into
    its base classes (as litscale's validation follows it)."""
    functions = [target]
    if inspect.isclass(target):
        functions = [cls.__init__ for cls in target.__mro__ if "__init__" in vars(cls) and cls is not object]
    defaults: dict[str, Any] = {}
    for function in functions:
        parameters = inspect.signature(function).parameters.values()
        for parameter in parameters:
            if parameter.default is not inspect.Parameter.empty:
                defaults.setdefault(parameter.name, parameter.default)
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return defaults


def targeted_nodes(node: DictConfig, path: tuple[str, ...] = ()):
    """``(path, node)`` for ``node`` and each node below it that names a ``_target_``."""
    if "_target_" in node:
        yield path, node
    for key in node:
        if OmegaConf.is_missing(node, key) or OmegaConf.is_interpolation(node, key):
            continue
        if isinstance(node[key], DictConfig):
            yield from targeted_nodes(node[key], (*path, key))


def given_values(raw: DictConfig) -> dict[str, Any]:
    """The plain values a YAML node gives (not Hydra's keys, interpolations, ``???``, nor a
    nested object, which is a node of its own)."""
    values = {}
    for key in raw:
        if key.startswith("_") or key == "defaults" or OmegaConf.is_missing(raw, key) \
                or OmegaConf.is_interpolation(raw, key):
            continue
        value = raw[key]
        if isinstance(value, DictConfig):
            continue
        values[key] = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    return values


def _comparable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def differences(group: str, option: str) -> dict[str, str]:
    """``{key: "given vs default"}`` for each value ``conf/<group>/<option>.yaml`` gives that
    differs from its constructor's default (keys under the group's node: ``net.dropout``)."""
    raw = OmegaConf.load(CONF_DIR / group / f"{option}.yaml")
    found = {}
    for path, node in targeted_nodes(composed()[group][option]):
        raw_node = OmegaConf.select(raw, ".".join(path)) if path else raw
        if not isinstance(raw_node, DictConfig):
            continue  # the whole object comes from a file this one extends
        defaults = constructor_defaults(get_object(node._target_))
        for key, value in given_values(raw_node).items():
            if key in defaults and _comparable(value) != _comparable(defaults[key]):
                found[".".join((*path, key))] = f"{value!r} vs default {defaults[key]!r}"
    return found


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}/{o}" for g, o in OPTIONS])
def test_values_are_the_constructor_defaults_unless_deliberate(group, option):
    unexplained = {key: text for key, text in differences(group, option).items()
                   if (f"{group}/{option}", key) not in DELIBERATE}
    assert unexplained == {}, "list each in DELIBERATE with its reason, or drop it from the YAML"


def test_deliberate_entries_still_differ():
    """An entry whose value has since become the default, or left its file, goes."""
    stale = [(option, key) for option, key in DELIBERATE
             if key not in differences(*option.split("/"))]
    assert stale == []
    assert all(reason.strip() for reason in DELIBERATE.values())
