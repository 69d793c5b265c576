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
from helpers.configs import CONF_DIR, compose_full, group_options
from helpers.user_models import RankBranchNet

from litscale.app.checks import collectives as collective_check
from litscale.app.checks.collectives import (
    EVEN_COUNTS,
    Collective,
    agreement_line,
    first_difference,
)

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


@pytest.mark.slow
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
    seen = {"ddp": "1 on rank 0: 1 all_reduce",
            "fsdp": "5 on rank 0: 3 all_gather_into_tensor, 2 reduce_scatter_tensor"}[strategy]
    assert (
        f"litscale: collectives traced on a fake process group of 2 ranks: the ranks of each group issue the "
        f"same ones in their first step ({seen})\n"
    ) in out


def _traces(overrides: list[str], tmp_path) -> tuple[dict[int, list[Collective]], bool]:
    """Each of 2 ranks' first-step collectives for ``overrides`` (and whether EP's counts were evened)."""
    from helpers.configs import compose_job
    from omegaconf import OmegaConf

    cfg, _ = compose_job([*overrides, "trainer.devices=2"], tmp_path)
    return collective_check._traced_in_this_process(OmegaConf.to_container(cfg, resolve=True), 2, 2)


def _parameter_count(overrides: list[str]) -> int:
    """Elements of the configured network's parameters (each tensor once: DDP's gradients)."""
    from helpers.configs import compose_full
    from omegaconf import open_dict

    from litscale.app.checks.validation import meta_net

    cfg = compose_full(overrides)
    with open_dict(cfg):
        del cfg["hydra"]
    return sum(p.numel() for p in meta_net(cfg).parameters())


@TRACED
def test_ddp_gradient_all_reduces_are_traced_on_both_ranks_and_a_skipped_bucket_is_a_desync(tmp_path):
    """DDP's buckets are all-reduced in its C++ reducer, which a Python trace cannot see; the
    traced DDP's comm hook issues them from Python. NOTE: DDP buckets its first step by
    ``bucket_cap_mb`` only when it looks for unused parameters (else all in one bucket), and
    then also all-reduces which parameters were used. A rank that skips a bucket is named."""
    overrides = [*SMALL, "strategy=ddp", "strategy.bucket_cap_mb=0.05", "strategy.find_unused_parameters=true"]
    traces, _ = _traces(overrides, tmp_path)
    buckets = [call for call in traces[0] if call.dtypes == ("torch.float32",)]
    assert traces[0] == traces[1]
    assert len(buckets) > 1 and {call.op for call in buckets} == {"all_reduce"}
    assert sum(call.shapes[0][0] for call in buckets) == _parameter_count(overrides)
    assert agreement_line(traces, "ddp") == (
        "collectives traced on a fake process group of 2 ranks: the ranks of each group issue the same ones "
        f"in their first step ({len(traces[0])} on rank 0: {len(traces[0])} all_reduce)")

    traces[1] = traces[1][1:]  # rank 1 never all-reduces the first bucket
    assert first_difference(traces) == (
        "the ranks would issue different collectives in their first training step: collective #0 of the group of "
        f"ranks 0, 1 differs (rank 0: all_reduce float32[{buckets[0].shapes[0][0]}]; rank 1: all_reduce "
        f"{traces[1][0].describe().removeprefix('all_reduce ')}); is there a rank-dependent branch in the model?")


@TRACED
def test_a_compression_hook_is_traced_as_what_it_sends(tmp_path):
    """Top-k sends its values and indices packed in bytes with one all-gather per bucket: that
    is what is traced, not the all-reduce it replaces."""
    traces, _ = _traces([*SMALL, "strategy=ddp", "compression=topk"], tmp_path)
    assert traces[0] == traces[1]
    assert [call.op for call in traces[0]] == ["all_gather"]
    assert set(traces[0][0].dtypes) == {"torch.uint8"}


MOE = ["model=moe", "data.batch_size=2", "data.seq_len=16"]


