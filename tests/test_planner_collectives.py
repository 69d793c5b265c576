"""The planner's collectives per step against the ones a real training step issues, for FSDP
(FSDP2's all-gathers and reduce-scatters, seen by a dispatch mode over the c10d ops) and DDP
(its gradient buckets, seen by a comm hook). On torch's fake process group at worlds 2 and 8:
one process, the collectives return at once, but their calls and sizes are the real ones."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from litscale.layout import MeshSizes
from litscale.models.gpt import build_gpt
from litscale.planner.cluster import Cluster, Link
from litscale.planner.cost import Plan, collectives
from litscale.planner.model_facts import model_facts

LINK = Link(bandwidth_bytes_s=1e9, latency_s=1e-5)
CLUSTER = Cluster(name="test", nodes=1, devices_per_node=8, device_memory_bytes=2**30,
                  peak_flops={"float32": 1e12}, intra_node=LINK, inter_node=LINK)
# c10d op -> (the planner's name, the argument whose bytes a ring passes (n - 1) / n of)
RING_OPS = {"_allgather_base_": ("parameter all-gather", 0), "_reduce_scatter_base_": ("gradient reduce-scatter", 1)}


class CollectiveCounter(TorchDispatchMode):
    """Calls of each c10d collective, and the bytes each rank sends in them (ring algorithm)."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world, self.calls, self.bytes = world, Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and func._overloadpacket.__name__ in RING_OPS:
            name, whole = RING_OPS[func._overloadpacket.__name__]
            self.calls[name] += 1
            self.bytes[name] += (self.world - 1) / self.world * args[whole].untyped_storage().nbytes()
        return func(*args, **(kwargs or {}))


@pytest.fixture(params=[2, 8], ids=lambda world: f"world{world}")
def fake_world(request):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=request.param)
    yield request.param
    dist.destroy_process_group()


def _gpt_and_facts():
    torch.manual_seed(0)
    net = build_gpt(vocab_size=256, block_size=32)
    with torch.device("meta"):
        facts = model_facts(build_gpt(vocab_size=256, block_size=32), seq_len=32, vocab_size=256)
    return net, facts


def _step(net: torch.nn.Module, micro_batch: int) -> None:
    tokens = torch.randint(256, (micro_batch, 33), generator=torch.Generator().manual_seed(0))
    F.cross_entropy(net(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()


def test_fsdp_step_issues_the_predicted_gathers_and_scatters(fake_world):
    net, facts = _gpt_and_facts()
    mesh = init_device_mesh("cpu", (fake_world,))
    for unit in net.sharding_units():  # as litscale's FSDP strategy wraps it
        fully_shard(unit, mesh=mesh)
    fully_shard(net, mesh=mesh, reshard_after_forward=False)
    _step(net, 2)  # the first step also lazily initialises FSDP's buffers
    counter = CollectiveCounter(fake_world)
    with counter:
        _step(net, 2)
    predicted = {c.name: c for c in collectives(Plan("fsdp", MeshSizes(data_shard=fake_world), micro_batch=2,
                                                     accumulation=1), facts, CLUSTER)}
    assert set(predicted) == set(counter.calls) == {"parameter all-gather", "gradient reduce-scatter"}
    for name, collective in predicted.items():
        assert collective.calls == counter.calls[name], name
        # FSDP2 pads each parameter's first dimension to a multiple of the world: a few bytes more
        assert counter.bytes[name] == pytest.approx(collective.bytes_per_rank, rel=2e-3), name


def test_ddp_step_reduces_the_predicted_buckets(fake_world):
    net, facts = _gpt_and_facts()
    ddp = DistributedDataParallel(net)
    buckets = []

    def count(state, bucket):  # counts each bucket's all-reduce instead of running it
        buckets.append(bucket.buffer().numel() * bucket.buffer().element_size())
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    ddp.register_comm_hook(None, count)
    _step(ddp, 2)
    buckets.clear()  # the first step built the buckets in the order gradients arrived
    _step(ddp, 2)
    (predicted,) = collectives(Plan("ddp", MeshSizes(data_replicate=fake_world), micro_batch=2, accumulation=1),
                               facts, CLUSTER)
    assert predicted.calls == len(buckets)
    assert predicted.bytes_per_rank == pytest.approx(2 * (fake_world - 1) / fake_world * sum(buckets))


@pytest.mark.parametrize("world", [2, 8, 64])
def test_fsdp_bytes_per_rank_are_the_predicted_shares_at_fake_worlds(world):
    """Parameters, gradients and AdamW state one rank holds after a step, against the planner's
    memory per rank (before activations), up to 64 ranks without starting one."""
    from litscale.callbacks.memory import optimizer_state_tensors, storage_bytes
    from litscale.planner.cost import memory_per_rank

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        net, facts = _gpt_and_facts()
        mesh = init_device_mesh("cpu", (world,))
        for unit in net.sharding_units():
            fully_shard(unit, mesh=mesh)
        fully_shard(net, mesh=mesh, reshard_after_forward=False)
        optimizer = torch.optim.AdamW(net.parameters())
        _step(net, 1)
        optimizer.step()
        measured = {"params": storage_bytes(net.parameters()), "grads": storage_bytes(p.grad for p in net.parameters()),
                    "optimizer": storage_bytes(optimizer_state_tensors(optimizer))}  # local shards
    finally:
        dist.destroy_process_group()
    predicted = memory_per_rank(Plan("fsdp", MeshSizes(data_shard=world), micro_batch=1, accumulation=1), facts,
                                CLUSTER)
    for kind in ("params", "grads", "optimizer"):
        # FSDP2 pads each parameter's first dimension to a multiple of the world
        assert measured[kind] == pytest.approx(predicted[kind], rel=0.02), kind
