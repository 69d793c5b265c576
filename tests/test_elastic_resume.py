"""A resume on another data-parallel count that cannot share the checkpoint's sample position
out: refused in one line before any rank starts, or, in an elastic job (``elastic=true``, which
the Ray and Kubernetes launchers set where the rank count changes on its own), moved forward
to the next position the new ranks share out, with one line saying which samples it skipped.

The samples are checked against the order's own arithmetic: the permutation of data epoch
``e`` is ``torch.randperm(N)`` drawn from ``seed + e``, and data-parallel rank ``r`` of ``R``
takes every ``R``-th index of it from the resumed position on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import sharded_checkpoint
from helpers.cli import explain, summaries
from helpers.configs import compose_job
from helpers.inprocess import train_on_pool
from hydra.utils import instantiate

from litscale.app.checks.validation import validate
from litscale.errors import ConfigError

SAMPLES, SEED = 64, 1234  # the synthetic training set and the default seed
SMALL = ["data=synthetic", f"data.num_samples={SAMPLES}", "data.val_samples=8", "data.seq_len=32",
         "model.net.preset=nano", "trainer.accelerator=cpu", "data.batch_size=1"]


def permutation(epoch: int = 0) -> list[int]:
    """Data epoch ``epoch``'s order, drawn as ``DistributedSampler`` draws it."""
    return torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()


def data_state(samples_drawn: int) -> dict:
    """``SyntheticDataModule``'s state in a checkpoint that stopped ``samples_drawn`` into epoch 0."""
    return {"SyntheticDataModule": {"epoch": 0, "samples_drawn": samples_drawn, "seed": SEED,
                                    "dataset_samples": SAMPLES}}


def checkpoint_file(path: Path, samples_drawn: int) -> str:
    """A Lightning checkpoint file of the nano GPT (its network, as the run configures it) with
    the data module's position."""
    cfg, _ = compose_job(SMALL, path.parent / "net")
    net = instantiate(cfg.model.net, _convert_="all")
    state = {f"net.{name}": tensor for name, tensor in net.state_dict().items()}
    torch.save({"state_dict": state, "global_step": 1, **data_state(samples_drawn)}, path)
    return str(path)


def checkpoint_directory(path: Path, samples_drawn: int) -> str:
    """A sharded (DCP) checkpoint directory whose ``meta.pt`` holds the data module's position."""
    path.mkdir(parents=True)
    sharded_checkpoint(path, step=1)
    torch.save({"global_step": 1, **data_state(samples_drawn)}, path / "meta.pt")
    return str(path)


def validated(overrides: list[str], tmp_path: Path):
    cfg, choices = compose_job([*SMALL, *overrides], tmp_path / "run")
    return validate(cfg, choices=choices, this_machine=False)


@pytest.mark.slow  # builds the nano GPT and validates a run: about a second
@pytest.mark.parametrize("form", ["file", "directory", "last"])
def test_a_resume_the_new_rank_count_cannot_share_out_is_refused_in_one_line(form, tmp_path):
    """Single process at micro batch 1 for 4 steps, resumed by DDP on 3 ranks: sample 4 splits
    over 1, 2 or 4 ranks, not 3. Before, the ranks started and the first one's loader raised."""
    saved = tmp_path / "saved" / "runs" / "r" / "checkpoints" / "last.ckpt"
    saved.parent.mkdir(parents=True)
    path = checkpoint_directory(saved, 4) if form == "directory" else checkpoint_file(saved, 4)
    ckpt_path = "last" if form == "last" else path
    ddp3 = ["strategy=ddp", "trainer.devices=3", f"ckpt_path={ckpt_path}", f"paths.root_dir={tmp_path}",
            "name=saved"]
    with pytest.raises(ConfigError) as refused:
        validated(ddp3, tmp_path)
    assert str(refused.value) == (
        "trainer.devices=3: the checkpoint stopped at sample 4 of epoch 0, which 3 data-parallel ranks cannot "
        "share out evenly; allowed: a data-parallel count that divides 4 (1, 2, 4), elastic=true to skip ahead "
        "to sample 6 (2 samples not trained in that epoch), or start fresh with ckpt_path=null")
    assert validated([*ddp3[:1], "trainer.devices=2", *ddp3[2:]], tmp_path).ckpt_path == path  # 2 divides 4
    assert validated([*ddp3, "elastic=true"], tmp_path).ckpt_path == path  # its ranks skip ahead


@pytest.mark.slow  # builds the nano GPT and validates a run: about a second
def test_a_layout_invariant_resume_is_refused_where_a_global_batch_does_not_split(tmp_path):
    """``determinism=layout_invariant`` gives each rank one contiguous block of every global
    batch: sample 2 (one process, micro batch 2, one step) divides over 2 ranks, but 2 ranks of
    micro batch 2 draw 4 at a time. Before, the resume was accepted, and its first step trained
    positions 1, 4, 3 and 6 of the order where one process trains 2 to 5: position 1 a second
    time, position 2 never."""
    path = checkpoint_file(tmp_path / "last.ckpt", 2)
    with pytest.raises(ConfigError) as refused:
        validated(["strategy=ddp", "trainer.devices=2", "data.batch_size=2", "determinism=layout_invariant",
                   "determinism.chunks=4", f"ckpt_path={path}"], tmp_path)
    assert str(refused.value) == (
        "trainer.devices=2: the checkpoint stopped at sample 2 of epoch 0, which 2 data-parallel ranks cannot "
        "share out evenly in blocks of 2 samples per rank (micro batch x accumulation, "
        "determinism=layout_invariant); allowed: a data-parallel count whose global batch (2 x the count) "
        "divides 2 (1), elastic=true to skip ahead to sample 4 (2 samples not trained in that epoch), or start "
        "fresh with ckpt_path=null")


