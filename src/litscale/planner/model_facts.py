"""What the planner needs to know of a model, read off a meta-device copy: its size, FLOPs per
token, layers, width, the bytes autograd saves for backward (the activations), and, for a
mixture of experts, what expert parallel shards and moves (``MoEFacts``)."""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from litscale.precision import converts_to_float8, float8_flops_per_token


@dataclass(frozen=True)
class Profile:
    """Seconds of one forward-backward by micro batch and of one AdamW step, timed on this
    machine on one thread (a CPU rank's share), for the network as one rank of a plan runs it
    (``profile_key``: plain, FSDP2-sharded, tensor-parallel). Where the plan runs here, this
    replaces FLOPs over an assumed throughput: a small model's matmuls reach anywhere from a
    third to three quarters of the probed peak on CPU depending on their widths, and FSDP2's
    and DTensor's own costs per step are not FLOPs at all."""

    forward_backward_s: dict[int, float]
    optimizer_step_s: float
    # Dense gradient bytes over the bytes a compression hook hands to collectives, in its
    # steady state (after any dense warm-up): litscale's own codecs, run on the profiled step.
    bytes_ratio: float = 1.0
    # The machine's load average when it was timed (None: not recorded).
    load_average: float | None = None


@dataclass(frozen=True)
class MoEFacts:
    """A mixture of experts as the planner costs it: ``layers`` MoE layers of ``n_experts``
    routed experts, each token sent to ``top_k``; ``expert_params`` the routed experts'
    parameters of all of them (what expert parallel shards); ``layer_params`` and
    ``layer_flops_per_token`` the MoE layers' whole (router, routed and shared experts), which
    tensor parallel leaves whole on every rank (``models/moe_parallel.py``), FLOPs of the active
    experts only; ``active_params`` a token's share of the model.

    ``load_imbalance``: the busiest expert-parallel rank's rows over an even split's, the same
    at every EP size (a stated assumption, ``plan.moe_load_imbalance``), unless
    ``tokens_per_expert`` (per MoE layer, a run's ``moe/tokens_per_expert``) measures it for
    each size (``imbalance``)."""

    layers: int
    n_experts: int
    top_k: int
    expert_params: int
    layer_params: int
    layer_flops_per_token: float
    active_params: int
    load_imbalance: float = 1.0
    tokens_per_expert: tuple[tuple[float, ...], ...] = ()
    # Activation bytes the MoE layers save for backward per sample (as traced), which tensor
    # parallel leaves whole on each of its ranks.
    saved_bytes_per_sample: float = 0.0

    def imbalance(self, expert_parallel_size: int) -> float:
        """Rows the busiest of ``expert_parallel_size`` ranks exchanges over the mean: measured
        (each layer's busiest block of ``n_experts / ep`` experts over the mean block, the blocks
        as expert parallel places them, averaged over the layers), else the stated figure."""
        if not self.tokens_per_expert:
            return self.load_imbalance
        ratios = []
        for layer in self.tokens_per_expert:
            block = len(layer) // expert_parallel_size
            blocks = [sum(layer[i:i + block]) for i in range(0, len(layer), block)]
            mean = sum(blocks) / len(blocks)
            ratios.append(max(blocks) / mean if mean else 1.0)
        return sum(ratios) / len(ratios)


