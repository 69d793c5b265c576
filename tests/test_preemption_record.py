"""A preempted run says "last.ckpt saved" only when every rank recorded the checkpoint it
saved; otherwise it fails with one line naming the ranks that did not."""

from __future__ import annotations

import json

import pytest
import torch

from litscale.app.launch import RankFailure
from litscale.app.ranks import ranks_without_preemption_checkpoint, record_rank
from litscale.app.run import check_every_rank_saved


def record(tmp_path, monkeypatch, rank: int, saved: str | None) -> None:
    monkeypatch.setenv("RANK", str(rank))
    record_rank(str(tmp_path), preemption_checkpoint=saved)


def test_a_rank_that_saved_nothing_or_left_no_record_is_named(tmp_path, monkeypatch):
    record(tmp_path, monkeypatch, 0, str(tmp_path / "checkpoints" / "last.ckpt"))
    record(tmp_path, monkeypatch, 1, None)  # preempted before it could save (its sanity check)
    assert (
        json.loads((tmp_path / "ranks" / "rank1.json").read_text())["preemption_checkpoint"] is None
    )
    assert ranks_without_preemption_checkpoint(str(tmp_path), range(3)) == [1, 2]
    monkeypatch.delenv("RANK")
    with pytest.raises(RankFailure) as info:
        check_every_rank_saved(str(tmp_path), 3)
    assert str(info.value) == (
        "stopped, but ranks 1,2 saved no checkpoint at the stop; there is no complete checkpoint: a rerun "
        "starts from step 0"
    )
    # The complete checkpoint of an earlier step (a Ctrl-C's abandoned save leaves it) is named.
    earlier = tmp_path / "checkpoints" / "step000050.ckpt"
    earlier.parent.mkdir(exist_ok=True)
    torch.save({"global_step": 50, "state_dict": {}}, earlier)
    with pytest.raises(RankFailure) as info:
        check_every_rank_saved(str(tmp_path), 3)
    assert str(info.value) == (
        f"stopped, but ranks 1,2 saved no checkpoint at the stop; the newest complete checkpoint is {earlier} "
        "(ckpt_path=auto resumes from it)"
    )


def test_every_rank_saved_passes(tmp_path, monkeypatch):
    for rank in (0, 1):
        record(tmp_path, monkeypatch, rank, str(tmp_path / "checkpoints" / "last.ckpt"))
    monkeypatch.delenv("RANK")
    check_every_rank_saved(str(tmp_path), 2)


def test_under_torchrun_a_rank_checks_its_own_record(tmp_path, monkeypatch):
    record(tmp_path, monkeypatch, 1, str(tmp_path / "checkpoints" / "last.ckpt"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_every_rank_saved(str(tmp_path), 2)  # rank 0's record is rank 0's to check
