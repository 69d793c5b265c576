"""Running a test function on several gloo ranks, with a deadline, on a persistent rank pool.

``run_distributed(fn, world_size, *args, **kwargs)`` calls ``fn(rank, world_size, *args,
**kwargs)`` in each of ``world_size`` processes with the default process group initialised
(gloo, CPU), and returns the list of per-rank return values. A rank that raises fails the test
with its traceback; a rank that hangs fails it after ``timeout`` seconds; every process group
is destroyed.

The ranks are long-lived workers (PyTorch's ``MultiProcContinuousTest`` pattern): one pool per
world size, started on first use and kept for the session, so torch and Lightning are imported
once per worker instead of once per call (4-7 s on a 2-core machine). Each call is a task: a
fresh store and process group, and the state a fresh interpreter would have (seeds, default
dtype, deterministic mode, threads, environment, working directory, warning filters, signal
handlers) set before it and put back after it. A task that fails, hangs or kills a worker
kills the whole pool (each worker's process group) and the next call starts a new one.
``fresh=True`` or ``LITSCALE_TEST_FRESH_RANKS=1`` runs on new interpreters instead.

``destroy_process_groups()`` is the teardown every group here gets, and that a test's own
one-rank group should get too (it waits for gloo's threads: see its note).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta
from multiprocessing.connection import wait

import torch.distributed as dist
import torch.multiprocessing as mp

FRESH_RANKS_ENV = "LITSCALE_TEST_FRESH_RANKS"
# Every task starts its random generators (torch, random, numpy) from this seed. (A new
# interpreter seeds torch's at random: a task that draws unseeded was never reproducible.)
TASK_SEED = 0
# After a rank fails, how long to wait for the others' tracebacks before killing them all.
FAILURE_GRACE_S = 1.0
# How long gloo's threads get to release comm hooks' Python callbacks before a group is
# destroyed (see ``destroy_process_groups``): 500 repetitions under load, none aborted.
HOOK_TAIL_S = 0.05
SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP",
                                                   "SIGALRM") if hasattr(signal, name))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_distributed(fn, world_size: int, *args, timeout: float = 120, fresh: bool = False,
                    **kwargs) -> list:
    """``[fn(rank, world_size, *args, **kwargs) for each rank]``, computed on ``world_size``
    gloo ranks.

    ``fn`` must be a module-level function (it is pickled by reference into the ranks), and its
    arguments and return values picklable (tensors are fine). ``timeout`` covers starting the
    ranks when none are running. ``fresh=True`` runs on new interpreters, for a test that needs
    its own (one that kills a rank, or must see a first import).
    """
    if fresh or os.environ.get(FRESH_RANKS_ENV) == "1":
        return _run_fresh(fn, world_size, args, kwargs, timeout)
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive():  # a worker may have died between tasks (OOM killer)
        shutdown_pools(world_size)
        pool = _POOLS[world_size] = _RankPool(world_size)
    try:
        return pool.run(fn, args, kwargs, timeout)
    except BaseException:
        # Failed, hung, or interrupted (pytest-timeout, Ctrl-C) mid-task: the workers may be
        # stuck in a collective or hold broken state, so none of them serves another test.
        shutdown_pools(world_size)
        raise


@contextlib.contextmanager
def one_rank_group():
    """A one-rank gloo group on an in-memory store of its own, destroyed however the block ends
    (``destroy_process_groups`` says how)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        destroy_process_groups()