@dataclass(frozen=True)
class ModelFacts:
    """``activation_bytes`` per sample (fp32, no activation checkpointing), traced at two micro
    batches so a fixed part (independent of the batch) is told from the per-sample one:
    what autograd saves for backward. ``working_bytes_per_sample``: what backward holds beside
    them at its busiest (the logits' gradient, a layer's activation gradients), from the
    high-water mark of a whole traced forward and backward at the larger batch."""

    num_params: int
    flops_per_token: float
    seq_len: int
    layers: int
    hidden: int
    heads: int
    activation_bytes_per_sample: float
    activation_bytes_fixed: float = 0.0
    # What backward holds at its peak beside the saved activations, per sample.
    working_bytes_per_sample: float = 0.0
    # The compute dtype the activations were traced in (autocast or 16-bit weights); a plan of
    # another scales the fp32 trace by its dtype's size.
    traced_dtype: str = "float32"
    # Traced under autocast (fp32 weights, 16-bit matmuls): the fixed part of the activations is
    # then mostly the 16-bit copies of the weights each matmul saves, which a strategy gathering
    # 16-bit weights does not make (``weights_in_compute_dtype`` holds its own trace).
    traced_under_autocast: bool = False
    root_params: int = 0  # parameters outside the sharding units (embeddings, final norm, head)
    vocab_size: int = 0
    # The norms' parameter tensors and their elements: under sequence parallel each one's
    # gradient is a partial sum, reduced once per step.
    norm_tensors: int = 0
    norm_params: int = 0
    # The blocks a pipeline may cut between (``pipeline_blocks``: the layers, the embedding and
    # the head); 0 where the model declares none.
    pipeline_blocks: int = 0
    # Each block's parameters, and the activation bytes its forward saves (per sample and fixed,
    # as ``activation_bytes_*`` are split): what each pipeline stage holds, cut as the strategy cuts.
    block_params: tuple[int, ...] = ()
    block_saved_per_sample: tuple[float, ...] = ()
    block_saved_fixed: tuple[float, ...] = ()
    block_backward_per_sample: tuple[float, ...] = ()  # each block's backward working set
    # Key (and value) features per token of each attention layer, where the model can split its
    # sequence (``context_parallel_attention``); 0 where it cannot.
    kv_width: int = 0
    moe: MoEFacts | None = None  # a mixture of experts' (None for a dense model)
    # fp32 bytes of optimizer state per parameter (no master copy): Adam's two moments unless the
    # configured optimizer says otherwise (Muon: one buffer for the hidden matrices).
    optimizer_state_bytes_per_param: float = 8.0
    # Muon's: the hidden matrices' parameters (their updates gathered whole where sharded) and
    # the Newton-Schulz iterations' FLOPs over them, in ``newton_schulz_dtype``; 0 for an
    # element-wise optimizer.
    matrix_params: int = 0
    matrix_tensors: int = 0
    newton_schulz_flops: float = 0.0
    newton_schulz_dtype: str = "float32"
    # Traced and timed on packed rows (``data.pack``, ``data.document_mask``): attention kept
    # inside each document by a mask, whose kernel keeps more for backward than a causal one.
    packed_documents: bool = False
    # Of packed rows, the keys a token attends to on average (``sum(l_i ** 2) / seq_len``, as the
    # data states it: ``data.base.ShardedDataModule.attended_length``), which ``flops_per_token``
    # then counts attention at (``with_attended_length``); None: the whole row's.
    attended_length: float | None = None
    # Of ``flops_per_token``, those of the layers precision=fp8 runs in float8 (its Linear layers
    # but the head: ``litscale.precision.converts_to_float8``).
    float8_flops_per_token: float = 0.0
    # Those layers' (input, output) features, one pair per layer: what precision=fp8 casts
    # (``float8_cost``).
    float8_linears: tuple[tuple[int, int], ...] = ()
    # Under mixed precision (traced under autocast), the activation fields above traced again with
    # the weights in the compute dtype and no autocast, as FSDP2's policy and DeepSpeed's 16-bit
    # engine run the model (``with_weights_in_compute_dtype``); {} otherwise.
    weights_in_compute_dtype: dict = field(default_factory=dict)
    profiles: dict[str, Profile] = field(default_factory=dict)  # by profile_key
    # The network read (on the meta device): what the strategies check a plan against.
    net: nn.Module | None = field(default=None, repr=False, compare=False)

    def with_weights_in_compute_dtype(self) -> ModelFacts:
        """These facts as a strategy that gathers its weights in the compute dtype runs the model
        (no autocast: every activation in 16 bits, no weight casts saved); themselves where the
        trace already ran so."""
        return dataclasses.replace(self, **self.weights_in_compute_dtype) if self.weights_in_compute_dtype else self

    def with_attended_length(self, attended_length: float | None) -> ModelFacts:
        """These facts for rows whose tokens attend to ``attended_length`` keys on average:
        ``flops_per_token`` with attention counted over each document, as MFU counts it
        (``litscale.measure.flops.flops_per_sample``); themselves for None."""
        from litscale.measure.flops import flops_per_sample

        if attended_length is None:
            return self
        example = torch.zeros(1, self.seq_len, dtype=torch.long, device="meta")
        per_sample = flops_per_sample(self.net, example, self.seq_len, attended_length)
        return dataclasses.replace(self, flops_per_token=per_sample / self.seq_len, attended_length=attended_length)

    def activations(self, micro_batch: int) -> float:
        return self.activation_bytes_fixed + micro_batch * self.activation_bytes_per_sample

    def backward_working_bytes(self, micro_batch: int) -> float:
        """What backward holds at its peak beside the saved activations: the high-water mark of
        a traced step above its saved activations, parameters and gradients."""
        return micro_batch * self.working_bytes_per_sample

    def block_shares(self, micro_batch: int) -> tuple[list[float], list[float]]:
        """Each pipeline block's saved activations and its backward's working set at
        ``micro_batch``, as shares of the whole model's saved activations (as traced); ([], [])
        where the blocks are unknown."""
        saved = [fixed + micro_batch * per_sample
                 for fixed, per_sample in zip(self.block_saved_fixed, self.block_saved_per_sample, strict=True)]
        total = sum(saved)
        if total <= 0 or len(self.block_backward_per_sample) != len(saved):
            return [], []
        return [b / total for b in saved], [micro_batch * b / total for b in self.block_backward_per_sample]

    def boundary_bytes(self, micro_batch: int, dtype_bytes: int = 4) -> float:
        """One layer's input (or output): what a pipeline stage sends, what a checkpointed layer keeps."""
        return micro_batch * self.seq_len * self.hidden * dtype_bytes


