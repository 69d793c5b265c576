"""Starting the ranks of one job.

One device: the job runs in this process. Several devices on this node: torch's elastic
agent (the engine behind ``torchrun``) spawns one worker per device, gives each its rank
environment and, when one fails, stops the others, so no rank is left waiting in a
collective. Each worker receives the job's resolved config as data; nothing re-runs the
command line, so a Hydra multirun is never re-launched by its own children (the failure
mode of Lightning's subprocess launcher). Under an external launcher (``torchrun``, SLURM's
``srun``) the ranks already exist and this process is one of them: the trainer must describe
the world they form, and before Hydra composes, ``prepare_external_rank`` makes all of them
(on every node) name the same run dir, which rank 0 alone records ``.hydra/`` in.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from collections.abc import Callable
from typing import Any

from litscale.errors import ConfigError
from litscale.health.heartbeat import STOPPED_BY_WATCHDOG
from litscale.health.launcher import (
    launcher_lost,
    left_behind_on_failure,
    note_launcher,
    told_to_stop,
)
from litscale.health.watchdog import HANG_ERROR, LAUNCHER_REPORTS_ENV
from litscale.parallel.layout import world_size_of


class RankFailure(RuntimeError):
    """A worker rank failed; the message names the rank and its error in one line."""


def launched_externally() -> bool:
    """True when this process is already one rank of a job (torchrun, SLURM with tasks)."""
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ


# The run dir's last part (conf/hydra/default.yaml); every rank of an external launch agrees on it.
RUN_ID_ENV = "LITSCALE_RUN_ID"
RUN_ID_TIME_FORMAT = "%Y-%m-%d_%H-%M-%S"  # as Hydra's ${now:...} in a single-process run


def external_rank() -> int | None:
    """This process's global rank under torchrun or srun; None when litscale starts the ranks."""
    if not launched_externally():
        return None
    return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)


def prepare_external_rank() -> list[str]:
    """Under torchrun or srun, before Hydra composes: set ``LITSCALE_RUN_ID`` (unless the user
    did) so that every rank, on every node, picks the same run dir; return the Hydra overrides
    of this rank: rank 0 alone writes ``.hydra/`` (all ranks append to the one ``train.log``)."""
    rank = external_rank()
    if rank is None:
        return []
    note_launcher()
    if RUN_ID_ENV not in os.environ:
        run_id = shared_run_id(rank)
        if run_id:
            os.environ[RUN_ID_ENV] = run_id
    return [] if rank == 0 else ["hydra.output_subdir=null"]


