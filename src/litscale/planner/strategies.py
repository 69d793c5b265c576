"""The strategies as the planner asks them (``litscale.parallel.contract``): which there are, each built
for a plan as a run builds it, and why one refuses a plan, in its own one line.

The planner keeps no table of strategy names and restates none of their rules: the strategies
are those registered in Lightning's ``StrategyRegistry`` as ``litscale_<name>`` (``<name>``:
the ``strategy=`` option), the plannable ones lay out their own candidate meshes
(``candidate_meshes``), and every plan is built and checked by its strategy (its constructor
and ``validate_setup``) on the model's meta-device network before it is costed.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from litscale.parallel.contract import (
    Option,
    contract_value,
    missing_requirement,
    network_refusal,
    refusal_line,
    validate_setup,
    why_not,
    why_not_with,
)
from litscale.parallel.layout import MeshSizes, mesh_of

if TYPE_CHECKING:
    from torch import nn

REGISTERED_PREFIX = "litscale_"


def registered() -> dict[str, type]:
    """litscale's strategies by their ``strategy=`` option, in the order they are registered
    (simplest first: the order of the planner's tie rule)."""
    from lightning.pytorch.strategies import StrategyRegistry

    import litscale.strategies  # noqa: F401  (importing it registers them)

    return _registered(tuple(StrategyRegistry))  # read again only when a strategy is registered or removed


@functools.cache
def _registered(names: tuple[str, ...]) -> dict[str, type]:
    from lightning.pytorch.strategies import StrategyRegistry

    return {name.removeprefix(REGISTERED_PREFIX): StrategyRegistry[name]["strategy"] for name in names
            if name.startswith(REGISTERED_PREFIX)}


def plannable() -> dict[str, type]:
    """The registered strategies whose layouts the planner ranks (``plannable`` in the contract)."""
    return {name: cls for name, cls in registered().items() if contract_value(cls, "plannable")}


@functools.cache
def _keywords(cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(cls.__init__).parameters)


def takes(cls: type, keyword: str) -> bool:
    """Whether ``cls``'s constructor has ``keyword`` (the contract: a strategy takes an option
    exactly when its constructor has the keyword)."""
    return keyword in _keywords(cls)


@functools.cache
def _built(cls: type, options: tuple[tuple[str, Any], ...]) -> Any:
    return cls(**dict(options))


def built(name: str, options: dict[str, Any]) -> Any:
    """The strategy ``strategy=<name>`` built with ``options``, once per class and options (its
    constructor raises ``ValueError`` for options it refuses)."""
    return _built(registered()[name], tuple(sorted(options.items())))


def chosen_options(compute_dtype: str, compression: str) -> dict[Option, str]:
    """The contract's options a plan asks for (its precision, its compression), each as typed."""
    chosen = {}
    if compute_dtype == "float16":
        chosen[Option.FP16_MIXED] = "precision=fp16_mixed"
    if compression != "none":
        chosen[Option.COMPRESSION] = f"compression={compression}"
    return chosen


class Refusals:
    """Why each strategy refuses a plan for one network (on the meta device) and sequence length,
    asked once per strategy, options, world size, micro batch, precision and compression."""

    def __init__(self, net: nn.Module | None, seq_len: int, *, run_options: dict[Option, str] | None = None,
                 settings: Mapping[str, Any] | None = None) -> None:
        """``run_options``: the contract's options the run chose that no plan changes (Muon, the
        determinism mode, ...: all but precision and compression), each as typed; ``settings``:
        the run's ``optimizer.<key>`` and ``trainer.<key>`` values a strategy may refuse them
        with (``litscale.parallel.contract.why_not_with``)."""
        if net is None:
            raise ValueError("the planner asks each strategy to check the model, so the model's facts must carry "
                             "its network (litscale.planner.model_facts.model_facts sets it)")
        self.net, self.seq_len = net, seq_len
        self.run_options = {option: typed for option, typed in (run_options or {}).items()
                            if option not in (Option.FP16_MIXED, Option.COMPRESSION)}
        self.settings = settings or {}
        self._asked: dict[tuple, str | None] = {}

    def __call__(self, name: str, options: dict[str, Any], *, mesh: MeshSizes, micro_batch: int,
                 compute_dtype: str = "float32", compression: str = "none") -> str | None:
        """The strategy's one line against running with ``options`` on ``mesh``, or ``None``
        where it takes it."""
        key = (name, tuple(sorted(options.items())), mesh, micro_batch, compute_dtype, compression)
        if key not in self._asked:
            chosen = {**self.run_options, **chosen_options(compute_dtype, compression)}
            self._asked[key] = self._ask(name, options, mesh, micro_batch, chosen)
        return self._asked[key]

    def _ask(self, name: str, options: dict[str, Any], mesh: MeshSizes, micro_batch: int,
             chosen: dict[Option, str]) -> str | None:
        missing = missing_requirement(registered()[name], name)
        if missing is not None:  # never recommend a run that fails once its ranks import the package
            return missing
        try:
            strategy = built(name, options)
            for option, typed in chosen.items():
                reason = why_not(strategy, option)
                if reason is not None:
                    return refusal_line(option, name, reason, typed=typed)
                refused = why_not_with(strategy, option, self.settings)
                if refused is not None:
                    return refused.line(typed, name)
            validate_setup(strategy, world_size=mesh.world_size, net=self.net, seq_len=self.seq_len,
                           micro_batch=micro_batch)
            refused = network_refusal(strategy, self.net, name)
            if refused is not None:
                return refused
            laid_out = mesh_of(strategy, mesh.world_size)
        except (ValueError, TypeError) as error:
            return str(error).splitlines()[0]
        if laid_out != mesh:  # a plan written without its strategy's options: costed on a mesh it is not run on
            return f"strategy={name} with {options} lays {mesh.world_size} ranks out as {laid_out}, not {mesh}"
        return None
