"""The strategy contract: what litscale asks of every strategy, and the one place a strategy
says what it accepts.

Validation, the planner, the determinism mode, the collective check and
``docs/compatibility.md`` ask these questions here and nowhere else; nobody keeps a table of
strategy names. A strategy answers in two ways:

- **its constructor's signature**: a strategy takes gradient compression, or an expert-,
  context-, tensor- or pipeline-parallel size, exactly when its constructor has that keyword
  (``compression``, ``expert_parallel_size``, ...). The config is checked against the same
  signature, so the two can never disagree;
- **class attributes** (``StrategyContract``): the options it refuses and why (``refuses``),
  the packages it needs (``requires``), whether the collective check can trace its first step
  (``untraced``), what it waits on by phase (``phase_collectives``).

A user's own Lightning strategy need not subclass ``StrategyContract``: every question has the
answer a plain data-parallel strategy would give (``contract_value``). How a strategy saves and
loads is not a question but a mixin every litscale strategy lists beside this one
(``litscale.checkpoint.strategy_checkpointing``).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar

from litscale.extras import Requirement
from litscale.parallel.layout import MeshSizes
from litscale.parallel.sharding import REPLICATED, Sharding

if TYPE_CHECKING:
    from torch import nn


# Why the FSDP2 and DTensor strategies refuse fp16: Lightning's ModelParallelStrategy, which they
# build on, refuses it only once the ranks have started.
NO_SHARDED_LOSS_SCALER = "FSDP2 and DTensor strategies have no sharded loss scaler"


class Option(StrEnum):
    """The options a strategy may refuse, spelled as a user types them."""

    FP16_MIXED = "precision=fp16_mixed"
    COMPRESSION = "compression"
    LAYOUT_INVARIANT = "determinism=layout_invariant"
    MIXTURE_OF_EXPERTS = "model=moe"
    EXPERT_PARALLEL = "strategy.expert_parallel_size"
    CONTEXT_PARALLEL = "strategy.context_parallel_size"
    TENSOR_PARALLEL = "strategy.tensor_parallel_size"
    PIPELINE_PARALLEL = "strategy.pipeline_parallel_size"
    ASYNC_SAVE = "checkpoint.async_save=true"
    MATRIX_OPTIMIZER = "optimizer=muon"
    LAYERWISE_OPTIMIZER = "optimizer=lars or lamb"
    WIDTH_SCALING = "lr_scaling=mup"
    REPLICA_GROUPS = "fault_tolerance=replicas"
    # A batch with a loss mask and packed documents (litscale.data.token_batch): every strategy
    # carries its positions and counts its tokens; a strategy that could not would refuse it.
    TOKEN_BATCHES = "data=sft or data.document_mask=true"


# An option a strategy takes through a keyword of its constructor: the keyword.
OPTION_KEYWORDS = {
    Option.COMPRESSION: "compression",
    Option.EXPERT_PARALLEL: "expert_parallel_size",
    Option.CONTEXT_PARALLEL: "context_parallel_size",
    Option.TENSOR_PARALLEL: "tensor_parallel_size",
    Option.PIPELINE_PARALLEL: "pipeline_parallel_size",
}

# What a user can choose instead, by option (the end of a refusal's line).
ALTERNATIVES = {
    Option.FP16_MIXED: "precision=bf16_mixed or bf16_true",
    Option.COMPRESSION: "compression=none, or a strategy whose data-parallel dimension uses DDP (strategy=ddp)",
    Option.LAYOUT_INVARIANT: "strategy=single, ddp or fsdp",
    Option.MIXTURE_OF_EXPERTS: "strategy=fsdp, tensor_parallel or deepspeed_zero stage 1 or 2",
    Option.EXPERT_PARALLEL: "strategy=fsdp or tensor_parallel",
    Option.CONTEXT_PARALLEL: "strategy=fsdp or tensor_parallel",
    Option.TENSOR_PARALLEL: "strategy=tensor_parallel or pipeline",
    Option.PIPELINE_PARALLEL: "strategy=pipeline",
    Option.ASYNC_SAVE: "checkpoint.async_save=false, or any strategy but deepspeed_zero",
    Option.MATRIX_OPTIMIZER: "optimizer=adamw, or any strategy but deepspeed_zero stage 3",
    Option.LAYERWISE_OPTIMIZER: "optimizer=adamw, sgd or muon, or any strategy but deepspeed_zero",
    Option.WIDTH_SCALING: "lr_scaling=none, linear or sqrt",
    Option.REPLICA_GROUPS: "fault_tolerance=none, or strategy=single, ddp or fsdp inside each group",
    Option.TOKEN_BATCHES: "data=tokens without data.document_mask",
}
# Why a strategy that is not a StrategyContract cannot save in the background: the background
# save is the ``save_checkpoint`` of every litscale strategy (``litscale.checkpoint.strategy_checkpointing``).
NO_CONTRACT_SAVE = "it is not a litscale StrategyContract, whose save_checkpoint writes in the background"


@dataclass(frozen=True)
class SettingRefusal:
    """A setting a strategy refuses beside an option it takes: the key, its value, why (a
    clause) and what is allowed instead."""

    key: str
    value: Any
    reason: str
    allowed: str

    def line(self, option: str, strategy_name: str) -> str:
        """The one line a user sees."""
        typed = {True: "true", False: "false", None: "null"}.get(self.value, self.value) \
            if isinstance(self.value, bool | None) else self.value
        return (f"{self.key}={typed} is not supported with {option} under strategy={strategy_name}: "
                f"{self.reason}; allowed: {self.allowed}")


class StrategyContract:
    """Mixin of every litscale strategy: the contract's questions with a plain data-parallel
    strategy's answers; a strategy overrides what differs. Subclasses of Lightning strategies
    list it first so its defaults come before Lightning's attributes."""

    # Option -> why this strategy cannot take it (a clause, no full stop). By default the
    # determinism mode is refused: it replaces the strategy's gradient reduction, which only a
    # strategy that says how it reduces can allow.
    refuses: ClassVar[dict[Option, str]] = {
        Option.LAYOUT_INVARIANT: "the strategy does not state how it reduces gradients, so their order cannot be fixed",
    }
    # fault_tolerance=replicas averages each rank's gradients, between the step's backward and
    # its update, with the same rank's in the other groups (same layout, same shards): right
    # where every rank then holds its parameters' final gradients and the optimizer steps on
    # them. A strategy says so once parity with one process proves it. Subclasses that
    # replace ``refuses`` keep this.
    averages_across_replica_groups: ClassVar[bool] = False
    # Option -> what the strategy needs beside an option it takes (a clause, no full stop), as
    # ``why_not_with`` checks it: a footnote of ``docs/compatibility.md``.
    conditions: ClassVar[dict[Option, str]] = {}
    # Packages imported when the strategy runs (not at import): checked before any rank starts.
    requires: ClassVar[tuple[Requirement, ...]] = ()  # litscale.extras
    # None: the collective check traces this strategy's first step; else why it cannot.
    untraced: ClassVar[str | None] = None
    # Where a rank waits for its peers, by training phase (named in a hang report).
    phase_collectives: ClassVar[dict[str, str]] = {}
    # More ranks than cores is this strategy's normal case (a simulation of clients).
    simulates_clients: ClassVar[bool] = False
    # Every rank trains every step, so the logged loss is averaged over the ranks (a collective
    # at each logging step); False where some ranks sit a step out (federated's unpicked
    # clients), which would leave the others waiting in that average.
    ranks_step_together: ClassVar[bool] = True
    # The planner costs and ranks this strategy: its step is a synchronous one whose memory and
    # communication follow from its sharding and mesh (not local SGD's or federated rounds).
    plannable: ClassVar[bool] = True
    # Its checkpoints (a torch.save file or a torch.distributed.checkpoint directory) resume under
    # any other such strategy (``litscale.checkpoint.moves``); False: its own format only.
    shares_checkpoint_formats: ClassVar[bool] = True
    # Each rank holds only some of the layers (pipeline stages): a whole-model export gathers them.
    splits_layers_over_ranks: ClassVar[bool] = False
    # How it holds a rank's share of the model (``litscale.parallel.sharding``): what the memory
    # callback, the planner and the dry run read. By default every rank holds it whole.
    sharding: ClassVar[Sharding] = REPLICATED
    # Its gradients live in buffers of its own, not in each parameter's ``.grad`` (DeepSpeed
    # ZeRO's partitions): it logs ``train/grad_norm`` itself, as its engine takes the norm.
    keeps_gradients_apart: ClassVar[bool] = False

    @classmethod
    def candidate_meshes(cls, *, world_size: int, nodes: int, devices_per_node: int,
                         context_sizes: Sequence[int]) -> list[tuple[dict[str, Any], MeshSizes]]:
        """The layouts the planner tries for this strategy on ``world_size`` ranks (``nodes`` x
        ``devices_per_node``): each as its constructor options and the mesh they lay the world
        out on (its ``resolve_mesh``). ``context_sizes``: the sequence splits to try (``[1]`` for
        a model that declares no attention to split); what the strategy refuses of them is
        pruned by its ``validate_setup``. By default: every rank a replica."""
        return [({}, MeshSizes(data_replicate=world_size))]

    def resolve_mesh(self, world_size: int) -> MeshSizes:
        """How ``world_size`` ranks split into the mesh: here, every rank a replica."""
        return MeshSizes(data_replicate=world_size)

    def validate_setup(self, *, world_size: int, net: nn.Module, seq_len: int | None = None,
                       micro_batch: int | None = None) -> None:
        """Raise ``ValueError`` (one line naming ``strategy.<key>``) if this strategy cannot
        run ``net`` on ``world_size`` ranks with sequences of ``seq_len`` tokens and
        ``micro_batch`` samples per data-parallel rank. Called before any process exists (the
        app's validation, the planner's pruning); the default checks the mesh."""
        self.resolve_mesh(world_size)

    def _configure_launcher(self) -> None:
        """Lightning's launcher, except for one process: there its script launcher starts no
        rank but a thread that watches none, which outlives ``fit`` by five seconds (in a
        notebook, in a user's loop of fits, in a worker that runs one job after another)."""
        super()._configure_launcher()
        if getattr(self, "num_processes", 1) * getattr(self, "num_nodes", 1) == 1:
            self._launcher = None

    def why_not(self, option: Option) -> str | None:
        """Why this strategy, as configured, refuses ``option``; ``None`` if it takes it."""
        if option in self.refuses:
            return self.refuses[option]
        return _no_replica_groups(self, option) or _lacks_keyword(self, option)

    def why_not_with(self, option: Option, settings: Mapping[str, Any]) -> SettingRefusal | None:
        """Why this strategy takes ``option`` but not with one of these ``settings`` (dotted
        config keys, ``optimizer.<key>`` and ``trainer.<key>``: the run's values); ``None`` if it
        takes them all. By default: any."""
        return None


