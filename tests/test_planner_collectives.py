"""The planner's collectives per step against the ones a real training step issues, counted by a
dispatch mode over the c10d ops (and torch's functional collectives, which DTensor issues,
inside its own dispatch too). FSDP (FSDP2's all-gathers and reduce-scatters), DDP (its
gradient buckets: a comm hook where the group is fake, whose all-reduces return no data) and
tensor parallel (the sequence-parallel gathers, scatters and all-reduces of activations) on
torch's fake process group at worlds 2 and 8: one process, the collectives return at once, but
their calls and sizes are the real ones; and the same on two real gloo ranks, where pipeline
parallel runs too (its sends and the loss broadcast, Lightning's step with the pipeline
strategy, for a one-stage, an interleaved and a V-shaped schedule)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from litscale.models.gpt import build_gpt
from litscale.parallel.layout import MeshSizes
from litscale.planner.cluster import Cluster, Link
from litscale.planner.cost import Plan, collectives
from litscale.planner.model_facts import model_facts

LINK = Link(bandwidth_bytes_s=1e9, latency_s=1e-5)
CLUSTER = Cluster(name="test", nodes=1, devices_per_node=8, device_memory_bytes=2**30,
                  peak_flops={"float32": 1e12}, intra_node=LINK, inter_node=LINK)
SEQ, VOCAB = 32, 256


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in (tensors if isinstance(tensors, (list, tuple)) else [tensors]))


# c10d / functional op -> the bytes one rank sends in it at world n (ring algorithms: an
# all-reduce 2 (n-1)/n of the buffer, an all-gather or reduce-scatter (n-1)/n of the whole;
# a send or a broadcast its buffer)
SENT = {
    "_allgather_base_": lambda args, n: (n - 1) / n * _nbytes(args[0]),  # (output, input)
    "_reduce_scatter_base_": lambda args, n: (n - 1) / n * _nbytes(args[1]),  # (output, input)
    "allreduce_": lambda args, n: 2 * (n - 1) / n * _nbytes(args[0]),
    "all_gather_into_tensor": lambda args, n: (n - 1) * _nbytes(args[0]),  # (this rank's shard, ...)
    "reduce_scatter_tensor": lambda args, n: (n - 1) / n * _nbytes(args[0]),
    "all_reduce": lambda args, n: 2 * (n - 1) / n * _nbytes(args[0]),
    "send": lambda args, n: _nbytes(args[0]),
    "broadcast_": lambda args, n: _nbytes(args[0]),
    # an all-to-all: its input but the rows it keeps (functional: input, out splits, in splits,
    # group name; c10d: output, input, group, out splits, in splits)
    "all_to_all_single": lambda args, n: _sent_to_peers(args[0], args[2], _group(args[3])),
    "alltoall_base_": lambda args, n: _sent_to_peers(args[1], args[4], dist.ProcessGroup.unbox(args[2])),
}


def _group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _sent_to_peers(tensor: torch.Tensor, input_splits, group) -> float:
    """Bytes of ``tensor``'s rows an all-to-all sends to the other ranks of ``group`` (no
    splits: an even split)."""
    rows = tensor.shape[0]
    splits = list(input_splits) or [rows // group.size()] * group.size()
    return (rows - splits[group.rank()]) * _nbytes(tensor) / max(rows, 1)
# the other end of a send, and the functional collectives' bookkeeping: no bytes of their own
NOT_SENDING = {"recv_", "wait_tensor", "_wrap_tensor_autograd"}
# c10d op -> the planner's name, by strategy
FSDP = {"_allgather_base_": "parameter all-gather", "_reduce_scatter_base_": "gradient reduce-scatter"}
DDP = {"allreduce_": "gradient all-reduce"}
TENSOR_PARALLEL = {"all_gather_into_tensor": "tensor-parallel all-gather",
                   "reduce_scatter_tensor": "tensor-parallel reduce-scatter",
                   "all_reduce": "tensor-parallel all-reduce"}
PIPELINE = {"send": "pipeline send/recv", "broadcast_": "pipeline loss broadcast"}
EXPERT_PARALLEL = {**FSDP, "all_to_all_single": "expert-parallel all-to-all",
                   "alltoall_base_": "expert-parallel count exchange"}


class CollectiveCounter(TorchDispatchMode):
    """Calls of each collective, by the planner's name (``names``: op -> name; any other
    collective is counted under its op's own name, which no prediction has), and the bytes
    this rank sends in them."""

    def __init__(self, world: int, names: dict[str, str]) -> None:
        super().__init__()
        self.world, self.names, self.calls, self.bytes = world, names, Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # DTensor's dispatch then runs with this mode still on: the collectives it issues
            # inside an op (e.g. on a partial gradient) are counted too
            return NotImplemented
        op = func._overloadpacket.__name__
        if func.namespace in ("c10d", "_c10d_functional") and op not in NOT_SENDING:
            name = self.names.get(op, f"{func.namespace}.{op}")
            self.calls[name] += 1
            self.bytes[name] += SENT[op](args, self.world) if op in SENT else 0
        return func(*args, **(kwargs or {}))

    def counted(self) -> tuple[dict[str, int], dict[str, float]]:
        return dict(self.calls), dict(self.bytes)


@pytest.fixture(params=[2, 8], ids=lambda world: f"world{world}")
def fake_world(request):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=request.param)
    yield request.param
    dist.destroy_process_group()


def _gpt_and_facts(**config):
    # Two layers (nano has four): the per-layer collectives still count apart from the
    # embedding's and the head's, at half the dispatches of a step under DTensor and FSDP.
    config = {"n_layer": 2, **config}
    torch.manual_seed(0)
    net = build_gpt(vocab_size=VOCAB, block_size=SEQ, **config)
    with torch.device("meta"):
        facts = model_facts(build_gpt(vocab_size=VOCAB, block_size=SEQ, **config), seq_len=SEQ, vocab_size=VOCAB)
    return net, facts


def _step(net: torch.nn.Module, micro_batch: int) -> None:
    tokens = torch.randint(VOCAB, (micro_batch, SEQ + 1), generator=torch.Generator().manual_seed(0))
    F.cross_entropy(net(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()


def _counted_step(net: torch.nn.Module, counter: CollectiveCounter, *, warm_up: int = 1, optimizer=None,
                  step=None):
    """Calls and bytes of one forward-backward (``step``, by default ``_step``) and
    ``optimizer``'s step, after ``warm_up`` uncounted forward-backwards (the first initialises
    FSDP's buffers, DDP's second rebuilds its buckets)."""
    step = step or (lambda: _step(net, 2))
    for _ in range(warm_up):
        step()
        net.zero_grad(set_to_none=True)
    with counter:
        step()
        if optimizer is not None:
            optimizer.step()
    return counter.counted()


def _fsdp_counts(world: int):
    net, _ = _gpt_and_facts()
    mesh = init_device_mesh("cpu", (world,))
    for unit in net.sharding_units():  # as litscale's FSDP strategy wraps it
        fully_shard(unit, mesh=mesh)
    fully_shard(net, mesh=mesh, reshard_after_forward=False)
    return _counted_step(net, CollectiveCounter(world, FSDP))


def _tensor_parallel_net(world: int):
    from litscale.strategies.tensor_plan import apply_declared_plan

    net, facts = _gpt_and_facts(n_head=8)  # heads for 8 ranks
    apply_declared_plan(net, init_device_mesh("cpu", (world,)))  # as the strategy: sequence parallel
    return net, facts


def _tensor_parallel_counts(world: int):
    """A whole step as the tensor-parallel strategy runs it: forward-backward, each partial
    gradient summed once (its ``optimizer_step``), and AdamW's step."""
    from litscale.parallel.gradient_norm import sum_partial_gradients_after

    net, _ = _tensor_parallel_net(world)
    step = sum_partial_gradients_after(lambda: _step(net, 2), net)
    return _counted_step(net, CollectiveCounter(world, TENSOR_PARALLEL), optimizer=torch.optim.AdamW(net.parameters()),
                         step=step)


