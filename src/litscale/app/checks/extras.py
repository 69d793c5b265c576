"""Every optional package a composed config needs, refused in one line where it is missing,
before any run dir or rank exists (who declares what: ``litscale.extras``).

A package is checked where it will be imported:

- the launcher's and the sweeper's (``hydra/launcher=ray``, ``hydra/sweeper=optuna``) in the
  process that starts a sweep (``check_sweep_extras``, from ``train.py -m``'s pre-flight);
- the job's (its loggers, data, strategy, precision, replica groups, export) where its ranks
  start (``check_job_extras``, from validation on that machine: a cluster job is checked on its
  node, and a plan, which imports none of them, not at all).

A Hydra option whose own defaults come from a missing package (``hydra/launcher=slurm``
extends hydra-submitit-launcher's ``submitit_slurm``) cannot be composed at all:
``missing_option_package`` reads the options a command line names, file by file.

NOTE: a network built during validation (``model=hf``, ``model.net.from_hf``) checks its
package itself, after its paths, so that a bad path is named as such with or without the extra.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from litscale.app.checks.safety import locate_target
from litscale.app.checks.schemas import PrecisionSchema, RunSchema
from litscale.errors import ConfigError
from litscale.extras import TENSORBOARD, WANDB, Requirement

# Targets in other packages that litscale's configs name: they cannot carry a ``requires``.
OTHER_PACKAGES_TARGETS: dict[str, tuple[Requirement, ...]] = {
    "lightning.pytorch.loggers.TensorBoardLogger": (TENSORBOARD,),
    "lightning.pytorch.loggers.WandbLogger": (WANDB,),
}
# The schemas of keys that are not constructor arguments, by where they sit in the config.
SCHEMAS = (("", RunSchema), ("precision", PrecisionSchema))
# What the sweep's own process builds under ``-m``: Hydra's launcher and sweeper.
SWEEP_NODES = ("launcher", "sweeper")
UNSET = (None, False, "none")


@dataclass(frozen=True)
class Need:
    """A package the config needs, and what asked for it as the user typed it."""

    typed: str
    requirement: Requirement


def check_job_extras(cfg: DictConfig, choices: dict[str, str]) -> None:
    """Raise ``ConfigError`` for the first package the job needs that is not installed."""
    needs = (need for key, node in cfg.items_ex(resolve=False) if key != "hydra"
             for need in target_needs(node, str(key), choices))
    _refuse_first_missing(needs)
    _refuse_first_missing(schema_needs(cfg))


def check_sweep_extras(cfg: DictConfig, choices: dict[str, str]) -> None:
    """Raise ``ConfigError`` for the first package the sweep's launcher or sweeper needs that
    is not installed (``cfg`` as composed, its ``hydra`` node included)."""
    hydra = cfg.get("hydra") or {}
    _refuse_first_missing(need for part in SWEEP_NODES if part in hydra
                          for need in target_needs(hydra._get_node(part), f"hydra.{part}", choices))


def missing_option_package(overrides: list[str], config_dir: str) -> str | None:
    """The one line for an option the command line chooses (``group=option``) whose own
    ``_target_``s need a package that is not installed, read from its file in ``config_dir``;
    None if there is none (for a config that Hydra could not compose)."""
    for override in overrides:
        group, _, option = override.lstrip("+").partition("=")
        path = os.path.join(config_dir, group, f"{option}.yaml")
        if not option or "." in group or not os.path.isfile(path):
            continue
        needs = target_needs(OmegaConf.load(path), group.replace("/", "."), {group: option})
        try:
            _refuse_first_missing(needs)
        except ConfigError as error:
            return str(error)
    return None


def target_needs(node: Any, path: str, choices: dict[str, str]) -> Iterator[Need]:
    """The packages that the ``_target_``s under ``node`` (at ``path``) declare, each node's
    before its children's: a child's module may itself import its parent's package (the Optuna
    sweeper's sampler), so it is located only once the parent's package is found."""
    if isinstance(node, DictConfig | ListConfig) and (node._is_none() or node._is_missing()):
        return  # an optional node left unset (hydra.launcher.setup: null)
    if isinstance(node, DictConfig):
        items = dict(node.items_ex(resolve=False))
        target = items.get("_target_")
        if isinstance(target, str):
            found = locate_target(target, path)
            for requirement in getattr(found, "requires", None) or OTHER_PACKAGES_TARGETS.get(target, ()):
                yield Need(_typed_choice(path, target, choices), requirement)
            for key, requirement in (getattr(found, "requires_when", None) or {}).items():
                yield from _when_set(node, key, f"{path}.{key}", requirement)
        for key, value in items.items():
            yield from target_needs(value, f"{path}.{key}", choices)
    elif isinstance(node, ListConfig):
        for index, value in enumerate(node):
            yield from target_needs(value, f"{path}[{index}]", choices)


def schema_needs(cfg: DictConfig) -> Iterator[Need]:
    """The packages that the keys described by ``SCHEMAS`` ask for when they are set."""
    for prefix, schema in SCHEMAS:
        node = cfg if not prefix else cfg.get(prefix)
        for key, requirement in getattr(schema, "requires_when", {}).items():
            if isinstance(node, DictConfig):
                yield from _when_set(node, key, f"{prefix}.{key}" if prefix else key, requirement)


def _when_set(node: DictConfig, key: str, typed_key: str, requirement: Requirement) -> Iterator[Need]:
    value = node.get(key)
    if value not in UNSET:
        yield Need(f"{typed_key}={_shown(value)}", requirement)


def _typed_choice(path: str, target: str, choices: dict[str, str]) -> str:
    """``logger.wandb`` -> ``logger=wandb``: the group option that brought the node in (the
    longest group its path lies in), else its ``_target_`` as set."""
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        group = "/".join(parts[:end])
        if group in choices:
            return f"{group}={choices[group]}"
    return f"{path}._target_={target}"


def _refuse_first_missing(needs: Iterator[Need]) -> None:
    for need in needs:
        if need.requirement.missing():
            raise ConfigError(need.requirement.refusal(need.typed))


def _shown(value: Any) -> str:
    return {True: "true", False: "false", None: "null"}.get(value, value) if isinstance(value, bool | None) \
        else str(value)
