"""A run moves between layouts: every layout of the same global batch trains step ``k`` on the
same samples and logs their mean loss, and a checkpoint resumes on another layout, mid-epoch,
with the losses and weights of the uninterrupted run.

Every run is ``train.py`` on the rank pool; the reference is always one process with the whole
global batch (16 samples), never the layout under test.
"""

from __future__ import annotations

import pytest
import torch
from helpers.cli import summaries
from helpers.moving_runs import RUN, SINGLE, STEPS, assert_same_run, train, train_one_process

pytestmark = pytest.mark.slow  # every test here runs train.py

# Layouts of a global batch of 16: (name, overrides, ranks).
LAYOUTS = [
    ("single_acc2", ("strategy=single", "data.batch_size=8", "trainer.accumulate_grad_batches=2"), 1),
    ("ddp2", ("strategy=ddp", "trainer.devices=2", "data.batch_size=8"), 2),
    ("ddp2_acc2", ("strategy=ddp", "trainer.devices=2", "data.batch_size=4",
                   "trainer.accumulate_grad_batches=2"), 2),
    # make test-soak: 4 DDP ranks run about 2 min on 2 cores, and zero2_acc2 and fsdp4_acc2 100 s
    # each: CI (make test-full) trains the first three.
    pytest.param(("ddp4", ("strategy=ddp", "trainer.devices=4", "launcher.oversubscribe=true",
                           "data.batch_size=4"), 4), marks=pytest.mark.soak),
    # DeepSpeed accumulates itself: Lightning calls on_before_optimizer_step at every micro batch.
    pytest.param(("zero2_acc2", ("strategy=deepspeed_zero", "trainer.devices=2", "data.batch_size=4",
                                 "trainer.accumulate_grad_batches=2"), 2), marks=pytest.mark.soak),
    pytest.param(("fsdp4_acc2", ("strategy=fsdp", "trainer.devices=4", "launcher.oversubscribe=true",
                                 "data.batch_size=2", "trainer.accumulate_grad_batches=2"), 4),
                 marks=pytest.mark.soak),
]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    return tmp_path_factory.mktemp("moving")


@pytest.fixture(scope="module")
def one_process(outputs) -> dict:
    return train_one_process(outputs)


@pytest.mark.full
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout[0])
def test_every_layout_of_a_global_batch_trains_and_logs_as_one_process(outputs, one_process, layout):
    name, overrides, ranks = layout
    summary = train(outputs, name, overrides, ranks, f"trainer.max_steps={STEPS}")
    assert summary["global_batch"] == one_process["global_batch"] == 16
    assert_same_run(summary, one_process, steps=range(STEPS))


@pytest.mark.full
@pytest.mark.timeout(600)
def test_a_run_stopped_on_two_ranks_resumes_on_one_with_the_uninterrupted_losses(outputs, one_process):
    """Saved when ``max_steps`` stopped the fit mid-epoch (Lightning then counts the epoch as
    done), with another micro batch and accumulation: the resume continues the same epoch's
    order at the same sample."""
    half = STEPS // 2
    _, ddp, ranks = LAYOUTS[2]
    part = train(outputs, "part_ddp2_acc2", ddp, ranks, f"trainer.max_steps={half}")
    name, single, _ = SINGLE
    resumed = train(outputs, "resumed_single", single, 1, f"trainer.max_steps={STEPS}",
                    f"ckpt_path={part['checkpoint']}")
    assert_same_run(resumed, one_process, steps=range(half, STEPS))


@pytest.mark.soak  # 4 ranks on 2 cores, 50 s: CI moves FSDP's checkpoint to TP at 2 ranks (fsdp2-to-tp2)
@pytest.mark.timeout(900)
def test_fsdp_on_four_ranks_resumes_under_tensor_parallel_on_two(outputs, one_process):
    half = STEPS // 2
    part = train(outputs, "part_fsdp4", ("strategy=fsdp", "trainer.devices=4", "launcher.oversubscribe=true",
                                         "data.batch_size=4"), 4, f"trainer.max_steps={half}")
    resumed = train(outputs, "resumed_tp2", ("strategy=tensor_parallel", "trainer.devices=2",
                                             "data.batch_size=16"), 2, f"trainer.max_steps={STEPS}",
                    f"ckpt_path={part['checkpoint']}")
    assert_same_run(resumed, one_process, steps=range(half, STEPS))


