"""``docs/compatibility.md`` is current, and validation refuses exactly what it states."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
from helpers.configs import compose_job
from helpers.inprocess import refusal_on_pool

from litscale.app.checks.contract import check_strategy_accepts
from litscale.app.checks.validation import validate
from litscale.app.compatibility import HEADINGS, render, strategy_nodes
from litscale.app.compatibility import strategy_rows as _strategy_rows
from litscale.errors import ConfigError
from litscale.parallel.contract import Option, why_not

strategy_rows = functools.cache(_strategy_rows)  # built once for every test here
PAGE = Path(__file__).resolve().parents[1] / "docs" / "compatibility.md"
# Each row of the page as a command line chooses it.
ROWS = {name: name.replace(" stage=", " strategy.stage=").split() for name, _ in strategy_nodes()}
CPU2 = ["trainer.accelerator=cpu", "trainer.devices=2", "launcher.oversubscribe=true", "data=synthetic",
        "data.seq_len=32"]


def test_the_compatibility_page_is_what_the_contract_says_now():
    assert PAGE.read_text() == render(), "run: python -m litscale.app.compatibility > docs/compatibility.md"


def _refusal(overrides: list[str], tmp_path) -> str | None:
    cfg, choices = compose_job(overrides, tmp_path / "run")
    try:
        validate(cfg, choices=choices, this_machine=False)
    except ConfigError as error:
        return str(error)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("row", sorted(ROWS))
@pytest.mark.parametrize(("option", "override"), [(Option.COMPRESSION, "compression=fp16"),
                                                  (Option.LAYOUT_INVARIANT, "determinism=layout_invariant"),
                                                  (Option.ASYNC_SAVE, "checkpoint.async_save=true")])
def test_validation_refuses_exactly_the_options_the_page_says_no_to(row, option, override, tmp_path):
    strategy = dict(strategy_rows())[row]
    first, *options = ROWS[row]
    devices = ["trainer.devices=1"] if first == "single" else []
    refusal = _refusal([*CPU2, f"strategy={first}", *options, override, *devices], tmp_path)
    reason = why_not(strategy, option)
    if reason is None:
        assert refusal is None or override not in refusal, refusal
    else:
        assert refusal is not None and refusal.startswith(f"{override} is not supported with") and reason in refusal


@pytest.mark.parametrize("row", sorted(ROWS))
def test_fp16_is_refused_by_exactly_the_strategies_the_page_says_no_to(row, tmp_path):
    """Asked of the contract check alone: on this CPU machine fp16 is refused before it."""
    first, *options = ROWS[row]
    cfg, choices = compose_job([f"strategy={first}", *options, "precision=fp16_mixed"], tmp_path / "run")
    reason = why_not(dict(strategy_rows())[row], Option.FP16_MIXED)
    if reason is None:
        check_strategy_accepts(cfg, choices, dict(strategy_rows())[row])
    else:
        with pytest.raises(ConfigError, match="^precision=fp16_mixed is not supported with strategy="):
            check_strategy_accepts(cfg, choices, dict(strategy_rows())[row])


def page_cells(heading: str) -> tuple[dict[str, str], dict[int, str]]:
    """The page's column ``heading``: each row's cell (``yes``, ``yes [n]`` or ``no [n]``), and
    the page's numbered notes."""
    lines = PAGE.read_text().splitlines()
    headings = [cell.strip() for cell in lines[next(i for i, line in enumerate(lines) if line.startswith("| strategy |"))]
                .strip("|").split("|")]
    column = headings.index(heading)
    cells = {}
    for line in lines:
        cells_of_line = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| `"):
            cells[cells_of_line[0].strip("`")] = cells_of_line[column]
    notes = {int(number): text for number, text in (re.match(r"(\d+)\. (.*)", line).groups()
                                                    for line in lines if re.match(r"\d+\. ", line))}
    return cells, notes


