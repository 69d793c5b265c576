"""The parity matrix: every strategy and option on 2 and 4 gloo ranks (and the 3-D mesh on 8)
against one process on the same global batches, step by step.

Each case trains a small GPT from the same seed on the same global batches as the reference
(``helpers.parity``): constant learning rate, no warm-up, no clipping (``test_pipeline.py``
and ``test_tensor_parallel.py`` cover clipping), weight decay on, SGD with momentum (biases
on) and AdamW (eps 1e-6: see ``OPTIMIZERS`` in ``helpers/parity.py``). Compared, fp32 at
PyTorch's defaults (rtol 1.3e-6, atol 1e-5) unless the table says otherwise:

- **loss**: the global batch's loss at every step;
- **grads**: every parameter's gradient at every step, gathered whole from its shards;
- **weights**: every parameter at the end, on every rank (a pipeline rank: its stages').

``tests/README.md`` has the table: every strategy and option x rank count x what is compared x
tolerance; ``FAMILIES`` below is that table as code.

Every optimizer (SGD, AdamW) for every cell but fp16 compression (SGD: AdamW normalises each
gradient element, so fp16 rounding of a near-zero gradient becomes a step of order lr). ZeRO
keeps gradients in its own partitions, not in ``.grad``: its loss and weights are compared.

A family of cases (one row group) runs in one process group: starting 4 or 8 processes on 2
cores costs more than fitting a tiny model. The 2-rank cells run in ``make test`` (but the
pipeline schedules other than 1f1b, which ``test_pipeline.py`` also runs on 2 ranks, and ZeRO
with accumulation or offload); past 2 ranks ``make test-full`` runs the meshes of two or more
dimensions (``MESHES_PAST_TWO_RANKS``); the rest is ``soak`` (``make test-soak``, beyond CI's
time). A family fits only the cells the session selected.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
from helpers.distributed import run_distributed
from helpers.parity import (
    TINY,
    TINY_WITH_BIASES,
    ParitySetup,
    assert_ranks_match,
    fit_on_mesh,
    local_sgd_reference,
    reference,
)
from helpers.strategies import (
    ddp,
    ddp_compressed,
    federated,
    fsdp,
    local_sgd,
    pipeline,
    tensor_parallel,
    zero,
)

from litscale.models.gpt import build_gpt
from litscale.models.llama import Llama, LlamaConfig
from litscale.models.moe import MoEConfig, MoEDecoder
from litscale.strategies.pipeline import SCHEDULES

pytestmark = pytest.mark.slow  # every cell starts gloo ranks; past 2 ranks `full` or `soak`


def setups(config=TINY_WITH_BIASES, optimizers=("sgd", "adamw"), **options):
    """The optimizers' setups over the same batches, biases (GPT's) and weight decay on."""
    return {name: ParitySetup(config=config, optimizer=name, weight_decay=0.1, **options)
            for name in optimizers}


def llama_setups(**changes):
    """A small Llama (no biases, as Llama has none): two query heads per key/value head."""
    config = LlamaConfig(**{"n_layer": 4, "n_head": 4, "n_kv_heads": 2, "n_embd": 32, "ffn_hidden_size": 64,
                            "vocab_size": 64, "block_size": 16, **changes})
    return setups(config, net_class=Llama, global_batch=16, accumulation=2)


def moe_setups(optimizers=("sgd", "adamw"), aux_loss_coef=0.0, **options):
    """A small MoE decoder: a dense layer, then two MoE layers of 4 experts (one per rank at EP
    4), top-2, one shared expert; dropless, without the bias update and by default without the
    balance loss (both read a rank's own tokens: under data parallel they are per micro batch,
    by design, not the global batch's; under context parallel the loss is the sequence's)."""
    config = MoEConfig(n_layer=3, n_head=4, n_kv_heads=2, n_embd=32, ffn_hidden_size=64, vocab_size=64,
                       block_size=16, n_experts=4, top_k=2, moe_ffn_hidden_size=16, n_shared_experts=1,
                       dense_layers=1, aux_loss_coef=aux_loss_coef)
    return setups(config, optimizers, net_class=MoEDecoder, **options)


def wider(config, **changes):
    return dataclasses.replace(config, **changes)


PLAIN = setups()
FOUR_HEADS = setups(wider(TINY_WITH_BIASES, n_head=4))  # TP up to 4
# Six blocks and eight units: enough for PP4 with two stages per rank (interleaved, V).
# Global batch 16 in 2 accumulated micro batches: every per-rank micro batch splits in 2.
PIPELINED = setups(wider(TINY_WITH_BIASES, n_layer=6), global_batch=16, accumulation=2)
LOCAL = setups(steps=8)  # two periods of 4
MUON = setups(optimizers=("muon",))
# µP at twice its base width (32 against 16): every multiplier of litscale.optim.mup is not 1.
MUP = setups(optimizers=("adamw", "muon"), base_width=16)
# NOTE: FedProx's AdamW without biases. The key projection's bias has an exactly zero data
# gradient (softmax ignores a constant added to every key), so AdamW moves it by fp32 noise
# (see OPTIMIZERS), and the proximal term mu * (w - w_sync) feeds that drift back into the
# gradient: at step 7 one element of it was 1.18e-5 off (atol 1e-5), run after run.
# SGD keeps the biases (its bias steps are proportional to their ~0 gradients).
FEDPROX = {**setups(optimizers=("sgd",), steps=8), **setups(TINY, optimizers=("adamw",), steps=8)}
_NANO = build_gpt(preset="nano", block_size=32).config
NANO = setups(wider(_NANO, bias=True), global_batch=8)
LLAMA = llama_setups()
LLAMA_QK_NORM_TIED = llama_setups(qk_norm=True, tie_embeddings=True)
LLAMA_LONG = llama_setups(block_size=64)
MOE = moe_setups()
TP_FULL = {"sequence_parallel": True, "loss_parallel": True}


@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the table: how to build the strategy in a rank (a picklable factory), the
    setups it trains, and how it is compared."""

    strategy: functools.partial
    setups: dict
    world_sizes: tuple[int, ...] = (2, 4)
    gradients: bool = True  # ZeRO keeps none in .grad
    # The logged train/grad_norm compared with one process's (ZeRO Muon logs none: its engine's
    # norm is of the orthogonalised updates)
    gradient_norms: bool = True
    weights_on_every_rank: bool = True  # ZeRO-3 consolidates on rank 0 only
    tolerance: dict = dataclasses.field(default_factory=dict)
    local_sgd: dict | None = None  # compared with local SGD re-derived: sync_every, outer_lr
    soak_only: bool = False  # `soak` at every rank count (make test-soak only; see _marks)
    soak_at: tuple[int, ...] = ()  # rank counts run by `make test-soak` only, beyond CI's time
    sequence_share: int | None = None  # each rank's module sees 1 / this of every sequence (context parallel)

    def expected(self, optimizer: str, world_size: int) -> list:
        setup = self.setups[optimizer]
        if self.local_sgd is not None:
            return local_sgd_reference(setup, world_size, **self.local_sgd)
        return [reference(setup)] * world_size


