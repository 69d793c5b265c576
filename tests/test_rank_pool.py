"""The persistent rank pool behind ``run_distributed``: the same results as fresh ranks, the
same workers from call to call, no state carried from one task to the next, and a failing,
hanging or dying rank fails its own test only (the pool is killed and the next call starts a
new one)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import run_distributed

pytestmark = pytest.mark.slow  # every test starts gloo ranks


def _what_a_rank_sees(rank, world_size, scale):
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return {"rank": rank, "world_size": world_size, "sum_of_ranks": total.item(),
            "scaled": torch.ones(3) * scale, "environ": {k: os.environ[k] for k in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")},
            "dtype": torch.get_default_dtype(), "threads": torch.get_num_threads()}


def _pid(rank, world_size):
    dist.barrier()
    return os.getpid()


def _fail_on_rank_1(rank, world_size, how):
    if rank == 1:
        if how == "raise":
            raise ValueError("boom on rank 1")
        sys.exit(3)
    dist.barrier()  # rank 0 waits for rank 1 forever: the pool must not


def _hang_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(600)
    dist.barrier()


def _die_on_rank_1(rank, world_size, how):
    if rank == 1:
        if how == "os._exit":
            os._exit(7)
        os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(600)


def _change_everything(rank, world_size, directory):
    first_draw = torch.randn(2)
    os.environ["LITSCALE_POOL_PROBE"] = "set"
    os.environ.pop("MASTER_ADDR")
    os.chdir(directory)
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(2)
    signal.signal(signal.SIGUSR1, lambda *_: None)
    warnings.simplefilter("error")
    return first_draw


def _observe_everything(rank, world_size):
    warnings.warn("a plain UserWarning", stacklevel=1)  # would raise under the last task's filter
    return {"draw": torch.randn(2), "probe": os.environ.get("LITSCALE_POOL_PROBE"), "cwd": os.getcwd(),
            "dtype": torch.get_default_dtype(), "deterministic": torch.are_deterministic_algorithms_enabled(),
            "threads": torch.get_num_threads(), "sigusr1": signal.getsignal(signal.SIGUSR1),
            "pid": os.getpid()}


def _sum_on_a_mesh_of_its_own(rank, world_size, groups_before):
    """A DTensor op on a mesh over a new group, after ``groups_before`` other groups: the
    group's name is its index, so it differs from one such task to the next."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial

    everyone = list(range(world_size))
    for _ in range(groups_before):
        dist.new_group(everyone)
    mesh = DeviceMesh.from_group(dist.new_group(everyone), "cpu", mesh_dim_names=("tp",))
    partial = DTensor.from_local(torch.tensor([rank + 1.0]), mesh, [Partial()])
    return (partial * 2).full_tensor()  # the product's mesh comes from sharding propagation


def _leave_a_thread(rank, world_size):
    threading.Thread(target=time.sleep, args=(30,), daemon=True, name="left-behind").start()
    return os.getpid()


@pytest.mark.timeout(200)
def test_pool_results_equal_fresh_ranks_and_the_workers_are_reused():
    pooled = run_distributed(_what_a_rank_sees, 2, 2.0, timeout=90)
    fresh = run_distributed(_what_a_rank_sees, 2, 2.0, timeout=90, fresh=True)
    for ours, theirs in zip(pooled, fresh, strict=True):
        assert torch.equal(ours.pop("scaled"), theirs.pop("scaled"))
        assert ours == theirs
    assert [r["sum_of_ranks"] for r in pooled] == [1.0, 1.0]
    first, second = run_distributed(_pid, 2, timeout=90), run_distributed(_pid, 2, timeout=90)
    assert first == second and len(set(first)) == 2 and os.getpid() not in first


