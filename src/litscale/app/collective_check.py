"""A desync check before launch: each rank's first training step traced on torch's fake process
group at the configured world size, one rank after the other in this process, and the ordered
collectives (op, shapes, dtype, process group) compared across the ranks of each group.

A layout whose ranks would issue different collectives (a model with a rank-dependent branch)
hangs or corrupts a real job at its first step; here it is refused with one line naming the
first collective that differs, before any rank starts. Built with the dry run's machinery
(``plan_dry_run``): the network on the meta device, split by the configured strategy, then
given uninitialised CPU storage (collectives on the fake group read no values).

What is traced is the module's loss, its backward, and the strategy's gradient reductions
(DDP's buckets with the plain all-reduce, FSDP2's and tensor parallel's own collectives); a
compression hook's or the layout-invariant mode's exchanges are not (both are the same on every
rank by construction). Strategies traced: ``TRACED``; the others are named as not traced.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from litscale.app.plan_dry_run import (
    DEEPSPEED_SKIPPED,
    fake_group,
    strategy_mesh,
    without_process_group,
)

TRACED = ("single", "ddp", "fsdp", "tensor_parallel")
NOT_TRACED = {
    "deepspeed_zero": DEEPSPEED_SKIPPED,
    "pipeline": "a pipeline schedule's sends and receives are not run on the fake process group",
    "local_sgd": "its synchronisation runs every strategy.sync_every steps, not in a step's backward",
    "federated": "its rounds run every strategy.sync_every steps, not in a step's backward",
}
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


@dataclass(frozen=True)
class Collective:
    """One collective a rank issued: the op, its tensors' shapes and dtypes, and its group's ranks."""

    op: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    group: tuple[int, ...]

    def describe(self) -> str:
        """``all_reduce float32[4, 8]`` (several tensors joined by commas)."""
        tensors = ", ".join(
            f"{dtype.removeprefix('torch.')}{list(shape)}"
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )
        return f"{self.op} {tensors}"


def not_traced_reason(strategy: str, cfg: Any) -> str | None:
    """Why ``strategy`` (the option's name) is not traced; None: it is."""
    if strategy in TRACED:
        if int(cfg.strategy.get("context_parallel_size", 1)) > 1:
            return "context parallel shards the batch in the strategy's own hook, which a trace does not run"
        if int(cfg.strategy.get("expert_parallel_size", 1)) > 1:
            return "expert parallel's token exchange needs the real counts of tokens per expert"
        return None
    return NOT_TRACED.get(
        strategy, f"strategy={strategy} is not among the traced ones ({', '.join(TRACED)})"
    )


def traced_collectives(
    run_config: dict, world_size: int, micro_batch: int
) -> dict[int, list[Collective]]:
    """Rank -> the collectives it issues in its first training step, at ``world_size`` ranks.
    ``run_config``: the job's config, resolved and validated; ``micro_batch``: the layout's."""
    return without_process_group(_traced_in_this_process, run_config, world_size, micro_batch)


def first_difference(traces: dict[int, list[Collective]]) -> str | None:
    """The first collective on which the ranks sharing a process group disagree (one issues
    another op, shape or dtype, or none at all), as one line; None when they all agree."""
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
            if len({(c.op, c.shapes, c.dtypes) if c else None for c in seen.values()}) > 1:
                return _difference_line(index, group, seen)
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
) -> dict[int, list[Collective]]:
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(run_config)
    traces = {}
    with warnings.catch_warnings():
        # a user's dist.all_reduce in forward has no autograd kernel: torch warns, the run would too
        warnings.simplefilter("ignore")
        for rank in range(world_size):
            with fake_group(world_size, rank):
                traces[rank] = _first_step(cfg, world_size, micro_batch)
    return traces


def _first_step(cfg: Any, world_size: int, micro_batch: int) -> list[Collective]:
    """This rank's collectives in one forward and backward of the module's loss, wrapped as the
    configured strategy wraps it."""
    from torch.nn.parallel import DistributedDataParallel

    from litscale.app.build import build, build_strategy, trusted_targets
    from litscale.strategies.ddp import DDPStrategy

    strategy = build_strategy(cfg)
    with torch.device("meta"):
        module = build(cfg.model, trusted=trusted_targets(cfg), optimizer=None)
    module.to(getattr(torch, cfg.precision.param_dtype))
    net = None
    if hasattr(strategy, "split"):
        strategy.split(module, strategy_mesh(strategy, world_size))
        module.to_empty(device="cpu")
    else:
        module.to_empty(device="cpu")
        if isinstance(strategy, DDPStrategy):
            net = DistributedDataParallel(
                module.net, bucket_cap_mb=strategy._ddp_kwargs.get("bucket_cap_mb")
            )
            net.register_comm_hook(None, _all_reduce_now)
    with _Recorder() as recorder:
        module.loss(_example_batch(cfg, module.task, micro_batch), net=net).backward()
    return recorder.calls


def _all_reduce_now(state, bucket):  # noqa: ANN001 - DDP refuses annotations it cannot read as types
    """DDP's bucket all-reduce, waited for here: the fake group's futures carry no result,
    which DDP's own hook reads."""
    dist.all_reduce(bucket.buffer())
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def _example_batch(cfg: Any, task: str, micro_batch: int) -> tuple:
    """A batch of the data's shapes (its values do not matter to which collectives run)."""
    if task == "causal_lm":
        tokens = torch.zeros(micro_batch, int(cfg.data.seq_len), dtype=torch.long)
        return tokens, tokens
    inputs = torch.zeros(micro_batch, *map(int, cfg.data.input_shape))
    return inputs, torch.zeros(micro_batch, dtype=torch.long)


class _Recorder(TorchDispatchMode):
    """Every c10d op (``dist.*``, DDP's and FSDP2's calls) and functional collective (DTensor's)
    in order. NOTE: a dispatch mode rather than torch's ``CommDebugMode``, which counts
    collectives by module but keeps neither their order nor their groups."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (
            func.namespace in ("c10d", "_c10d_functional")
            and func.__name__.split(".")[0] in COLLECTIVES
        ):
            self.calls.append(_collective(func, args))
        return func(*args, **(kwargs or {}))


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
    return Collective(
        OP_NAMES.get(name, name.rstrip("_")),
        tuple(tuple(t.shape) for t in tensors),
        tuple(str(t.dtype) for t in tensors),
        tuple(dist.get_process_group_ranks(group)) if group is not None else (),
    )


def check_collectives(cfg: Any, strategy: str, layout: Any) -> str:
    """Trace the run's first step at its world size; return what was found, in one line, or
    raise ``ConfigError`` naming the first collective its ranks disagree on. ``strategy``: the
    option's name; ``layout``: the validated ``RunLayout``."""
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
    traces = traced_collectives(
        OmegaConf.to_container(cfg, resolve=True), layout.world_size, layout.micro_batch
    )
    difference = first_difference(traces)
    if difference is not None:
        raise ConfigError(difference)
    return (
        f"collectives traced on a fake process group of {layout.world_size} ranks: the ranks of each group "
        f"issue the same ones in their first step ({len(traces[0])} on rank 0)"
    )
