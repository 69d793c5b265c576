"""``determinism=layout_invariant``: GPT-nano trained at 1, 2, 4 and 8 ranks, under DDP and
FSDP, with and without gradient accumulation, gives ``torch.equal`` losses at every step and
``torch.equal`` weights at the end; the pairwise tree and the chunk arithmetic by hand."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.configs import compose_job
from helpers.distributed import run_distributed
from helpers.strategies import ddp, fsdp

from litscale.app.validation import ConfigError, validate
from litscale.determinism import LayoutInvariance, _Subtree, tree_sum

STEPS = 20
GLOBAL_BATCH = 16
CHUNKS = 8
SEQ = 16
VOCAB = 64


# --- the arithmetic ------------------------------------------------------------------------------


def test_the_tree_adds_neighbours_first():
    a, b, c, d = (torch.tensor([x]) for x in (1e8, 1.0, -1e8, 1.0))
    assert torch.equal(tree_sum([a, b, c, d]), (a + b) + (c + d))


def test_a_ranks_subtree_is_the_node_of_the_global_tree_over_its_chunks():
    values = [torch.randn(5, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    for ranks in (1, 2, 4, 8):
        share = 8 // ranks
        sums = []
        for rank in range(ranks):
            subtree = _Subtree()
            for value in values[rank * share : (rank + 1) * share]:
                subtree.add([value])
            sums.append(subtree.total()[0])
        assert torch.equal(tree_sum(sums), tree_sum(values)), ranks


def test_chunks_must_be_a_power_of_two():
    with pytest.raises(ValueError, match=r"^determinism.chunks must be a power of two, got 6$"):
        LayoutInvariance(chunks=6)


# --- what the mode refuses, before anything starts ----------------------------------------------

CPU2 = [
    "determinism=layout_invariant",
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "launcher.oversubscribe=true",
]


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (
            ["strategy=tensor_parallel"],
            "determinism=layout_invariant is not supported with strategy=tensor_parallel: "
            "tensor and pipeline parallel change the reductions inside a matmul; allowed: strategy=single, ddp or fsdp",
        ),
        (
            ["strategy=pipeline"],
            "determinism=layout_invariant is not supported with strategy=pipeline: tensor and "
            "pipeline parallel change the reductions inside a matmul; allowed: strategy=single, ddp or fsdp",
        ),
        (
            ["strategy=local_sgd", "strategy.sync_every=1"],
            "determinism=layout_invariant is not supported with strategy=local_sgd: each rank's optimizer steps "
            "on its own share of the batch before the parameters are averaged, so the model depends on the number "
            "of ranks by design (at sync_every=1 too); allowed: strategy=single, ddp or fsdp",
        ),
        (
            ["strategy=deepspeed_zero"],
            "determinism=layout_invariant is not supported with strategy=deepspeed_zero: DeepSpeed's engine "
            "reduces gradients in its own backward hooks into the partitioned buffers its optimizer steps, and "
            "takes no gradient summed outside them; allowed: strategy=single, ddp or fsdp",
        ),
        (
            ["strategy=ddp", "compression=powersgd"],
            "determinism=layout_invariant sums exact gradients, not "
            "compression=powersgd; allowed: compression=none",
        ),
        (
            ["strategy=ddp", "data.batch_size=3"],
            "determinism.chunks=8 must be a power of two, a multiple of 2 "
            "data-parallel rank(s) x 1 micro batch(es) = 2, and divide the global batch 6",
        ),
        (
            ["strategy=ddp", "determinism.chunks=2", "trainer.accumulate_grad_batches=2"],
            "determinism.chunks=2 must "
            "be a power of two, a multiple of 2 data-parallel rank(s) x 2 micro batch(es) = 4, and divide the global "
            "batch 64",
        ),
    ],
    ids=[
        "tensor_parallel",
        "pipeline",
        "local_sgd",
        "deepspeed_zero",
        "compression",
        "batch",
        "accumulation",
    ],
)
def test_a_layout_the_mode_cannot_hold_is_refused_in_one_line(
    overrides, error, tmp_path, outputs_root
):
    cfg, choices = compose_job([*CPU2, *overrides], tmp_path / "run")
    with pytest.raises(ConfigError) as info:
        validate(cfg, choices=choices, this_machine=False)
    assert str(info.value) == error


# --- real training --------------------------------------------------------------------------------


def batches() -> torch.Tensor:
    """``[steps, global batch, seq + 1]`` tokens, the same in every process."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=generator)