@TRACED
def test_expert_parallel_token_exchange_is_traced_with_even_counts(tmp_path):
    """EP: before each grouped-experts module an all-to-all of the token counts, then of the
    rows, and the rows back after it; the counts evened, every pair of ranks agrees on its rows."""
    traces, evened = _traces([*MOE, "strategy=fsdp", "strategy.expert_parallel_size=2"], tmp_path)
    assert evened and first_difference(traces) is None
    counts = [c for c in traces[0] if c.op == "all_to_all_single" and c.dtypes[0] == "torch.int64"]
    rows = [c for c in traces[0] if c.op == "all_to_all_single" and c.dtypes[0] != "torch.int64"]
    assert counts and len(rows) >= 2 * len(counts)
    tokens = rows[0].shapes[0][0]
    assert all(call.sent == call.received == (tokens // 2, tokens // 2) for call in rows[:2])
    assert agreement_line(traces, "fsdp", evened=evened).endswith(f"; {EVEN_COUNTS}")


@TRACED
def test_context_parallel_all_gathers_keys_and_values_of_its_shard(tmp_path):
    """CP: the batch is cut by the strategy's own hook, so each rank all-gathers the keys and
    values of half the sequence (``[batch, kv heads, seq / 2, head dim]``) in every layer."""
    traces, _ = _traces(["model=llama", "data.batch_size=2", "data.seq_len=16", "strategy=fsdp",
                         "strategy.context_parallel_size=2"], tmp_path)
    assert first_difference(traces) is None
    key_values = [c for c in traces[0] if c.op == "all_gather_into_tensor" and len(c.shapes[0]) == 4]
    assert key_values and all(c.shapes[0][0] == 2 and c.shapes[0][2] == 8 for c in key_values)


def test_an_all_to_all_whose_ranks_disagree_on_rows_is_a_desync():
    """Each rank's tensors may differ in an all-to-all; what rank i sends rank j must be what j
    expects from i."""
    def exchange(sent, received):
        return Collective("all_to_all_single", ((8, 4),), ("torch.float32",), (0, 1), sent, received)

    traces = {0: [exchange((4, 4), (4, 4))], 1: [exchange((4, 4), (4, 4))]}
    assert first_difference(traces) is None
    traces[1] = [exchange((2, 6), (4, 4))]
    assert first_difference(traces) == (
        "the ranks would exchange different numbers of rows in their first training step: collective #0 of the "
        "group of ranks 0, 1 (all_to_all_single) differs (rank 1 sends rank 0 2 rows, rank 0 expects 4)"
    )


def test_a_check_that_traced_nothing_says_so_and_reports_no_agreement(capsys, monkeypatch):
    """A step in which no rank issued a collective compares nothing: said so, never agreement."""
    monkeypatch.setattr(collective_check, "_traced_in_this_process", lambda *args: ({0: [], 1: []}, False))
    code, out, err = check(["preflight.collectives=true", "strategy=ddp", "trainer.devices=2", *SMALL], capsys)
    assert (code, err) == (0, "")
    assert ("litscale: traced no collective in the first step of strategy=ddp: nothing compared (2 ranks on a "
            "fake process group)\n") in out
    assert "same ones" not in out


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
        "error: preflight.collectives=true cannot trace strategy=pipeline: its stages' send/recv pairs are "
        "not traced; set preflight.collectives=false\n",
    )


@pytest.mark.parametrize("strategy", group_options("strategy"))
def test_what_is_traced_is_the_contract_s_answer(strategy):
    """The check asks each strategy's class (``untraced``), keeping no table of names."""
    from litscale.app.checks.safety import locate_target
    from litscale.parallel.contract import contract_value

    cfg = compose_full([f"strategy={strategy}"])
    strategy_class = locate_target(cfg.strategy._target_, "strategy")
    assert collective_check.not_traced_reason(strategy, cfg) == contract_value(strategy_class, "untraced")
    assert (collective_check.not_traced_reason(strategy, cfg) is None) == (
        strategy in ("single", "ddp", "fsdp", "tensor_parallel"))


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


@pytest.mark.full
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