@pytest.mark.soak  # 4 ranks on 2 cores, 40 s: beyond CI's time
@pytest.mark.timeout(900)
def test_layout_invariant_ddp_on_four_ranks_resumes_on_one_bit_for_bit(outputs):
    invariant = ("determinism=layout_invariant",)
    half = STEPS // 2
    straight = train(outputs, "invariant_single", (*SINGLE[1], *invariant), 1, f"trainer.max_steps={STEPS}")
    part = train(outputs, "invariant_ddp4", ("strategy=ddp", "trainer.devices=4", "launcher.oversubscribe=true",
                                             "data.batch_size=4", *invariant), 4, f"trainer.max_steps={half}")
    resumed = train(outputs, "invariant_resumed", (*SINGLE[1], *invariant), 1, f"trainer.max_steps={STEPS}",
                    f"ckpt_path={part['checkpoint']}")
    assert_same_run(resumed, straight, steps=range(half, STEPS), exact=True)


# --- resume on another layout: the matrix -----------------------------------------------------

# Layouts of 2 ranks (or one process) with the global batch of 16: where a checkpoint is saved
# after STEPS // 2 steps, and where it resumes.
MATRIX = {
    "single": (("strategy=single", "data.batch_size=16"), 1),
    "ddp2": (("strategy=ddp", "trainer.devices=2", "data.batch_size=8"), 2),
    "fsdp2": (("strategy=fsdp", "trainer.devices=2", "data.batch_size=8"), 2),
    "tp2": (("strategy=tensor_parallel", "trainer.devices=2", "data.batch_size=16"), 2),
    "pp2": (("strategy=pipeline", "trainer.devices=2", "data.batch_size=16"), 2),
    "zero2": (("strategy=deepspeed_zero", "trainer.devices=2", "data.batch_size=8"), 2),
    # ZeRO-1 saves as ZeRO-2 does (DeepSpeed's stage_1_and_2), ZeRO-3 its own way: two cells of
    # each out of DeepSpeed, and two into ZeRO-3.
    "zero1": (("strategy=deepspeed_zero", "strategy.stage=1", "trainer.devices=2", "data.batch_size=8"), 2),
    "zero3": (("strategy=deepspeed_zero", "strategy.stage=3", "trainer.devices=2", "data.batch_size=8"), 2),
    "zero2_1": (("strategy=deepspeed_zero", "trainer.devices=1", "data.batch_size=16"), 1),
}
OUT_OF_DEEPSPEED_ONLY = ("zero1", "zero3", "zero2_1")
# DeepSpeed into DeepSpeed where its own loader cannot read the partitions: another world size,
# ZeRO-3 against ZeRO-1/2 (read whole and written in through its setters).
DEEPSPEED_CROSSINGS = [("zero2", "zero2_1"), ("zero2", "zero3"), ("zero3", "zero2"), ("zero2_1", "zero3")]
# CI (make test-full) trains these cells (DCP resharded across strategies, a pipeline's stages
# out, DeepSpeed's partitions in and out, and onto fewer ranks); make test-soak the whole matrix
# (36 cells and the DeepSpeed ones: about 17 min on 2 cores).
QUICK_CELLS = {("fsdp2", "tp2"), ("pp2", "ddp2"), ("fsdp2", "zero2"), ("zero2", "fsdp2"), ("zero2", "zero2_1")}
CELLS = [pytest.param(source, target, id=f"{source}-to-{target}",
                      marks=() if (source, target) in QUICK_CELLS else pytest.mark.soak)
         for source in MATRIX for target in MATRIX if not {source, target} & set(OUT_OF_DEEPSPEED_ONLY)] + [
    pytest.param(source, target, id=f"{source}-to-{target}", marks=pytest.mark.soak)
    for source in OUT_OF_DEEPSPEED_ONLY for target in ("single", "fsdp2")] + [
    pytest.param(source, "zero3", id=f"{source}-to-zero3", marks=pytest.mark.soak) for source in ("single", "fsdp2")] + [
    pytest.param(source, target, id=f"{source}-to-{target}",
                 marks=() if (source, target) in QUICK_CELLS else pytest.mark.soak)
    for source, target in DEEPSPEED_CROSSINGS]


