"""Starting the ranks of one job.

One device: the job runs in this process. Several devices on this node: torch's elastic
agent (the engine behind ``torchrun``) spawns one worker per device, gives each its rank
environment and, when one fails, stops the others, so no rank is left waiting in a
collective. Each worker receives the job's resolved config as data; nothing re-runs the
command line, so a Hydra multirun is never re-launched by its own children (the failure
mode of Lightning's subprocess launcher). Under an external launcher (``torchrun``, SLURM's
``srun``) the ranks already exist and this process is one of them.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Callable
from typing import Any

from litscale.errors import ConfigError


class RankFailure(RuntimeError):
    """A worker rank failed; the message names the rank and its error in one line."""


def launched_externally() -> bool:
    """True when this process is already one rank of a job (torchrun, SLURM with tasks)."""
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ


def launch(entrypoint: Callable[[Any], Any], payload: Any, *, processes: int, num_nodes: int = 1) -> Any:
    """Run ``entrypoint(payload)`` on every rank of this node; return rank 0's result."""
    if launched_externally() or (processes == 1 and num_nodes == 1):
        return entrypoint(payload)
    if num_nodes > 1:
        raise ConfigError(
            f"trainer.num_nodes={num_nodes} needs one launcher per node: start train.py with "
            "torchrun on each node, or use SLURM (hydra/launcher=submitit_slurm); see the README"
        )
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
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        shutdown_timeout=60,  # time for ranks to save a checkpoint after SIGTERM
    )
    try:
        results = elastic_launch(config, entrypoint)(payload)
    except ChildFailedError as error:
        raise RankFailure(describe_first_failure(error)) from None
    except SignalException:
        # This process was told to stop (SIGTERM, SLURM preemption): the agent passed the
        # signal on to the ranks, which save last.ckpt at their next step and exit.
        return {"preempted": True}
    return results[0]


# How a rank reports that a peer died; failure timestamps are whole seconds, so ties with the
# rank that actually failed are common, and these messages are never the root cause.
_KNOCK_ON = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing",
             "NCCL communicator was aborted", "Broken pipe")


def _is_knock_on(message: Any) -> bool:
    text = message if isinstance(message, str) else str(message.get("message", ""))
    return any(marker in text for marker in _KNOCK_ON)


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
