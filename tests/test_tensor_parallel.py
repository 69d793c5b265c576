"""Tensor parallel (and DP x TP) against a single process of the same global batch, on gloo
CPU ranks; checkpoints saved at TP=2 loaded into the plain network; the mesh errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.distributed import run_distributed
from helpers.parity import (
    TINY_WITH_BIASES,
    ParitySetup,
    assert_traces_match,
    assert_weights_match,
    data_parallel_rank,
    fit,
    loop_trace,
    reference,
    tiny_module,
    tiny_net,
)

from litscale.models.gpt import GPT

pytestmark = pytest.mark.slow  # every test here starts gloo ranks

SETUP = ParitySetup(config=TINY_WITH_BIASES)  # SGD + momentum, 5 steps of a global batch of 8
TIED = dataclasses.replace(SETUP, config=dataclasses.replace(TINY_WITH_BIASES, tie_embeddings=True))


def tensor_parallel_trace(rank, world_size, setup, sequence_parallel, loss_parallel=False):
    """The plain loop over the whole global batches, with the network split over every rank by
    hand: each step's loss and gradients, gathered whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_context

    from litscale.strategies.tensor_plan import apply_tensor_parallel

    net = tiny_net(setup)
    apply_tensor_parallel(net, init_device_mesh("cpu", (world_size,)), GPT.tensor_parallel_plan,
                          sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    assert sum(isinstance(p, torch.distributed.tensor.DTensor) for p in net.parameters()) > 10
    return loop_trace(net, setup, loss_context=loss_parallel_context if loss_parallel else None)


TP_VARIANTS = {
    "plain": (SETUP, False, False),
    "sequence_parallel": (SETUP, True, False),
    "loss_parallel": (SETUP, True, True),
    "tied_embeddings": (TIED, True, False),
}


def tp_variants(rank, world_size):
    return {name: tensor_parallel_trace(rank, world_size, *args) for name, args in TP_VARIANTS.items()}


@pytest.mark.full
@pytest.mark.timeout(150)
def test_tensor_parallel_two_ranks_match_single_process_loss_and_gradients():
    """Plain TP, + sequence parallel, + loss parallel, and with tied embeddings (small/medium
    presets): 5 SGD steps, every step's loss and gradients."""
    results = run_distributed(tp_variants, 2, timeout=140)
    for traces in results:  # every rank gathers the whole of each tensor
        for name, (setup, *_) in TP_VARIANTS.items():
            assert_traces_match(traces[name], reference(setup), weights=False, rtol=1.3e-6, atol=1e-5)


# --- through Lightning: the strategy, the sampler, the optimizer step, clipping ---------------

CLIPPED = dataclasses.replace(SETUP, gradient_clip_val=0.5)  # Lightning's norm clipping


def fit_on_mesh(rank, world_size, strategy, setup, checkpoint_path=None):
    """Fit with a strategy on a mesh, each rank fed the rows of its data-parallel index."""
    sizes = strategy.resolve_mesh(world_size)
    data_rank = data_parallel_rank(rank, sizes)
    trace = fit(rank, world_size, strategy, setup, data_parallel_size=sizes.data,
                data_parallel_rank=data_rank, checkpoint_path=checkpoint_path)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": sizes.data, "rank": data_rank}
    return trace


def fit_plain_and_loss_parallel(rank, world_size, checkpoint_dir):
    from litscale.strategies import TensorParallelStrategy

    plain = TensorParallelStrategy(tensor_parallel_size=2)
    loss_parallel = TensorParallelStrategy(tensor_parallel_size=2, loss_parallel=True)
    return [fit_on_mesh(rank, world_size, plain, CLIPPED, f"{checkpoint_dir}/tp.ckpt").weights,
            fit_on_mesh(rank, world_size, loss_parallel, CLIPPED).weights]


@pytest.mark.full
@pytest.mark.timeout(150)
def test_strategy_tp2_fits_like_single_process_and_checkpoint_loads_unsharded(tmp_path):
    import torch.distributed.checkpoint as dcp

    results = run_distributed(fit_plain_and_loss_parallel, 2, str(tmp_path), timeout=140)
    expected = reference(CLIPPED).weights
    for weights in results[0]:  # TP, and TP with loss parallel (the strategy's loss context)
        assert_weights_match(weights, expected, rtol=1.3e-6, atol=1e-5)
    # The DCP checkpoint written at TP=2 loads into the plain (TP=1) network: DCP reshards.
    plain = tiny_module(CLIPPED)
    state = {"state_dict": plain.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "tp.ckpt"))
    plain.load_state_dict(state["state_dict"])
    assert_weights_match({k.removeprefix("net."): v for k, v in plain.state_dict().items()
                          if k.startswith("net.")}, expected, rtol=1.3e-6, atol=1e-5)
