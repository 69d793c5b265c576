"""Fine-tuning batches through the strategies, on 2 gloo ranks (Lightning's loop, litscale's
strategies): a prompt's logits get exactly zero gradient and the gradient is the single-process
mean over the answers' tokens (one process, FSDP, tensor parallel); in a packed row, changing
every token of one document leaves the other documents' logits bit-identical (tensor parallel, a
2-stage pipeline whose stages hand the positions on, context parallel's gathered documents; one
process for Llama, the MoE decoder and model=hf is in ``test_token_batch.py``); and the same
global batches of packed conversations log the same loss, the mean over their answers' tokens,
on 1 rank, 2 ranks and 2 ranks with accumulation 2; and packed rows with loss masks train 3
optimizer steps under DeepSpeed ZeRO-2 and ZeRO-3, tensor parallel 2, a 2-stage pipeline,
context parallel 2 (FSDP) and expert parallel 2 (FSDP, the MoE decoder) to the losses, gradient
norms, gradients (where ``.grad`` holds them) and final weights of one process's plain loop
(``make test-full``: the six in one rank-pool run)."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from helpers import strategies
from helpers.distributed import run_distributed
from helpers.parity import (
    OPTIMIZERS,
    TOLERANCE,
    ParitySetup,
    StepRecorder,
    Trace,
    assert_ranks_match,
    fit_on_mesh,
    full,
    norm_of,
    tiny_net,
)

from litscale.data.token_batch import IGNORE_INDEX, TokenBatch, document_positions
from litscale.models.llama import Llama, LlamaConfig
from litscale.models.moe import MoEConfig, MoEDecoder

CONFIG = LlamaConfig(n_layer=2, n_head=4, n_kv_heads=2, n_embd=32, ffn_hidden_size=64, vocab_size=64, block_size=16)
ROWS, LENGTH = 4, 16
LENGTHS = [5, 6, 3]  # a packed row's documents, then 2 positions of padding


def sft_batch(seed: int = 0) -> TokenBatch:
    """``ROWS`` packed rows; in each document the first half of the targets is a prompt's
    (ignored), the rest an answer's; the padding counts nothing."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(CONFIG.vocab_size, (ROWS, LENGTH), generator=generator)
    targets = torch.randint(CONFIG.vocab_size, (ROWS, LENGTH), generator=generator)
    counted = torch.zeros(ROWS, LENGTH, dtype=torch.bool)
    start = 0
    for row in range(ROWS):
        start = 0
        for length in LENGTHS:
            answer = (length + row) // 2  # rows with different counts
            counted[row, start + length - answer:start + length] = True
            start += length
    positions = torch.from_numpy(document_positions(LENGTHS, LENGTH))[None].repeat(ROWS, 1)
    fraction = counted.sum() / counted.numel()
    return TokenBatch(tokens, torch.where(counted, targets, IGNORE_INDEX), positions,
                      torch.full((ROWS,), float(fraction), dtype=torch.float64))


def _net() -> Llama:
    torch.manual_seed(0)
    return Llama(CONFIG)


def _loader(batches: list[TokenBatch], rows: slice):
    samples = [TokenBatch(*(t[i] for t in batch)) for batch in batches for i in range(ROWS)[rows]]
    return torch.utils.data.DataLoader(samples, batch_size=len(range(ROWS)[rows]), shuffle=False)


def _keep_logits(net: torch.nn.Module, found: dict) -> None:
    """Keep each output of the LM head (the logits) and the gradient that reaches it, whole."""
    def hook(module, inputs, output):
        found.setdefault("logits", []).append(full(output))
        if output.requires_grad:
            output.register_hook(lambda grad: found.setdefault("grad", []).append(full(grad)))

    net.lm_head.register_forward_hook(hook)


def _trainer(world_size: int, strategy, callbacks=(), steps: int = 1):
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps, logger=False,
                     log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
                     callbacks=list(callbacks))


