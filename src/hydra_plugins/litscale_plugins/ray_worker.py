"""What runs on each Ray Train worker besides the job itself: the stop signal handed to the
training loop, the run dir's copy in URI storage, and an elastic job's worker count.

**SIGTERM.** Ray Train runs the training function in a thread of the worker process, where
litscale's ``PreemptionCheckpoint`` installs no signal handlers, and Ray's own handler on the
worker's main thread exits the process at once: a SIGTERM (a node drained, a spot instance
reclaimed) lost every step since the last save. Here the worker's main thread (the actor's
own, reached through ``RayTrainWorker.execute``) takes SIGTERM instead and only sets an event;
``RayWorkerCallback`` hands it to ``PreemptionCheckpoint`` at the next batch (its
``signalled``, which it polls), so every rank stops after the same step and saves
``last.ckpt``. The rank then fails on purpose (``RayWorkerPreempted``), so that Ray Train
starts the job again (``max_failures``) from that save (``ckpt_path=here``). A second SIGTERM
gets Ray's handler: exit at once.

Lightning is imported only by ``_ray_worker_callback`` (the job's callback): Hydra imports
every plugin module whose name does not start with ``_`` (this one through the launcher) to
list its plugins, before every command line's check, and a one-line refusal then paid 6 s of
imports it never used.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from hydra_plugins.litscale_plugins import _ray_worker_state as state
from hydra_plugins.litscale_plugins.ray_storage import StoredRunDir

PREEMPTION_TARGET = "litscale.callbacks.preemption.PreemptionCheckpoint"


class RayWorkerPreempted(RuntimeError):
    """A rank stopped by SIGTERM after saving ``last.ckpt``: failed, so Ray Train restarts it."""


def _on_sigterm(signum: int, frame: Any) -> None:
    if state.stop_requested.is_set() and callable(state.previous_handler):
        state.previous_handler(signum, frame)  # the second: Ray's own, which exits
    state.stop_requested.set()


def install_stop_handler() -> None:
    """On the worker's main thread: SIGTERM sets ``state.stop_requested`` instead of exiting."""
    state.stop_requested.clear()
    state.previous_handler = signal.signal(signal.SIGTERM, _on_sigterm)


def restore_stop_handler() -> None:
    """On the worker's main thread: Ray's handler again."""
    if state.previous_handler is not None:
        signal.signal(signal.SIGTERM, state.previous_handler)


def on_main_thread(function: Any) -> None:
    """Run ``function`` on this Ray worker's main thread (the only one that may set signal
    handlers), through the worker actor's own ``execute``; nothing outside a Ray actor."""
    import ray

    if threading.current_thread() is threading.main_thread():
        function()
        return
    actor = ray.get_runtime_context().current_actor if ray.is_initialized() else None
    if actor is not None:
        ray.get(actor.execute.remote(function))


def has_preemption_checkpoint(job_config: Any) -> bool:
    """Whether the job saves on a stop signal (its callbacks hold a ``PreemptionCheckpoint``)."""
    callbacks = job_config.get("callbacks") or {}
    return any(hasattr(node, "get") and node.get("_target_") == PREEMPTION_TARGET for node in callbacks.values())


def start_stored_run_dir(uri: str, local_dir: str) -> None:
    """Before the job: this node's run dir becomes the storage copy (its first rank copies,
    the others wait for it on Ray's process group, which is still up)."""
    import torch.distributed as dist

    state.stored_run_dir = StoredRunDir(uri, local_dir)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        state.stored_run_dir.download()
    if dist.is_initialized():
        dist.barrier()
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        from hydra_plugins.litscale_plugins.ray_storage import snapshot

        state.stored_run_dir.copied = snapshot(local_dir)


def finish_stored_run_dir() -> None:
    """After the job, ended or failed: what this node's first rank wrote goes to storage."""
    if state.stored_run_dir is not None and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        # NOTE: each node's copy of the run dir has its own train.log (its ranks' lines): the
        # other nodes add only what storage lacks (their ranks' records), not rank 0's files.
        state.stored_run_dir.upload_changed(only_new=int(os.environ.get("NODE_RANK", "0")) != 0)
    state.stored_run_dir = None


def elastic_trainer_shape(world_size: int, local_world_size: int) -> tuple[int, int]:
    """``(trainer.devices, trainer.num_nodes)`` for the workers Ray gave an elastic job: the
    workers per node where every node has as many, else one node of them all (the product is
    what Lightning and litscale check against ``WORLD_SIZE``)."""
    if local_world_size and world_size % local_world_size == 0:
        return local_world_size, world_size // local_world_size
    return world_size, 1


def elastic_line(number: int, workers: int, bounds: tuple[int, int], batch_size: int,
                 accumulation: int, lr_scaling: str) -> str:
    """The line an elastic job's rank 0 prints at each start: the batch rule and the LR rule."""
    rule = ("optimizer.lr stays as given (lr_scaling=none)" if lr_scaling in ("none", "None")
            else f"lr_scaling={lr_scaling} rescales optimizer.lr to it")
    return (f"litscale: job {number} runs on {workers} Ray workers (elastic, {bounds[0]}-{bounds[1]}): "
            f"data.batch_size={batch_size} per device is fixed, so the global batch is "
            f"{batch_size * workers * accumulation}; {rule}")
