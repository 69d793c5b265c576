"""Running a test function on several gloo ranks, with a free port and a deadline.

``run_distributed(fn, world_size, *args, **kwargs)`` calls ``fn(rank, world_size, *args,
**kwargs)`` in each of ``world_size`` processes with the default process group initialised
(gloo, CPU), and returns the list of per-rank return values. A rank that raises fails the test with its traceback; a
rank that hangs fails it after ``timeout`` seconds; every process group is destroyed.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, fn, args, kwargs, results, timeout):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    try:
        # Plain pickle, not the multiprocessing pickler: that one sends a tensor as a handle to
        # this process's shared memory, which the test process may not open before this
        # process has exited ("received 0 items of ancdata" under load).
        results[rank] = ("ok", pickle.dumps(fn(rank, world_size, *args, **kwargs)))
    except BaseException:
        results[rank] = ("error", traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 120, **kwargs) -> list:
    """``[fn(rank, world_size, *args, **kwargs) for each rank]``, computed on ``world_size``
    gloo ranks.

    ``fn`` must be a module-level function (it is pickled into spawned processes), and its
    arguments and return values picklable (tensors are fine).
    """
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    context = mp.start_processes(_worker, nprocs=world_size, join=False, start_method="spawn",
                                 args=(world_size, free_port(), fn, args, kwargs, results, timeout))
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise AssertionError(f"ranks did not finish within {timeout} s (a hang)")
    except mp.ProcessRaisedException as error:
        failures = {r: v[1] for r, v in results.items() if v[0] == "error"}
        raise AssertionError(f"rank failures: {failures or error}") from None
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [pickle.loads(results[rank][1]) for rank in range(world_size)]
