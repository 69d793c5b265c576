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
from litscale.optim.lr_scaling import LRScaling, ScaledOptimizerFactory, base_lr_of
from litscale.optim.muon import Muon
from litscale.optim.mup import WidthScaling

# PyTorch's fp32 defaults for assert_close: what a sharded step may differ from one process by.
TOLERANCE = {"rtol": 1.3e-6, "atol": 1e-5}

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16, bias=False)
TINY_WITH_BIASES = dataclasses.replace(TINY, bias=True)

OPTIMIZERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
    # NOTE: eps 1e-6 (torch: 1e-8) and lr 1e-3. AdamW steps each element by about
    # lr x m / (sqrt(v) + eps): once |gradient| >> eps, about lr x its sign, whatever its size.
    # For an element whose gradient is (nearly) zero, as the key projection's bias is exactly
    # (softmax ignores a constant added to every key), or comparable to eps, the fp32 noise of
    # a different summation order (another rank count, a sharded reduction) then changes the
    # step by a fraction of lr. eps 1e-6 bounds that fraction for true zeros (noise / eps), and
    # lr 1e-3 keeps what remains, for gradients near eps, under the 1e-5 tolerance after a few
    # steps (at lr 1e-2 a 4-stage pipeline differed by 1.04e-5). AdamW is invariant to the
    # gradient's scale, so it cannot catch a sum-instead-of-mean bug anyway: SGD does that.
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-3, betas=(0.9, 0.95), eps=1e-6),
    # Muon on the hidden matrices (orthogonalised whole, gathered from their shards), its
    # AdamW on the rest with AdamW's eps above.
    "muon": functools.partial(Muon, lr=1e-3, betas=(0.9, 0.95), eps=1e-6),
}


@dataclasses.dataclass(frozen=True)
class ParitySetup:
    """What both sides train: the network (``net_class(config)``), the optimizer (a key of ``OPTIMIZERS``) and its
    weight decay (on matrices, as ``CausalLMModule`` groups it), the global batches (``steps``
    of ``global_batch`` random sequences from ``data_seed``), each rank's share of a global
    batch split into ``accumulation`` micro batches, and Lightning's norm clipping (the
    reference clips the same way)."""

    config: GPTConfig = TINY
    net_class: type = GPT  # built as net_class(config): any causal LM of the zoo
    optimizer: str = "sgd"
    weight_decay: float = 0.0
    steps: int = 5
    global_batch: int = 8
    accumulation: int = 1
    data_seed: int = 0
    gradient_clip_val: float | None = None
    base_width: int | None = None  # µP against the network at this width (lr_scaling=mup)


@dataclasses.dataclass
class Trace:
    """What a run did: the global batch's loss at each step, every parameter's full gradient
    at each step (before clipping; empty unless recorded), the full weights at the end, and the
    shapes of the token batches this rank's module was given (a context-parallel rank's share),
    and the whole gradient's norm at each step."""

    losses: list[float]
    gradients: list[dict[str, torch.Tensor]]
    weights: dict[str, torch.Tensor]
    input_shapes: set[tuple[int, ...]] = dataclasses.field(default_factory=set)
    # The whole gradient's 2-norm before clipping at each step: as the run logs it
    # (``train/grad_norm``), or as one process takes it from its full gradients.
    gradient_norms: list[float] = dataclasses.field(default_factory=list)


# --- the data ---------------------------------------------------------------------------------


def global_batches(setup: ParitySetup) -> torch.Tensor:
    """``[steps, global_batch, T+1]`` random tokens, the same in every process."""
    config = setup.config
    generator = torch.Generator().manual_seed(setup.data_seed)
    return torch.randint(0, config.vocab_size, (setup.steps, setup.global_batch, config.block_size + 1),
                         generator=generator)


