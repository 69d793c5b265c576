"""Tensor parallel (and DP x TP) against a single process of the same global batch, on gloo
CPU ranks; checkpoints saved at TP=2 loaded into the plain network; the mesh errors."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from distributed import run_distributed

from litscale.models.gpt import GPT, GPTConfig, build_gpt
from litscale.modules import CausalLMModule

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16)
STEPS, GLOBAL_BATCH = 5, 8
TOLERANCE = {"rtol": 1.3e-6, "atol": 1e-5}
SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def global_batches(config: GPTConfig) -> torch.Tensor:
    """``[STEPS, GLOBAL_BATCH, T+1]`` random tokens, the same in every process."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, config.vocab_size, (STEPS, GLOBAL_BATCH, config.block_size + 1),
                         generator=generator)


def _loss(net, tokens):
    logits = net(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _full(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def tp_loss_and_grads_match(rank, world_size, sequence_parallel, loss_parallel=False, config=TINY):
    """5 SGD steps of the reference and of its TP copy: loss and every gradient must agree."""
    from contextlib import nullcontext

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_context

    from litscale.strategies.tensor_parallel import apply_tensor_parallel

    torch.manual_seed(0)
    reference = GPT(config)
    parallel = copy.deepcopy(reference)
    apply_tensor_parallel(parallel, init_device_mesh("cpu", (world_size,)), GPT.tensor_parallel_plan,
                          sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    assert sum(isinstance(p, torch.distributed.tensor.DTensor) for p in parallel.parameters()) > 10
    optimizers = [SGD(reference.parameters()), SGD(parallel.parameters())]
    for tokens in global_batches(config):
        losses = []
        for net, optimizer in zip((reference, parallel), optimizers, strict=True):
            optimizer.zero_grad()
            with loss_parallel_context() if loss_parallel and net is parallel else nullcontext():
                losses.append(_loss(net, tokens))
                losses[-1].backward()
        torch.testing.assert_close(_full(losses[1]), losses[0], **TOLERANCE)
        expected, actual = dict(reference.named_parameters()), dict(parallel.named_parameters())
        for name in expected:
            torch.testing.assert_close(_full(actual[name].grad), expected[name].grad, **TOLERANCE,
                                       msg=lambda m, name=name: f"{name}: {m}")
        for optimizer in optimizers:
            optimizer.step()
    return True


TIED = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16, tie_embeddings=True)


def tp_variants(rank, world_size):
    return [tp_loss_and_grads_match(rank, world_size, False),
            tp_loss_and_grads_match(rank, world_size, True),
            tp_loss_and_grads_match(rank, world_size, True, loss_parallel=True),
            tp_loss_and_grads_match(rank, world_size, True, config=TIED)]


@pytest.mark.timeout(150)
def test_tensor_parallel_two_ranks_match_single_process_loss_and_gradients():
    """Plain TP, + sequence parallel, + loss parallel, and with tied embeddings (small/medium
    presets): 5 SGD steps, every step's loss and gradients."""
    results = run_distributed(tp_variants, 2, timeout=140)
    assert results == [[True] * 4] * 2


# --- through Lightning: the strategy, the sampler, the optimizer step, clipping ---------------

def reference_weights(config: GPTConfig) -> dict[str, torch.Tensor]:
    """A plain single-process loop over the global batches, with Lightning's norm clipping."""
    torch.manual_seed(0)
    net = GPT(config)
    optimizer = SGD(net.parameters())
    for tokens in global_batches(config):
        optimizer.zero_grad()
        _loss(net, tokens).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        optimizer.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def rank_loader(config, data_parallel_size: int, data_parallel_rank: int):
    micro = GLOBAL_BATCH // data_parallel_size
    rows = slice(data_parallel_rank * micro, (data_parallel_rank + 1) * micro)
    tokens = global_batches(config)[:, rows].reshape(-1, config.block_size + 1)
    dataset = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return torch.utils.data.DataLoader(dataset, batch_size=micro, shuffle=False)


def fit_with_strategy(rank, world_size, config, strategy_kwargs, checkpoint_dir=None, strategy_class=None):
    """Fit with TensorParallelStrategy (or ``strategy_class``); return (consolidated weights,
    logged loss)."""
    import lightning as L

    from litscale.export import consolidated_state_dict
    from litscale.strategies import TensorParallelStrategy

    torch.manual_seed(0)
    module = CausalLMModule(net=GPT(config), optimizer=SGD)
    strategy = (strategy_class or TensorParallelStrategy)(**strategy_kwargs)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, gradient_clip_val=0.5,
        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False)
    sizes = strategy.resolve_mesh(world_size)
    data_rank = (rank // sizes.tensor) % sizes.data  # mesh order: (pipeline, data, tensor)
    trainer.fit(module, train_dataloaders=rank_loader(config, sizes.data, data_rank))
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": sizes.data, "rank": data_rank}
    if checkpoint_dir is not None:
        trainer.save_checkpoint(f"{checkpoint_dir}/tp.ckpt")
    return consolidated_state_dict(trainer, module), float(trainer.callback_metrics["train/loss"])


def assert_matches(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys() and len(expected) > 3
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")


def fit_plain_and_loss_parallel(rank, world_size, checkpoint_dir):
    return [fit_with_strategy(rank, world_size, TINY, {"tensor_parallel_size": 2}, checkpoint_dir)[0],
            fit_with_strategy(rank, world_size, TINY, {"tensor_parallel_size": 2, "loss_parallel": True})[0]]


@pytest.mark.timeout(150)
def test_strategy_tp2_fits_like_single_process_and_checkpoint_loads_unsharded(tmp_path):
    import torch.distributed.checkpoint as dcp

    results = run_distributed(fit_plain_and_loss_parallel, 2, str(tmp_path), timeout=140)
    expected = reference_weights(TINY)
    for weights in results[0]:  # TP, and TP with loss parallel (the strategy's loss context)
        assert_matches(weights, expected)
    # The DCP checkpoint written at TP=2 loads into the plain (TP=1) network: DCP reshards.
    plain = CausalLMModule(net=GPT(TINY), optimizer=SGD)
    state = {"state_dict": plain.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "tp.ckpt"))
    plain.load_state_dict(state["state_dict"])
    assert_matches({k.removeprefix("net."): v for k, v in plain.state_dict().items()
                    if k.startswith("net.")}, expected)


def fit_on_four_ranks(rank, world_size, nano):
    """DP=2 x TP=2 on GPT-nano, then the pipeline composed with each: PP=2 x DP=2, PP=2 x TP=2."""
    from litscale.strategies import PipelineParallelStrategy

    results = {"dp2_tp2": fit_with_strategy(rank, world_size, nano, {"tensor_parallel_size": 2})}
    for name, sizes in {"pp2_dp2": {"data_parallel_size": 2}, "pp2_tp2": {"tensor_parallel_size": 2}}.items():
        strategy = functools.partial(PipelineParallelStrategy, pipeline_parallel_size=2, microbatches=2, **sizes)
        results[name] = fit_with_strategy(rank, world_size, TINY, {}, strategy_class=strategy)
    return results


@pytest.mark.timeout(300)
def test_four_ranks_two_dimensional_meshes_match_single_process():
    nano = build_gpt(preset="nano", block_size=32).config
    results = run_distributed(fit_on_four_ranks, 4, nano, timeout=280)
    assert_matches(results[0]["dp2_tp2"][0], reference_weights(nano))
    tiny = reference_weights(TINY)
    for name in ("pp2_dp2", "pp2_tp2"):  # rank 0 holds the first stage, gathered over its mesh
        stage = results[0][name][0]
        assert 10 < len(stage) < len(tiny), name
        assert_matches(stage, {key: tiny[key] for key in stage})
