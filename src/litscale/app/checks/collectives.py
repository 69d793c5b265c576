"""The pre-flight desync check: each rank's first training step traced on torch's fake process
group at the configured world size, one rank after the other in this process, and the ordered
collectives (op, shapes, dtype, process group) compared across the ranks of each group.

A layout whose ranks would issue different collectives (a model with a rank-dependent branch)
hangs or corrupts a real job at its first step; here it is refused with one line naming the
first collective that differs, before any rank starts. Built with the dry run's machinery
(``plan_dry_run``): the network on the meta device, split by the configured strategy, then
given uninitialised CPU storage (what is compared are calls and shapes, not values).

What is traced: the module's loss and backward as the strategy wraps them. DDP's bucketed
gradient all-reduce runs in its C++ reducer, out of sight of a Python trace, so the traced DDP
carries a comm hook: torch's plain ``allreduce_hook``, or the configured compression hook, whose
exchanges are then the ones traced. FSDP2's, tensor parallel's, context parallel's (the
all-gather of keys and values) and expert parallel's (the all-to-all of token counts and
tokens) collectives are issued from Python and traced as they are. A strategy whose contract
sets ``untraced`` (``litscale.parallel.contract``) is named as not traced, with its reason; a trace that
saw no collective at all says so instead of reporting agreement.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from litscale.app.plan.dry_run import fake_group, strategy_mesh, without_process_group
from litscale.parallel.contract import contract_value

# c10d's ops (``dist.*``) and the functional ones (DTensor) -> the name a user knows.
OP_NAMES = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce_coalesced",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced_": "all_gather_into_tensor_coalesced",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor_coalesced",
    "broadcast_": "broadcast",
    "reduce_": "reduce",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all_single",
    "gather_": "gather",
    "scatter_": "scatter",
    "barrier": "barrier",
}
# The functional collectives' own names are the same (their waits and autograd wrappers are not collectives).
COLLECTIVES = {*OP_NAMES, *OP_NAMES.values()}
# What the agreement line adds when expert parallel's token counts were evened (``_Recorder``).
EVEN_COUNTS = "token counts per expert taken as even across the expert-parallel ranks"


@dataclass(frozen=True)
class Collective:
    """One collective a rank issued: the op, its tensors' shapes and dtypes, its group's ranks,
    and for an all-to-all the rows it sends to and receives from each rank of the group."""

    op: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    group: tuple[int, ...]
    sent: tuple[int, ...] = ()
    received: tuple[int, ...] = ()

    def describe(self) -> str:
        """``all_reduce float32[4, 8]`` (several tensors joined by commas)."""
        tensors = ", ".join(
            f"{dtype.removeprefix('torch.')}{list(shape)}"
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )
        return f"{self.op} {tensors}"

    def matches(self) -> tuple:
        """What must be the same on every rank of the group. NOTE: an all-to-all's tensors may
        differ between ranks (each sends its own rows); what must agree is checked pairwise."""
        return (self.op, self.dtypes) if self.sent else (self.op, self.shapes, self.dtypes)


def not_traced_reason(strategy: str, cfg: Any) -> str | None:
    """Why the configured strategy's first step is not traced: its contract's ``untraced``
    (``strategy``, the option's name, is not consulted: the class answers); None: it is."""
    from litscale.app.checks.safety import locate_target

    return contract_value(locate_target(cfg.strategy._target_, "strategy"), "untraced")


def traced_collectives(
    run_config: dict, world_size: int, micro_batch: int
) -> dict[int, list[Collective]]:
    """Rank -> the collectives it issues in its first training step, at ``world_size`` ranks.
    ``run_config``: the job's config, resolved and validated; ``micro_batch``: the layout's."""
    traces, _ = without_process_group(_traced_in_this_process, run_config, world_size, micro_batch)
    return traces


def first_difference(traces: dict[int, list[Collective]]) -> str | None:
    """The first collective on which the ranks sharing a process group disagree (one issues
    another op, shape or dtype, or none at all; or an all-to-all's ranks disagree on the rows
    one sends another), as one line; None when they all agree."""
    by_group: dict[tuple[int, ...], dict[int, list[Collective]]] = {}
    for rank, calls in traces.items():
        for call in calls:
            by_group.setdefault(call.group, {r: [] for r in call.group if r in traces})[
                rank
            ].append(call)
    for group, calls in sorted(
        by_group.items(), key=lambda item: (len(item[0]), item[0]), reverse=True
    ):
        length = max(len(c) for c in calls.values())
        for index in range(length):
            seen = {rank: c[index] if index < len(c) else None for rank, c in calls.items()}
            if len({c.matches() if c else None for c in seen.values()}) > 1:
                return _difference_line(index, group, seen)
            uneven = _uneven_exchange(group, seen)
            if uneven is not None:
                return (f"the ranks would exchange different numbers of rows in their first training step: "
                        f"collective #{index} of the group of {_ranks(list(group))} ({seen[group[0]].op}) "
                        f"differs ({uneven})")
    return None


def _uneven_exchange(group: tuple[int, ...], seen: dict[int, Collective | None]) -> str | None:
    """``rank 0 sends rank 1 12 rows, rank 1 expects 8``: the first pair of an all-to-all's
    ranks whose sent and received rows disagree; None when every pair agrees (or not an
    all-to-all, or a rank of the group was not traced)."""
    if not all(call is not None and call.sent for call in seen.values()) or set(seen) != set(group):
        return None
    for source_index, source in enumerate(group):
        for target_index, target in enumerate(group):
            rows, expected = seen[source].sent[target_index], seen[target].received[source_index]
            if rows != expected:
                return f"rank {source} sends rank {target} {rows} rows, rank {target} expects {expected}"
    return None


def _difference_line(index: int, group: tuple[int, ...], seen: dict[int, Collective | None]) -> str:
    """``rank 0: all_reduce float32[30], rank 1: all_reduce float32[3, 4]``, ranks issuing the
    same call named together."""
    variants: dict[str, list[int]] = {}
    for rank, call in sorted(seen.items()):
        variants.setdefault(call.describe() if call else "no collective", []).append(rank)
    parts = [f"{_ranks(ranks)}: {what}" for what, ranks in variants.items()]
    return (
        f"the ranks would issue different collectives in their first training step: collective "
        f"#{index} of the group of {_ranks(list(group))} differs ({'; '.join(parts)}); is there a "
        "rank-dependent branch in the model?"
    )


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _traced_in_this_process(
    run_config: dict, world_size: int, micro_batch: int
) -> tuple[dict[int, list[Collective]], bool]:
    """(rank -> its collectives, whether expert parallel's token counts were evened)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(run_config)
    traces, evened = {}, False
    with warnings.catch_warnings():
        # a user's dist.all_reduce in forward has no autograd kernel: torch warns, the run would too
        warnings.simplefilter("ignore")
        for rank in range(world_size):
            with fake_group(world_size, rank):
                traces[rank], evened_here = _first_step(cfg, world_size, micro_batch)
                evened = evened or evened_here
    return traces, evened


def _first_step(cfg: Any, world_size: int, micro_batch: int) -> tuple[list[Collective], bool]:
    """This rank's collectives in one forward and backward of the module's loss, on a batch
    the strategy has placed (context parallel's sequence shard), wrapped as the strategy wraps
    it; and whether it evened expert parallel's token counts."""
    from litscale.app.build import build, build_strategy, trusted_targets

    strategy = build_strategy(cfg)
    with torch.device("meta"):
        module = build(cfg.model, trusted=trusted_targets(cfg), optimizer=None)
    module.to(getattr(torch, cfg.precision.param_dtype))
    batch = _example_batch(cfg, module.task, micro_batch)
    net = None
    if hasattr(strategy, "split"):
        mesh = strategy_mesh(strategy, world_size)
        strategy.split(module, mesh)
        module.to_empty(device="cpu")
        # NOTE: the strategy's mesh is set by its process-group setup, which a trace does not
        # run; its batch hook reads the mesh there.
        strategy.use_mesh(mesh)
        batch = strategy.batch_to_device(batch, torch.device("cpu"))
    else:
        module.to_empty(device="cpu")
        net = _traced_ddp(strategy, module.net)
    with _Recorder() as recorder:
        module.loss(batch, net=net).backward()
    return recorder.calls, recorder.evened


def _traced_ddp(strategy: Any, net: torch.nn.Module) -> torch.nn.Module | None:
    """``net`` wrapped in DDP as the strategy wraps it, with a comm hook that issues each
    bucket's reduction from Python, where the trace sees it: the configured compression hook,
    else torch's plain all-reduce hook (DDP's own reduction, which its C++ reducer would issue
    unseen). None for a strategy that does not wrap in DDP."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    from litscale.strategies.ddp import DDPStrategy

    if not isinstance(strategy, DDPStrategy):
        return None
    wrapped = DistributedDataParallel(net, **strategy._ddp_kwargs)
    if strategy.compression is not None:
        strategy.compression.register(wrapped)
    else:
        wrapped.register_comm_hook(None, allreduce_hook)
    return wrapped


def _example_batch(cfg: Any, task: str, micro_batch: int) -> tuple:
    """A batch of the data's shapes (its values do not matter to which collectives run)."""
    if task == "causal_lm":
        tokens = torch.zeros(micro_batch, int(cfg.data.seq_len), dtype=torch.long)
        return tokens, tokens
    inputs = torch.zeros(micro_batch, *map(int, cfg.data.input_shape))
    return inputs, torch.zeros(micro_batch, dtype=torch.long)


class _Recorder(TorchDispatchMode):
    """Every c10d op (``dist.*``, DDP's hooks' and FSDP2's calls) and functional collective
    (DTensor's, context and expert parallel's) in order. NOTE: a dispatch mode rather than
    torch's ``CommDebugMode``, which counts collectives by module but keeps neither their order
    nor their groups.

    Two things make the fake group answer as a real one would, where the step reads the answer:
    a c10d op's future carries its output (the fake group's carries none, and DDP's hooks chain
    on it); and expert parallel's exchange of token counts (an all-to-all of integers) sends
    even counts. NOTE: the counts come from routing on uninitialised weights, so they differ by
    rank for no reason a real run shares; even counts are the balanced case, in which every
    pair of ranks must agree on the rows between them (``first_difference`` checks it)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Collective] = []
        self.evened = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace not in ("c10d", "_c10d_functional") or name not in COLLECTIVES:
            return func(*args, **(kwargs or {}))
        if name == "alltoall_base_" and not args[1].is_floating_point() and not args[4]:
            _even_counts(args[1], dist.ProcessGroup.unbox(args[2]).size())
            self.evened = True
        self.calls.append(_collective(func, args))
        result = func(*args, **(kwargs or {}))
        if func.namespace == "c10d" and isinstance(result, tuple) and isinstance(result[-1], torch.ScriptObject):
            return (*result[:-1], _completed_work(result[0]))
        return result


def _even_counts(counts: torch.Tensor, ranks: int) -> None:
    """``counts`` (rows per expert, experts grouped by rank) replaced, in place, by the same
    total split evenly over the ranks, and within a rank over its experts."""
    total, experts = int(counts.sum()), counts.numel()
    per_rank = [total // ranks + (rank < total % ranks) for rank in range(ranks)]
    local = experts // ranks
    even = [rows // local + (e < rows % local) for rows in per_rank for e in range(local)]
    counts.copy_(torch.tensor(even, dtype=counts.dtype))


def _completed_work(output: Any) -> torch.ScriptObject:
    """A c10d work whose future holds ``output``, as a real process group's does."""
    from torch._C._distributed_c10d import _create_work_from_future

    future = torch.futures.Future()
    future.set_result(output)
    return _create_work_from_future(future).boxed()


def _collective(func: Any, args: tuple) -> Collective:
    leaves = tree_leaves(args)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    # c10d's ops take the group object; functional ones its name, their last string argument
    boxed = [leaf for leaf in leaves if isinstance(leaf, torch.ScriptObject)]
    names = [leaf for leaf in leaves if isinstance(leaf, str)]
    group = (
        dist.ProcessGroup.unbox(boxed[0])
        if boxed
        else dist.distributed_c10d._resolve_process_group(names[-1])
        if names
        else None
    )
    name = func.__name__.split(".")[0]
    sent, received = _rows_exchanged(name, args, group)
    return Collective(
        OP_NAMES.get(name, name.rstrip("_")),
        tuple(tuple(t.shape) for t in tensors),
        tuple(str(t.dtype) for t in tensors),
        tuple(dist.get_process_group_ranks(group)) if group is not None else (),
        sent,
        received,
    )


def _rows_exchanged(name: str, args: tuple, group: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """An all-to-all's rows sent to and received from each rank of its group (no splits given:
    an even split); ((), ()) for any other collective."""
    if name == "all_to_all_single":  # functional: (input, output splits, input splits, group name)
        inputs, outputs, received, sent = args[0], args[0], args[1], args[2]
    elif name == "alltoall_base_":  # c10d: (output, input, group, output splits, input splits, ...)
        outputs, inputs, received, sent = args[0], args[1], args[3], args[4]
    else:
        return (), ()
    size = group.size()
    return (tuple(sent) or (inputs.shape[0] // size,) * size,
            tuple(received) or (outputs.shape[0] // size,) * size)


def check_collectives(cfg: Any, strategy: str, layout: Any) -> str:
    """Trace the run's first step at its world size; return what was seen, in one line, or
    raise ``ConfigError`` naming the first collective its ranks disagree on, or why the
    strategy is not traced. ``strategy``: the option's name; ``layout``: the validated
    ``RunLayout``."""
    from omegaconf import OmegaConf

    from litscale.errors import ConfigError

    if layout.world_size == 1:
        return "collectives not traced: one rank has nothing to compare with"
    reason = not_traced_reason(strategy, cfg)
    if reason is not None:
        raise ConfigError(
            f"preflight.collectives=true cannot trace strategy={strategy}: {reason}; "
            "set preflight.collectives=false"
        )
    traces, evened = without_process_group(
        _traced_in_this_process, OmegaConf.to_container(cfg, resolve=True), layout.world_size,
        layout.micro_batch,
    )
    difference = first_difference(traces)
    if difference is not None:
        raise ConfigError(difference)
    return agreement_line(traces, strategy, evened=evened)


def agreement_line(traces: dict[int, list[Collective]], strategy: str, *, evened: bool = False) -> str:
    """What a trace whose ranks agree saw: the collectives of rank 0 by op, or that there were
    none to compare."""
    world = len(traces)
    if not any(traces.values()):
        return (f"traced no collective in the first step of strategy={strategy}: nothing compared "
                f"({world} ranks on a fake process group)")
    ops = Counter(call.op for call in traces[0])
    seen = ", ".join(f"{count} {op}" for op, count in ops.items())
    return (
        f"collectives traced on a fake process group of {world} ranks: the ranks of each group issue the "
        f"same ones in their first step ({len(traces[0])} on rank 0: {seen})"
        + (f"; {EVEN_COUNTS}" if evened else "")
    )
