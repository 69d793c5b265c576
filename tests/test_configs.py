"""Every option of every config group composes, validates and builds the objects it names.

Groups and options are discovered from ``conf/<group>/*.yaml``, so a new option is covered
without touching this file; a new group needs an entry in ``GROUP_CHECKS``.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from helpers.configs import (
    CONF_DIR,
    as_job,
    compose_full,
    compose_job,
    config_groups,
    group_options,
)
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import Strategy, StrategyRegistry
from omegaconf import OmegaConf
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from litscale.app.build import (
    _build_callbacks,
    _build_named,
    build,
    build_module,
    build_run,
    build_strategy,
)
from litscale.app.checks.devices import CPU_PRECISIONS
from litscale.app.checks.safety import locate_target
from litscale.app.checks.validation import ConfigError, validate
from litscale.arguments import signature_annotations
from litscale.compression import CommHook
from litscale.modules import TaskModule
from litscale.precision import PrecisionDtypes

CUDA = torch.cuda.is_available()


# --- pairing: what an option needs from the other groups ------------------------------------


def _option_node(group: str, option: str):
    return OmegaConf.load(CONF_DIR / group / f"{option}.yaml")


def data_task(option: str) -> str:
    node = _option_node("data", option)
    return node.get("task") or locate_target(node._target_, "data").task


def model_task(option: str) -> str:
    return locate_target(_option_node("model", option)._target_, "model").task


def _default_choice(group: str) -> str:
    defaults = OmegaConf.load(CONF_DIR / "train.yaml").defaults
    return next(entry[group] for entry in defaults if OmegaConf.is_dict(entry) and group in entry)


def _needs_paths(option: str) -> bool:
    node = _option_node("data", option)
    return "paths" in node.keys() and OmegaConf.is_missing(node, "paths")


def _reads_paths(option: str) -> bool:
    return "paths" in _option_node("data", option).keys()


@functools.cache
def data_for(task: str) -> str:
    """The default data option if it has ``task``, else the first that needs no ``paths``."""
    candidates = [_default_choice("data")] + group_options("data")
    return next(o for o in candidates if data_task(o) == task and not _needs_paths(o))


@functools.cache
def model_for(task: str) -> str:
    candidates = [_default_choice("model")] + group_options("model")
    return next(o for o in candidates if model_task(o) == task)


# Data options whose default corpus tokenizes in about a second (data=sft: litscale's example chats).
SMALL_DEFAULT_DATA = ("sft",)


def pairing(group: str, option: str, tmp_path) -> list[str]:
    """Overrides that make ``group=option`` a config that can run on this machine."""
    if group == "model":
        return [f"data={data_for(model_task(option))}"]
    if group == "data":
        extra = []
        # A few lines of text, also where the option has a default corpus: data=tokens would
        # tokenize the whole standard library here (seconds); that default is test_tokens.py's.
        if _reads_paths(option) and option not in SMALL_DEFAULT_DATA:
            corpus = tmp_path / "corpus"
            corpus.mkdir()
            (corpus / "a.txt").write_text("hello litscale\n" * 100)
            extra.append(f"data.paths={corpus}/*.txt")
        return [f"model={model_for(data_task(option))}", *extra]
    if group == "precision" and option not in CPU_PRECISIONS:
        return ["trainer.accelerator=cpu"]
    if group == "compression":
        return ["strategy=ddp"]  # the strategy that takes a compression hook
    if group == "fault_tolerance" and option == "replicas":
        return ["launcher.oversubscribe=true"]  # its 3 groups' ranks on a machine of 2 cores
    return []


def expected_error(group: str, option: str) -> str | None:
    """The start of the ConfigError a composed option must raise here, or None."""
    if group == "precision" and option not in CPU_PRECISIONS:
        return f"precision={option} is not supported on cpu"
    if group == "trainer" and not CUDA:
        node = compose_full([f"trainer={option}"]).trainer
        if node.accelerator in ("gpu", "cuda"):
            return f"trainer.accelerator={node.accelerator} but no CUDA device is visible"
    return None


# --- per-group checks of the built objects --------------------------------------------------


def check_trainer(cfg, choices, tmp_path):
    trainer = build(cfg.trainer, strategy=build_strategy(cfg), precision=cfg.precision.lightning,
                    callbacks=_build_callbacks(cfg), logger=False, use_distributed_sampler=False,
                    default_root_dir=cfg.paths.output_dir)
    assert isinstance(trainer, Trainer)
    assert trainer.max_steps == cfg.trainer.max_steps
    assert trainer.num_nodes == cfg.trainer.num_nodes


def check_model(cfg, choices, tmp_path):
    module = build_module(cfg)
    assert isinstance(module, LightningModule) and isinstance(module, TaskModule)
    assert isinstance(module.net, torch.nn.Module)
    module.eval()
    with torch.no_grad():
        if module.task == "classification":
            out = module(torch.randn(2, *cfg.data.input_shape))
            assert out.shape == (2, cfg.data.num_classes)
        else:
            out = module(torch.randint(cfg.data.vocab_size, (2, cfg.data.seq_len)))
            assert out.shape == (2, cfg.data.seq_len, cfg.data.vocab_size)


def check_data(cfg, choices, tmp_path):
    datamodule = build(cfg.data)
    assert isinstance(datamodule, LightningDataModule)
    assert datamodule.batch_size == cfg.data.batch_size
    assert datamodule.task == data_task(choices["data"])


def check_strategy(cfg, choices, tmp_path):
    strategy = build_strategy(cfg)
    assert isinstance(strategy, Strategy)
    target = locate_target(cfg.strategy._target_, "strategy")
    assert not isinstance(target, type) or isinstance(strategy, target)


def check_compression(cfg, choices, tmp_path):
    strategy = build_strategy(cfg)
    if "_target_" in cfg.compression:
        assert isinstance(build(cfg.compression), CommHook)
        assert isinstance(strategy.compression, CommHook)
    else:
        assert len(cfg.compression) == 0, "a compression option without _target_ must be empty"
        assert strategy.compression is None


def check_precision(cfg, choices, tmp_path):
    assert cfg.precision.lightning in ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
    trainer = build(cfg.trainer, strategy=build_strategy(cfg), precision=cfg.precision.lightning,
                    logger=False, enable_checkpointing=False, use_distributed_sampler=False,
                    default_root_dir=cfg.paths.output_dir)
    assert trainer.precision == cfg.precision.lightning


def check_optimizer(cfg, choices, tmp_path):
    factory = build(cfg.optimizer)
    params = [torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(2))]
    optimizer = factory(params)
    assert isinstance(optimizer, Optimizer)
    target = locate_target(cfg.optimizer._target_, "optimizer")
    assert not isinstance(target, type) or isinstance(optimizer, target)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(cfg.optimizer.lr)


def check_scheduler(cfg, choices, tmp_path):
    optimizer = build(cfg.optimizer)([torch.nn.Parameter(torch.zeros(2))])
    scheduler = build(cfg.scheduler)(optimizer, total_steps=100)
    assert isinstance(scheduler, LRScheduler)
    assert scheduler.optimizer is optimizer
    for _ in range(100):
        optimizer.step()
        scheduler.step()
    # Every schedule ends at min_lr_ratio x the peak (a constant one at the peak).
    end = cfg.optimizer.lr * cfg.scheduler.get("min_lr_ratio", 1.0)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(end)


def check_logger(cfg, choices, tmp_path):
    loggers = _build_named(cfg.logger)
    targets = [n for n in cfg.logger.values() if "_target_" in n]
    assert len(loggers) == len(targets)
    assert all(isinstance(logger, Logger) for logger in loggers)
    if choices["logger"] == "wandb":
        assert loggers[0]._offline is True  # no API key configured


def check_callbacks(cfg, choices, tmp_path):
    callbacks = _build_named(cfg.callbacks)
    assert len(callbacks) == len([n for n in cfg.callbacks.values() if "_target_" in n])
    assert all(isinstance(callback, Callback) for callback in callbacks)


def check_paths(cfg, choices, tmp_path):
    assert cfg.paths.root_dir == str(tmp_path / "outputs")  # from $LITSCALE_OUTPUTS


def check_lr_scaling(cfg, choices, tmp_path):
    """An LR-scaling rule with a ``_target_`` is a callback; ``none`` builds nothing."""
    assert OmegaConf.is_dict(cfg.lr_scaling)
    if "_target_" in cfg.lr_scaling:
        assert isinstance(build(cfg.lr_scaling), Callback)


def check_cluster(cfg, choices, tmp_path):
    """A cluster builds; ``local_cpu`` from this machine's calibration file (a made-up one here:
    the calibration itself is tested in test_planner.py)."""
    import json
    import os

    from litscale.planner.cluster import Cluster

    figures = {"cores": 2, "memory_bytes": 8 * 2**30, "peak_flops": {"float32": 1e11, "bfloat16": 2e11},
               "bandwidth_bytes_s": 1e9, "latency_s": 1e-4, "measured": "test"}
    (tmp_path / "cluster_local_cpu.json").write_text(json.dumps(figures))
    previous = os.environ.get("LITSCALE_CACHE")
    os.environ["LITSCALE_CACHE"] = str(tmp_path)
    try:
        cluster = build(cfg.cluster)
    finally:
        os.environ.pop("LITSCALE_CACHE") if previous is None else os.environ.update(LITSCALE_CACHE=previous)
    assert isinstance(cluster, Cluster) and cluster.world_size >= 1


def check_plan(cfg, choices, tmp_path):
    assert cfg.plan.mode == choices["plan"]


def check_determinism(cfg, choices, tmp_path):
    from litscale.reliability.determinism import LayoutInvariance

    determinism = build_module(cfg).determinism
    if "_target_" in cfg.determinism:
        assert isinstance(determinism, LayoutInvariance) and determinism.chunks == cfg.determinism.chunks
    else:
        assert len(cfg.determinism) == 0 and determinism is None


def check_fault_tolerance(cfg, choices, tmp_path):
    layout = validate(cfg, choices=choices)
    replicas = build(cfg.fault_tolerance) if "_target_" in cfg.fault_tolerance else None
    assert (replicas is not None) == (choices["fault_tolerance"] == "replicas")
    assert layout.replica_groups == (replicas.groups if replicas is not None else 1)


GROUP_CHECKS = {
    "trainer": check_trainer,
    "model": check_model,
    "data": check_data,
    "strategy": check_strategy,
    "compression": check_compression,
    "precision": check_precision,
    "optimizer": check_optimizer,
    "scheduler": check_scheduler,
    "logger": check_logger,
    "callbacks": check_callbacks,
    "paths": check_paths,
    "lr_scaling": check_lr_scaling,
    "cluster": check_cluster,
    "plan": check_plan,
    "determinism": check_determinism,
    "fault_tolerance": check_fault_tolerance,
    "hydra": None,  # checked on the composed hydra node, see test_option
    "experiment": None,  # see test_experiment
    "sweeps": None,  # +sweeps=<option> beside hydra/sweeper=optuna: see test_optuna.py
}

OPTIONS = [(g, o) for g in config_groups() if g not in ("experiment", "sweeps") for o in group_options(g)]


def test_every_group_has_a_check():
    assert set(config_groups()) <= set(GROUP_CHECKS), "add a check for the new config group"
    assert len(OPTIONS) >= 20


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


@pytest.mark.slow
@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option(group, option, tmp_path, outputs_root, wandb_offline, monkeypatch):
    overrides = [f"{group}={option}", *pairing(group, option, tmp_path)]
    full = compose_full(overrides)
    assert full.hydra.runtime.choices[group] == option
    if group == "hydra":
        root = f"{outputs_root}/{full.name}/"
        assert full.hydra.run.dir.startswith(root + "runs/")
        assert full.hydra.sweep.dir.startswith(root + "multiruns/")
    cfg, choices = as_job(full, tmp_path / "run")

    error = expected_error(group, option)
    if error is not None:
        with pytest.raises(ConfigError) as info:
            validate(cfg, choices=choices)
        assert str(info.value).startswith(error)
        return
    layout = validate(cfg, choices=choices)
    if GROUP_CHECKS[group] is not None:
        GROUP_CHECKS[group](cfg, choices, tmp_path)

    if group == "logger" and option == "wandb":
        return  # build_run would log hyperparameters, which starts a wandb run
    # The whole run as each rank builds it, from the resolved config.
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # restored after the test; seeding sets it
    built = build_run(OmegaConf.to_container(cfg, resolve=True), choices, layout)
    assert isinstance(built.trainer, Trainer)
    assert isinstance(built.datamodule, LightningDataModule)
    assert isinstance(built.module, LightningModule)
    assert built.module.task == built.datamodule.task
    assert isinstance(built.trainer.strategy, Strategy)
    assert built.trainer.precision == cfg.precision.lightning
    for node in (cfg.callbacks or {}).values():
        cls = locate_target(node._target_, "callbacks")
        assert any(isinstance(c, cls) for c in built.trainer.callbacks), node._target_
    assert len(built.trainer.loggers) == len([n for n in (cfg.logger or {}).values()])


# --- experiments ----------------------------------------------------------------------------


def _leaves(node, prefix=""):
    for key, value in node.items():
        path = f"{prefix}{key}"
        if OmegaConf.is_dict(value):
            yield from _leaves(value, path + ".")
        else:
            yield path, value


@pytest.mark.slow
@pytest.mark.parametrize("option", group_options("experiment"))
def test_experiment(option, tmp_path, outputs_root, monkeypatch):
    cfg, choices = compose_job([f"experiment={option}"], tmp_path / "run")
    assert choices["experiment"] == option
    layout = validate(cfg, choices=choices)
    raw = _option_node("experiment", option)
    assert "# @package _global_" in (CONF_DIR / "experiment" / f"{option}.yaml").read_text()
    for entry in raw.get("defaults", []):
        for key, value in entry.items():
            assert choices[key.removeprefix("override /")] == value
    body = OmegaConf.masked_copy(raw, [k for k in raw if k != "defaults"])
    for key, value in _leaves(body):
        assert OmegaConf.select(cfg, key) == value, key  # the experiment wins over its groups
    assert model_task(choices["model"]) == data_task(choices["data"])
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")
    # On the meta device: experiments name real sizes (GPT-2 small, a 1.2B Llama), whose weights
    # would take seconds and gigabytes to initialise here; what is built is the same.
    with torch.device("meta"):
        built = build_run(OmegaConf.to_container(cfg, resolve=True), choices, layout)
    assert built.module.task == built.datamodule.task
    assert all(p.is_meta for p in built.module.parameters())


# --- defaults and registry ------------------------------------------------------------------


def test_default_config_validates(tmp_path, outputs_root):
    cfg, choices = compose_job([], tmp_path / "run")
    validate(cfg, choices=choices)
    defaults = OmegaConf.load(CONF_DIR / "train.yaml").defaults
    for entry in defaults:
        if OmegaConf.is_dict(entry):
            (group, option), = entry.items()
            if option is not None:  # `override hydra/sweeper: litscale` picks Hydra's own group
                assert choices[group.removeprefix("override ")] == option


@pytest.mark.parametrize("option", group_options("strategy"))
def test_strategy_registered(option):
    import litscale.strategies  # noqa: F401  (registers litscale_*)

    name = f"litscale_{option}"
    assert name in StrategyRegistry
    target = locate_target(_option_node("strategy", option)._target_, "strategy")
    assert StrategyRegistry[name]["strategy"] is target
    assert isinstance(StrategyRegistry.get(name), target)


def test_known_strategies_registered():
    import litscale.strategies  # noqa: F401

    assert {"litscale_single", "litscale_ddp"} <= set(StrategyRegistry.available_strategies())


def test_sqrt_rule_is_the_linear_option_but_for_its_rule():
    """``lr_scaling/sqrt.yaml`` extends ``linear.yaml``: base batch and warmup stay in one file."""
    linear, sqrt = (OmegaConf.to_container(compose_full([f"lr_scaling={rule}"]).lr_scaling)
                    for rule in ("linear", "sqrt"))
    assert (linear.pop("rule"), sqrt.pop("rule")) == ("linear", "sqrt")
    assert sqrt == linear


# --- runtime objects reach the strategy as built --------------------------------------------

HOOKED = [o for o in group_options("compression") if "_target_" in _option_node("compression", o)]


def _accepts(option: str, argument: str) -> bool:
    target = locate_target(_option_node("strategy", option)._target_, "strategy")
    return argument in signature_annotations(target)


# Regression: a dataclass passed through hydra's instantiate arrives as a plain dict.
@pytest.mark.parametrize("option", HOOKED)
def test_strategy_gets_the_comm_hook(option, tmp_path, outputs_root):
    strategies = [o for o in group_options("strategy") if _accepts(o, "compression")]
    cfg, _ = compose_job([f"strategy={strategies[0]}", f"compression={option}"], tmp_path / "run")
    assert isinstance(build_strategy(cfg).compression, CommHook)


@pytest.mark.parametrize(
    "option", [o for o in group_options("strategy") if _accepts(o, "precision_dtypes")])
def test_strategy_gets_precision_dtypes(option, tmp_path, outputs_root):
    cfg, _ = compose_job([f"strategy={option}", "precision=bf16_mixed"], tmp_path / "run")
    dtypes = build_strategy(cfg).precision_dtypes
    assert isinstance(dtypes, PrecisionDtypes)
    assert (dtypes.param, dtypes.compute, dtypes.reduce) == (
        torch.float32, torch.bfloat16, torch.float32)


def test_a_run_that_never_validates_skips_the_starting_validation():
    """The sanity pass gives val/loss_initial, a baseline for the run's own validation: a fresh
    run ending before its first validation skips it; one that validates, resumes, or counts
    its interval in epochs keeps it."""
    from omegaconf import OmegaConf

    from litscale.app.build import never_validates

    def trainer(**values):
        return OmegaConf.create({"max_steps": 300, "val_check_interval": 100, "check_val_every_n_epoch": None,
                                 **values})

    assert never_validates(trainer(max_steps=1), None)
    assert never_validates(trainer(max_steps=99), None)
    assert not never_validates(trainer(max_steps=100), None)
    assert not never_validates(trainer(max_steps=1), "last")  # a resumed run may cross step 100
    assert not never_validates(trainer(max_steps=1, val_check_interval=0.5), None)  # a share of an epoch
    assert not never_validates(trainer(max_steps=1, check_val_every_n_epoch=1), None)
    assert not never_validates(trainer(max_steps=-1), None)


@pytest.mark.slow
def test_compositions_come_out_the_same_with_the_faster_composition():
    """``helpers.configs.faster_composition`` hands Hydra copies of the files it read before
    and skips maps nothing reads: the tests' compositions must be exactly Hydra's own (an
    override once leaked into the next composition through a shared copy)."""
    from helpers.combinations import sample
    from helpers.configs import CONF_DIR, faster_composition
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    commands = [["checkpoint.async_save=true", "callbacks=checkpoints", "strategy=fsdp"], ["strategy=ddp"],
                ["model=moe", "optimizer=muon", "trainer.gradient_clip_val=null"], [],
                *(combination.overrides() for combination in sample(4, seed=0))]

    def composed(read_once: bool) -> list:
        found = []
        for overrides in commands:
            GlobalHydra.instance().clear()
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"), \
                    (faster_composition() if read_once else contextlib.nullcontext()):
                found.append(OmegaConf.to_container(compose("train", overrides=overrides, return_hydra_config=True)))
        return found

    assert composed(read_once=True) == composed(read_once=False)
