"""Local SGD / DiLoCo: the synchronisation schedule and the outer Nesterov step against
their definitions on 2 gloo ranks; parity with a single process when synchronising every
step; DiLoCo end to end through ``train.py``; config errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.cli import comm_metrics, explain, final_weights, summaries
from helpers.configs import compose_job
from helpers.distributed import run_distributed
from helpers.inprocess import train_on_pool

from litscale.app.checks.validation import ConfigError, validate
from litscale.compression import CommHook
from litscale.strategies.local_sgd_state import LocalSGDState, local_sgd_hook


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _gathered_mean(tensor: torch.Tensor) -> torch.Tensor:
    copy = tensor.clone()
    dist.all_reduce(copy)
    return copy / dist.get_world_size()


def _schedule(rank: int, world_size: int, outer_optimizer: str) -> dict:
    """7 steps, warm-up 1, sync every 3: record what each step did to the parameters."""
    from torch.nn.parallel import DistributedDataParallel

    state = LocalSGDState(sync_every=3, warmup_steps=1, outer_optimizer=outer_optimizer,
                          outer_lr=0.7, outer_momentum=0.9)
    model = DistributedDataParallel(_net())
    CommHook(hook=local_sgd_hook, state=state).register(model)
    params = list(model.module.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    reference_outer, checks = None, []
    for step in range(7):
        local = _net()
        local.load_state_dict(model.module.state_dict())
        batch = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        local(batch).square().mean().backward()
        optimizer.zero_grad()
        model(batch).square().mean().backward()
        own_gradient = _flat(p.grad for p in local.parameters())
        synced_gradient = _flat(p.grad for p in params)
        optimizer.step()
        before_sync = _flat(params)
        if step == 0:  # the local phase begins after warm-up: DiLoCo's first anchor
            anchor = before_sync.clone()
            if outer_optimizer == "nesterov":
                reference_outer = torch.optim.SGD([anchor], lr=0.7, momentum=0.9, nesterov=True)
        expected = before_sync
        if step in (3, 6):  # 3 and 6 local steps after the warm-up step
            expected = _gathered_mean(before_sync)
            if reference_outer is not None:
                anchor.grad = anchor - expected
                reference_outer.step()
                expected = anchor.detach().clone()
        state.after_optimizer_step(params)
        checks.append({
            "gradient_was_averaged": torch.allclose(synced_gradient, _gathered_mean(own_gradient)),
            "gradient_is_own": torch.equal(synced_gradient, own_gradient),
            "params": _flat(params), "expected": expected,
        })
    return {"checks": checks, "bytes": state.bytes_sent, "state": state.state_dict(),
            "param_bytes": sum(p.numel() * 4 for p in params), "dense": state.dense_bytes}


def _schedules(rank: int, world_size: int) -> dict:
    return {outer: _schedule(rank, world_size, outer) for outer in ("none", "nesterov")}


@pytest.fixture(scope="module")
def schedules():
    return run_distributed(_schedules, 2, timeout=150)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("outer_optimizer", ["none", "nesterov"])
def test_parameters_synchronise_every_period_with_the_outer_step(outer_optimizer, schedules):
    ranks = [rank_results[outer_optimizer] for rank_results in schedules]
    for result in ranks:
        checks = result["checks"]
        assert checks[0]["gradient_was_averaged"]  # warm-up: ordinary DDP
        for check in checks[1:]:  # local steps: no gradient exchange at all
            assert check["gradient_is_own"] and not check["gradient_was_averaged"]
        for check in checks:
            torch.testing.assert_close(check["params"], check["expected"], rtol=1.3e-6, atol=1e-6)
        # warm-up all-reduces the gradients once; each of the 2 syncs sends the parameters once
        assert result["bytes"] == result["param_bytes"] * 3
        assert result["dense"] == result["param_bytes"] * 7
    # after a sync every rank holds the same parameters; in between they drift apart
    assert torch.equal(ranks[0]["checks"][6]["params"], ranks[1]["checks"][6]["params"])
    assert not torch.equal(ranks[0]["checks"][5]["params"], ranks[1]["checks"][5]["params"])
    saved = ranks[0]["state"]
    assert saved["steps"] == 7 and (saved["outer"] is not None) == (outer_optimizer == "nesterov")


def test_outer_state_round_trips():
    state = LocalSGDState(sync_every=2, warmup_steps=0, outer_optimizer="nesterov", outer_lr=0.5,
                          outer_momentum=0.9)
    params = [torch.nn.Parameter(torch.randn(3, 2))]
    state.start_local_phase(params)
    state.outer.param_groups[0]["params"][0].grad = torch.ones(3, 2)
    state.outer.step()
    saved = state.state_dict()
    restored = LocalSGDState(sync_every=2, warmup_steps=0, outer_optimizer="nesterov",
                             outer_lr=0.5, outer_momentum=0.9)
    restored.load_state_dict(saved)
    restored._restore_outer(params)
    assert torch.equal(restored.outer.param_groups[0]["params"][0], saved["outer"]["anchor"][0])
    momentum = restored.outer.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(momentum, torch.ones(3, 2))


# --- through train.py ---------------------------------------------------------------------

RUN = ("optimizer=sgd", "optimizer.lr=0.05", "trainer.max_steps=6", "trainer.val_check_interval=6",
       "trainer.limit_val_batches=2", "trainer.accelerator=cpu", "data.seq_len=32",
       "data.max_bytes=400000", "trainer.enable_progress_bar=false", "trainer.gradient_clip_val=null",
       "trainer.log_every_n_steps=3")


@pytest.mark.full  # make test-full: keeps make test within its time budget
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sync_every_step_matches_single_process_of_same_global_batch(tmp_path):
    """Averaging parameters after every SGD+momentum step is averaging the gradients
    (momentum and weight decay are linear): the same weights as one process of the same
    global batch. (Gradient clipping is off: it is not linear.)"""
    single = train_on_pool(*RUN, "data.batch_size=8", "name=single", outputs=tmp_path)
    assert single.returncode == 0, explain(single)
    local = train_on_pool(*RUN, "data.batch_size=4", "strategy=local_sgd", "strategy.sync_every=1",
                          "trainer.devices=2", "name=local", outputs=tmp_path, devices=2)
    assert local.returncode == 0, explain(local)
    reference, averaged = summaries(tmp_path)
    expected, actual = final_weights(reference), final_weights(averaged)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1.3e-6, atol=1e-5, msg=name)


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_diloco_trains_and_sends_parameters_once_per_period(tmp_path):
    diloco = train_on_pool(*RUN, "data.batch_size=4", "strategy=local_sgd", "strategy.sync_every=3",
                           "strategy.outer_optimizer=nesterov", "trainer.devices=2", "name=diloco",
                           outputs=tmp_path, devices=2)
    assert diloco.returncode == 0, explain(diloco)
    (outer,) = summaries(tmp_path)
    assert outer["val/loss"] < outer["val/loss_initial"]
    last = comm_metrics(outer)[-1]
    assert last["comm/compression_ratio"] == pytest.approx(3.0)  # parameters every 3 steps
    assert last["comm/bytes_per_step"] == pytest.approx(4 * outer["num_params"] / 3)


@pytest.mark.parametrize(("overrides", "message"), [
    (["strategy=local_sgd", "compression=topk"],
     "compression=topk is not supported with strategy=local_sgd"),
    (["strategy=local_sgd", "strategy.outer_optimizer=lamb"],
     "strategy.outer_optimizer='lamb' is not valid: expected one of: 'none', 'nesterov', 'sgd', 'adam'"),
    (["strategy=local_sgd", "strategy.sync_every=0"],
     "strategy.sync_every=0 is not valid: expected an int >= 1"),
])
def test_bad_local_sgd_values_are_one_line_errors(overrides, message, tmp_path, outputs_root):
    cfg, choices = compose_job(overrides, tmp_path / "run")
    with pytest.raises(ConfigError) as error:
        validate(cfg, choices=choices)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
