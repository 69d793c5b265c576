"""A search space written in Hydra's sweep syntax, as Optuna distributions.

The same syntax as Hydra's own Optuna sweeper: ``choice(8, 16)`` is categorical,
``range(1, 5)`` an integer range (stop excluded, as in Hydra's basic sweeper),
``interval(1e-4, 1e-2)`` a float interval and ``tag(log, interval(...))`` the same on a log
scale; anything else is a fixed value given to every trial.
"""

from __future__ import annotations

from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import (
    ChoiceSweep,
    IntervalSweep,
    Override,
    RangeSweep,
    Transformer,
)


def parse(pairs: list[str]) -> list[Override]:
    """``key=value`` strings as Hydra overrides."""
    return OverridesParser.create().parse_overrides(overrides=pairs)


def distribution(override: Override) -> Any:
    """The Optuna distribution of one sweep override (its plain value where it is not a sweep)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    value = override.value()
    if not override.is_sweep_override():
        return value
    if isinstance(value, ChoiceSweep):
        return CategoricalDistribution(
            list(override.sweep_iterator(transformer=Transformer.encode))
        )
    if isinstance(value, RangeSweep):
        if all(isinstance(x, int) for x in (value.start, value.stop, value.step)):
            return IntDistribution(int(value.start), int(value.stop) - 1, step=int(value.step))
        return FloatDistribution(value.start, value.stop, step=value.step)
    if isinstance(value, IntervalSweep):
        log = "log" in value.tags
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(value.start, value.end, log=log)
        return FloatDistribution(value.start, value.end, log=log)
    raise ValueError(
        f"{override.input_line}: a search parameter is choice(...), range(...) or interval(...)"
    )


def split(overrides: list[Override]) -> tuple[dict[str, Any], list[str]]:
    """The search space (key -> distribution) and the fixed overrides every trial gets."""
    space: dict[str, Any] = {}
    fixed: list[str] = []
    for override in overrides:
        if override.is_sweep_override():
            space[override.get_key_element()] = distribution(override)
        else:
            fixed.append(override.input_line)
    return space, fixed