def why_not(strategy: Any, option: Option) -> str | None:
    """``strategy.why_not(option)`` for a contract strategy; for a user's own strategy, the
    answers of a plain data-parallel one (it has no keyword it lacks)."""
    if isinstance(strategy, StrategyContract):
        return strategy.why_not(option)
    if option is Option.ASYNC_SAVE:
        return NO_CONTRACT_SAVE
    return StrategyContract.refuses.get(option) or _no_replica_groups(strategy, option) or _lacks_keyword(strategy, option)


def network_options(net: nn.Module, *, typed: str = "model=moe") -> dict[Option, str]:
    """The contract's options a network asks for by what it declares, each as typed (``typed``:
    how the run names the network): a mixture of experts declares its ``expert_modules``."""
    from litscale.parallel.declarations import declared

    return {Option.MIXTURE_OF_EXPERTS: typed} if declared(net, "expert_modules") else {}


def network_refusal(strategy: Any, net: nn.Module, strategy_name: str, *, typed: str = "model=moe") -> str | None:
    """The one-line refusal of an option ``net`` asks for (``network_options``) that the strategy
    refuses, else ``None``: what validation and the planner ask beside the config's options."""
    for option, as_typed in network_options(net, typed=typed).items():
        reason = why_not(strategy, option)
        if reason is not None:
            return refusal_line(option, strategy_name, reason, typed=as_typed)
    return None