@pytest.fixture(scope="module")
def saved_halfway(outputs):
    """Each source layout's checkpoint after ``STEPS // 2`` steps, trained once per module."""
    saved: dict[str, dict] = {}

    def save(source: str) -> dict:
        if source not in saved:
            overrides, ranks = MATRIX[source]
            saved[source] = train(outputs, f"half_{source}", overrides, ranks, f"trainer.max_steps={STEPS // 2}")
        return saved[source]

    return save


@pytest.mark.full
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("source", "target"), CELLS)
def test_a_checkpoint_resumes_on_another_layout_with_the_uninterrupted_run(
        outputs, one_process, saved_halfway, source, target):
    part = saved_halfway(source)
    overrides, ranks = MATRIX[target]
    name, more = f"resumed_{source}_to_{target}", (f"trainer.max_steps={STEPS}", f"ckpt_path={part['checkpoint']}")
    resumed = train(outputs, name, overrides, ranks, *more)
    assert_same_run(resumed, one_process, steps=range(STEPS // 2, STEPS))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("source", [pytest.param("zero2"), pytest.param("zero3", marks=pytest.mark.soak)])
def test_a_deepspeed_checkpoint_is_read_with_the_weights_deepspeeds_own_reader_recovers(saved_halfway, source):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from litscale.checkpoint.deepspeed import deepspeed_as_file_checkpoint

    path = saved_halfway(source)["checkpoint"]
    theirs, ours = get_fp32_state_dict_from_zero_checkpoint(path), deepspeed_as_file_checkpoint(path)["state_dict"]
    assert theirs and all(torch.equal(ours[name], weight) for name, weight in theirs.items())


# --- expert and context parallel: their own models ----------------------------------------------

# A mixture of experts (the balance loss off: it weighs each rank's own micro batch; the
# selection-bias update on, so its bias moves with the checkpoint) and a Llama, each with its
# one-process layout and its parallel one on 2 ranks.
FAMILIES = {
    "moe": (("model=moe", "model.net.aux_loss_coef=0"),
            {"single": (("strategy=single", "data.batch_size=16"), 1),
             "ep2": (("strategy=fsdp", "strategy.expert_parallel_size=2", "trainer.devices=2",
                      "data.batch_size=8"), 2)}),
    "llama": (("model=llama",),
              {"single": (("strategy=single", "data.batch_size=16"), 1),
               "cp2": (("strategy=fsdp", "strategy.context_parallel_size=2", "trainer.devices=2",
                        "data.batch_size=16"), 2)}),
}
# RUN without GPT's preset and the byte corpus: the synthetic tokens of data=synthetic.
FAMILY_RUN = (*(o for o in RUN if not o.startswith(("model.net.preset", "data.max_bytes"))), "data=synthetic")
FAMILY_CELLS = [pytest.param(family, source, target, id=f"{family}-{source}-to-{target}", marks=marks)
                for family, source, target, marks in (
                    ("moe", "ep2", "single", ()), ("moe", "single", "ep2", pytest.mark.soak),
                    ("llama", "single", "cp2", ()), ("llama", "cp2", "single", pytest.mark.soak))]


@pytest.mark.full
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("family", "source", "target"), FAMILY_CELLS)
def test_expert_and_context_parallel_checkpoints_move_with_the_uninterrupted_run(outputs, family, source, target):
    model, layouts = FAMILIES[family]
    single, _ = layouts["single"]
    reference_name = f"{family}_uninterrupted"
    if not (outputs / reference_name).exists():
        train(outputs, reference_name, (*model, *single), 1, f"trainer.max_steps={STEPS}", base=FAMILY_RUN)
    reference = summaries(outputs / reference_name)[-1]
    overrides, ranks = layouts[source]
    part = train(outputs, f"{family}_half_{source}_{target}", (*model, *overrides), ranks,
                 f"trainer.max_steps={STEPS // 2}", base=FAMILY_RUN)
    overrides, ranks = layouts[target]
    resumed = train(outputs, f"{family}_{source}_to_{target}", (*model, *overrides), ranks,
                    f"trainer.max_steps={STEPS}", f"ckpt_path={part['checkpoint']}", base=FAMILY_RUN)
    assert_same_run(resumed, reference, steps=range(STEPS // 2, STEPS))