P = functools.partial
FAMILIES: dict[str, dict[str, Case]] = {
    "data_parallel": {
        "ddp": Case(P(ddp), PLAIN),
        # SGD only: AdamW divides each gradient by its own running scale, so fp16's relative
        # rounding (2^-11) of a gradient near zero becomes a step of order lr.
        "ddp_fp16": Case(P(ddp_compressed, "fp16"), setups(optimizers=("sgd",)),
                         tolerance={"rtol": 1e-3, "atol": 1e-4}),
        "fsdp_reshard": Case(P(fsdp, reshard_after_forward=True), PLAIN),
        "fsdp_no_reshard": Case(P(fsdp, reshard_after_forward=False), PLAIN),
        "fsdp_activation_checkpointing": Case(P(fsdp, activation_checkpointing=True), PLAIN),
        "hsdp_2x2": Case(P(fsdp, replicate_size=2), PLAIN, world_sizes=(4,)),
        # Muon: the whole matrix's update orthogonalised, from gradients all-reduced (DDP) or
        # shards gathered (FSDP).
        "ddp_muon": Case(P(ddp), MUON),
        "fsdp_muon": Case(P(fsdp), MUON),
        "ddp_mup": Case(P(ddp), MUP),
        "fsdp_mup": Case(P(fsdp), MUP),
    },
    "zero": {
        **{f"zero{stage}": Case(P(zero, stage), PLAIN, gradients=False,
                                weights_on_every_rank=stage < 3) for stage in (1, 2, 3)},
        # Each micro batch's loss divided once for accumulation (Lightning's loop does it; the
        # engine's backward did it again, by its gradient_accumulation_steps).
        # `make test` keeps stage 2 (time budget).
        **{f"zero{stage}_accumulated": Case(P(zero, stage), setups(accumulation=2), gradients=False,
                                            weights_on_every_rank=stage < 3, world_sizes=(2,), soak_only=stage != 2)
           for stage in (1, 2, 3)},
        # Muon by DeepSpeed's ZeRO Muon: a matrix split over partitions all-reduced whole to its
        # owners, orthogonalised there (litscale.strategies.zero_muon); experts each on their own.
        **{f"zero{stage}_muon": Case(P(zero, stage), MUON, gradients=False, gradient_norms=False)
           for stage in (1, 2)},
        "zero2_muon_accumulated": Case(P(zero, 2), setups(optimizers=("muon",), accumulation=2), gradients=False,
                                       gradient_norms=False, world_sizes=(2,)),
        "zero2_moe_muon": Case(P(zero, 2), moe_setups(("muon",)), gradients=False, gradient_norms=False,
                               world_sizes=(2,), soak_only=True),
        # µP's per-group LRs through ZeRO's flattened groups.
        "zero2_mup": Case(P(zero, 2), setups(optimizers=("adamw",), base_width=16), gradients=False, world_sizes=(2,)),
        # NOTE: DeepSpeed's Newton-Schulz normalises by |G| + 1e-7 (litscale's and torch's: by
        # max(|G|, 1e-7)). Under µP the query and key projections' gradients are tiny at this
        # width (scores x 1/head_dim), so that epsilon changes the directions Newton-Schulz
        # amplifies: the weights differ by up to 2.6e-5. The same one process stepped with
        # DeepSpeed's Newton-Schulz matched this cell to 2e-8 (by hand, once): the rest of the
        # mapping (groups, scales, decay, momentum) is exact.
        "zero2_mup_muon": Case(P(zero, 2), setups(optimizers=("muon",), base_width=16), gradients=False,
                               gradient_norms=False, world_sizes=(2,), tolerance={"atol": 5e-5}, soak_only=True),
    },
    "zero_offload": {
        "zero2_offload_optimizer": Case(P(zero, 2, offload_optimizer=True), PLAIN, world_sizes=(2,),
                                        gradients=False, soak_only=True),
        "zero2_offload_optimizer_muon": Case(P(zero, 2, offload_optimizer=True), MUON, world_sizes=(2,),
                                             gradients=False, gradient_norms=False, soak_only=True),
        "zero3_offload_all": Case(P(zero, 3, offload_optimizer=True, offload_parameters=True), PLAIN,
                                  world_sizes=(2,), gradients=False, weights_on_every_rank=False,
                                  soak_only=True),
    },
    "tensor_parallel": {
        "tp": Case(P(tensor_parallel, sequence_parallel=False), FOUR_HEADS),
        "tp_sequence_parallel": Case(P(tensor_parallel, sequence_parallel=True), FOUR_HEADS),
        "tp_loss_parallel": Case(P(tensor_parallel, sequence_parallel=True, loss_parallel=True), FOUR_HEADS),
        "dp2_tp2": Case(P(tensor_parallel, tensor_parallel_size=2), FOUR_HEADS, world_sizes=(4,)),
        "tp_muon": Case(P(tensor_parallel, sequence_parallel=False), setups(wider(TINY_WITH_BIASES, n_head=4),
                                                                            optimizers=("muon",))),
        "tp_mup": Case(P(tensor_parallel, **TP_FULL), setups(wider(TINY_WITH_BIASES, n_head=4), optimizers=("adamw",),
                                                            base_width=16)),
    },
    "pipeline": {
        # As many micro-batches as stages (V shapes and interleaving hold 2 per rank): DualPipeV
        # needs that many; each splits a rank's micro batch of 8 evenly.
        # At 2 ranks, `make test` keeps 1f1b; test_pipeline.py runs every schedule there too.
        **{f"pp{size}_{schedule}": Case(P(pipeline, schedule=schedule, microbatches=2 * size), PIPELINED,
                                  world_sizes=(size,), soak_only=schedule != "1f1b",
                                  soak_at=(4,) if schedule != "1f1b" else ())
           for schedule in SCHEDULES for size in (2, 4)},
        # Each stage holds its matrices whole.
        "pp2_1f1b_muon": Case(P(pipeline, schedule="1f1b", microbatches=4),
                              setups(wider(TINY_WITH_BIASES, n_layer=6), global_batch=16, accumulation=2,
                                     optimizers=("muon",)), world_sizes=(2,)),
        "pp2_1f1b_mup": Case(P(pipeline, schedule="1f1b", microbatches=4),
                             setups(wider(TINY_WITH_BIASES, n_layer=6), global_batch=16, accumulation=2,
                                    optimizers=("adamw",), base_width=16), world_sizes=(2,)),
        "pp2_dp2": Case(P(pipeline, pipeline_parallel_size=2, data_parallel_size=2, microbatches=4),
                        PIPELINED, world_sizes=(4,)),
        "pp2_tp2": Case(P(pipeline, pipeline_parallel_size=2, tensor_parallel_size=2, microbatches=4),
                        PIPELINED, world_sizes=(4,)),
    },
    "mesh_3d": {
        "pp2_dp2_tp2": Case(P(pipeline, pipeline_parallel_size=2, data_parallel_size=2,
                              tensor_parallel_size=2, microbatches=2), NANO, world_sizes=(8,)),
    },
    # Llama (GQA, RMSNorm, RoPE, SwiGLU): the key/value heads split over tensor-parallel ranks.
    "llama": {
        "llama_fsdp": Case(P(fsdp), LLAMA),
        "llama_tp_gqa": Case(P(tensor_parallel, **TP_FULL), LLAMA, world_sizes=(2,)),
        "llama_tp_qk_norm_tied": Case(P(tensor_parallel, **TP_FULL), LLAMA_QK_NORM_TIED, world_sizes=(2,)),
        "llama_dp2_tp2": Case(P(tensor_parallel, tensor_parallel_size=2, **TP_FULL), LLAMA, world_sizes=(4,)),
        "llama_pp_1f1b": Case(P(pipeline, schedule="1f1b", microbatches=4), LLAMA),
        "llama_pp2_tp2": Case(P(pipeline, pipeline_parallel_size=2, tensor_parallel_size=2, microbatches=4),
                              LLAMA, world_sizes=(4,)),
    },
    # Context parallel: each sequence (4x the Llama cells' length) split over the ranks in
    # load-balanced chunks, keys and values gathered; FSDP shards over data x context.
    "context_parallel": {
        "llama_cp2": Case(P(fsdp, context_parallel_size=2), LLAMA_LONG, world_sizes=(2,), sequence_share=2),
        "llama_cp4": Case(P(fsdp, context_parallel_size=4), LLAMA_LONG, world_sizes=(4,), sequence_share=4),
        "llama_cp2_fsdp2": Case(P(fsdp, context_parallel_size=2), LLAMA_LONG, world_sizes=(4,),
                                sequence_share=2),
        # The balance loss's expert shares are the whole sequence's: every rank's share of
        # the loss together makes the sequence's, as one process computes it.
        "moe_cp2_balanced": Case(P(fsdp, context_parallel_size=2), moe_setups(aux_loss_coef=0.1),
                                 world_sizes=(2,), sequence_share=2),
        "llama_cp2_tp2": Case(P(tensor_parallel, tensor_parallel_size=2, context_parallel_size=2, **TP_FULL),
                              LLAMA_LONG, world_sizes=(4,), sequence_share=2),
    },
    # Mixture of experts: experts sharded over expert-parallel ranks, tokens moved by all-to-all.
    "moe": {
        # 2 ranks: EP 2 alone; 4 ranks: EP 2 x FSDP 2 on the experts, FSDP 4 on the rest.
        "moe_fsdp_ep2": Case(P(fsdp, expert_parallel_size=2), MOE),
        # Clipped by the global norm over both meshes (experts' and the rest's); 0.05 clips every step.
        "moe_fsdp_ep2_clipped": Case(P(fsdp, expert_parallel_size=2), moe_setups(("sgd",), gradient_clip_val=0.05),
                                     world_sizes=(2,)),
        "moe_fsdp_ep4": Case(P(fsdp, expert_parallel_size=4), MOE, world_sizes=(4,)),
        "moe_tp": Case(P(tensor_parallel, **TP_FULL), MOE, world_sizes=(2,)),
        # Muon per expert: each expert's matrix of the stacked weights orthogonalised on its own.
        "moe_fsdp_ep2_muon": Case(P(fsdp, expert_parallel_size=2), moe_setups(("muon",))),
        "moe_fsdp_ep2_mup": Case(P(fsdp, expert_parallel_size=2), moe_setups(("adamw",), base_width=16)),
        "moe_dp2_tp2_ep2": Case(P(tensor_parallel, tensor_parallel_size=2, expert_parallel_size=2, **TP_FULL),
                                MOE, world_sizes=(4,)),
    },
    "local_sgd": {
        "local_sgd_1": Case(P(local_sgd, sync_every=1), LOCAL, local_sgd={"sync_every": 1}),
        "local_sgd_4": Case(P(local_sgd, sync_every=4), LOCAL, local_sgd={"sync_every": 4}),
        "diloco_4": Case(P(local_sgd, sync_every=4, outer_optimizer="nesterov", outer_lr=0.7,
                           outer_momentum=0.9), LOCAL,
                         local_sgd={"sync_every": 4, "outer_lr": 0.7, "outer_momentum": 0.9}),
        "local_sgd_4_muon": Case(P(local_sgd, sync_every=4), setups(steps=8, optimizers=("muon",)),
                                 local_sgd={"sync_every": 4}),
    },
    # Every client every round, IID rows, one local step: FedAvg is DDP's SGD (momentum and
    # weight decay are linear), compared with the one process as DDP is; the gradients are each
    # client's own. FedProx and FedOpt's Adam: against local SGD re-derived with the proximal
    # gradient's formula and the server's Adam (equal clients: the weighted mean is the mean).
    "federated": {
        "fedavg_1": Case(P(federated, local_steps=1), setups(optimizers=("sgd",), steps=8),
                         gradients=False, gradient_norms=False),  # each client logs its own
        "fedprox_4": Case(P(federated, local_steps=4, proximal_mu=0.5), FEDPROX,
                          local_sgd={"sync_every": 4, "proximal_mu": 0.5}),
        "fedadam_4": Case(P(federated, local_steps=4, outer_optimizer="adam", outer_lr=0.01), LOCAL,
                          local_sgd={"sync_every": 4, "outer_lr": 0.01, "outer_optimizer": "adam"}),
    },
}
# Seconds a family may take on a 2-core machine, by world size (starting ranks included).
DEADLINE = {2: 600, 4: 900, 8: 900}


