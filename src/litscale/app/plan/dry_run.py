"""The run as configured, built for real at its world size without starting a rank: the
configured strategy (``build_strategy``, as a run builds it) splits the network on the meta
device (no storage, so 256 ranks of a large model cost nothing) over torch's fake process
group (its collectives return at once), and what rank 0 then holds is read off its
parameters, for ``plan=show`` to print beside the planner's prediction.

Built in this process when it holds no process group (``plan=show``'s own process: a child
would cost a second torch import), else in a child, because a process holds one default
process group and the fake one must have the configured world size.
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from litscale.parallel.mesh import ParallelMesh

DEEPSPEED_SKIPPED = ("DeepSpeed is not built on a fake process group: its engine flattens the "
                     "parameters into buffers on its device, which a meta-device network does not have")
REPLICATED_MESH = "none: every rank holds the whole model"


def built_on_fake_world(run_config: dict, world_size: int) -> dict[str, Any]:
    """What rank 0 holds once the configured strategy has split the configured network at
    ``world_size`` ranks. ``run_config``: the job's config, resolved (``OmegaConf.to_container``),
    already validated. Returns ``{"params_bytes": bytes of the parameters rank 0 holds (its local
    shards), "mesh": the device mesh built (e.g. "replicate 2 x shard 128"), "ranks": world_size}``;
    for DeepSpeed ``params_bytes`` is None and ``skipped`` says why."""
    return without_process_group(built_in_this_process, run_config, world_size)


def without_process_group(work: Callable[..., Any], *args: Any) -> Any:
    """``work(*args)`` here when this process holds no process group, else in a spawned child
    (``work`` starts fake groups of its own, and a process holds one default group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return work(*args)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(work, *args).result()


@contextmanager
def fake_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as ``rank`` of a fake default process group of ``world_size`` ranks (its
    collectives return at once), destroyed on leaving."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("this process holds a process group already; without_process_group "
                           "runs the work in a child process instead")
    # init_process_group wraps sys.excepthook (a "[rank0]:" prefix) and nothing unwraps it;
    # restored so that building here many times does not stack the prefixes.
    excepthook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook


def built_in_this_process(run_config: dict, world_size: int) -> dict[str, Any]:
    """``built_on_fake_world`` in this process, which must hold no default process group (the
    fake one is started here and destroyed again)."""
    import torch
    from omegaconf import OmegaConf
    from torch import nn

    from litscale.app.build import build_strategy
    from litscale.app.checks.validation import meta_net
    from litscale.parallel.contract import contract_value

    cfg = OmegaConf.create(run_config)
    strategy = build_strategy(cfg)
    # As the strategies see it: the LightningModule, whose network is `net`, converted first
    # (bf16-true stores the shards in bf16).
    holder = nn.ModuleDict({"net": meta_net(cfg).to(getattr(torch, cfg.precision.param_dtype))})
    if contract_value(strategy, "sharding").zero_stage == 0:  # replicated, as the strategy states: nothing to split
        return with_step({"params_bytes": held_bytes([holder]), "mesh": REPLICATED_MESH, "ranks": world_size},
                         cfg, strategy, holder, [])
    if not hasattr(strategy, "split"):
        return {"params_bytes": None, "mesh": "not built", "ranks": world_size, "skipped": DEEPSPEED_SKIPPED}
    return _split_on_fake_group(holder, strategy, world_size, cfg)


def _split_on_fake_group(holder: nn.Module, strategy: Any, world_size: int, cfg: Any) -> dict[str, Any]:
    with fake_group(world_size):
        mesh = strategy_mesh(strategy, world_size)
        stages = strategy.split(holder, mesh)
        return with_step({"params_bytes": held_bytes([holder, *stages]), "mesh": mesh.describe(), "ranks": world_size},
                         cfg, strategy, holder, stages)


def with_step(built: dict[str, Any], cfg: Any, strategy: Any, holder: nn.Module, stages: list) -> dict[str, Any]:
    """``built``, with ``plan.fake_step``, and one step's peak (``step_peak_bytes``) or why there
    is none (``step_skipped``): ``litscale.app.plan.fake_step``."""
    from litscale.app.plan import fake_step

    if not (cfg.get("plan") or {}).get("fake_step"):
        return built
    reason = fake_step.why_not(cfg, strategy, holder, stages)
    if reason is None:
        try:
            built["step_peak_bytes"] = fake_step.peak_of_one_step(cfg, holder, strategy)
        except Exception as error:  # a what-if beside the prediction, never a reason for plan=show to fail
            reason = f"{type(error).__name__}: {error}".splitlines()[0]
    if reason is not None:
        built["step_skipped"] = reason
    return built


def strategy_mesh(strategy: Any, world_size: int) -> ParallelMesh:
    """The mesh ``strategy`` lays out at ``world_size`` ranks, on the fake group."""
    from litscale.parallel.mesh import ParallelMesh

    return ParallelMesh.build(strategy.resolve_mesh(world_size), "cpu")


def held_bytes(modules: list[nn.Module]) -> int:
    """Bytes of the parameters of ``modules`` (each counted once) as this rank holds them: a
    DTensor's local shard. NOTE: counted from shapes, as meta tensors have no storage to
    measure. FSDP2 pads every shard to ``ceil(dim 0 / ranks)`` rows and rank 0's local shard
    is a whole one, so on rank 0 the local shard is what is held."""
    from torch.distributed.tensor import DTensor

    params = {id(p): p for module in modules for p in module.parameters()}
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params.values()]
    return sum(t.numel() * t.element_size() for t in local)
