"""Compression hooks on several gloo ranks: attached to CPU DDP and computing the average of
the ranks' decoded gradients; top-k 1% + error feedback against dense training through
``train.py``; per-rank state gathered into checkpoints and a resumed run continuing exactly.
The ``train.py`` runs are on the rank pool: their claims are what a run computes, not how it
starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers.cli import comm_metrics, explain, final_weights, summaries
from helpers.distributed import run_distributed
from helpers.inprocess import train_on_pool

from litscale import compression
from litscale.callbacks.communication import CommunicationCallback

pytestmark = pytest.mark.slow  # every test here starts ranks or train.py

LOSSY = {
    "topk": lambda: compression.topk(ratio=0.05),
    "qsgd": lambda: compression.qsgd(levels=3, block_size=64, error_feedback=True),
    "terngrad": lambda: compression.terngrad(block_size=64, error_feedback=True),
    "signsgd": lambda: compression.signsgd(block_size=64),
}
ALL = {**LOSSY, "fp16": compression.fp16, "bf16": compression.bf16,
       "powersgd": lambda: compression.powersgd(rank=2, start_iteration=2)}


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 32, generator=torch.Generator().manual_seed(100 * step + rank))


def _one_step_per_hook(rank: int, world_size: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    results = {}
    for name, factory in ALL.items():
        hook = factory()
        model = DistributedDataParallel(_net())
        hook.register(model)
        local = _net()  # the same weights, no communication: this rank's own gradient
        for net in (model, local):
            net(_batch(rank, 0)).square().mean().backward()
        synced = [p.grad for p in model.parameters()]
        expected = None
        if name in LOSSY:
            # What this rank sent, decoded: its gradient minus the residual error feedback kept.
            residuals = hook.state.residuals.per_parameter()
            sent = [p.grad - residuals[n].view_as(p) for (n, p) in local.named_parameters()]
            expected = [s.clone() for s in sent]
            for tensor in expected:
                dist.all_reduce(tensor)
                tensor /= world_size
        elif name in ("fp16", "bf16"):
            dtype = torch.float16 if name == "fp16" else torch.bfloat16
            expected = [p.grad.to(dtype) for p in local.parameters()]
            for tensor in expected:
                dist.all_reduce(tensor)
            expected = [(t / world_size).float() for t in expected]
        results[name] = {"hook": model._get_ddp_logging_data().get("comm_hook"),
                         "synced": synced, "expected": expected,
                         "sent": hook.state.bytes_sent, "dense": hook.state.dense_bytes}
    return results


@pytest.mark.timeout(120)
def test_hooks_are_attached_on_cpu_ddp_and_average_what_ranks_sent():
    ranks = run_distributed(_one_step_per_hook, 2, timeout=100)
    for name, factory in ALL.items():
        first, second = ranks[0][name], ranks[1][name]
        assert first["hook"] == second["hook"] == factory().hook.__qualname__, name
        for a, b in zip(first["synced"], second["synced"], strict=True):
            assert torch.equal(a, b), name  # every rank ends with the same gradient
        if first["expected"] is not None:
            for actual, expected in zip(first["synced"], first["expected"], strict=True):
                torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=name)
        assert first["dense"] > 0 and 0 < first["sent"] <= first["dense"], name


def _checkpoint_round_trip(rank: int, world_size: int, name: str) -> list[list[torch.Tensor]]:
    """Train 2 steps, save via the callback, train 3 more; a fresh DDP model and hook loaded
    from the saved state train the same 3 steps: both gradients sequences are returned."""
    from torch.nn.parallel import DistributedDataParallel

    def steps(model, first_step: int, count: int) -> list[torch.Tensor]:
        optimizer, grads = torch.optim.SGD(model.parameters(), lr=0.1), []
        for step in range(first_step, first_step + count):
            optimizer.zero_grad()
            model(_batch(rank, step)).square().mean().backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
            optimizer.step()
        return grads

    hook = LOSSY[name]() if name in LOSSY else ALL[name]()
    model = DistributedDataParallel(_net())
    hook.register(model)
    steps(model, 0, 2)
    saved = CommunicationCallback(compression=hook).state_dict()  # a collective: all ranks
    weights = {k: v.clone() for k, v in model.module.state_dict().items()}
    expected = steps(model, 2, 3)
    resumed_hook = LOSSY[name]() if name in LOSSY else ALL[name]()
    CommunicationCallback(compression=resumed_hook).load_state_dict(saved)
    net = _net()
    net.load_state_dict(weights)
    resumed = DistributedDataParallel(net)
    resumed_hook.register(resumed)
    return [expected, steps(resumed, 2, 3), len(saved["ranks"])]


def _checkpoint_round_trips(rank: int, world_size: int, names: list[str]) -> dict:
    return {name: _checkpoint_round_trip(rank, world_size, name) for name in names}


@pytest.mark.timeout(150)
def test_checkpointed_state_of_every_rank_resumes_exactly():
    names = ["qsgd", "topk", "signsgd", "powersgd"]
    for rank_results in run_distributed(_checkpoint_round_trips, 2, names, timeout=130):
        for name in names:
            expected, resumed, saved_ranks = rank_results[name]
            assert saved_ranks == 2  # residuals differ per rank: each rank's are kept
            for a, b in zip(expected, resumed, strict=True):
                torch.testing.assert_close(b, a, rtol=1.3e-6, atol=1e-5, msg=name)


# --- PowerSGD against its math ------------------------------------------------------------

POWERSGD_RANK, WARM_UP, COMPRESSED_STEPS = 4, 2, 12
# Each rank's gradient of the weight matrix: fixed, so the mean M is too. M's spectrum has a
# wide gap after the 4th singular value, so warm-started power iteration converges in a few steps.
SINGULAR_VALUES = [10.0, 8.0, 6.0, 4.0] + [0.4 / (i + 1) for i in range(28)]


def _rank_gradient(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's gradient, the mean over 2 ranks): the mean is U diag(s) V^T, and rank r's
    gradient is the mean plus (-1)^r times a fixed noise matrix, so the two average to it."""
    generator = torch.Generator().manual_seed(7)
    u, _ = torch.linalg.qr(torch.randn(64, 32, generator=generator))
    v, _ = torch.linalg.qr(torch.randn(32, 32, generator=generator))
    mean = u @ torch.diag(torch.tensor(SINGULAR_VALUES)) @ v.T
    noise = torch.randn(64, 32, generator=generator)
    return mean + (noise if rank == 0 else -noise), mean