def fit_family(rank: int, world_size: int, cases: dict[str, Case], cells: frozenset) -> dict:
    """The ``cells`` ``(case, optimizer)`` of a family at ``world_size``, in one process group:
    ``{(case, optimizer): Trace}``."""
    return {(name, optimizer): fit_on_mesh(rank, world_size, case.strategy(), setup,
                                           gradients=case.gradients,
                                           local_weights=case.weights_on_every_rank)
            for name, case in cases.items() for optimizer, setup in case.setups.items()
            if (name, optimizer) in cells}


@functools.cache
def family_fits(family: str, world_size: int, cells: frozenset) -> dict | str:
    """Each rank's traces ``{(case, optimizer): [Trace per rank]}`` of the family's ``cells``
    at ``world_size`` (those this session selected: `make test` fits no cell it leaves out),
    or the failure's text (kept, so the family's other cells fail at once instead of starting
    the ranks again)."""
    try:
        ranks = run_distributed(fit_family, world_size, FAMILIES[family], cells, timeout=DEADLINE[world_size])
    except AssertionError as error:
        return str(error)
    return {key: [traces[key] for traces in ranks] for key in ranks[0]}


# Past 2 ranks, CI (`make test-full`) trains one mesh of each pair of dimensions 2 ranks cannot
# hold (HSDP, DP x TP, CP x FSDP, CP x TP, EP x FSDP, DP x TP x EP) and PP x DP x TP at 8; the
# others (one-dimensional layouts at 4 ranks, PP x DP and PP x TP at 4, Llama's DP x TP and PP x
# TP) and the 2-rank cells make test leaves out (the other pipeline schedules, ZeRO with
# accumulation or offload) are `soak`: CI's 30 minutes on 2 cores do not hold them.
MESHES_PAST_TWO_RANKS = {"hsdp_2x2", "dp2_tp2", "pp2_dp2_tp2", "llama_cp2_fsdp2", "llama_cp2_tp2", "moe_fsdp_ep2",
                         "moe_dp2_tp2_ep2"}