def destroy_process_groups() -> None:
    """Destroy every process group, once gloo's threads are done with Python.

    NOTE: a gloo thread completes a DDP comm hook's future, then frees the hook's Python
    callback (which needs the GIL) after the caller has moved on. If the group was destroyed in
    between, the callback's closure may hold the last reference to it: the gloo thread frees
    the group, joins itself, and the process aborts ("terminate called after throwing an
    instance of 'std::system_error' ... Resource deadlock avoided"); and a group freed later by
    a thread holding the GIL waits forever for a gloo thread waiting for the GIL. Both reproduce
    in a loop of the one-rank fixture under load (tests/README.md). So the GIL is released for
    ``HOOK_TAIL_S`` first: those threads finish while the group is alive, and whoever frees it
    later joins idle threads.

    Through DeepSpeed when it is in use: its teardown also drops the groups it cached
    (``deepspeed.utils.groups``), which a later task would find dead.
    """
    time.sleep(HOOK_TAIL_S)
    deepspeed_comm = sys.modules.get("deepspeed.comm.comm")
    if deepspeed_comm is not None and deepspeed_comm.is_initialized():
        deepspeed_comm.destroy_process_group()
    if dist.is_initialized():
        dist.destroy_process_group()


# --- the pool, on the test process's side ---------------------------------------------------

_POOLS: dict[int, _RankPool] = {}


def shutdown_pools(world_size: int | None = None) -> None:
    """Kill the pool of ``world_size`` ranks (every pool without one); the next call restarts it."""
    for size in [world_size] if world_size is not None else list(_POOLS):
        pool = _POOLS.pop(size, None)
        if pool is not None:
            pool.close()


atexit.register(shutdown_pools)  # tests/conftest.py also calls it at the session's end


class _RankPool:
    """``world_size`` spawned workers, rank ``r`` always served by worker ``r``, each reached
    through its own pipe; a worker's sentinel tells at once when it has died."""

    def __init__(self, world_size: int) -> None:
        context = mp.get_context("spawn")
        self.world_size = world_size
        self.connections, self.processes = [], []
        for rank in range(world_size):
            ours, theirs = context.Pipe()
            process = context.Process(target=_serve, args=(rank, world_size, theirs),
                                      name=f"rank-pool-{world_size}-{rank}")
            process.start()
            theirs.close()
            self.connections.append(ours)
            self.processes.append(process)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def alive(self) -> bool:
        return all(process.is_alive() for process in self.processes)

    def run(self, fn, args, kwargs, timeout: float) -> list:
        # The store lives here, on a port the OS picked for it: no race for a free port, and
        # it outlives any rank. Ranks find it through MASTER_ADDR/MASTER_PORT, as before.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout))
        task = pickle.dumps((fn, args, kwargs, store.port, timeout))
        deadline = time.monotonic() + timeout
        for connection in self.connections:
            connection.send_bytes(task)
        replies = self._collect(deadline)
        del store
        failures = {rank: value for rank, (status, value, _) in sorted(replies.items()) if status != "ok"}
        if failures or len(replies) < self.world_size:
            shutdown_pools(self.world_size)
            if failures:
                raise AssertionError(f"rank failures: {failures}")
            missing = sorted(set(range(self.world_size)) - set(replies))
            raise AssertionError(f"ranks did not finish within {timeout} s (a hang): "
                                 f"ranks {missing} still running")
        if any(left for _, _, left in replies.values()):
            # A task left threads running: results stand, but no later task should share a
            # process with them.
            left = {rank: left for rank, (_, _, left) in sorted(replies.items()) if left}
            warnings.warn(f"rank pool of {self.world_size} restarted: the task left threads running "
                          f"{left}", stacklevel=3)
            shutdown_pools(self.world_size)
        return [pickle.loads(replies[rank][1]) for rank in range(self.world_size)]

    def _collect(self, deadline: float) -> dict[int, tuple]:
        """Each rank's reply ``(status, value, threads left)`` until all are in, a rank fails
        (then the others get ``FAILURE_GRACE_S`` to report too) or the deadline passes."""
        replies: dict[int, tuple] = {}
        waiting = {connection: rank for rank, connection in enumerate(self.connections)}
        waiting.update({process.sentinel: rank for rank, process in enumerate(self.processes)})
        while any(rank not in replies for rank in waiting.values()):
            if any(status != "ok" for status, _, _ in replies.values()):
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for ready in wait([w for w, rank in waiting.items() if rank not in replies], remaining):
                rank = waiting[ready]
                if rank in replies:  # its pipe and its sentinel both woke up: a death
                    continue
                connection = self.connections[rank]
                if ready is connection or connection.poll():  # a reply, even from a worker that then died
                    try:
                        replies[rank] = pickle.loads(connection.recv_bytes())
                        continue
                    except (EOFError, OSError):
                        pass
                replies[rank] = ("died", self._death(rank), ())
        return replies

    def _death(self, rank: int) -> str:
        process = self.processes[rank]
        process.join(timeout=5)
        code = process.exitcode
        what = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
                else f"exited with code {code}")
        return f"the rank's process {what} before replying (a crash, os._exit, or a failed start)"

    def close(self) -> None:
        for connection in self.connections:
            connection.close()
        for process in self.processes:
            # Each worker leads its own process group: killing the group takes any process the
            # task started with it.
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            process.kill()
        for process in self.processes:
            process.join()


