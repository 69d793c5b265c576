"""Fine-tuning runs through ``train.py`` on the rank pool: a two-source mixture of packed
conversations and plain text saved under FSDP on 2 ranks resumes under tensor parallel on 2
ranks with the losses and weights of the uninterrupted run (one process, the same global
batch), each source continuing where it stopped; and what the run records of it (the tokens
trained on beside those seen, the packing efficiency, each source's share, the loss curve)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.moving_runs import assert_same_run, train

from litscale.app.checks.checkpoint import saved_data_state

pytestmark = pytest.mark.slow  # every test here runs train.py

STEPS = 6
RUN = ("model=llama", "data=sft", "data.pack=true", "data.seq_len=64", "trainer.accelerator=cpu",
       "trainer.log_every_n_steps=1", f"trainer.val_check_interval={STEPS}", "trainer.limit_val_batches=1",
       "logger=csv", "trainer.enable_progress_bar=false")


def mixture(tmp_path: Path) -> tuple[str, ...]:
    """litscale's example chats at 0.7 and 20 short notes at 0.3: the notes pack into a few rows,
    so that source comes round again (a new permutation of its rows) within the run."""
    notes = tmp_path / "notes.jsonl"
    notes.write_text("".join(json.dumps({"text": f"note {n}: " + "word " * (n % 7)}) + "\n" for n in range(20)))
    return (f"data.sources=[{{paths: null, weight: 0.7, name: chats}}, "
            f"{{paths: '{notes}', weight: 0.3, kind: text, name: notes}}]", f"data.cache_dir={tmp_path / 'cache'}")


@pytest.mark.full
@pytest.mark.timeout(600)
def test_a_mixture_saved_under_fsdp_resumes_under_tensor_parallel_with_the_uninterrupted_losses(tmp_path):
    outputs, sources = tmp_path / "outputs", mixture(tmp_path)
    whole = train(outputs, "single", ("strategy=single", "data.batch_size=8", *sources), 1,
                  f"trainer.max_steps={STEPS}", base=RUN)
    half = STEPS // 2
    part = train(outputs, "part_fsdp2", ("strategy=fsdp", "trainer.devices=2", "data.batch_size=4", *sources), 2,
                 f"trainer.max_steps={half}", base=RUN)
    saved = saved_data_state(part["checkpoint"], "SFTDataModule")
    drawn = {source["name"]: source["drawn"] for source in saved["sources"]}
    assert saved["samples_drawn"] == sum(drawn.values()) == 8 * half
    assert abs(drawn["notes"] - 0.3 * 8 * half) <= 1, drawn
    resumed = train(outputs, "resumed_tp2", ("strategy=tensor_parallel", "trainer.devices=2", "data.batch_size=8",
                                             *sources), 2, f"trainer.max_steps={STEPS}",
                    f"ckpt_path={part['checkpoint']}", base=RUN)
    assert_same_run(resumed, whole, steps=range(half, STEPS))
    # what the run says it trained on: its own steps' samples, answers only, packed
    data = resumed["data"]
    assert 0 < data["tokens_trained"] < data["tokens_seen"] <= data["positions_seen"] == 8 * half * 64
    assert data["packing_efficiency"] == data["tokens_seen"] / data["positions_seen"]
    assert abs(data["source_shares"]["notes"] - 0.3) <= 1 / (8 * half)
    assert data["source_weights"] == {"chats": 0.7, "notes": 0.3}
    assert (Path(resumed["output_dir"]) / "loss_curve.png").stat().st_size > 0