def _marks(name: str, case: Case, world_size: int) -> list:
    if world_size in case.soak_at or case.soak_only or (world_size > 2 and name not in MESHES_PAST_TWO_RANKS):
        return [pytest.mark.soak]
    return [pytest.mark.full] if world_size > 2 else []


CELLS = [pytest.param(family, name, world_size, optimizer, id=f"{name}-{world_size}ranks-{optimizer}",
                      marks=_marks(name, case, world_size))
         for family, cases in FAMILIES.items() for name, case in cases.items()
         for world_size in case.world_sizes for optimizer in case.setups]


def selected_cells(session, family: str, world_size: int) -> frozenset:
    """The ``(case, optimizer)`` cells of ``family`` at ``world_size`` this session runs."""
    return frozenset((item.callspec.params["name"], item.callspec.params["optimizer"])
                     for item in session.items
                     if item.originalname == "test_strategy_matches_one_process_step_by_step"
                     and item.callspec.params["family"] == family
                     and item.callspec.params["world_size"] == world_size)


@pytest.mark.timeout(1000)
@pytest.mark.parametrize(("family", "name", "world_size", "optimizer"), CELLS)
def test_strategy_matches_one_process_step_by_step(family, name, world_size, optimizer, request):
    fits = family_fits(family, world_size, selected_cells(request.session, family, world_size))
    assert not isinstance(fits, str), fits
    case = FAMILIES[family][name]
    if case.sequence_share:
        length = case.setups[optimizer].config.block_size // case.sequence_share
        assert {shape[1] for trace in fits[name, optimizer] for shape in trace.input_shapes} == {length}
    assert_ranks_match(fits[name, optimizer], case.expected(optimizer, world_size),
                       gradients=case.gradients, weights_on_every_rank=case.weights_on_every_rank,
                       gradient_norms=case.gradient_norms, **case.tolerance)