@pytest.mark.slow  # builds the nano GPT and validates two jobs: about two seconds
@pytest.mark.parametrize(("launcher", "keys"), [
    (("hydra/launcher=ray", "trainer.devices=3"), "trainer.devices=3"),
    (("hydra/launcher=k8s", "hydra.launcher.api=pytorchjob", "trainer.devices=3", "trainer.num_nodes=2"),
     "trainer.devices=3 x trainer.num_nodes=2")], ids=["ray", "k8s"])
def test_the_sweeps_check_lets_an_elastic_launchers_job_resume_anywhere(launcher, keys, tmp_path):
    """Before a sweep, each job is validated as its ranks will be: an elastic one (Ray's
    ``min_workers``/``max_workers``, a PyTorchJob's ``min_nodes``/``max_nodes``) gets
    ``elastic=true`` from its launcher, so a position its configured count cannot share out is
    not refused; the same job of a fixed size is."""
    from helpers.configs import compose_full

    from litscale.app.preflight import validate_job

    path = checkpoint_file(tmp_path / "last.ckpt", 4)
    job = [*SMALL, *launcher, "strategy=ddp", f"ckpt_path={path}"]
    elastic = (["hydra.launcher.min_workers=1", "hydra.launcher.max_workers=4"] if "ray" in launcher[0]
               else ["hydra.launcher.min_nodes=1", "hydra.launcher.max_nodes=4"])
    validate_job(compose_full([*job, *elastic]), multirun=True)
    with pytest.raises(ConfigError, match=f"^{keys}: the checkpoint stopped at sample 4 of epoch 0"):
        validate_job(compose_full(job), multirun=True)


# --- end to end: an elastic job that loses ranks twice --------------------------------------------

ELASTIC_LINE = ("litscale: elastic resume: the checkpoint stopped at sample {saved} of epoch 0, which {ranks} "
                "data-parallel ranks cannot share out evenly: skipped {which} of the epoch's order ({count} "
                "sample{plural}, not trained in this epoch); the run continues at sample {resumed}")


def trained(record: Path) -> dict[tuple[int, int], list[int]]:
    """``(step, rank) -> the sample indices it trained``, from every rank's record."""
    rows = [json.loads(line) for path in sorted(record.glob("rank*.jsonl")) for line in path.read_text().splitlines()]
    found = {(row["step"], row["rank"]): row["indices"] for row in rows}
    assert len(found) == len(rows), "a rank trained a step twice"
    return found


def expected(steps: range, ranks: int, position: int) -> dict[tuple[int, int], list[int]]:
    """What ``ranks`` ranks of micro batch 1 train in ``steps`` from ``position`` of epoch 0's
    order: step ``steps[j]``'s global batch is positions ``position + j x ranks`` on, rank ``r``
    the ``r``-th of them."""
    order = permutation()
    return {(step, rank): [order[position + j * ranks + rank]] for j, step in enumerate(steps) for rank in range(ranks)}


def elastic_lines(process) -> list[str]:
    return re.findall(r"litscale: elastic resume: [^\n]*", process.stdout + process.stderr)


# soak: 4 then 3 ranks on 2 cores (150-300 s); make test holds the arithmetic
# (test_data.py's skip ahead, the refusals above, the launchers' elastic=true).
@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(1500)
def test_an_elastic_job_resumes_from_4_to_3_and_3_to_2_ranks_skipping_the_samples_it_says(tmp_path):
    """DDP at micro batch 1: 4 ranks train step 0 (positions 0-3) and save at sample 4; 3 ranks
    (a node lost) cannot share 4 out, skip positions 4-5 and train step 1 on 6-8; 2 ranks then
    skip position 9 and train steps 2 and 3 on 10-13. Before, the 3-rank start failed on every
    rank (``ValueError ... cannot share out evenly``), as every retry would."""
    outputs, record = tmp_path / "outputs", tmp_path / "record"
    run = [*SMALL, "strategy=ddp", "launcher.oversubscribe=true", "elastic=true", "trainer.val_check_interval=1",
           "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false", "allowed_targets=[helpers]"]

    def train(name: str, ranks: int, steps: int, *more: str):
        recorded = f"+callbacks.sample_record={{_target_:helpers.sample_record.SampleRecord,path:{record / name}}}"
        process = train_on_pool(*run, f"trainer.devices={ranks}", f"trainer.max_steps={steps}", f"name={name}",
                                recorded, *more, outputs=outputs, devices=ranks, timeout=600)
        assert process.returncode == 0, explain(process)
        return process, summaries(outputs / name)[-1]["checkpoint"]

    four, saved = train("four", 4, 1)
    assert elastic_lines(four) == []
    assert trained(record / "four") == expected(range(0, 1), 4, 0)

    three, saved = train("three", 3, 2, f"ckpt_path={saved}")
    assert elastic_lines(three) == [ELASTIC_LINE.format(saved=4, ranks=3, which="samples 4 to 5", count=2,
                                                        plural="s", resumed=6)]
    assert trained(record / "three") == expected(range(1, 2), 3, 6)

    two, _ = train("two", 2, 4, f"ckpt_path={saved}")
    assert elastic_lines(two) == [ELASTIC_LINE.format(saved=9, ranks=2, which="sample 9", count=1, plural="",
                                                      resumed=10)]
    assert trained(record / "two") == expected(range(2, 4), 2, 10)
    # Every sample of the epoch's first 14 trained once, but the 3 the two resumes said they skipped.
    seen = [index for name in ("four", "three", "two") for indices in trained(record / name).values()
            for index in indices]
    order = permutation()
    assert sorted(seen) == sorted(set(order[:14]) - {order[4], order[5], order[9]})