def _fit(rank: int, world_size: int, strategy_factory, accumulation: int) -> tuple[list, dict]:
    """GPT-nano (dropout on) through Lightning in layout-invariant mode on this rank's
    contiguous share of each global batch; (global losses, full weights on rank 0)."""
    import lightning as L

    from litscale.export import consolidated_state_dict
    from litscale.models.gpt import build_gpt
    from litscale.modules import CausalLMModule

    torch.manual_seed(0)
    net = build_gpt(preset="nano", vocab_size=VOCAB, block_size=SEQ, dropout=0.1)
    determinism = LayoutInvariance(chunks=CHUNKS, seed=7)
    module = CausalLMModule(
        net=net,
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
        weight_decay=0.1,
        determinism=determinism,
    )
    share = GLOBAL_BATCH // world_size
    tokens = batches()[:, rank * share : (rank + 1) * share].reshape(-1, SEQ + 1)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]),
        batch_size=share // accumulation,
        shuffle=False,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy_factory(),
        max_steps=STEPS,
        accumulate_grad_batches=accumulation,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, train_dataloaders=loader)
    return [loss.item() for loss in determinism.losses], consolidated_state_dict(trainer, module)


def single():
    from litscale.strategies import SingleStrategy

    return SingleStrategy()


@functools.cache
def reference() -> tuple[list, dict]:
    """One process, the whole global batch as one micro batch."""
    return run_distributed(_fit, 1, single, 1)[0]


def assert_bit_identical(result: tuple[list, dict]) -> None:
    losses, weights = result
    expected_losses, expected_weights = reference()
    assert len(losses) == STEPS
    assert losses == expected_losses  # floats compared exactly: torch.equal on each step's loss
    assert weights.keys() == expected_weights.keys()
    unequal = [name for name in weights if not torch.equal(weights[name], expected_weights[name])]
    assert not unequal, unequal


# Every layout whose ranks x accumulation split the 8 chunks (8 ranks with accumulation 2 would
# need 16 chunks: another run, compared with nothing here).
CELLS = [
    (ranks, name, accumulation)
    for ranks in (1, 2, 4, 8)
    for name in ("ddp", "fsdp")
    for accumulation in (1, 2)
    if ranks * accumulation <= CHUNKS and (ranks > 1 or (name, accumulation) == ("ddp", 2))
]
QUICK = {(2, "ddp", 2), (2, "fsdp", 1)}  # in make test; the other cells in make test-full
STRATEGIES = {"ddp": ddp, "fsdp": fsdp}


@pytest.mark.slow
@pytest.mark.timeout(900)  # 8 ranks on 2 cores: 280 s for DDP on a shared machine
@pytest.mark.parametrize(
    ("ranks", "strategy", "accumulation"),
    [
        pytest.param(
            *cell,
            marks=[] if cell in QUICK else [pytest.mark.full],
            id=f"{cell[1] if cell[0] > 1 else 'single'}-{cell[0]}ranks-acc{cell[2]}",
        )
        for cell in CELLS
    ],
)
def test_every_layout_trains_bit_identically_to_one_process(ranks, strategy, accumulation):
    """20 steps of GPT-nano (dropout 0.1, AdamW, clipping) on 16 samples a step in 8 chunks:
    every step's global loss and the final weights equal one process's bit for bit."""
    factory = single if ranks == 1 else STRATEGIES[strategy]
    assert_bit_identical(run_distributed(_fit, ranks, factory, accumulation, timeout=600)[0])