def saved_activation_bytes(net: nn.Module, inputs: torch.Tensor, *, next_token_loss: bool = False) -> int:
    """Bytes of the tensors autograd saves in one forward of ``net`` (and of the next-token
    cross-entropy over its output, which keeps the log-probabilities), parameters excluded,
    each storage counted once. ``net`` and ``inputs`` may be on the meta device: only shapes count."""
    return traced_step_bytes(net, inputs, next_token_loss=next_token_loss, backward=False).saved


@dataclass(frozen=True)
class TracedStep:
    """One traced forward (and backward) of a network: see ``traced_step_bytes``."""

    saved: int
    step: int
    saved_in_moe: int
    saved_by_unit: tuple[int, ...] = ()
    backward_by_unit: tuple[int, ...] = ()


def traced_step_bytes(net: nn.Module, inputs: torch.Tensor, *, next_token_loss: bool = False,
                      backward: bool = True, units: list[list[str]] | None = None,
                      positions: torch.Tensor | None = None) -> TracedStep:
    """The bytes autograd saves in one forward (``saved``, as ``saved_activation_bytes``), the
    high-water mark of the forward and backward above the parameters and the gradients backward
    ends with (``step``, 0 without ``backward``), as torch's MemTracker counts the tensors alive
    (litscale.measure.step_memory: what a run's ``callbacks.memory.measure_peak`` measures), and of the
    saved bytes those saved inside a mixture of experts' MoE layers. Gradients start as None, as
    each training step finds them.

    ``units``: the pipeline units of ``net`` (submodule names, in forward order): ``saved_by_unit``
    then splits ``saved`` by the unit whose forward saved each storage first (the loss's, after
    the last unit, with the last unit), as a pipeline stage holding those units keeps them; and
    ``backward_by_unit`` is each unit's backward working set: what its backward holds at its
    busiest above what it started with (the parameters' gradients it creates left out: a step
    holds those anyway). A pipeline stage runs that backward while other micro-batches' saved
    activations stay (1F1B's first stages), where a whole model's backward has freed the
    later layers' first.

    ``positions``: the rows are packed documents, passed to the net beside the tokens (its
    attention then takes the masked kernel: ``litscale.models.documents``).

    NOTE: traced as CPU tensors under ``FakeTensorMode``, not on the meta device: there attention
    takes the math path and keeps every T x T score matrix (8 GiB per layer for Llama-3 8B at
    8,192 tokens), where the fused kernels of CPUs and GPUs keep only their output and log-sum-exp."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from litscale.measure.step_memory import TOTAL, total_only_tracker
    from litscale.parallel.declarations import find_moe_layers

    fake_net = copy.deepcopy(net)
    in_moe: list[bool] = [False]
    for layer in find_moe_layers(fake_net):
        layer.register_forward_pre_hook(lambda *_: in_moe.__setitem__(0, True))
        layer.register_forward_hook(lambda *_: in_moe.__setitem__(0, False))
    unit_now = [0]  # the unit running: set as each unit's modules start their forward
    for index, names in enumerate(units or ()):
        for name in names:
            fake_net.get_submodule(name).register_forward_pre_hook(
                lambda *_, index=index: unit_now.__setitem__(0, index))
    cpu = torch.device("cpu")
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake_net.to_empty(device="cpu")
        inputs = torch.empty_like(inputs, device="cpu")
        arguments = (inputs,) if positions is None else (inputs, torch.empty_like(positions, device="cpu"))
        weights = {p.untyped_storage()._cdata for p in fake_net.parameters()}
        seen: dict[int, int] = {}
        seen_in_moe: dict[int, int] = {}
        unit_of: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage._cdata not in weights:
                seen[storage._cdata] = storage.nbytes()
                unit_of.setdefault(storage._cdata, unit_now[0])
                if in_moe[0]:
                    seen_in_moe[storage._cdata] = storage.nbytes()
            return tensor

        tracker = total_only_tracker()
        tracker.track_external(fake_net)
        windows = _BackwardWindows(tracker, fake_net, units or [])
        with tracker:
            start = tracker.get_tracker_snapshot()[cpu][TOTAL]
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                output = fake_net(*arguments)
                # in fp32, as litscale's modules take it (``modules.next_token_loss``): under autocast
                # the same, with 16-bit weights twice the log-probabilities' bytes of a 16-bit loss
                loss = F.cross_entropy(output.flatten(0, 1).float(), inputs.flatten()) if next_token_loss \
                    else output.sum()
            if backward:
                windows.open(len(windows.backward) - 1)  # the loss's backward: the last unit's
                loss.backward()
                windows.close()
        grads = sum(p.grad.untyped_storage().nbytes() for p in fake_net.parameters() if p.grad is not None)
        step = tracker.get_tracker_snapshot("peak")[cpu][TOTAL] - start - grads if backward else 0
    by_unit = [0] * len(units or ())
    for storage, nbytes in seen.items():
        if by_unit:
            by_unit[unit_of[storage]] += nbytes
    return TracedStep(sum(seen.values()), max(0, step), sum(seen_in_moe.values()), tuple(by_unit),
                      tuple(windows.backward) if backward else ())


class _BackwardWindows:
    """Each pipeline unit's backward, seen from tensor hooks placed in forward: it starts when the
    gradient of the unit's output is computed and ends when that of its input is (or the next
    unit's starts: a unit's output is often the next one's input, whose hooks run in the order
    they were placed). ``backward[u]``: the unit's largest rise of the tracker's total above
    where its backward started, less the parameters' gradients created meanwhile."""

    def __init__(self, tracker, net: nn.Module, units: list[list[str]]) -> None:
        self.tracker, self.params = tracker, list(net.parameters())
        self.backward = [0] * len(units)
        self._open: tuple[int, int, int] | None = None  # (unit, total, gradient bytes) at its start
        for index, names in enumerate(units):
            net.get_submodule(names[-1]).register_forward_hook(
                lambda _m, _i, output, index=index: self._on_grad(output, lambda: self.open(index)))
            net.get_submodule(names[0]).register_forward_pre_hook(
                lambda _m, inputs, index=index: self._on_grad(inputs, lambda: self.close(index)))

    @staticmethod
    def _on_grad(value, action) -> None:
        first = value[0] if isinstance(value, (tuple, list)) and value else value
        if isinstance(first, torch.Tensor) and first.requires_grad:
            first.register_hook(lambda grad: action())

    def _grad_bytes(self) -> int:
        return sum(p.grad.untyped_storage().nbytes() for p in self.params if p.grad is not None)

    def open(self, unit: int) -> None:
        if self._open is not None and self._open[0] == unit:
            return
        self.close()
        if unit >= 0:
            self._open = (unit, self.tracker.open_window(), self._grad_bytes())

    def close(self, unit: int | None = None) -> None:
        if self._open is None or unit is not None and self._open[0] != unit:
            return
        opened, total, grads = self._open
        rise = self.tracker.window_peak - total - (self._grad_bytes() - grads)
        self.backward[opened] = max(self.backward[opened], rise)
        self._open = None