def _assert_fsdp_predicted(world: int, calls: dict, sent: dict) -> None:
    _, facts = _gpt_and_facts()
    predicted = {c.name: c for c in collectives(Plan("fsdp", MeshSizes(data_shard=world), micro_batch=2,
                                                     accumulation=1), facts, CLUSTER)}
    assert set(predicted) == set(calls) == {"parameter all-gather", "gradient reduce-scatter"}
    for name, collective in predicted.items():
        assert collective.calls == calls[name], name
        # FSDP2 pads each parameter's first dimension to a multiple of the world: a few bytes more
        assert sent[name] == pytest.approx(collective.bytes_per_rank, rel=2e-3), name


def _assert_tensor_parallel_predicted(world: int, calls: dict, sent: dict) -> None:
    _, facts = _gpt_and_facts(n_head=8)
    predicted = {c.name: c for c in collectives(Plan("tensor_parallel", MeshSizes(tensor=world), micro_batch=2,
                                                     accumulation=1), facts, CLUSTER)}
    assert calls == {name: c.calls for name, c in predicted.items()}
    assert sent == pytest.approx({name: c.bytes_per_rank for name, c in predicted.items()})


@pytest.mark.slow
def test_fsdp_step_issues_the_predicted_gathers_and_scatters(fake_world):
    _assert_fsdp_predicted(fake_world, *_fsdp_counts(fake_world))