@pytest.mark.slow
@pytest.mark.parametrize("row", sorted(ROWS))
def test_validation_takes_a_mixture_of_experts_exactly_where_the_page_says(row, tmp_path):
    """The page's model=moe column against validation of the command line a user types: a ``no``
    is refused in the contract's line with the note's reason; a ``yes`` is accepted; a ``yes [n]``
    is accepted with the settings its note names (the pipeline's model.net.aux_loss_coef=0) and
    refused without them in one line naming the key. The pipeline's cell said ``no`` while it
    took model=moe with model.net.aux_loss_coef=0: the network's options were never asked."""
    cells, notes = page_cells(HEADINGS[Option.MIXTURE_OF_EXPERTS])
    cell = cells[row]
    first, *options = ROWS[row]
    command = [*CPU2, f"strategy={first}", *options, "model=moe", *(["trainer.devices=1"] if first == "single" else [])]
    refusal = _refusal(command, tmp_path)
    note = notes.get(int(cell.split("[")[1].rstrip("]"))) if "[" in cell else None
    if cell.startswith("no"):
        assert refusal is not None and refusal.startswith("model=moe is not supported with strategy="), refusal
        assert note.split(". Instead: ")[0] in refusal, (refusal, note)
    elif note is None:
        assert refusal is None, refusal
    else:
        needed = re.findall(r"model\.net\.\w+=[\w.]+", note)
        assert needed, note  # a condition on the model names the settings it needs
        assert refusal is not None and any(refusal.startswith(f"{setting.split('=')[0]}=") for setting in needed), \
            refusal
        assert _refusal([*command, *needed], tmp_path) is None


@pytest.mark.slow
@pytest.mark.parametrize(("aux_loss_coef", "refused"), [(0.01, True), (0.0, False)])
def test_a_pipeline_refuses_a_load_balancing_loss_its_schedule_would_drop(aux_loss_coef, refused, tmp_path):
    """The schedule computes the loss from the last stage's output only: a mixture of experts'
    balance loss (added beside the output) vanished silently; without one, the pipeline trains it."""
    overrides = [*CPU2, "strategy=pipeline", "model=moe", f"model.net.aux_loss_coef={aux_loss_coef}"]
    refusal = _refusal(overrides, tmp_path)
    if refused:
        assert refusal == (f"model.net.aux_loss_coef={aux_loss_coef} is not supported with strategy=pipeline: the "
                           "schedule computes the loss from the last stage's output only, so a mixture of experts "
                           "trains only without its load-balancing loss (model.net.aux_loss_coef=0; the bias update, "
                           "model.net.bias_update_rate, still balances the experts); allowed: model.net.aux_loss_coef=0")
    else:
        assert refusal is None


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "refused"), [("bf16_mixed", True), ("fp32", False)])
def test_deepspeed_refuses_16_bit_training_of_batch_norm_statistics(precision, refused, tmp_path):
    """Found by the combination test: ZeRO-3 in bf16 on model=resnet crashed in its first forward
    ("expected scalar type BFloat16 but found Float"): DeepSpeed casts parameters, not statistics."""
    refusal = _refusal(["trainer.accelerator=cpu", "trainer.devices=1", "model=resnet", "data=digits",
                        "strategy=deepspeed_zero", "strategy.stage=3", f"precision={precision}"], tmp_path)
    if refused:
        assert refusal == ("strategy=deepspeed_zero with a bfloat16 precision: the network's BatchNorm2d keeps "
                           "fp32 running statistics, which DeepSpeed's 16-bit engine does not cast; allowed: "
                           "precision=fp32 with this model, or strategy=ddp or fsdp in 16 bits")
    else:
        assert refusal is None


ZERO_MUON = "is not supported with optimizer=muon under strategy=deepspeed_zero: DeepSpeed's ZeRO Muon"