def _gradients_on_ranks(rank: int, world_size: int, factory, data_parallel: bool) -> dict:
    """One SGD step of the tiny Llama on the global batch (each data-parallel rank its rows):
    every parameter's full gradient, and the logits' gradient this rank saw."""
    from litscale.modules import CausalLMModule

    net, found = _net(), {}
    _keep_logits(net, found)
    module = CausalLMModule(net=net, optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    recorder = StepRecorder(gradients=True)
    share = ROWS // world_size if data_parallel else ROWS
    rows = slice(rank * share, (rank + 1) * share) if data_parallel else slice(0, ROWS)
    _trainer(world_size, factory(), [recorder]).fit(module, train_dataloaders=_loader([sft_batch()], rows))
    return {"gradients": recorder.gradients[0], "logits_grad": found["grad"][0], "rows": (rows.start, rows.stop)}


def _reference_gradients() -> dict[str, torch.Tensor]:
    """The definition in one process: the mean cross-entropy over the answers' tokens only."""
    net, batch = _net(), sft_batch()
    logits = net(batch.tokens, batch.positions)
    counted = batch.targets != IGNORE_INDEX
    F.cross_entropy(logits[counted], batch.targets[counted]).backward()
    return {name: p.grad for name, p in net.named_parameters()}


def _assert_prompt_gets_no_gradient(result: dict) -> None:
    batch = sft_batch()
    rows = slice(*result["rows"])
    counted = (batch.targets != IGNORE_INDEX)[rows]
    grad = result["logits_grad"]
    assert torch.count_nonzero(grad[~counted]) == 0, "a prompt's (or padding's) logits got a gradient"
    assert (grad[counted].abs().sum(-1) > 0).all(), "an answer's logits got no gradient"


def test_prompt_tokens_get_exactly_zero_gradient_in_one_process():
    net, found = _net(), {}
    _keep_logits(net, found)
    from litscale.modules import CausalLMModule

    module = CausalLMModule(net=net, optimizer=torch.optim.SGD)
    module.loss(sft_batch()).backward()
    _assert_prompt_gets_no_gradient({"logits_grad": found["grad"][0], "rows": (0, ROWS)})
    reference = _reference_gradients()
    for name, param in net.named_parameters():
        torch.testing.assert_close(param.grad, reference[name], **TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("name, factory, data_parallel", [
    ("fsdp", strategies.fsdp, True),
    ("tensor_parallel", functools.partial(strategies.tensor_parallel, tensor_parallel_size=2), False),
    pytest.param("tensor_parallel loss_parallel", functools.partial(
        strategies.tensor_parallel, tensor_parallel_size=2, loss_parallel=True), False, marks=pytest.mark.full),
])
def test_prompt_tokens_get_exactly_zero_gradient_on_two_ranks(name, factory, data_parallel):
    reference = _reference_gradients()
    for result in run_distributed(_gradients_on_ranks, 2, factory, data_parallel, timeout=300):
        _assert_prompt_gets_no_gradient(result)
        assert result["gradients"].keys() == reference.keys()
        for parameter, grad in reference.items():
            torch.testing.assert_close(result["gradients"][parameter], grad, **TOLERANCE,
                                       msg=lambda m, p=parameter: f"{name} {p}: {m}")


def changed_batch() -> TokenBatch:
    """``sft_batch`` with every token of document 1 (positions 5 to 10) replaced."""
    batch = sft_batch()
    tokens = batch.tokens.clone()
    tokens[:, 5:11] = torch.randint(CONFIG.vocab_size, (ROWS, 6), generator=torch.Generator().manual_seed(9))
    return batch._replace(tokens=tokens)


def _logits_on_ranks(rank: int, world_size: int, factory, context_parallel: bool) -> dict:
    """Validation of the original and the changed batch: the logits this rank computed of each
    (a pipeline's last stage: all; a context-parallel rank: its chunks'), and where in the row
    they sit."""
    from litscale.modules import CausalLMModule
    from litscale.strategies.context_parallel import chunks_of

    net, found = _net(), {}
    _keep_logits(net, found)
    module = CausalLMModule(net=net, optimizer=torch.optim.SGD)
    _trainer(world_size, factory()).validate(module, dataloaders=_loader([sft_batch(), changed_batch()], slice(0, ROWS)),
                                             verbose=False)
    if not found.get("logits"):
        return {}  # a pipeline's first stage
    # NOTE: the last 2 x ROWS rows: a pipeline's stages first run one micro batch to learn the
    # shapes they pass on, whose logits come before the batches'.
    logits = torch.cat(found["logits"])[-2 * ROWS:]
    columns = list(range(LENGTH))
    if context_parallel:
        chunk = LENGTH // (2 * world_size)
        columns = [c for g in chunks_of(rank, world_size) for c in range(g * chunk, (g + 1) * chunk)]
    return {"original": logits[:ROWS], "changed": logits[ROWS:], "columns": columns}


@pytest.mark.slow
def test_a_changed_document_leaves_the_other_documents_logits_bit_identical_on_two_ranks():
    cases = {
        "tensor_parallel": (functools.partial(strategies.tensor_parallel, tensor_parallel_size=2), False),
        "pipeline": (functools.partial(strategies.pipeline, pipeline_parallel_size=2, microbatches=2), False),
        "context_parallel": (functools.partial(strategies.fsdp, context_parallel_size=2), True),
    }
    other = [c for c in range(LENGTH) if not 5 <= c < 11]
    for name, (factory, context_parallel) in cases.items():
        results = [r for r in run_distributed(_logits_on_ranks, 2, factory, context_parallel, timeout=300) if r]
        assert results, name
        held = set()
        for result in results:
            columns = result["columns"]
            mine = [i for i, c in enumerate(columns) if c in other]
            assert torch.equal(result["original"][:, mine], result["changed"][:, mine]), name
            theirs = [i for i, c in enumerate(columns) if c not in other]
            if theirs:  # a context-parallel rank's chunks may hold none of the changed document
                assert not torch.equal(result["original"][:, theirs], result["changed"][:, theirs]), name
            held |= set(columns)
        assert held == set(range(LENGTH)), name


# --- the logged loss of the same global batches on every layout ----------------------------------

SFT_CONFIG = dataclasses.replace(CONFIG, vocab_size=4096, block_size=64)  # the shipped BPE's vocabulary
GLOBAL_BATCH, SFT_STEPS = 8, 3


def _sft_data(cache_dir: str, batch_size: int):
    """litscale's example conversations, packed into rows of 64 positions: rows whose counted
    tokens differ, so a mean per rank or per micro batch would not be the global batch's."""
    from litscale.data.sft import SFTDataModule

    return SFTDataModule(seq_len=64, batch_size=batch_size, pack=True, cache_dir=cache_dir, seed=1)


def _logged_losses_on_ranks(rank: int, world_size: int, cache_dir: str, layouts: dict) -> dict:
    """``train/loss`` as each run logs it at each step, for each ``{name: (strategy factory,
    accumulation)}``, the global batch ``GLOBAL_BATCH`` rows shared out over the ranks."""
    import lightning as L

    from litscale.modules import CausalLMModule

    class LoggedLoss(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if "train/loss" in trainer.callback_metrics and len(self.losses) < trainer.global_step:
                self.losses.append(float(trainer.callback_metrics["train/loss"]))

    found = {}
    for name, (factory, accumulation) in layouts.items():
        torch.manual_seed(0)
        module = CausalLMModule(net=Llama(SFT_CONFIG), optimizer=functools.partial(torch.optim.SGD, lr=0.5))
        logged = LoggedLoss()
        trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=factory(), max_steps=SFT_STEPS,
                            accumulate_grad_batches=accumulation, logger=False, log_every_n_steps=1,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
                            callbacks=[logged])
        data = _sft_data(cache_dir, GLOBAL_BATCH // world_size // accumulation)
        trainer.fit(module, datamodule=data)
        found[name] = logged.losses
    return found


def _reference_losses(cache_dir: str) -> list[float]:
    """The definition in one plain loop: global batch ``i`` is rows ``8i`` to ``8i + 7`` of the
    seeded permutation of the training rows, its loss the mean cross-entropy over its counted
    (the answers') tokens; SGD on it."""
    data = _sft_data(cache_dir, GLOBAL_BATCH)
    data.prepare_data()
    data.setup("fit")
    order = torch.randperm(len(data.train_dataset), generator=torch.Generator().manual_seed(data.seed))
    torch.manual_seed(0)
    net = Llama(SFT_CONFIG)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    losses = []
    for step in range(SFT_STEPS):
        rows = [data.train_dataset[int(i)] for i in order[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]]
        tokens, targets, positions = (torch.stack([getattr(r, f) for r in rows]) for f in ("tokens", "targets", "positions"))
        assert len(set((targets != IGNORE_INDEX).sum(1).tolist())) > 1, "rows that count alike prove nothing"
        optimizer.zero_grad()
        loss = F.cross_entropy(net(tokens, positions).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_the_same_global_batch_logs_the_same_sft_loss_on_1_rank_2_ranks_and_2_ranks_with_accumulation(tmp_path):
    cache_dir = str(tmp_path / "cache")
    reference = _reference_losses(cache_dir)  # also writes the example cache the ranks read
    one = _logged_losses_on_ranks(0, 1, cache_dir, {"1 rank": (strategies.single, 1)})
    two = run_distributed(_logged_losses_on_ranks, 2, cache_dir, {
        "ddp 2": (strategies.ddp, 1), "fsdp 2 x accumulation 2": (strategies.fsdp, 2)}, timeout=300)[0]
    for name, losses in {**one, **two}.items():
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), **TOLERANCE,
                                   msg=lambda m, n=name: f"{n}: {m}")


# --- packed SFT trained for several steps under every strategy, against one process -------------

TRAIN_STEPS = 3
# parity's small MoE decoder (a dense layer, then two of 4 experts, top-2, a shared expert),
# dropless and without the balance loss or the bias update: both read a rank's own tokens, by
# design not the global batch's.
MOE_CONFIG = MoEConfig(n_layer=3, n_head=4, n_kv_heads=2, n_embd=32, ffn_hidden_size=64, vocab_size=64,
                       block_size=16, n_experts=4, top_k=2, moe_ffn_hidden_size=16, n_shared_experts=1,
                       dense_layers=1, aux_loss_coef=0.0)
# SGD with momentum (parity's "sgd"): a step that divides the loss wrongly moves the weights wrongly.
SETUPS = {"llama": ParitySetup(config=CONFIG, net_class=Llama, steps=TRAIN_STEPS, global_batch=ROWS),
          "moe": ParitySetup(config=MOE_CONFIG, net_class=MoEDecoder, steps=TRAIN_STEPS, global_batch=ROWS)}


class Trained(NamedTuple):
    """A strategy that trains packed SFT rows: how a rank builds it, the network it trains, and
    what it can show (ZeRO keeps no gradient in ``.grad``; ZeRO-3 gathers the weights on rank 0)."""

    strategy: functools.partial
    model: str = "llama"
    gradients: bool = True
    weights_on_every_rank: bool = True


P = functools.partial
TRAINED = {
    "deepspeed_zero2": Trained(P(strategies.zero, 2), gradients=False),
    "deepspeed_zero3": Trained(P(strategies.zero, 3), gradients=False, weights_on_every_rank=False),
    "tensor_parallel2": Trained(P(strategies.tensor_parallel, tensor_parallel_size=2)),
    # the positions and the counted fraction travel with each micro batch through the stages
    "pipeline2": Trained(P(strategies.pipeline, pipeline_parallel_size=2, microbatches=2)),
    "context_parallel2": Trained(P(strategies.fsdp, context_parallel_size=2)),
    "expert_parallel2": Trained(P(strategies.fsdp, expert_parallel_size=2), model="moe"),
}


def sft_global_batches() -> list[TokenBatch]:
    """One packed SFT global batch (``sft_batch``) per step, each of other tokens."""
    return [sft_batch(seed=step) for step in range(TRAIN_STEPS)]


def _sft_rank_loader(data_parallel_size: int, data_parallel_rank: int):
    """A data-parallel rank's rows of each global batch, one micro batch per step."""
    share = ROWS // data_parallel_size
    return _loader(sft_global_batches(), slice(data_parallel_rank * share, (data_parallel_rank + 1) * share))


def _trained_on_ranks(rank: int, world_size: int, cases: dict[str, Trained]) -> dict[str, Trace]:
    """Each case trained ``TRAIN_STEPS`` steps in one process group, every rank fed the rows of
    its data-parallel index on the strategy's mesh."""
    return {name: fit_on_mesh(rank, world_size, case.strategy(), SETUPS[case.model], gradients=case.gradients,
                              local_weights=case.weights_on_every_rank, loader_of=_sft_rank_loader)
            for name, case in cases.items()}


@functools.cache
def _reference_training(model: str) -> Trace:
    """The definition in one plain loop: each global batch's loss the mean cross-entropy over
    its counted (the answers') tokens, the network attending within documents by their
    positions; the same optimizer steps on it."""
    setup = SETUPS[model]
    net = tiny_net(setup)
    optimizer = OPTIMIZERS[setup.optimizer](net.parameters())
    losses, gradients = [], []
    for batch in sft_global_batches():
        optimizer.zero_grad()
        logits = net(batch.tokens, batch.positions)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        losses.append(loss.item())
        gradients.append({name: p.grad.clone() for name, p in net.named_parameters()})
        optimizer.step()
    return Trace(losses, gradients, {name: t.detach().clone() for name, t in net.state_dict().items()},
                 gradient_norms=[norm_of(step) for step in gradients])


@functools.cache
def _trained(cases: frozenset) -> dict | str:
    """Each rank's traces ``{case: [Trace per rank]}`` of ``cases``, trained in one rank-pool
    run on 2 ranks, or the failure's text (kept: the other cases fail at once)."""
    try:
        ranks = run_distributed(_trained_on_ranks, 2, {name: TRAINED[name] for name in TRAINED if name in cases},
                                timeout=900)
    except AssertionError as error:
        return str(error)
    return {name: [traces[name] for traces in ranks] for name in ranks[0]}


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", list(TRAINED))
def test_packed_sft_trains_as_one_process_does_on_two_ranks(name, request):
    selected = frozenset(item.callspec.params["name"] for item in request.session.items
                         if item.originalname == "test_packed_sft_trains_as_one_process_does_on_two_ranks")
    traces = _trained(selected)
    assert not isinstance(traces, str), traces
    case = TRAINED[name]
    reference = _reference_training(case.model)
    if name.startswith("context_parallel"):  # each rank's module saw half of every row
        assert {shape[1] for trace in traces[name] for shape in trace.input_shapes} == {LENGTH // 2}
    assert_ranks_match(traces[name], [reference] * 2, gradients=case.gradients,
                       weights_on_every_rank=case.weights_on_every_rank)