@pytest.mark.slow
def test_a_muon_step_under_fsdp_gathers_each_matrix_update_as_predicted(fake_world):
    """Muon's step gathers each sharded hidden matrix's update whole (``full_tensor``): the
    planner's ``Muon update all-gather``, in calls and bytes, beside FSDP's own collectives."""
    from litscale.app.plan.runs import with_muon
    from litscale.optim.muon import Muon, parameter_roles

    world = fake_world
    net, facts = _gpt_and_facts()
    mesh = init_device_mesh("cpu", (world,))
    for unit in net.sharding_units():
        fully_shard(unit, mesh=mesh)
    fully_shard(net, mesh=mesh, reshard_after_forward=False)
    counter = CollectiveCounter(world, {**FSDP, "all_gather_into_tensor": "Muon update all-gather"})
    calls, sent = _counted_step(net, counter, optimizer=Muon(parameter_roles(net, 0.0), lr=1e-3))
    plan = Plan("fsdp", MeshSizes(data_shard=world), micro_batch=2, accumulation=1)
    predicted = {c.name: c for c in collectives(plan, with_muon(facts), CLUSTER)}
    assert sorted(calls) == sorted(predicted)
    gather = predicted["Muon update all-gather"]
    assert (calls["Muon update all-gather"], sent["Muon update all-gather"]) == (gather.calls, gather.bytes_per_rank)


@pytest.mark.slow
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


@pytest.mark.slow
def test_tensor_parallel_step_issues_the_predicted_gathers_scatters_and_all_reduces(fake_world):
    """Sequence parallel, as the strategy runs it: per layer, forward gathers the sequence for
    attention and the MLP and reduce-scatters their outputs; backward gathers the outputs'
    gradients and reduce-scatters the inputs'; the embedding's output all-reduced, the head's
    input gathered and its logits gathered whole, and back; each norm's partial gradient
    all-reduced once before AdamW's step (which issues no collective of its own)."""
    _assert_tensor_parallel_predicted(fake_world, *_tensor_parallel_counts(fake_world))


@pytest.mark.slow
def test_tensor_parallel_step_of_a_mixture_of_experts_issues_the_predicted_collectives():
    """The tiny MoE decoder (its 2 key/value heads split over 2 ranks at most) under the
    tensor-parallel plan on the fake group: the dense layer as a GPT block; each MoE layer,
    whole on both ranks, gathers its input and its output's gradient but scatters neither."""
    from litscale.models.moe import build_moe
    from litscale.parallel.gradient_norm import sum_partial_gradients_after
    from litscale.strategies.tensor_plan import apply_declared_plan

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch.manual_seed(0)
        net = build_moe(vocab_size=VOCAB, block_size=SEQ)
        apply_declared_plan(net, init_device_mesh("cpu", (2,)))
        step = sum_partial_gradients_after(lambda: _step(net, 2), net)
        calls, sent = _counted_step(net, CollectiveCounter(2, TENSOR_PARALLEL),
                                    optimizer=torch.optim.AdamW(net.parameters()), step=step)
    finally:
        dist.destroy_process_group()
    with torch.device("meta"):
        facts = model_facts(build_moe(vocab_size=VOCAB, block_size=SEQ), seq_len=SEQ, vocab_size=VOCAB)
    predicted = collectives(Plan("tensor_parallel", MeshSizes(tensor=2), micro_batch=2, accumulation=1), facts,
                            CLUSTER)
    assert calls == {c.name: c.calls for c in predicted}
    assert sent == pytest.approx({c.name: c.bytes_per_rank for c in predicted})


# --- two real gloo ranks -----------------------------------------------------------------------

# Pipeline: a one-stage, an interleaved and a V-shaped schedule (stages per rank); each
# optimizer step accumulates 2 micro batches of 8 samples, each cut into 4 pipeline micro-batches.
PIPELINE_SCHEDULES = {"1f1b": 1, "interleaved_1f1b": 2, "zbv_zero_bubble": 2}
PIPELINE_MICROBATCHES, PIPELINE_ACCUMULATION, PIPELINE_STEPS = 4, 2, 3