def _powersgd_steps(rank: int, world_size: int) -> dict:
    """DDP with PowerSGD (no error feedback: each step compresses the same mean) on a layer
    whose gradient is ``_rank_gradient(rank)`` (loss = <W, G_r>) and a bias that gets a dense
    all-reduce; the synced gradients of each step."""
    from torch.nn.parallel import DistributedDataParallel

    gradient, _ = _rank_gradient(rank)
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 64)
    model = DistributedDataParallel(layer)
    compression.powersgd(rank=POWERSGD_RANK, start_iteration=WARM_UP, error_feedback=False,
                         min_compression_rate=1.0).register(model)
    bias_gradient = torch.full((64,), float(rank))
    synced = []
    for _ in range(WARM_UP + COMPRESSED_STEPS):
        model.zero_grad()
        x = torch.zeros(1, 32)  # the output is the bias: <W, G_r> carries the weight's gradient
        ((layer.weight * gradient).sum() + (model(x)[0] * bias_gradient).sum()).backward()
        synced.append((layer.weight.grad.clone(), layer.bias.grad.clone()))
    return {"synced": synced}


@pytest.mark.timeout(120)
def test_powersgd_after_warm_up_is_the_rank_r_approximation_of_the_mean_gradient():
    """torch's PowerSGD through litscale's hook, against the math (Vogels et al. 2019): during
    warm-up the dense mean; then at every step a projection of the mean gradient M onto a
    rank-4 subspace (P P^T M, P orthonormal: one step of subspace iteration), converging under
    warm start to the best rank-4 approximation, computed here by SVD."""
    _, mean = _rank_gradient(0)
    u, s, vh = torch.linalg.svd(mean, full_matrices=False)
    best = u[:, :POWERSGD_RANK] @ torch.diag(s[:POWERSGD_RANK]) @ vh[:POWERSGD_RANK]
    for rank_result in run_distributed(_powersgd_steps, 2, timeout=100):
        steps = rank_result["synced"]
        for weight, _ in steps[:WARM_UP]:
            torch.testing.assert_close(weight, mean, rtol=1e-5, atol=1e-5)
        for step, (_, bias) in enumerate(steps):  # 1-D: all-reduced dense at every step
            torch.testing.assert_close(bias, torch.full((64,), 0.5), msg=f"bias at step {step}")
        for step, (weight, _) in enumerate(steps[WARM_UP:], start=WARM_UP):
            assert torch.linalg.matrix_rank(weight, atol=1e-4) == POWERSGD_RANK, step
            basis = torch.linalg.svd(weight, full_matrices=False)[0][:, :POWERSGD_RANK]
            torch.testing.assert_close(weight, basis @ basis.T @ mean, rtol=1e-4, atol=1e-4,
                                       msg=lambda m, step=step: f"step {step} is not P P^T M: {m}")
        torch.testing.assert_close(steps[-1][0], best, rtol=1e-4, atol=1e-4)
        assert (steps[WARM_UP][0] - best).abs().max() > 1e-3  # it converged: it did not start there