def shared_run_id(rank: int) -> str | None:
    """A name for the run dir that all ranks of this launch compute alike."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return _start_time_of_rank_zero(rank)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return os.environ["TORCHELASTIC_RUN_ID"]
    if "SLURM_JOB_ID" in os.environ:
        return slurm_run_id()
    return None  # another launcher: each rank names its own dir unless hydra.run.dir is given


def _start_time_of_rank_zero(rank: int) -> str:
    """Rank 0's start time, shared through the store that torchrun's agent hosts for its workers.

    NOTE: not TORCHELASTIC_RUN_ID: torchrun's --rdzv-id defaults to "none" on multi-node
    launches, which would put every launch in one dir. A restarted rank 0 reuses the key if
    the store still holds it, so an elastic restart stays in its job's dir.
    """
    from datetime import datetime, timedelta

    from torch.distributed import TCPStore

    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=timedelta(minutes=5))
    key = f"litscale/run_id/{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
    if rank == 0 and not store.check([key]):
        store.set(key, datetime.now().strftime(RUN_ID_TIME_FORMAT))
    return store.get(key).decode()


def slurm_run_id() -> str:
    """SLURM's name of this job (``<job>`` or ``<array job>_<task>``, ``.<step>`` after the first
    step): the same on every task and after a requeue, so a requeued job resumes in its dir."""
    job = os.environ["SLURM_JOB_ID"]
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    step = os.environ.get("SLURM_STEP_ID", "0")
    return job if step == "0" else f"{job}.{step}"


def external_world_size() -> int:
    """The number of ranks an external launcher started (torchrun's, else SLURM's)."""
    return int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)


def check_launchable(processes: int, num_nodes: int) -> None:
    """``processes`` per node x ``num_nodes`` ranks can run from here: under torchrun or srun
    they are the ranks the launcher started; otherwise this node is the only one."""
    if launched_externally():
        started, world = external_world_size(), world_size_of(num_nodes=num_nodes, processes_per_node=processes)
        if world != started:
            raise ConfigError(
                f"trainer.devices={processes} x trainer.num_nodes={num_nodes} is "
                f"{world} rank(s), but the launcher started {started}; set "
                "trainer.devices to the processes per node (torchrun --nproc-per-node, srun "
                "--ntasks-per-node) and trainer.num_nodes to the number of nodes"
            )
    elif num_nodes > 1:
        raise ConfigError(
            f"trainer.num_nodes={num_nodes} needs one launcher per node: start train.py with "
            "torchrun on each node, or use SLURM (srun, or -m hydra/launcher=slurm); see the README"
        )


# torch's switch for a fresh rendezvous store per restart attempt (see ``launch``).
FRESH_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

# A rank stopped by a preemption signal, its checkpoint saved, exits with this code (EX_TEMPFAIL:
# a temporary failure, run again) instead of handing its result back (see ``_run_rank``).
PREEMPTED_EXIT_CODE = 75


def _run_rank(entrypoint: Callable[[Any], Any], payload: Any) -> Any:
    """``entrypoint(payload)`` on one rank started by the agent below.

    NOTE: torch's worker wrapper, after handing back the result, waits until the agent has
    read it; an agent shutting down on SIGTERM never does, and kills the rank only after its
    shutdown timeout (60 s). A preempted rank, whose checkpoint is saved and loggers closed,
    exits at once instead, with a code that tells the agent why."""
    note_launcher()
    try:
        result = entrypoint(payload)
    except Exception as error:
        if left_behind_on_failure() is not None:
            _exit_at_once(error)
        raise
    if isinstance(result, dict) and result.get("preempted"):
        sys.exit(PREEMPTED_EXIT_CODE)
    return result


def launch(entrypoint: Callable[[Any], Any], payload: Any, *, processes: int, num_nodes: int = 1,
           max_restarts: int = 0, agent: bool = False) -> Any:
    """Run ``entrypoint(payload)`` on every rank of this node; return rank 0's result.

    ``max_restarts``: times the agent starts all ranks again after one fails (a replica group of
    ``fault_tolerance=replicas``); ``agent``: under the agent even with one process (to restart it)."""
    check_launchable(processes, num_nodes)
    if launched_externally() or (processes == 1 and not agent):
        return entrypoint(payload)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The agent logs every rendezvous step, and each failure with a prefix on every line;
    # the root cause is reported once below instead.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=processes,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port, as `torchrun --standalone` does
        run_id=uuid.uuid4().hex,
        max_restarts=max_restarts,
        # NOTE: the agent polls its workers this often; at 0.1 s (torchrun's default) its
        # polling took 2% of a 2-rank CPU DDP step on a fully loaded 2-core machine
        # (experiments/bench). A failure is still seen within a second.
        monitor_interval=1.0,
        start_method="spawn",
        shutdown_timeout=60,  # time for ranks to save a checkpoint after SIGTERM
    )
    if max_restarts and processes > 1:
        # NOTE: torch's agent shares one rendezvous store with every attempt's ranks, its keys not
        # scoped by attempt (pytorch/pytorch#135712): a restarted rank read the previous
        # attempt's address of its peer and its process group failed to connect (a replica
        # group's restart failed so whenever its rank 1 started before its rank 0). This torch
        # setting gives each attempt a fresh store, hosted by rank 0's process group, as
        # docs/clusters.md has torchrun do. One process has no peer to read a stale key, and no
        # process group to host a store: its torchft manager meets at the agent's.
        os.environ[FRESH_STORE_ENV] = "1"
    previous_sigusr1 = _pass_sigusr1_to_the_ranks()
    os.environ[LAUNCHER_REPORTS_ENV] = "1"  # a hang's line: printed below, not by rank 0
    try:
        results = elastic_launch(config, _run_rank)(entrypoint, payload)
    except ChildFailedError as error:
        if all(f.exitcode == PREEMPTED_EXIT_CODE for f in error.failures.values()):
            return {"preempted": True}  # a rank alone got the signal; they all stopped and saved
        raise RankFailure(hang_report(error) or describe_first_failure(error)) from None
    except SignalException:
        # This process was told to stop (SIGTERM, SLURM preemption): the agent passed the
        # signal on to the ranks, which save last.ckpt together after a step and exit.
        return {"preempted": True}
    finally:
        os.environ.pop(LAUNCHER_REPORTS_ENV, None)
        if previous_sigusr1 is not None:
            signal.signal(signal.SIGUSR1, previous_sigusr1)
    return results[0]


def _exit_at_once(error: Exception) -> None:
    """Record ``error`` for the agent as torch's worker wrapper does, then exit with code 1
    without joining the threads left running (``left_behind_on_failure``).

    NOTE: Python joins every non-daemon thread at exit. torchft's quorum thread, waiting on a
    replica group's lost rank for up to ``quorum_timeout_s``, kept the group's live rank alive
    until the agent killed it 30 s later: its group's restart, and every other group's quorum
    (which waited for a group still heartbeating), paid those 30 s. The rank's loggers are
    finished and its process group destroyed before this (``run_rank``)."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    get_error_handler().record_exception(error)  # the error file the agent reports from
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _pass_sigusr1_to_the_ranks() -> Any:
    """Let SIGUSR1 (SLURM's warning before a time limit) stop the run as SIGTERM does.

    The elastic agent turns SIGTERM into ``SignalException`` and sends the same signal to
    every rank before it shuts down; SIGUSR1 it leaves to its default action, which would
    kill this process and orphan the ranks. Raising the same exception for SIGUSR1 makes the
    agent pass SIGUSR1 on, and each rank's ``PreemptionCheckpoint`` handles it. Returns the
    handler it replaced (None where there is no SIGUSR1)."""
    if not hasattr(signal, "SIGUSR1"):
        return None
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def stop(signum: int, frame: Any) -> None:
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    return signal.signal(signal.SIGUSR1, stop)