def _pipeline_setup():
    from helpers.parity import ParitySetup

    return ParitySetup(global_batch=8 * PIPELINE_ACCUMULATION, accumulation=PIPELINE_ACCUMULATION,
                       steps=PIPELINE_STEPS)


def _pipeline_counts(world: int, schedule: str):
    """Lightning's next-to-last optimizer step with the pipeline strategy, counted on this rank:
    each of its micro batches from ``on_train_batch_start`` to ``on_train_batch_end`` (the
    optimizer step included). NOTE: not the strategy's own, and so not counted: between
    batches, outside those hooks, Lightning broadcasts whether a rank received SIGTERM (8
    bytes), and the last step is a logging step, whose loss the module averages over the ranks
    (an all-reduce of 4 bytes and Lightning's barrier before it)."""
    import lightning as L
    from helpers.parity import rank_loader, tiny_module
    from lightning.pytorch import Callback

    from litscale.strategies import PipelineParallelStrategy

    counter, setup = CollectiveCounter(world, PIPELINE), _pipeline_setup()
    counted_step = range((PIPELINE_STEPS - 2) * PIPELINE_ACCUMULATION, (PIPELINE_STEPS - 1) * PIPELINE_ACCUMULATION)

    class CountLastStep(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx in counted_step:
                counter.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx in counted_step:
                counter.__exit__(None, None, None)

    trainer = L.Trainer(
        accelerator="cpu", devices=world, max_steps=setup.steps, accumulate_grad_batches=setup.accumulation,
        strategy=PipelineParallelStrategy(schedule=schedule, microbatches=PIPELINE_MICROBATCHES,
                                          virtual_stages=PIPELINE_SCHEDULES[schedule]),
        callbacks=[CountLastStep()], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False)
    trainer.fit(tiny_module(setup), train_dataloaders=rank_loader(setup))
    return counter.counted()


def _count_on_real_ranks(rank: int, world: int) -> dict:
    """Every strategy's counted step on this rank, in one start of the ranks."""
    net, _ = _gpt_and_facts()
    ddp = _counted_step(DistributedDataParallel(net), CollectiveCounter(world, DDP), warm_up=2)
    found = {"fsdp": _fsdp_counts(world), "ddp": ddp, "tensor_parallel": _tensor_parallel_counts(world)}
    for schedule in PIPELINE_SCHEDULES:
        found[f"pipeline {schedule}"] = _pipeline_counts(world, schedule)
    return found


@pytest.fixture(scope="module")
def real_world2():
    return run_distributed(_count_on_real_ranks, 2, timeout=280)


@pytest.mark.soak  # make test-full (about 15 s): the fake group's counts stay in make test
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_step_issues_the_predicted_gathers_and_scatters_on_two_ranks(real_world2):
    for ranks in real_world2:
        _assert_fsdp_predicted(2, *ranks["fsdp"])


@pytest.mark.full  # make test-full (about 15 s): the fake group's counts stay in make test
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_step_reduces_the_predicted_buckets_on_two_ranks(real_world2):
    _, facts = _gpt_and_facts()
    (predicted,) = collectives(Plan("ddp", MeshSizes(data_replicate=2), micro_batch=2, accumulation=1), facts,
                               CLUSTER)
    for calls, sent in (ranks["ddp"] for ranks in real_world2):
        assert calls == {"gradient all-reduce": predicted.calls}
        assert sent == pytest.approx({"gradient all-reduce": predicted.bytes_per_rank})


@pytest.mark.full  # make test-full (about 15 s): the fake group's counts stay in make test
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_step_issues_the_predicted_collectives_on_two_ranks(real_world2):
    for ranks in real_world2:
        _assert_tensor_parallel_predicted(2, *ranks["tensor_parallel"])


@pytest.mark.full  # make test-full (about 15 s): the fake group's counts stay in make test
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", list(PIPELINE_SCHEDULES))
def test_pipeline_step_sends_the_predicted_activations_and_gradients_on_two_ranks(real_world2, schedule):
    """Each rank's sends (activations forward, gradients back, of each pipeline micro-batch)
    and the last stage's loss broadcast, against the planner's figure for the busiest rank
    (at 2 ranks every rank is as busy)."""
    from helpers.parity import TINY

    from litscale.models.gpt import GPT

    with torch.device("meta"):
        facts = model_facts(GPT(TINY), seq_len=TINY.block_size, vocab_size=TINY.vocab_size)
    setup = _pipeline_setup()
    plan = Plan("pipeline", MeshSizes(pipeline=2), micro_batch=setup.global_batch // setup.accumulation,
                accumulation=setup.accumulation, microbatches=PIPELINE_MICROBATCHES, schedule=schedule,
                virtual_stages=PIPELINE_SCHEDULES[schedule])
    predicted = collectives(plan, facts, CLUSTER)
    for calls, sent in (ranks[f"pipeline {schedule}"] for ranks in real_world2):
        assert calls == {c.name: c.calls for c in predicted}
        assert sent == pytest.approx({c.name: c.bytes_per_rank for c in predicted})


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 8, 64])
def test_fsdp_bytes_per_rank_are_the_predicted_shares_at_fake_worlds(world):
    """Parameters, gradients and AdamW state one rank holds after a step, against the planner's
    memory per rank (before activations), up to 64 ranks without starting one."""
    from litscale.measure.tensor_bytes import optimizer_state_tensors, storage_bytes
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