POWERSGD_ON_MANY_BUCKETS = """
import time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from litscale.compression import powersgd
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)]),
                                bucket_cap_mb=0.01)
powersgd(rank=2, start_iteration=2).register(model)
for _ in range(50):
    model(torch.randn(8, 64)).square().mean().backward()
# As helpers.distributed.destroy_process_groups: gloo's threads get the GIL to free the hook's
# callbacks before the group goes, or the process may abort; the model (its reducer holds the
# group) goes first.
del model
time.sleep(0.05)
dist.destroy_process_group()
print("done")
"""


@pytest.mark.full
@pytest.mark.timeout(150)
def test_powersgd_on_gloo_with_many_buckets_does_not_deadlock():
    """torch's PowerSGD hook blocks gloo's worker threads while buckets are in flight; before
    litscale finished each bucket on gloo, this run hung every time. In a subprocess: a hang
    inside a C++ wait cannot be interrupted in this one."""
    process = subprocess.run([sys.executable, "-c", POWERSGD_ON_MANY_BUCKETS], capture_output=True,
                             text=True, timeout=120)
    assert process.returncode == 0 and process.stdout.strip() == "done", process.stderr[-2000:]


# --- end to end through train.py ----------------------------------------------------------

SHORT_RUN = (
    "strategy=ddp", "trainer.devices=2", "trainer.accelerator=cpu", "data.seq_len=32",
    "data.max_bytes=400000", "data.batch_size=8", "trainer.limit_val_batches=4",
    "trainer.enable_progress_bar=false", "optimizer=sgd", "optimizer.lr=0.3",
)


