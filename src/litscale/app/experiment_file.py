"""A run, given as command-line overrides, written as a Hydra experiment config: the file
``plan=auto`` leaves behind and each job of ``plan.verify`` runs, so that what was measured
and what the user runs next are the same file."""

from __future__ import annotations

import os

from omegaconf import OmegaConf

# Keys a plan sets (the user's own values of them give way to the plan's), and keys that must
# not follow a run into its experiment (``plan`` would plan again instead of training).
PLAN_KEYS = ("strategy", "trainer.devices", "trainer.num_nodes", "data.batch_size", "trainer.accumulate_grad_batches")
NOT_CARRIED = ("plan", "hydra")


def carried_overrides(user_overrides: list[str], *, keep_layout: bool = False) -> list[str]:
    """The user's overrides that still describe the run once a plan replaces its layout
    (``keep_layout``: the run as given, its layout included)."""
    return without(user_overrides, NOT_CARRIED if keep_layout else PLAN_KEYS + NOT_CARRIED)


def without(overrides: list[str], keys: tuple[str, ...]) -> list[str]:
    """``overrides`` less those of ``keys`` and of the keys under them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides=overrides)
    return [o.input_line for o in parsed if not _under(o.key_or_group, keys)]


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith((f"{p}.", f"{p}/")) for p in prefixes)


def write_experiment(overrides: list[str], path: str, *, groups: set[str], comment: str) -> list[str]:
    """``overrides`` as the experiment file ``path`` (``.../experiment/<name>.yaml``); ``groups``
    are the config groups (``model``, ``strategy``, ...), whose overrides become defaults.
    Returns the overrides a file cannot hold (deletions, ``~key``), to pass on the command line."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    defaults, values, left = [], OmegaConf.create(), []
    for override in OverridesParser.create().parse_overrides(overrides=overrides):
        key = override.key_or_group
        if override.is_delete():
            left.append(override.input_line)
        elif key == "experiment":  # the user's experiment first: the plan's settings override it
            defaults.insert(0, f"/experiment/{override.value()}")
        elif key in groups:
            defaults.append({f"{'' if override.is_add() else 'override '}/{key}": override.value()})
        else:
            OmegaConf.update(values, key, override.value(), force_add=True)
    document = OmegaConf.create({"defaults": defaults, **OmegaConf.to_container(values)})
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        handle.write(f"# @package _global_\n# {comment}\n{OmegaConf.to_yaml(document)}")
    return left