@pytest.mark.parametrize(("overrides", "refusal"), [
    ([], f"trainer.gradient_clip_val=1.0 {ZERO_MUON} clips by the norm of its orthogonalised updates, not of the "
     "gradients one process clips; allowed: trainer.gradient_clip_val=null"),
    (["trainer.gradient_clip_val=null", "optimizer.nesterov=false"],
     f"optimizer.nesterov=false {ZERO_MUON} steps Nesterov's momentum; allowed: optimizer.nesterov=true"),
    (["trainer.gradient_clip_val=null", "optimizer.ns_steps=3"],
     f"optimizer.ns_steps=3 {ZERO_MUON} runs 5 Newton-Schulz steps; allowed: optimizer.ns_steps=5"),
    (["trainer.gradient_clip_val=null", "trainer.accelerator=gpu"],
     "optimizer.ns_dtype=float32 is not supported with optimizer=muon under strategy=deepspeed_zero: on a GPU "
     "DeepSpeed's ZeRO Muon runs Newton-Schulz in bfloat16; allowed: optimizer.ns_dtype=bfloat16"),
    (["trainer.gradient_clip_val=null", "strategy.stage=3"],
     "optimizer=muon is not supported with strategy=deepspeed_zero: ZeRO hands the optimizer flat partitions of the "
     "parameters, and litscale hands Muon's whole matrices to DeepSpeed's ZeRO Muon at stages 1 and 2 only; allowed: "
     "optimizer=adamw, or any strategy but deepspeed_zero stage 3"),
    (["trainer.gradient_clip_val=null", "strategy.stage=1"], None),
    (["trainer.gradient_clip_val=null", "optimizer.ns_dtype=bfloat16"], None),
], ids=["clipping", "nesterov", "ns_steps", "float32_on_gpu", "stage3", "stage1", "bfloat16"])
def test_deepspeed_takes_muon_at_stages_1_2_with_the_settings_its_zero_muon_steps(overrides, refusal, tmp_path):
    """Muon under ZeRO 1-2 is DeepSpeed's ZeRO Muon (``litscale.strategies.zero_muon``): what it
    cannot step as one process does is refused in one line naming the key."""
    assert _refusal([*CPU2, "strategy=deepspeed_zero", "optimizer=muon", *overrides], tmp_path) == refusal


@pytest.mark.parametrize(("optimizer", "stage"), [("lars", 1), ("lamb", 3)])
def test_deepspeed_refuses_a_layerwise_optimizer_at_every_stage(optimizer, stage, tmp_path):
    """Found by the combination test: LARS under ZeRO-1 on 2 ranks trained its second step 1% off
    one process (ZeRO steps flat partitions: the trust ratio took a partition's norms)."""
    assert _refusal([*CPU2, "strategy=deepspeed_zero", f"strategy.stage={stage}", f"optimizer={optimizer}"],
                    tmp_path) == (
        f"optimizer={optimizer} is not supported with strategy=deepspeed_zero: ZeRO hands the optimizer flat "
        "partitions of the parameters, so a layer-wise trust ratio would take the norms of a partition, not of "
        "each weight tensor; allowed: optimizer=adamw, sgd or muon, or any strategy but deepspeed_zero")


@pytest.mark.slow
@pytest.mark.parametrize(("option", "line"), [
    ("checkpoint.async_save=true", "error: checkpoint.async_save=true is not supported with strategy=deepspeed_zero: "
     "DeepSpeed's engine writes its own partitioned checkpoint files, on the training thread; allowed: "
     "checkpoint.async_save=false, or any strategy but deepspeed_zero"),
    ("optimizer=muon", "error: trainer.gradient_clip_val=1.0 is not supported with optimizer=muon under "
     "strategy=deepspeed_zero: DeepSpeed's ZeRO Muon clips by the norm of its orthogonalised updates, not of the "
     "gradients one process clips; allowed: trainer.gradient_clip_val=null"),
], ids=["async_save", "muon"])
def test_train_py_refuses_what_deepspeed_cannot_take_in_one_line_before_any_rank_starts(option, line, tmp_path):
    assert refusal_on_pool("strategy=deepspeed_zero", "trainer.accelerator=cpu", "trainer.devices=2", option,
                           outputs=tmp_path) == line
