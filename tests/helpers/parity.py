"""One parity harness: a strategy on N gloo ranks against one process on the same global
batches, compared at every step (the global batch's loss, every parameter's full gradient)
and at the end (the weights).

Both sides train a small GPT from the same seed on the same global batches (``ParitySetup``).
A data-parallel rank ``r`` of ``D`` gets rows ``r*b:(r+1)*b`` of each global batch, with
``b = global_batch / D``; ranks that share a data-parallel index (tensor- or pipeline-parallel
peers on one mesh) get the same rows, so such a mesh passes its data-parallel size and index.

    setup = ParitySetup(optimizer="adamw")
    trace = run_distributed(fit_with, 2, fsdp, setup, gradients=True)[0]  # rank 0's: complete
    assert_traces_match(trace, reference(setup))

``fit`` runs Lightning's loop with a strategy; ``loop_trace`` runs a plain loop, either the
single-process reference or a network parallelised by hand (DTensor parameters).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.distributed as dist
from lightning.pytorch import Callback

from litscale.models.gpt import GPT, GPTConfig
from litscale.modules import CausalLMModule

# PyTorch's fp32 defaults for assert_close: what a sharded step may differ from one process by.
TOLERANCE = {"rtol": 1.3e-6, "atol": 1e-5}

# NOTE: no biases: the key projection's bias has an exactly zero gradient (softmax ignores a
# constant added to every key), so its computed gradient is rounding noise of order 1e-10,
# which AdamW divides by its own square root into steps of size lr: any two correct
# implementations then disagree by ~lr on that tensor. SGD comparisons may keep them.
TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16, bias=False)
TINY_WITH_BIASES = dataclasses.replace(TINY, bias=True)

OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95)),
}


@dataclasses.dataclass(frozen=True)
class ParitySetup:
    """What both sides train: the network, the optimizer (a key of ``OPTIMIZERS``), the
    global batches (``steps`` of ``global_batch`` random sequences from ``data_seed``) and
    Lightning's norm clipping (the reference clips the same way)."""

    config: GPTConfig = TINY
    optimizer: str = "sgd"
    steps: int = 5
    global_batch: int = 8
    data_seed: int = 0
    gradient_clip_val: float | None = None


@dataclasses.dataclass
class Trace:
    """What a run did: the global batch's loss at each step, every parameter's full gradient
    at each step (before clipping; empty unless recorded), and the full weights at the end."""

    losses: list[float]
    gradients: list[dict[str, torch.Tensor]]
    weights: dict[str, torch.Tensor]


# --- the data ---------------------------------------------------------------------------------


def global_batches(setup: ParitySetup) -> torch.Tensor:
    """``[steps, global_batch, T+1]`` random tokens, the same in every process."""
    config = setup.config
    generator = torch.Generator().manual_seed(setup.data_seed)
    return torch.randint(0, config.vocab_size, (setup.steps, setup.global_batch, config.block_size + 1),
                         generator=generator)


def rank_loader(setup: ParitySetup, data_parallel_size: int = 1, data_parallel_rank: int = 0):
    """The micro batches of one data-parallel rank: rows ``r*b:(r+1)*b`` of each global batch
    (with the defaults, the whole global batch at every step)."""
    micro = setup.global_batch // data_parallel_size
    rows = slice(data_parallel_rank * micro, (data_parallel_rank + 1) * micro)
    tokens = global_batches(setup)[:, rows].reshape(-1, setup.config.block_size + 1)
    dataset = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return torch.utils.data.DataLoader(dataset, batch_size=micro, shuffle=False)