# --- expert parallel: two real gloo ranks ------------------------------------------------------

# The tiny MoE decoder (a dense layer, then 2 MoE layers) with every token routed to all 4 of its
# experts: each rank then sends exactly half its rows to the other (1 / ep kept), the even
# routing the planner assumes by default (load imbalance 1).
EVEN_ROUTING = {"n_experts": 4, "top_k": 4}


class _Holder(torch.nn.Module):
    """As a LightningModule holds the network (``net``), for the strategy's ``split``."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net(tokens)


def _expert_parallel_counts(rank: int, world: int):
    """One forward-backward of the MoE decoder as the FSDP strategy splits it with
    ``expert_parallel_size=2`` (experts over both ranks, everything else FSDP2), counted after
    an uncounted one."""
    from litscale.models.moe import build_moe
    from litscale.parallel.mesh import ParallelMesh
    from litscale.strategies import FSDPStrategy

    torch.manual_seed(0)
    module = _Holder(build_moe(vocab_size=VOCAB, block_size=SEQ, **EVEN_ROUTING))
    strategy = FSDPStrategy(expert_parallel_size=world)
    strategy.split(module, ParallelMesh.build(strategy.resolve_mesh(world), "cpu"))
    tokens = torch.randint(VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        F.cross_entropy(module(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()

    return _counted_step(module, CollectiveCounter(world, EXPERT_PARALLEL), step=step)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_expert_parallel_step_exchanges_the_predicted_all_to_all_bytes_on_two_ranks():
    """Per MoE layer, the rows (64 tokens x top-4 x width 64, fp32) go to their experts' rank
    and back in forward and their gradients the other way in backward: 4 all-to-alls, each
    sending half the rows; once per layer and forward the rows per expert; FSDP2's gathers and
    scatters of the rest, the experts apart (one rank holds each: nothing to gather)."""
    from litscale.models.moe import build_moe

    with torch.device("meta"):
        facts = model_facts(build_moe(vocab_size=VOCAB, block_size=SEQ, **EVEN_ROUTING), seq_len=SEQ,
                            vocab_size=VOCAB)
    plan = Plan("fsdp", MeshSizes(data_shard=2, expert=2), micro_batch=2, accumulation=1)
    predicted = {c.name: c for c in collectives(plan, facts, CLUSTER)}
    moe = facts.moe
    rows_bytes = 2 * SEQ * moe.top_k * facts.hidden * 4  # one exchange's input, fp32
    assert predicted["expert-parallel all-to-all"].calls == 4 * moe.layers == 8
    assert predicted["expert-parallel all-to-all"].bytes_per_rank == 4 * moe.layers * rows_bytes / 2
    assert predicted["expert-parallel count exchange"].bytes_per_rank == moe.layers * moe.n_experts * 8 / 2
    for calls, sent in run_distributed(_expert_parallel_counts, 2, timeout=280):
        assert calls == {name: c.calls for name, c in predicted.items()}
        assert sent["expert-parallel all-to-all"] == predicted["expert-parallel all-to-all"].bytes_per_rank
        assert sent["expert-parallel count exchange"] == predicted["expert-parallel count exchange"].bytes_per_rank
        for name in FSDP.values():  # FSDP2 pads each parameter's first dimension to a multiple of the world
            assert sent[name] == pytest.approx(predicted[name].bytes_per_rank, rel=2e-3), name
