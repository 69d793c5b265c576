"""``determinism=layout_invariant``: GPT-nano trained at 1, 2, 4 and 8 ranks, under DDP and
FSDP, with and without gradient accumulation, gives ``torch.equal`` losses at every step and
``torch.equal`` weights at the end; a ResNet's batch-norm statistics move alike on every layout;
LARS and LAMB (norms of each tensor) step alike under FSDP; bf16 runs as under one process; the
pairwise tree and the chunk arithmetic by hand; what the mode refuses before any rank starts."""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch
from helpers.configs import compose_job
from helpers.distributed import run_distributed
from helpers.strategies import ddp, fsdp

from litscale.app.checks.validation import ConfigError, validate
from litscale.reliability import determinism
from litscale.reliability.determinism import LayoutInvariance, _Subtree, tree_sum

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
        (
            ["strategy=fsdp", "model=llama", "strategy.context_parallel_size=2"],
            "strategy.context_parallel_size=2 is not supported with determinism=layout_invariant: the mode "
            "splits the batch into chunks of whole samples, each forwarded on an unsplit replica of the network; "
            "allowed: strategy.context_parallel_size=1",
        ),
        (
            ["strategy=fsdp", "model=moe"],
            "model=moe is not supported with determinism=layout_invariant: the mode forwards a replica of the "
            "network, and what its experts' training reads from the network itself (auxiliary_loss, "
            "take_router_statistics, update_expert_bias, expert_modules) would be lost; allowed: a network "
            "without experts (e.g. model=gpt or llama)",
        ),
        (
            ["strategy=ddp", "precision=fp16_mixed", "trainer.accelerator=gpu"],
            "precision=fp16_mixed is not supported with determinism=layout_invariant: its loss scaler would "
            "unscale gradients the mode sums unscaled; allowed: precision=fp32, bf16_mixed or bf16_true",
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
        "context_parallel",
        "moe",
        "fp16_mixed",
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


def images() -> tuple[torch.Tensor, torch.Tensor]:
    """``[steps, global batch, 1, 8, 8]`` images (not centred: the statistics have somewhere to
    move) and their ``[steps, global batch]`` labels, the same in every process."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(STEPS, GLOBAL_BATCH, 1, 8, 8, generator=generator) * 2 + 0.5
    return inputs, torch.randint(0, 10, (STEPS, GLOBAL_BATCH), generator=generator)


def resnet() -> torch.nn.Module:
    from litscale.models.resnet import ResNet

    torch.manual_seed(0)
    return ResNet(input_shape=[1, 8, 8], num_classes=10, widths=[8, 16], blocks_per_stage=1)


def _task(name: str, rank: int, world_size: int):
    """(module class, network, this rank's contiguous share of every global batch)."""
    from litscale.models.gpt import build_gpt
    from litscale.modules import CausalLMModule, ClassificationModule

    share = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
    if name == "resnet":
        inputs, labels = images()
        return ClassificationModule, resnet(), (inputs[:, share].flatten(0, 1), labels[:, share].flatten())
    torch.manual_seed(0)
    net = build_gpt(preset="nano", vocab_size=VOCAB, block_size=SEQ, dropout=0.1)
    tokens = batches()[:, share].reshape(-1, SEQ + 1)
    return CausalLMModule, net, (tokens[:, :-1], tokens[:, 1:])


def _fit(rank: int, world_size: int, strategy_factory, accumulation: int, *, task: str = "gpt",
         steps: int = STEPS, precision: str = "32-true", accelerator: str = "cpu",
         optimizer: str = "adamw") -> tuple[list, dict]:
    """GPT-nano (dropout on) or a small ResNet through Lightning in layout-invariant mode on
    this rank's contiguous share of each global batch, stepped by ``optimizer`` (``OPTIMIZERS``);
    (global losses, full state on rank 0)."""
    import lightning as L

    from litscale.checkpoint.export import consolidated_state_dict

    module_class, net, data = _task(task, rank, world_size)
    determinism = LayoutInvariance(chunks=CHUNKS, seed=7)
    module = module_class(
        net=net,
        optimizer=OPTIMIZERS[optimizer](),
        weight_decay=0.1,
        determinism=determinism,
    )
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(*data),
        batch_size=GLOBAL_BATCH // world_size // accumulation,
        shuffle=False,
    )
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=world_size,
        strategy=strategy_factory(),
        max_steps=steps,
        precision=precision,
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


def _layerwise(name: str):
    from litscale.optim import layerwise

    # A LR large enough that the trust ratio's rounding shows in 4 steps.
    return functools.partial(getattr(layerwise, name), lr=1.0 if name == "LARS" else 1e-2)


# The optimizers a run of the mode steps with, built inside a rank (LARS and LAMB import
# pytorch_optimizer there only).
OPTIMIZERS = {"adamw": lambda: functools.partial(torch.optim.AdamW, lr=1e-3),
              "lars": functools.partial(_layerwise, "LARS"), "lamb": functools.partial(_layerwise, "LAMB")}


def single():
    from litscale.strategies import SingleStrategy

    return SingleStrategy()


@functools.cache
def reference() -> tuple[list, dict]:
    """One process, the whole global batch as one micro batch."""
    return run_distributed(_fit, 1, single, 1)[0]


def assert_bit_identical(result: tuple[list, dict], expected: tuple[list, dict] | None = None) -> None:
    losses, weights = result
    expected_losses, expected_weights = expected or reference()
    assert len(losses) == len(expected_losses) > 0
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
QUICK = {(2, "ddp", 2)}  # in make test-full (CI); the other cells in make test-soak, beyond CI's time
# on 2 cores (4 ranks 36-40 s each, 8 ranks 70-100 s).
STRATEGIES = {"ddp": ddp, "fsdp": fsdp}


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(900)  # 8 ranks on 2 cores: 280 s for DDP on a shared machine
@pytest.mark.parametrize(
    ("ranks", "strategy", "accumulation"),
    [
        pytest.param(
            *cell,
            marks=[] if cell in QUICK else [pytest.mark.soak],
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


@functools.cache
def optimizer_reference(optimizer: str) -> tuple[list, dict]:
    return run_distributed(_fit, 1, single, 1, steps=4, optimizer=optimizer, timeout=300)[0]


@pytest.mark.slow
@pytest.mark.timeout(900)  # 3 processes on a shared 2-core machine
@pytest.mark.parametrize("optimizer", ["lars", "lamb"])
def test_a_trust_ratio_takes_the_same_norms_on_a_sharded_layout(optimizer):
    """LARS and LAMB scale each matrix's step by its norms: under FSDP each rank holds a shard
    of the matrix, and the norms of its shards, reduced over the ranks, differed from one
    process's in the last bits (66 of 69 tensors after 4 steps). Under the mode they are the
    norms of the whole tensors, so 2 FSDP ranks with accumulation train as one process, bit for
    bit."""
    result = run_distributed(_fit, 2, fsdp, 2, steps=4, optimizer=optimizer, timeout=300)[0]
    assert_bit_identical(result, optimizer_reference(optimizer))


# --- running statistics -----------------------------------------------------------------------------

STATISTICS = ("running_mean", "running_var")


def statistics_by_hand(net: torch.nn.Module, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    """A batch-norm network's running statistics after one step of the mode, computed apart from
    it: each chunk forwarded alone on a copy of ``net``, the copies' statistics averaged."""
    after = []
    for chunk in inputs.chunk(CHUNKS):
        replica = copy.deepcopy(net).train()
        with torch.no_grad():
            replica(chunk)
        after.append(replica.state_dict())
    return {name: torch.stack([state[name] for state in after]).mean(0)
            for name in after[0] if name.endswith(STATISTICS)}


@pytest.mark.slow
def test_batch_norm_statistics_after_a_step_are_the_mean_of_the_chunks():
    """One step of a ResNet: the network's running mean and variance are those each chunk's
    forward leaves, averaged (a momentum step towards the chunks' mean batch statistics), and
    each batch norm counts one batch."""
    _, state = run_distributed(_fit, 1, single, 1, task="resnet", steps=1)[0]
    expected = statistics_by_hand(resnet(), images()[0][0])
    assert len(expected) == 2 * 6  # the stem's batch norm, two in each block, the second's shortcut
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, msg=name)
    assert {int(v) for n, v in state.items() if n.endswith("num_batches_tracked")} == {1}


@functools.cache
def resnet_reference() -> tuple[list, dict]:
    return run_distributed(_fit, 1, single, 1, task="resnet", steps=4)[0]


@pytest.mark.slow
@pytest.mark.parametrize(("ranks", "strategy", "accumulation"), [(1, "single", 2), (2, "ddp", 1), (2, "fsdp", 2)])
def test_batch_norm_statistics_move_alike_on_every_layout(ranks, strategy, accumulation):
    """Four steps of a ResNet: losses, weights and running statistics equal one process's bit
    for bit, and the statistics have moved."""
    factory = single if strategy == "single" else STRATEGIES[strategy]
    expected = resnet_reference()
    initial = resnet().state_dict()
    moved = [n for n in initial if n.endswith(STATISTICS) and not torch.equal(expected[1][n], initial[n])]
    assert len(moved) == 2 * 6
    result = run_distributed(_fit, ranks, factory, accumulation, task="resnet", steps=4, timeout=300)[0]
    assert_bit_identical(result, expected)


# --- precision ----------------------------------------------------------------------------------------


@functools.cache
def precision_reference(precision: str) -> tuple[list, dict]:
    """One process of ``strategy=single``, whose precision plugin autocasts its whole step."""
    return run_distributed(_fit, 1, single, 1, steps=4, precision=precision)[0]


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.parametrize(("ranks", "strategy", "precision"),
                         [(1, "fsdp", "bf16-mixed"), (2, "fsdp", "bf16-mixed"), (2, "ddp", "bf16-true")])
def test_bf16_trains_as_one_process_of_strategy_single(ranks, strategy, precision):
    """Under FSDP, whose precision plugin leaves autocast out, the chunks' forwards still run in
    bf16 autocast; bf16-true weights take their gradients in bf16."""
    result = run_distributed(_fit, ranks, STRATEGIES[strategy], 1, steps=4, precision=precision, timeout=300)[0]
    assert_bit_identical(result, precision_reference(precision))


# --- CUDA ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_on_cuda_the_run_takes_deterministic_algorithms(tmp_path, outputs_root, monkeypatch):
    """The app's build turns torch's deterministic algorithms and cuBLAS's fixed workspace on
    before ``fit`` when the run's device is CUDA (faked here), and leaves a CPU run as it is."""
    from omegaconf import OmegaConf

    from litscale.app.build import build_run

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    threads = torch.get_num_threads()
    cfg, choices = compose_job(["determinism=layout_invariant", "trainer.accelerator=cpu"], tmp_path / "run")
    layout = validate(cfg, choices=choices, this_machine=False)
    config = OmegaConf.to_container(cfg, resolve=True)
    seen = []
    try:
        build_run(config, choices, layout)
        assert not torch.are_deterministic_algorithms_enabled()
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        monkeypatch.setattr(determinism, "on_cuda", lambda device: seen.append(torch.device(device)) or True)
        build_run(config, choices, layout)
        assert seen == [torch.device("cpu")]  # asked once, of the strategy's device
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)


def _fit_on_gpu(rank: int, world_size: int) -> tuple[tuple[list, dict], bool, str | None]:
    result = _fit(rank, world_size, single, 1, steps=4, accelerator="gpu")
    return result, torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_mode_runs_deterministic_kernels_and_repeats_itself():
    first, enabled, workspace = run_distributed(_fit_on_gpu, 1)[0]
    assert enabled and workspace in (":4096:8", ":16:8")
    assert_bit_identical(run_distributed(_fit_on_gpu, 1)[0][0], first)