@pytest.mark.soak
@pytest.mark.timeout(200)
@pytest.mark.parametrize("how", ["raise", "sys.exit"])
def test_a_failing_rank_fails_with_its_traceback_and_the_next_call_succeeds(how):
    before = run_distributed(_pid, 2, timeout=90)
    with pytest.raises(AssertionError, match=r"^rank failures: \{") as failed:
        run_distributed(_fail_on_rank_1, 2, how, timeout=60)
    # (rank 0 may fail too: its barrier's peer went away)
    assert "1: 'Traceback" in str(failed.value)
    assert ("ValueError: boom on rank 1" if how == "raise" else "SystemExit: 3") in str(failed.value)
    after = run_distributed(_pid, 2, timeout=90)
    assert set(after).isdisjoint(before)  # a new pool: the old one was killed
    assert not any(_is_running(pid) for pid in before)


@pytest.mark.soak
@pytest.mark.timeout(200)
def test_a_hanging_rank_fails_at_its_deadline_and_the_next_call_succeeds():
    before = run_distributed(_pid, 2, timeout=90)
    # The deadline's own message; a pool that let rank 1 sleep on (600 s) would meet this
    # test's timeout instead.
    with pytest.raises(AssertionError, match=r"ranks did not finish within 3 s \(a hang\): ranks \[0, 1\] still running"):
        run_distributed(_hang_on_rank_1, 2, timeout=3)
    assert not any(_is_running(pid) for pid in before)
    assert len(run_distributed(_pid, 2, timeout=90)) == 2


@pytest.mark.full
@pytest.mark.timeout(200)
@pytest.mark.parametrize(("how", "said"), [pytest.param("os._exit", "exited with code 7", marks=pytest.mark.soak),
                                           ("segfault", "killed by SIGSEGV")])  # soak: CI's time
def test_a_rank_that_dies_fails_at_once_and_the_next_call_succeeds(how, said):
    before = run_distributed(_pid, 2, timeout=90)
    # A deadline past this test's own timeout: a pool that waited for it, or for rank 0's
    # sleep, rather than end the call at rank 1's death, fails the test by its timeout.
    with pytest.raises(AssertionError, match=rf"rank failures: \{{1: \"the rank's process {said} before replying"):
        run_distributed(_die_on_rank_1, 2, how, timeout=900)
    assert not any(_is_running(pid) for pid in before)
    assert len(run_distributed(_pid, 2, timeout=90)) == 2


@pytest.mark.timeout(200)
def test_no_state_leaks_from_one_task_into_the_next(tmp_path):
    first_draws = run_distributed(_change_everything, 2, str(tmp_path), timeout=90)
    for rank, seen in enumerate(run_distributed(_observe_everything, 2, timeout=90)):
        assert torch.equal(seen.pop("draw"), first_draws[rank])  # seeds reset: the same first draw
        assert seen.pop("pid") > 0
        assert seen == {"probe": None, "cwd": os.getcwd(), "dtype": torch.float32, "deterministic": False,
                        "threads": 1, "sigusr1": signal.SIG_DFL}


@pytest.mark.timeout(200)
def test_a_mesh_of_a_later_task_uses_its_own_groups():
    # The first task's product is cached with its mesh, equal to the second's (same ranks,
    # shape and names) but holding group "9": the second, with groups up to "1", once failed
    # with "Could not resolve the process group registered under the name 9".
    for groups_before in (8, 0):
        assert [total.item() for total in run_distributed(_sum_on_a_mesh_of_its_own, 2, groups_before,
                                                          timeout=90)] == [6.0, 6.0]


@pytest.mark.soak
@pytest.mark.timeout(200)
def test_a_task_that_leaves_a_thread_running_retires_its_workers():
    with pytest.warns(UserWarning, match=r"rank pool of 2 restarted: the task left threads running "
                                         r"\{0: \['left-behind'\], 1: \['left-behind'\]\}"):
        before = run_distributed(_leave_a_thread, 2, timeout=90)
    assert set(run_distributed(_pid, 2, timeout=90)).isdisjoint(before)


def _is_running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not a zombie) of this machine."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
