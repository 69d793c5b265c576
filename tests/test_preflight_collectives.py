"""The desync check before launch (``preflight.collectives=true``, and ``plan=show``): each
rank's first step traced on torch's fake process group, in this process, and a layout whose
ranks would issue different collectives refused with one line before any rank starts.

The traced checks run each rank's forward and backward in this process (1-8 s each on a loaded
2-core machine) and are marked ``slow``, out of the quick loop; the line's logic is not.
The expected shapes are the user network's own: its parameters' total (DDP's one bucket) and
its hidden state (what rank 1 all-reduces), read off the network, not the trace.
"""

from __future__ import annotations

import os

import pytest
from helpers.cli import check_command, run_train
from helpers.configs import CONF_DIR
from helpers.user_models import RankBranchNet

from litscale.app.plan_collectives import Collective, first_difference

SMALL = [
    "data.batch_size=2",
    "data.seq_len=16",
    "+model.net.n_layer=1",
    "+model.net.n_embd=32",
    "+model.net.n_head=2",
]
BRANCH = [
    "~model.net",
    "+model.net={_target_:helpers.user_models.RankBranchNet,vocab_size:256}",
    "allowed_targets=[helpers]",
    "data.batch_size=2",
    "data.seq_len=16",
]


check = check_command


def branch_line(batch: int = 2, seq_len: int = 16) -> str:
    """The one line a 2-rank DDP run of ``RankBranchNet`` is refused with: rank 0's first
    collective is DDP's bucket of every gradient, rank 1's its extra all-reduce of the hidden state."""
    net = RankBranchNet(vocab_size=256)
    bucket = sum(p.numel() for p in net.parameters())
    hidden = [batch, seq_len, net.embed.embedding_dim]
    return (
        "error: the ranks would issue different collectives in their first training step: collective #0 of "
        f"the group of ranks 0, 1 differs (rank 0: all_reduce float32[{bucket}]; rank 1: all_reduce "
        f"float32{hidden}); is there a rank-dependent branch in the model?\n"
    )


TRACED = pytest.mark.slow  # each rank's first step runs here: seconds, not milliseconds


@TRACED
def test_a_rank_dependent_all_reduce_is_refused_with_the_first_differing_collective(capsys):
    code, out, err = check(
        ["preflight.collectives=true", "strategy=ddp", "trainer.devices=2", *BRANCH], capsys
    )
    assert (code, err) == (2, branch_line())
    assert "collectives traced" not in out


def test_the_check_is_off_by_default(capsys):
    code, out, err = check(["strategy=ddp", "trainer.devices=2", *BRANCH], capsys)
    assert (code, err) == (0, "")
    assert "collectives" not in out


@TRACED
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_normal_layout_passes_and_says_what_it_traced(strategy, capsys):
    code, out, err = check(
        ["preflight.collectives=true", f"strategy={strategy}", "trainer.devices=2", *SMALL], capsys
    )
    assert (code, err) == (0, "")
    # DDP: one bucket. FSDP2: all-gathers of the root and the one block in forward, the block's
    # again in backward (resharded after forward), then a reduce-scatter of each.
    count = {"ddp": 1, "fsdp": 5}[strategy]
    assert (
        f"litscale: collectives traced on a fake process group of 2 ranks: the ranks of each group issue the "
        f"same ones in their first step ({count} on rank 0)\n"
    ) in out


def test_a_strategy_that_is_not_traced_is_named(capsys):
    code, _, err = check(
        [
            "preflight.collectives=true",
            "strategy=pipeline",
            "strategy.pipeline_parallel_size=2",
            "strategy.microbatches=2",
            "trainer.devices=2",
            *SMALL,
        ],
        capsys,
    )
    assert (code, err) == (
        2,
        "error: preflight.collectives=true cannot trace strategy=pipeline: a pipeline "
        "schedule's sends and receives are not run on the fake process group; set "
        "preflight.collectives=false\n",
    )


def _call(op: str, shape: tuple[int, ...], group: tuple[int, ...] = (0, 1, 2, 3)) -> Collective:
    return Collective(op, (shape,), ("torch.float32",), group)


def test_the_first_difference_is_found_per_group_and_a_missing_call_is_named():
    """Ranks 0-3 agree on the default group; in the group of ranks 2 and 3, rank 3 never issues
    its second all-gather; ranks of other groups (0, 1) may issue other shapes."""
    common = [_call("all_reduce", (8,))]
    traces = {
        0: [*common, _call("all_gather_into_tensor", (4,), (0, 1))] * 2,
        1: [*common, _call("all_gather_into_tensor", (4,), (0, 1))] * 2,
        2: [*common, _call("all_gather_into_tensor", (6,), (2, 3))] * 2,
        3: [*common, _call("all_gather_into_tensor", (6,), (2, 3)), *common],
    }
    assert first_difference(traces) == (
        "the ranks would issue different collectives in their first training step: collective #1 of the group of "
        "ranks 2, 3 differs (rank 2: all_gather_into_tensor float32[6]; rank 3: no collective); is there a "
        "rank-dependent branch in the model?"
    )
    traces[3] = traces[2]
    assert first_difference(traces) is None


@pytest.mark.slow
def test_plan_show_refuses_the_rank_dependent_branch_before_any_rank_starts(tmp_path):
    """``plan=show`` traces at the configured world too: refused with the same line, exit 2."""
    result = run_train(
        "plan=show",
        "cluster=h100_8x",
        "strategy=ddp",
        "trainer.devices=2",
        *BRANCH,
        outputs=tmp_path,
        env={
            "PYTHONPATH": os.pathsep.join(
                [str(CONF_DIR.parent / "tests"), os.environ.get("PYTHONPATH", "")]
            )
        },
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.endswith(branch_line()), result.stderr[-2000:]
    assert "litscale: as configured: every rank holds the whole model" in result.stdout