# The documents of a packed row as the planner traces and times one: the masked kernels of
# CPUs (SDPA with a boolean mask) keep the same bytes and do the same work whatever the lengths.
TRACED_DOCUMENTS = 4


def packed_positions(rows: int, seq_len: int, device: str = "meta") -> torch.Tensor:
    """``[rows, seq_len]`` positions of rows packed with ``TRACED_DOCUMENTS`` documents of
    equal length (``litscale.data.token_batch``)."""
    from litscale.data.token_batch import document_positions

    lengths = [seq_len // TRACED_DOCUMENTS] * (TRACED_DOCUMENTS - 1)
    return torch.as_tensor(document_positions(lengths, seq_len), device=device).expand(rows, seq_len)


# The micro batches traced: forward at both, forward and backward at the larger (below a few
# samples the gradients, not the activations, set a step's peak).
TRACED_BATCHES = (2, 4)


@contextmanager
def traced_precision(net: nn.Module, compute_dtype: str, param_dtype: str) -> Iterator[tuple[nn.Module, str]]:
    """``(network, compute dtype)`` as a run of that precision computes: a 16-bit copy of ``net``
    (``*_true``), or ``net`` under CPU autocast (``*_mixed``: its norms, softmax and loss in fp32,
    its matmuls in 16 bits, as CUDA's autocast casts them too); ``net`` in fp32 otherwise (fp8's
    float8 matmuls included: traced in fp32, scaled by the plan's dtype)."""
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(compute_dtype)
    if dtype is None:
        yield net, "float32"
    elif param_dtype == compute_dtype:
        yield copy.deepcopy(net).to(dtype), compute_dtype
    else:
        # CPU's fused norm kernels want one dtype; torch says so once per process and takes the
        # unfused path, which saves the same tensors: nothing a user of the trace can act on.
        with torch.autocast("cpu", dtype=dtype), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
            yield net, compute_dtype


def model_facts(net: nn.Module, *, seq_len: int, vocab_size: int, compute_dtype: str = "float32",
                param_dtype: str = "float32", packed_documents: bool = False) -> ModelFacts:
    """Facts of a zoo network (GPT, Llama, Hugging Face) built on the meta device; with
    ``packed_documents``, traced on packed rows (``packed_positions``)."""
    config = getattr(net, "config", None)
    units = list(net.sharding_units()) if hasattr(net, "sharding_units") else [net]
    in_units = sum(p.numel() for unit in units for p in unit.parameters())
    hidden = _first(config, ("n_embd", "dim", "hidden_size"), 0)
    heads = _first(config, ("n_head", "n_heads", "num_attention_heads"), 1)
    blocks = pipeline_block_names(net)
    traced, moe_per_sample = traced_activations(net, seq_len, compute_dtype, param_dtype, blocks, packed_documents)
    # Mixed precision runs two ways: under autocast (DDP, one process: fp32 weights, the residual
    # stream and the norms in fp32) or with the weights gathered in 16 bits and no autocast
    # (FSDP2's policy, DeepSpeed's engine: every activation 16-bit). Both are traced.
    sixteen_bit = traced_activations(net, seq_len, compute_dtype, compute_dtype, blocks, packed_documents)[0] \
        if traced["traced_under_autocast"] else {}
    num_params = sum(p.numel() for p in net.parameters())
    norms = [p for m in net.modules() if type(m).__name__.endswith("Norm") for p in m.parameters(recurse=False)]
    return ModelFacts(num_params=num_params, flops_per_token=float(net.flops_per_token(seq_len)), seq_len=seq_len,
                      float8_flops_per_token=float8_flops_per_token(net), packed_documents=packed_documents,
                      float8_linears=tuple((m.in_features, m.out_features) for name, m in net.named_modules()
                                           if converts_to_float8(m, name)),
                      layers=len(units), hidden=hidden, heads=heads, **traced, weights_in_compute_dtype=sixteen_bit,
                      root_params=num_params - in_units,
                      vocab_size=vocab_size, norm_tensors=len(norms), norm_params=sum(p.numel() for p in norms),
                      pipeline_blocks=len(blocks),
                      block_params=tuple(sum(p.numel() for name in unit for p in net.get_submodule(name).parameters())
                                         for unit in blocks),
                      kv_width=context_parallel_kv_width(net), moe=moe_facts(net, saved_per_sample=moe_per_sample),
                      net=net)


def traced_activations(net: nn.Module, seq_len: int, compute_dtype: str, param_dtype: str,
                       blocks: list[list[str]], packed_documents: bool = False) -> tuple[dict, float]:
    """``ModelFacts``' activation fields, traced at two micro batches in the given precision (see
    ``traced_precision``), on packed rows with ``packed_documents``, and the bytes the MoE
    layers save per sample."""
    small, large = TRACED_BATCHES

    def rows(batch: int) -> dict:
        tokens = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
        return {"inputs": tokens, "positions": packed_positions(batch, seq_len) if packed_documents else None}

    with traced_precision(net, compute_dtype, param_dtype) as (traced_net, traced_dtype):
        at_small = traced_step_bytes(traced_net, **rows(small), next_token_loss=True, backward=False, units=blocks)
        at_large = traced_step_bytes(traced_net, **rows(large), next_token_loss=True, units=blocks)
    saved_small, saved_large, step_large = at_small.saved, at_large.saved, at_large.step
    per_sample = (saved_large - saved_small) / (large - small)
    block_per_sample = [(b - a) / (large - small) for a, b in zip(at_small.saved_by_unit, at_large.saved_by_unit, strict=True)]
    fields = {"activation_bytes_per_sample": per_sample, "activation_bytes_fixed": saved_small - small * per_sample,
              "working_bytes_per_sample": max(0, step_large - saved_large) / large,
              "traced_dtype": traced_dtype, "traced_under_autocast": traced_dtype != param_dtype,
              "block_saved_per_sample": tuple(block_per_sample),
              "block_backward_per_sample": tuple(b / large for b in at_large.backward_by_unit),
              "block_saved_fixed": tuple(a - small * b for a, b in zip(at_small.saved_by_unit, block_per_sample,
                                                                        strict=True))}
    return fields, (at_large.saved_in_moe - at_small.saved_in_moe) / (large - small)


def pipeline_block_names(net: nn.Module) -> list[list[str]]:
    """The blocks ``net`` declares for a pipeline (``pipeline_blocks``), each a list of submodule
    names relative to ``net``; [] where it declares none."""
    from litscale.strategies.stages import find_blocks

    try:
        owner, units = find_blocks(net)
    except ValueError:
        return []
    prefix = next((name for name, module in net.named_modules() if module is owner), None)
    if prefix is None:  # declared on a module outside ``net``: not this network's blocks
        return []
    return [[f"{prefix}.{name}" if prefix else name for name in unit] for unit in units]


def moe_facts(net: nn.Module, saved_per_sample: float = 0.0) -> MoEFacts | None:
    """The MoE facts of a network that declares grouped experts (``expert_modules``), read off
    its modules: each declared module's parent is its MoE layer (router, experts, shared
    experts); None for a dense network. ``saved_per_sample``: the traced bytes its MoE layers
    save for backward, per sample."""
    from litscale.parallel.declarations import find_expert_modules, moe_parameter_counts

    experts = find_expert_modules(net)
    config = getattr(net, "config", None)
    if not experts or not hasattr(config, "n_experts"):
        return None
    layer_params, expert_params = moe_parameter_counts(net)
    unchosen = expert_params * (config.n_experts - config.top_k) // config.n_experts
    return MoEFacts(layers=len(experts), n_experts=config.n_experts, top_k=config.top_k, expert_params=expert_params,
                    layer_params=layer_params, layer_flops_per_token=6.0 * (layer_params - unchosen),
                    active_params=sum(p.numel() for p in net.parameters()) - unchosen,
                    saved_bytes_per_sample=saved_per_sample)


def context_parallel_kv_width(net: nn.Module) -> int:
    """The key projection's width of the first attention a context-parallel strategy splits."""
    attention = net.context_parallel_attention() if hasattr(net, "context_parallel_attention") else []
    return attention[0].k_proj.out_features if attention else 0


def _first(config, names: tuple[str, ...], default: int) -> int:
    if hasattr(config, "transformers_config"):
        config = config.transformers_config()
    return next((int(getattr(config, n)) for n in names if getattr(config, n, None)), default)


def profile(net: nn.Module, *, seq_len: int, micro_batches: set[int], vocab_size: int, repeats: int = 3,
            packed_documents: bool = False) -> Profile:
    """``net`` (real weights, on the CPU; sharded or not) timed at each micro batch: the median
    of ``repeats`` forward-backwards after one untimed, on one thread (on packed rows with
    ``packed_documents``); and one AdamW step."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    try:
        timed = {}
        for micro in sorted(micro_batches):
            tokens = torch.randint(vocab_size, (micro, seq_len + 1), generator=generator)
            positions = packed_positions(micro, seq_len, device="cpu") if packed_documents else None
            timed[micro] = _median_seconds(lambda t=tokens, p=positions: forward_backward(net, t, p), repeats)
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-6)
        step_s = _median_seconds(optimizer.step, repeats)
        net.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(previous)
    return Profile(timed, step_s)


def forward_backward(net: nn.Module, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> None:
    """One training step's forward and backward: next-token cross-entropy over ``tokens``, the
    rows packed documents at ``positions`` where given."""
    logits = net(tokens[:, :-1]) if positions is None else net(tokens[:, :-1], positions)
    if hasattr(logits, "full_tensor"):  # a DTensor (tensor parallel): the loss on the whole logits
        logits = logits.full_tensor()
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()


def _median_seconds(work, repeats: int) -> float:
    work()  # the first call allocates
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