def rank_loader(setup: ParitySetup, data_parallel_size: int = 1, data_parallel_rank: int = 0):
    """The micro batches of one data-parallel rank: rows ``r*b:(r+1)*b`` of each global batch
    (with the defaults, the whole global batch at every step), in ``setup.accumulation``
    consecutive micro batches per step."""
    share = setup.global_batch // data_parallel_size
    rows = slice(data_parallel_rank * share, (data_parallel_rank + 1) * share)
    tokens = global_batches(setup)[:, rows].reshape(-1, setup.config.block_size + 1)
    dataset = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return torch.utils.data.DataLoader(dataset, batch_size=share // setup.accumulation, shuffle=False)


def data_parallel_rank(rank: int, sizes) -> int:
    """The data-parallel index of ``rank`` on a mesh laid out row-major over (pipeline, data,
    context, tensor), as litscale's strategies lay it (``sizes``: their ``MeshSizes``)."""
    return (rank // (sizes.context * sizes.tensor)) % sizes.data


# --- the model and the reference --------------------------------------------------------------


def tiny_net(setup: ParitySetup) -> torch.nn.Module:
    torch.manual_seed(0)
    return setup.net_class(setup.config)


def module_for(net: torch.nn.Module, setup: ParitySetup) -> CausalLMModule:
    return CausalLMModule(net=net, optimizer=OPTIMIZERS[setup.optimizer], weight_decay=setup.weight_decay)


def tiny_module(setup: ParitySetup) -> CausalLMModule:
    return module_for(tiny_net(setup), setup)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole: a DTensor gathered from its shards (a collective), anything else as is."""
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def norm_of(gradients: dict[str, torch.Tensor]) -> float:
    """The 2-norm of a whole gradient (every parameter's, concatenated), in float64."""
    return float(torch.linalg.vector_norm(torch.stack([g.double().norm() for g in gradients.values()])))


def full_gradients(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: full(p.grad) for name, p in net.named_parameters() if p.grad is not None}


def loop_trace(net: torch.nn.Module, setup: ParitySetup, *, loss_context=None) -> Trace:
    """Train ``net`` with a plain loop over the whole global batches, optimised and clipped as
    the module's own ``configure_optimizers`` and Lightning would; ``loss_context`` is entered
    around each loss and its backward (e.g. tensor parallel's ``loss_parallel``)."""
    module = module_for(net, setup)
    if setup.base_width is not None:  # µP by its parts, as the LR-scaling callback applies it
        width = WidthScaling(net, setup.base_width)
        width.apply()
        module.optimizer_factory = ScaledOptimizerFactory(module.optimizer_factory, base_lr_of(module.optimizer_factory), width)
    optimizer = module.configure_optimizers()
    losses, gradients, norms = [], [], []
    for tokens in global_batches(setup):
        optimizer.zero_grad()
        with (loss_context or contextlib.nullcontext)():
            loss = module.loss((tokens[:, :-1], tokens[:, 1:]))
            auxiliary = net.auxiliary_loss() if hasattr(net, "auxiliary_loss") else None  # MoE balance
            loss = loss if auxiliary is None else loss + auxiliary
            loss.backward()
        losses.append(float(full(loss)))
        gradients.append(full_gradients(net))
        norms.append(norm_of(gradients[-1]))
        if setup.gradient_clip_val:
            torch.nn.utils.clip_grad_norm_(net.parameters(), setup.gradient_clip_val)
        optimizer.step()
    return Trace(losses, gradients, {k: full(v) for k, v in net.state_dict().items()}, gradient_norms=norms)


@functools.cache
def reference(setup: ParitySetup) -> Trace:
    """One process over the global batches: what every strategy must reproduce."""
    return loop_trace(tiny_net(setup), setup)


def local_sgd_reference(setup: ParitySetup, world_size: int, sync_every: int, *,
                        outer_lr: float | None = None, outer_momentum: float = 0.9,
                        outer_optimizer: str = "nesterov", proximal_mu: float = 0.0) -> list[Trace]:
    """Local SGD re-derived in one process, one trace per rank: ``world_size`` replicas of the
    same network, each with its own optimizer, stepping on its rank's rows of each global
    batch; after every ``sync_every`` steps their parameters are replaced by the mean. With
    ``outer_lr`` (DiLoCo; FedOpt's ``sgd`` or ``adam``), the mean's distance from the last
    synchronised parameters is the gradient of an outer optimizer over those (Nesterov SGD
    unless ``outer_optimizer`` says), whose result every replica takes. ``proximal_mu``
    (FedProx) adds ``mu * (w - w_sync)`` to each gradient, the formula of the gradient of
    ``mu / 2 * ||w - w_sync||^2``, written out here, and that term's value to each loss. Each
    trace's loss is the mean of the replicas' losses, as the ranks record it."""
    nets = [tiny_net(setup) for _ in range(world_size)]
    modules = [module_for(net, setup) for net in nets]
    optimizers = [module.configure_optimizers() for module in modules]
    batches = [list(rank_loader(setup, world_size, rank)) for rank in range(world_size)]
    anchor = [p.detach().clone() for p in nets[0].parameters()]
    outer = outer_lr and _outer_optimizer(outer_optimizer, anchor, outer_lr, outer_momentum)
    losses, gradients, norms = [], [[] for _ in nets], [[] for _ in nets]
    for step in range(setup.steps):
        step_losses = []
        for rank, (net, module, optimizer) in enumerate(zip(nets, modules, optimizers, strict=True)):
            optimizer.zero_grad()
            loss = module.loss(batches[rank][step])
            loss.backward()
            with torch.no_grad():
                for param, start in zip(net.parameters(), anchor, strict=True):
                    loss += 0.5 * proximal_mu * (param - start).square().sum()
                    param.grad += proximal_mu * (param - start)
            step_losses.append(loss.item())
            gradients[rank].append(full_gradients(net))
            # each replica's own gradient, as its rank logs it (train/grad_norm)
            norms[rank].append(norm_of({name: p.grad for name, p in net.named_parameters()}))
            optimizer.step()
        losses.append(sum(step_losses) / world_size)
        if (step + 1) % sync_every:
            continue
        with torch.no_grad():
            replicas = list(zip(*(net.parameters() for net in nets), strict=True))
            means = [torch.stack(params).mean(0) for params in replicas]
            if outer:
                for start, mean in zip(anchor, means, strict=True):
                    start.grad = start - mean
                outer.step()
                means = anchor
            for params, mean in zip(replicas, means, strict=True):
                for param in params:
                    param.copy_(mean)
            for start, mean in zip(anchor, means, strict=True):
                start.copy_(mean)
    return [Trace(losses, gradients[rank], {k: full(v) for k, v in net.state_dict().items()},
                  gradient_norms=norms[rank]) for rank, net in enumerate(nets)]


def _outer_optimizer(kind: str, anchor: list[torch.Tensor], lr: float, momentum: float):
    """The outer optimizers by their definitions: DiLoCo's Nesterov SGD, FedAvgM's heavy-ball
    SGD, FedAdam's Adam (beta2 0.99, eps 1e-3, as Reddi et al. 2021)."""
    if kind == "adam":
        return torch.optim.Adam(anchor, lr=lr, betas=(momentum, 0.99), eps=1e-3)
    return torch.optim.SGD(anchor, lr=lr, momentum=momentum, nesterov=kind == "nesterov")


# --- N ranks through Lightning ----------------------------------------------------------------


class StepRecorder(Callback):
    """The global batch's loss at each step (``losses``, by the number of steps done once it is
    taken) and, with
    ``gradients=True``, every parameter's full gradient as the optimizer receives it.

    Gradients are read from ``.grad`` before Lightning clips them; sharded ones (DTensor) are
    gathered, so every rank must record. A strategy that keeps gradients elsewhere (DeepSpeed
    ZeRO's partitions) records none: compare its losses and weights.
    """

    def __init__(self, *, gradients: bool = False) -> None:
        self.record_gradients = gradients
        self.losses: dict[int, float] = {}
        self.gradient_norms: dict[int, float] = {}  # as the run logs it, by step
        self.gradients: list[dict[str, torch.Tensor]] = []
        self._step = 0
        self.input_shapes: set[tuple[int, ...]] = set()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.record_gradients:
            self.gradients.append(full_gradients(getattr(pl_module, "net", pl_module)))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # The optimizer step this micro batch accumulates into, counted from 1 (the number of
        # steps done once it is taken), as ``trainer.global_step`` reads after it.
        self._step = trainer.global_step + 1
        self.input_shapes.add(tuple(batch[0].shape))  # as the strategy hands it to the module

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Each rank's loss is over its own micro batch, already divided by the accumulation
        # (Lightning's closure does it): summed over a step's micro batches and averaged over
        # ranks, equal micro batches make it the global batch's loss (model-parallel peers
        # hold the same value, so they weigh every data-parallel index alike).
        loss = full(outputs["loss"])
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        self.losses[self._step] = self.losses.get(self._step, 0.0) + float(loss)
        if trainer.global_step == self._step and "train/grad_norm" in trainer.callback_metrics:  # the step ended
            self.gradient_norms[self._step] = float(trainer.callback_metrics["train/grad_norm"])


def fit(rank: int, world_size: int, strategy, setup: ParitySetup, *,
        data_parallel_size: int | None = None, data_parallel_rank: int | None = None,
        gradients: bool = False, precision: str = "32-true", callbacks=(),
        checkpoint_path: str | None = None, local_weights: bool = False, loader_of=None) -> Trace:
    """Fit ``tiny_module(setup)`` with ``strategy`` (built in this rank) on this rank's micro
    batches; every rank a data-parallel rank unless the mesh says otherwise. ``loader_of(data
    parallel size, data-parallel rank)``: the rank's micro batches where they are not the
    setup's random tokens (``rank_loader``), e.g. packed fine-tuning rows. Returns the
    trace, its weights consolidated (complete on rank 0), or with ``local_weights`` the
    parameters this rank holds (a pipeline stage's, a mesh's gathered whole). A collective:
    call it on every rank."""
    import lightning as L

    from litscale.checkpoint.export import consolidated_state_dict

    module, recorder = tiny_module(setup), StepRecorder(gradients=gradients)
    if setup.base_width is not None:  # µP as a run gets it: lr_scaling=mup's callback
        share = setup.global_batch // (data_parallel_size or world_size) // setup.accumulation
        callbacks = [*callbacks, LRScaling(rule="none", base_width=setup.base_width, micro_batch_size=share)]
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=setup.steps,
        accumulate_grad_batches=setup.accumulation, precision=precision,
        gradient_clip_val=setup.gradient_clip_val, logger=False, log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[recorder, *callbacks],
    )
    loader = (loader_of or functools.partial(rank_loader, setup))(
        data_parallel_size or world_size, rank if data_parallel_rank is None else data_parallel_rank)
    trainer.fit(module, train_dataloaders=loader)
    if checkpoint_path is not None:
        trainer.save_checkpoint(checkpoint_path)
    weights = ({name: full(value) for name, value in module.net.state_dict().items()} if local_weights
               else consolidated_state_dict(trainer, module))
    return Trace([recorder.losses[step] for step in sorted(recorder.losses)], recorder.gradients, weights,
                 recorder.input_shapes, [recorder.gradient_norms.get(step) for step in sorted(recorder.losses)])


def fit_on_mesh(rank: int, world_size: int, strategy, setup: ParitySetup, **options) -> Trace:
    """``fit`` with a model-parallel strategy: each rank fed the rows of its data-parallel
    index on the strategy's mesh."""
    sizes = strategy.resolve_mesh(world_size)
    return fit(rank, world_size, strategy, setup, data_parallel_size=sizes.data,
               data_parallel_rank=data_parallel_rank(rank, sizes), **options)


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
                        gradients: bool = True, weights: bool = True, gradient_norms: bool | None = None,
                        **tolerance) -> None:
    """Step by step, then at the end: each step's loss and the gradient's norm before clipping
    (as the run logged it: every strategy logs ``train/grad_norm``), each step's gradients
    (which ``fit`` records only when asked), the final weights. ``gradient_norms`` follows
    ``losses`` unless given (False where the run's norm is another quantity by design)."""
    tolerance = {**TOLERANCE, **tolerance}
    if losses:
        torch.testing.assert_close(torch.tensor(actual.losses), torch.tensor(expected.losses),
                                   **tolerance, msg=lambda message: f"losses by step: {message}")
    if losses if gradient_norms is None else gradient_norms:
        # a reference that recorded only its gradients: their norms
        want = expected.gradient_norms or [norm_of(step) for step in expected.gradients]
        assert None not in actual.gradient_norms and len(actual.gradient_norms) == len(want), \
            f"train/grad_norm not logged at every step: {actual.gradient_norms}"
        torch.testing.assert_close(torch.tensor(actual.gradient_norms, dtype=torch.float64),
                                   torch.tensor(want, dtype=torch.float64), **tolerance,
                                   msg=lambda message: f"gradient norms by step: {message}")
    if gradients:
        assert len(actual.gradients) == len(expected.gradients), \
            f"gradients of {len(actual.gradients)} steps, not {len(expected.gradients)}: fit(..., gradients=True)"
        for step, (got, want) in enumerate(zip(actual.gradients, expected.gradients, strict=True)):
            _assert_tensors_close(got, want, f"gradient at step {step}: ", tolerance)
    if weights:
        assert_weights_match(actual.weights, expected.weights, **tolerance)


def assert_ranks_match(traces: list[Trace], expected: list[Trace], *, gradients: bool = True,
                       weights_on_every_rank: bool = True, gradient_norms: bool = True, **tolerance) -> None:
    """Each rank's trace against its own expected one (the same reference for every rank of a
    synchronous strategy), where a rank may hold part of the network (a pipeline stage): its
    gradients and weights are compared with those names of the expected ones, and the ranks
    together must hold every parameter. ``weights_on_every_rank=False``: only rank 0 holds the
    consolidated weights (ZeRO-3)."""
    held = set()
    for rank, (actual, want) in enumerate(zip(traces, expected, strict=True)):
        names = set(actual.weights)
        assert names <= set(want.weights), f"rank {rank}: unknown tensors {sorted(names - set(want.weights))}"
        held |= names
        stage = Trace(want.losses, [{k: v for k, v in step.items() if k in names} for step in want.gradients],
                      {k: v for k, v in want.weights.items() if k in names}, gradient_norms=want.gradient_norms)
        try:
            assert_traces_match(actual, stage, gradients=gradients, weights=False, gradient_norms=gradient_norms,
                                **tolerance)
            if weights_on_every_rank or rank == 0:
                assert names, "no weights"
                _assert_tensors_close(actual.weights, stage.weights, "", {**TOLERANCE, **tolerance})
        except AssertionError as error:
            raise AssertionError(f"rank {rank}: {error}") from None
    assert held == set(expected[0].weights), f"no rank holds {sorted(set(expected[0].weights) - held)}"
