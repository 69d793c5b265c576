"""The config's options against what its strategy says it accepts (the strategy contract,
``litscale.parallel.contract``): each refusal one line, before any rank starts.

Validation asks here and only here which strategy takes which option; the strategies answer
for themselves, so a new strategy (or a user's own) needs no entry in any table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from litscale.app.checks.devices import resolve_accelerator
from litscale.app.checks.fault_tolerance import replicas_chosen
from litscale.app.checks.safety import locate_target
from litscale.app.checks.width import base_width_of, width_rule
from litscale.errors import ConfigError
from litscale.optim.muon import adapts_each_tensor, wants_parameter_roles
from litscale.parallel.contract import (
    Option,
    missing_requirement,
    network_refusal,
    refusal_line,
    why_not,
    why_not_with,
)

if TYPE_CHECKING:
    from torch import nn


def strategy_name(cfg: DictConfig, choices: dict[str, str]) -> str:
    """The strategy as the user chose it (its option name), else its ``_target_``."""
    return choices.get("strategy", cfg.strategy._target_)


def chosen_options(cfg: DictConfig, choices: dict[str, str]) -> dict[Option, str]:
    """The contract options this config asks for, each as the user typed it; those its network
    asks for by what it declares (a mixture of experts) are checked once it is built
    (``check_network_accepted``)."""
    chosen: dict[Option, str] = {}
    if cfg.precision.lightning == "16-mixed":
        chosen[Option.FP16_MIXED] = f"precision={choices.get('precision', 'fp16_mixed')}"
    if "_target_" in (cfg.get("compression") or {}):
        chosen[Option.COMPRESSION] = f"compression={choices.get('compression', cfg.compression._target_)}"
    if "_target_" in (cfg.get("determinism") or {}):
        chosen[Option.LAYOUT_INVARIANT] = f"determinism={choices.get('determinism', 'layout_invariant')}"
    optimizer = locate_target(cfg.optimizer._target_, "optimizer")
    typed_optimizer = f"optimizer={choices.get('optimizer', cfg.optimizer._target_)}"
    if wants_parameter_roles(optimizer):
        chosen[Option.MATRIX_OPTIMIZER] = typed_optimizer
    if adapts_each_tensor(optimizer):
        chosen[Option.LAYERWISE_OPTIMIZER] = typed_optimizer
    if (cfg.get("checkpoint") or {}).get("async_save"):
        chosen[Option.ASYNC_SAVE] = Option.ASYNC_SAVE.value
    if base_width_of(cfg) is not None:
        chosen[Option.WIDTH_SCALING] = width_rule(choices)
    if replicas_chosen(cfg):
        chosen[Option.REPLICA_GROUPS] = f"fault_tolerance={choices.get('fault_tolerance', 'replicas')}"
    data = cfg.get("data") or {}
    if data.get("document_mask"):
        chosen[Option.TOKEN_BATCHES] = "data.document_mask=true"
    elif "_target_" in data and getattr(locate_target(data._target_, "data"), "yields_token_batches", False):
        chosen[Option.TOKEN_BATCHES] = f"data={choices.get('data', data._target_)}"
    return chosen


def run_settings(cfg: DictConfig) -> dict[str, Any]:
    """The settings a strategy may refuse an option with (``why_not_with``): the optimizer's
    keys and the trainer's, dotted, the accelerator resolved (``auto`` is this machine's)."""
    settings = {f"optimizer.{key}": value for key, value in cfg.optimizer.items() if not key.startswith("_")}
    settings |= {f"trainer.{key}": value for key, value in cfg.trainer.items()}
    settings["trainer.accelerator"] = resolve_accelerator(str(cfg.trainer.get("accelerator", "auto")))
    return settings


def check_strategy_accepts(cfg: DictConfig, choices: dict[str, str], strategy: Any) -> None:
    """The strategy's package is installed and it takes every option the config chose."""
    name = strategy_name(cfg, choices)
    missing = missing_requirement(strategy, name)
    if missing:
        raise ConfigError(missing)
    settings = run_settings(cfg)
    for option, typed in chosen_options(cfg, choices).items():
        reason = why_not(strategy, option)
        if reason is not None:
            raise ConfigError(refusal_line(option, name, reason, typed=typed))
        refused = why_not_with(strategy, option, settings)
        if refused is not None:
            raise ConfigError(refused.line(typed, name))


def check_network_accepted(cfg: DictConfig, choices: dict[str, str], strategy: Any, net: nn.Module) -> None:
    """The strategy takes every option the network asks for by what it declares (a mixture of
    experts: ``litscale.parallel.contract.network_options``), as ``docs/compatibility.md`` states it."""
    refused = network_refusal(strategy, net, strategy_name(cfg, choices),
                              typed=f"model={choices.get('model', cfg.model.net.get('_target_'))}")
    if refused is not None:
        raise ConfigError(refused)