@pytest.mark.soak  # two runs of 300 steps
@pytest.mark.timeout(900)
def test_topk_one_percent_with_error_feedback_ends_within_5_percent_of_dense(tmp_path):
    """The compression study's setting and its seed 0 (experiments/compression: 300 steps,
    where top-k 1% + EF ends +0.7% from dense over 3 seeds; at 30 or 60 steps it had not caught
    up and the goal did not hold)."""
    steps = ("trainer.max_steps=300", "trainer.val_check_interval=300", "trainer.log_every_n_steps=5",
             "trainer.limit_val_batches=8", "seed=0", "callbacks.model_checkpoint.save_top_k=0")
    for option in ("none", "topk"):
        process = train_on_pool(*SHORT_RUN, *steps, f"compression={option}", f"name={option}",
                                outputs=tmp_path, devices=2, timeout=800)
        assert process.returncode == 0, explain(process)
    dense, topk = summaries(tmp_path)
    assert dense["steps"] == topk["steps"] == 300
    assert topk["val/loss"] <= 1.05 * dense["val/loss"], (topk["val/loss"], dense["val/loss"])
    assert topk["val/loss"] < 0.7 * topk["val/loss_initial"]  # it trained, not just stayed put
    last = comm_metrics(topk)[-1]
    assert last["comm/compression_ratio"] >= 40
    assert last["comm/dense_bytes_per_step"] / last["comm/bytes_per_step"] >= 40
    assert last["comm/dense_bytes_per_step"] == 4 * dense["num_params"]  # fp32 gradients


@pytest.mark.full  # make test-full: keeps make test within its time budget
@pytest.mark.timeout(300)
def test_resumed_powersgd_run_continues_exactly(tmp_path):
    """10 steps straight vs 5 steps, then a resume from that checkpoint to step 10 (epochs
    of 5 batches, so the data order replays too)."""
    run = (*SHORT_RUN, "compression=powersgd", "compression.start_iteration=2", "optimizer.lr=0.1",
           "+trainer.limit_train_batches=5", "trainer.val_check_interval=5",
           "callbacks.model_checkpoint.save_top_k=-1", "logger=none")
    straight = train_on_pool(*run, "trainer.max_steps=10", "name=straight", outputs=tmp_path, devices=2)
    assert straight.returncode == 0, explain(straight)
    checkpoint = Path(summaries(tmp_path)[0]["output_dir"]) / "checkpoints" / "step000005.ckpt"
    state = torch.load(checkpoint, weights_only=True)["callbacks"]["CommunicationCallback"]
    assert [s["iteration"] for s in state["ranks"]] == [5, 5] and state["ranks"][0]["low_rank"]
    resumed = train_on_pool(*run, "trainer.max_steps=10", f"ckpt_path={checkpoint}", "name=resumed",
                            outputs=tmp_path, devices=2)
    assert resumed.returncode == 0, explain(resumed)
    expected, actual = (final_weights(s) for s in summaries(tmp_path))
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=1.3e-6, atol=1e-5, msg=key)


@pytest.mark.soak  # CI's time: test_compression.py checks the mean error feedback moved, in-process
@pytest.mark.timeout(300)
def test_a_top_k_run_saved_on_two_ranks_resumes_on_one_with_the_mean_error_feedback(tmp_path):
    """A move between compressed layouts end to end: each rank of the new world takes the
    saved ranks' mean residuals (``test_compression.py`` checks the mean itself)."""
    run = (*SHORT_RUN, "compression=topk", "compression.error_feedback=true", "+trainer.limit_train_batches=5",
           "trainer.val_check_interval=5", "callbacks.model_checkpoint.save_top_k=-1", "logger=none")
    saved = train_on_pool(*run, "trainer.max_steps=5", "name=saved", outputs=tmp_path, devices=2)
    assert saved.returncode == 0, explain(saved)
    checkpoint = Path(summaries(tmp_path)[0]["output_dir"]) / "checkpoints" / "step000005.ckpt"
    state = torch.load(checkpoint, weights_only=True)["callbacks"]["CommunicationCallback"]
    assert len(state["ranks"]) == 2 and all(s["residuals"] for s in state["ranks"])
    moved = train_on_pool(*run, "trainer.max_steps=10", "trainer.devices=1", f"ckpt_path={checkpoint}", "name=moved",
                          outputs=tmp_path, devices=1)
    assert moved.returncode == 0, explain(moved)
    assert ("compression state was saved by 2 ranks and is resumed on 1: each rank's error feedback starts from "
            "the saved ranks' mean") in moved.stderr
    assert summaries(tmp_path)[-1]["steps"] == 10