def data_parallel_rank(rank: int, sizes) -> int:
    """The data-parallel index of ``rank`` on a mesh laid out row-major over (pipeline, data,
    tensor), as litscale's strategies lay it (``sizes``: their ``MeshSizes``)."""
    return (rank // sizes.tensor) % sizes.data


# --- the model and the reference --------------------------------------------------------------


def tiny_net(setup: ParitySetup) -> GPT:
    torch.manual_seed(0)
    return GPT(setup.config)


def tiny_module(setup: ParitySetup) -> CausalLMModule:
    return CausalLMModule(net=tiny_net(setup), optimizer=OPTIMIZERS[setup.optimizer])


def full(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole: a DTensor gathered from its shards (a collective), anything else as is."""
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def full_gradients(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: full(p.grad) for name, p in net.named_parameters() if p.grad is not None}


def loop_trace(net: torch.nn.Module, setup: ParitySetup, *, loss_context=None) -> Trace:
    """Train ``net`` with a plain loop over the whole global batches, optimised and clipped as
    the module's own ``configure_optimizers`` and Lightning would; ``loss_context`` is entered
    around each loss and its backward (e.g. tensor parallel's ``loss_parallel``)."""
    module = CausalLMModule(net=net, optimizer=OPTIMIZERS[setup.optimizer])
    optimizer = module.configure_optimizers()
    losses, gradients = [], []
    for tokens in global_batches(setup):
        optimizer.zero_grad()
        with (loss_context or contextlib.nullcontext)():
            loss = module.loss((tokens[:, :-1], tokens[:, 1:]))
            loss.backward()
        losses.append(float(full(loss)))
        gradients.append(full_gradients(net))
        if setup.gradient_clip_val:
            torch.nn.utils.clip_grad_norm_(net.parameters(), setup.gradient_clip_val)
        optimizer.step()
    return Trace(losses, gradients, {k: full(v) for k, v in net.state_dict().items()})


@functools.cache
def reference(setup: ParitySetup) -> Trace:
    """One process over the global batches: what every strategy must reproduce."""
    return loop_trace(tiny_net(setup), setup)


# --- N ranks through Lightning ----------------------------------------------------------------


class StepRecorder(Callback):
    """The global batch's loss after each step (``losses``, by the number of steps done) and,
    with ``gradients=True``, every parameter's full gradient as the optimizer receives it.

    Gradients are read from ``.grad`` before Lightning clips them; sharded ones (DTensor) are
    gathered, so every rank must record. A strategy that keeps gradients elsewhere (DeepSpeed
    ZeRO's partitions) records none: compare its losses and weights.
    """

    def __init__(self, *, gradients: bool = False) -> None:
        self.record_gradients = gradients
        self.losses: dict[int, float] = {}
        self.gradients: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.record_gradients:
            self.gradients.append(full_gradients(getattr(pl_module, "net", pl_module)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Each rank's loss is over its own micro batch; equal micro batches make the mean over
        # ranks the global batch's loss (model-parallel peers hold the same value, so they
        # weigh every data-parallel index alike).
        loss = full(outputs["loss"])
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        self.losses[trainer.global_step] = float(loss)


def fit(rank: int, world_size: int, strategy, setup: ParitySetup, *,
        data_parallel_size: int | None = None, data_parallel_rank: int | None = None,
        gradients: bool = False, precision: str = "32-true", callbacks=(),
        checkpoint_path: str | None = None) -> Trace:
    """Fit ``tiny_module(setup)`` with ``strategy`` (built in this rank) on this rank's micro
    batches; every rank a data-parallel rank unless the mesh says otherwise. Returns the
    trace, its weights consolidated (complete on rank 0). A collective: call it on every rank."""
    import lightning as L

    from litscale.export import consolidated_state_dict

    module, recorder = tiny_module(setup), StepRecorder(gradients=gradients)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=setup.steps,
        precision=precision, gradient_clip_val=setup.gradient_clip_val, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[recorder, *callbacks],
    )
    loader = rank_loader(setup, data_parallel_size or world_size,
                         rank if data_parallel_rank is None else data_parallel_rank)
    trainer.fit(module, train_dataloaders=loader)
    if checkpoint_path is not None:
        trainer.save_checkpoint(checkpoint_path)
    return Trace([recorder.losses[step] for step in sorted(recorder.losses)], recorder.gradients,
                 consolidated_state_dict(trainer, module))


def fit_with(rank: int, world_size: int, strategy_factory, setup: ParitySetup, **options) -> Trace:
    """``fit`` with ``strategy_factory()``: what ``run_distributed`` can send to the ranks."""
    return fit(rank, world_size, strategy_factory(), setup, **options)


def fit_variants(rank: int, world_size: int, factories: dict, setups: dict, **options) -> dict:
    """Every (strategy variant, setup) fit in one process group, one spawn instead of one per
    case: ``{(variant, setup key): Trace}``."""
    return {(name, key): fit_with(rank, world_size, factory, setup, **options)
            for name, factory in factories.items() for key, setup in setups.items()}


# --- comparing ------------------------------------------------------------------------------


def _assert_tensors_close(actual: dict, expected: dict, label: str, tolerance: dict) -> None:
    assert actual.keys() == expected.keys(), f"{label}: {sorted(actual)} != {sorted(expected)}"
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **tolerance,
                                   msg=lambda message, name=name: f"{label}{name}: {message}")


def assert_weights_match(actual: dict, expected: dict, **tolerance) -> None:
    """The same tensor names, each close (fp32 defaults unless ``tolerance`` says otherwise)."""
    assert len(expected) > 10, f"only {len(expected)} tensors: not a whole network or stage"
    _assert_tensors_close(actual, expected, "", {**TOLERANCE, **tolerance})


def assert_traces_match(actual: Trace, expected: Trace, *, losses: bool = True,
                        gradients: bool = True, weights: bool = True, **tolerance) -> None:
    """Step by step, then at the end: each step's loss, each step's gradients (which ``fit``
    records only when asked), the final weights."""
    tolerance = {**TOLERANCE, **tolerance}
    if losses:
        torch.testing.assert_close(torch.tensor(actual.losses), torch.tensor(expected.losses),
                                   **tolerance, msg=lambda message: f"losses by step: {message}")
    if gradients:
        assert len(actual.gradients) == len(expected.gradients), \
            f"gradients of {len(actual.gradients)} steps, not {len(expected.gradients)}: fit(..., gradients=True)"
        for step, (got, want) in enumerate(zip(actual.gradients, expected.gradients, strict=True)):
            _assert_tensors_close(got, want, f"gradient at step {step}: ", tolerance)
    if weights:
        assert_weights_match(actual.weights, expected.weights, **tolerance)