# How a rank reports that a peer died; failure timestamps are whole seconds, so ties with the
# rank that actually failed are common, and these messages are never the root cause.
_KNOCK_ON = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing",
             "NCCL communicator was aborted", "Broken pipe", STOPPED_BY_WATCHDOG)


# How long a rank whose error only says that a peer died waits before exiting (see
# ``wait_for_the_cause``); the launcher stops it as soon as the peer's own failure is seen.
KNOCK_ON_GRACE_S = 20.0


def _is_knock_on(message: Any) -> bool:
    text = message if isinstance(message, str) else str(message.get("message", ""))
    return any(marker in text for marker in _KNOCK_ON)


def is_knock_on_failure(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) only reports that a peer died."""
    link, seen = error, 0
    while link is not None and seen < 8:
        if _is_knock_on(str(link)):
            return True
        link, seen = link.__cause__ or link.__context__, seen + 1
    return False


def wait_for_the_cause(error: BaseException) -> None:
    """On a rank that failed only because a peer did, wait before exiting.

    NOTE: torch's elastic agent (litscale's launcher and torchrun alike) records the failure
    of the first rank to exit and stops the others, whose errors are then lost. The rank that
    raised the real error is often still in Lightning's exception handling when its peers,
    their connections closed, fail within milliseconds; without this wait the report would
    name a "Connection closed by peer" instead of the cause. Where the launcher itself is gone
    (and its store with it: the likely cause), no one is left to report either: no wait; nor
    where the launcher has told this rank to stop, before the wait or during it (it has seen
    the failure by then).
    """
    if not is_knock_on_failure(error) or launcher_lost() or told_to_stop():
        return
    import threading
    import time

    if threading.current_thread() is not threading.main_thread():  # only the main thread takes signals
        time.sleep(KNOCK_ON_GRACE_S)
        return
    # NOTE: the launcher sends SIGTERM once it has seen a rank's failure (the cause is recorded
    # then) to stop the others. The preemption handler only notes a SIGTERM for the next step
    # boundary, which this rank never reaches: it slept on, and the agent killed it after its
    # 30 s shutdown wait, a wait a replica group's restart and every other group paid
    # (tests/test_fault_tolerance.py, a rank killed in a DDP group of two). The signal ends it.
    previous = signal.signal(signal.SIGTERM, _stop_waiting)
    try:
        time.sleep(KNOCK_ON_GRACE_S)
    except _StoppedWaiting:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


class _StoppedWaiting(Exception):
    """The launcher stopped a rank waiting for its peer's report: the report is in."""


def _stop_waiting(signum: int, frame: Any) -> None:
    raise _StoppedWaiting


def hang_report(error) -> str | None:
    """The hang watchdog's line, if it stopped the job: rank 0 records it, and every rank it
    stopped repeats it (the agent may see any of them first)."""
    for failure in error.failures.values():
        data = failure.message
        text = str(data if isinstance(data, str) else data.get("message", ""))
        for prefix in (f"{HANG_ERROR}: ", f"{STOPPED_BY_WATCHDOG}: "):
            if text.startswith(prefix):
                return text.removeprefix(prefix).splitlines()[0]
    return None


def describe_first_failure(error) -> str:
    """Print the traceback of the rank that failed first (the root cause: the others often
    fail because it did) and return one line naming it."""
    rank, failure = min(error.failures.items(), key=lambda item: (
        _is_knock_on(item[1].message), item[1].timestamp, item[0]))
    data = failure.message
    message, traceback = (data, None) if isinstance(data, str) else (
        data.get("message", ""), data.get("extraInfo", {}).get("py_callstack"))
    if traceback:
        print(traceback.rstrip(), file=sys.stderr, flush=True)
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    cause = lines[0] if lines else f"exit code {failure.exitcode}"
    return f"rank {rank} failed: {cause}"