def _no_replica_groups(strategy: Any, option: Option) -> str | None:
    if option is Option.REPLICA_GROUPS and not contract_value(strategy, "averages_across_replica_groups"):
        return ("averaging its ranks' gradients across groups before the update is not proven to train right "
                "(parity with one process)")
    return None


def why_not_with(strategy: Any, option: Option, settings: Mapping[str, Any]) -> SettingRefusal | None:
    """A contract strategy's refusal of one of ``option``'s ``settings``; a user's strategy
    refuses none."""
    return strategy.why_not_with(option, settings) if isinstance(strategy, StrategyContract) else None


def _lacks_keyword(strategy: Any, option: Option) -> str | None:
    """An option taken through a constructor keyword is refused by a strategy without it."""
    keyword = OPTION_KEYWORDS.get(option)
    if keyword is not None and keyword not in inspect.signature(type(strategy).__init__).parameters:
        return f"it has no {keyword} option"
    return None


def refusal_line(option: Option, strategy_name: str, reason: str, *, typed: str | None = None) -> str:
    """The one line a user sees: the option as typed, the strategy, why, and what is allowed."""
    return (f"{typed or option.value} is not supported with strategy={strategy_name}: {reason}; "
            f"allowed: {ALTERNATIVES[option]}")


def contract_value(strategy: Any, name: str) -> Any:
    """A contract attribute of any strategy (class or instance), a user's own included."""
    return getattr(strategy, name, getattr(StrategyContract, name))


def missing_requirement(strategy: Any, strategy_name: str) -> str | None:
    """The one-line refusal of a strategy whose package is not installed, else ``None``."""
    for requirement in contract_value(strategy, "requires"):
        if requirement.missing():
            return requirement.refusal(f"strategy={strategy_name}")
    return None


def validate_setup(strategy: Any, *, world_size: int, net: nn.Module, seq_len: int | None = None,
                   micro_batch: int | None = None) -> None:
    """The strategy's own pre-flight check; a user's strategy without one is checked for its mesh
    only (``litscale.parallel.layout.mesh_of``)."""
    if isinstance(strategy, StrategyContract):
        strategy.validate_setup(world_size=world_size, net=net, seq_len=seq_len, micro_batch=micro_batch)
        return
    check = getattr(strategy, "validate_setup", None)
    if check is not None:
        check(world_size=world_size, net=net)


def data_parallel_size(strategy: Any) -> int:
    """How many ranks of a running strategy consume distinct samples: its sampler's replicas
    (1 for a single process, or a strategy that shards no data)."""
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", 1))