# --- the worker --------------------------------------------------------------------------------


def _serve(rank: int, world_size: int, connection) -> None:
    """A worker's life: import once, then run tasks until the test process closes the pipe."""
    os.setpgid(0, 0)  # its own process group (see ``close``); Ctrl-C reaches the test process only
    _die_with_parent()
    import lightning.pytorch  # noqa: F401  (imported once here, not in the first task)
    import torch
    import tqdm

    torch.set_num_threads(1)
    # No tqdm monitor thread: one left behind by a bar a task did not close (DeepSpeed's families
    # in CI) made the pool restart after the task (4 fresh interpreters, about a minute).
    tqdm.tqdm.monitor_interval = 0
    # What the imports made lives as long as the worker: out of the collector's sight, so that
    # the collection closing each task scans what tasks made (about 5 ms) and not torch's and
    # Lightning's half a million objects again (0.26 s per task and rank, most of a small task).
    gc.collect()
    gc.freeze()
    threads_at_start = set(threading.enumerate())
    global _FUNCTIONAL_AT_START
    _FUNCTIONAL_AT_START = dict(vars(torch.nn.functional))
    while True:
        try:
            task = connection.recv_bytes()
        except EOFError:
            return
        reply = _run_task(rank, world_size, task)
        connection.send_bytes(pickle.dumps((*reply, _threads_left(threads_at_start))))


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the test process dies, however it dies."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _run_task(rank: int, world_size: int, task: bytes) -> tuple[str, object]:
    """``("ok", pickled result)`` or ``("error", traceback)``, the worker left as it was."""
    environ, cwd = dict(os.environ), os.getcwd()
    handlers = {signum: signal.getsignal(signum) for signum in SIGNALS}
    try:
        fn, args, kwargs, port, timeout = pickle.loads(task)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size))
        _fresh_interpreter_state(rank)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=timedelta(seconds=timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        try:
            with warnings.catch_warnings():  # filters a task sets end with it
                result = fn(rank, world_size, *args, **kwargs)
        finally:
            destroy_process_groups()
        # Plain pickle, not the multiprocessing pickler: that one sends a tensor as a handle to
        # this process's shared memory, which the test process may fail to open under load
        # ("received 0 items of ancdata").
        return "ok", pickle.dumps(result)
    except BaseException:  # SystemExit and KeyboardInterrupt too: the pool is killed after it
        return "error", traceback.format_exc()
    finally:
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        for signum, handler in handlers.items():
            if handler is not None:
                signal.signal(signum, handler)
        _forget_process_groups()
        sys.stdout.flush()
        sys.stderr.flush()
        gc.collect()


def _fresh_interpreter_state(rank: int) -> None:
    """What a new interpreter starts a task with, whatever the previous task changed."""
    import random

    import numpy
    import torch
    from lightning_utilities.core.rank_zero import rank_zero_only

    from litscale.health import flight_recorder

    torch.manual_seed(TASK_SEED)
    random.seed(TASK_SEED)
    numpy.random.seed(TASK_SEED)
    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(False)
    torch.set_float32_matmul_precision("highest")
    torch.set_grad_enabled(True)
    torch.set_num_threads(1)  # 2 cores shared by every rank
    _restore_functional()
    rank_zero_only.rank = rank  # as the strategies set it; a new interpreter read it from RANK
    warnings.onceregistry.clear()  # "once" warnings show again, as in a new interpreter
    flight_recorder.start_new_run()  # a dump holds this task's collectives alone


# ``torch.nn.functional`` as the worker imported it (set in ``_serve``).
_FUNCTIONAL_AT_START: dict = {}


def _restore_functional() -> None:
    """``torch.nn.functional`` as a new interpreter has it: a library may swap a function there
    for good (DeepSpeed's ZeRO-3 does ``F.linear``: litscale's strategy puts it back, a test's
    own use of DeepSpeed may not), and a later task's gradients would differ in the last bit."""
    import torch.nn.functional as F

    for name, value in _FUNCTIONAL_AT_START.items():
        if getattr(F, name, None) is not value:
            setattr(F, name, value)


def _forget_process_groups() -> None:
    """Module globals that keep a destroyed group (or an object built on it) between tasks: a
    new interpreter has none, and a later task would otherwise reuse a dead group.

    DTensor's sharding propagation caches (Python's and the C++ dispatch fast path's) map an
    op's input specs to its output spec, and a spec holds its ``DeviceMesh``. Two meshes are
    equal when their ranks, shape and names are (not their groups), so the next task's mesh
    finds the last task's entries and its outputs carry the last task's mesh: a collective on
    it resolves the group name that mesh recorded. Group names restart from 0 with each
    default group, so that name is either gone ("Could not resolve the process group
    registered under the name 55") or, worse, names another group of this task.
    """
    tensor_random = sys.modules.get("torch.distributed.tensor._random")
    if tensor_random is not None:
        tensor_random._rng_tracker = None
    if "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor import DTensor, _redistribute
        from torch.distributed.tensor._collective_utils import MeshTopoInfo
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()
        # These keep old meshes as keys only (so their groups alive), not in what they return.
        DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear()
        _redistribute._gen_transform_infos.cache_clear()
        MeshTopoInfo.build_from_mesh.cache_clear()


def _threads_left(threads_at_start: set) -> list[str]:
    """Names of Python threads a task left running (after a second's grace to finish)."""
    deadline = time.monotonic() + 1.0
    for thread in set(threading.enumerate()) - threads_at_start:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    return sorted(t.name for t in set(threading.enumerate()) - threads_at_start)


# --- fresh interpreters: the escape hatch ------------------------------------------------------


def _fresh_worker(rank, world_size, port, fn, args, kwargs, results, timeout):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    try:
        results[rank] = ("ok", pickle.dumps(fn(rank, world_size, *args, **kwargs)))  # plain pickle: see above
    except BaseException:
        results[rank] = ("error", traceback.format_exc())
        raise
    finally:
        destroy_process_groups()


def _run_fresh(fn, world_size: int, args, kwargs, timeout: float) -> list:
    """The same call on ``world_size`` new interpreters, started for it and gone after it."""
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    context = mp.start_processes(_fresh_worker, nprocs=world_size, join=False, start_method="spawn",
                                 args=(world_size, free_port(), fn, args, kwargs, results, timeout))
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise AssertionError(f"ranks did not finish within {timeout} s (a hang)")
        return [pickle.loads(results[rank][1]) for rank in range(world_size)]
    except mp.ProcessRaisedException as error:
        failures = {r: v[1] for r, v in results.items() if v[0] == "error"}
        raise AssertionError(f"rank failures: {failures or error}") from None
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
        manager.shutdown()
