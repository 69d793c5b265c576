"""The line that says Ray Train restarted a job's workers (``hydra.launcher.max_failures``): the
rank whose worker died (or failed), the restart's number, and the checkpoint the job resumes from.

Ray Train calls a ``UserCallback``'s ``after_exception`` with the errors of a job's failed workers
(by world rank) on its controller, an actor on the driver's node, before its failure policy
starts the workers again: the one place that sees the failure before the restart. A worker that
died (killed, out of memory) shows there as a failed health check; one whose task raised, as its
own exception. The controller's lines reach the driver under Ray's prefix for it
(``(TrainController pid=...)``).

NOTE: ``ray`` is imported at the top, which a plugin module must not need: Hydra's plugin scan
skips modules whose names start with ``_``, and the launcher imports this one only to run a job.
"""

from __future__ import annotations

import os
from typing import Any

try:
    from ray.train import UserCallback
except ImportError:  # without ray (the plugin modules' import test): nothing here runs then
    UserCallback = object


class RayRestartReport(UserCallback):
    """One ``litscale:`` line per failure of job ``number`` that Ray restarts it after."""

    def __init__(self, *, number: int, max_failures: int, run_dir: str | None, ckpt_path: str | None) -> None:
        self.number, self.max_failures = number, max_failures
        self.run_dir, self.ckpt_path = run_dir, ckpt_path
        self.failures = 0  # those charged to max_failures, as Ray's failure policy counts them

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, BaseException]) -> None:
        if any(was_preempted(error) for error in worker_exceptions.values()):
            return  # Ray retries a preempted node's job under its own budget, not max_failures
        self.failures += 1
        if self.failures <= self.max_failures:
            print(self.line(worker_exceptions), flush=True)
        # past max_failures Ray ends the job, and the driver names its failure (``reported``)

    def line(self, worker_exceptions: dict[int, BaseException]) -> str:
        return (f"litscale: job {self.number}: {failed_ranks(worker_exceptions)}; Ray restarts the job's workers "
                f"(restart {self.failures} of hydra.launcher.max_failures={self.max_failures}), "
                f"{self.resumes_from()}")

    def resumes_from(self) -> str:
        """What the restarted job resumes from: ``ckpt_path=here``'s choice in its run dir."""
        from litscale.checkpoint.resume import newest_last_checkpoint

        if self.ckpt_path != "here":
            return f"resuming from ckpt_path={self.ckpt_path} again, as the job names it"
        if self.run_dir is None:  # in URI storage, which this node cannot list
            return "resuming from the newest complete checkpoint of its run dir (ckpt_path=here)"
        newest = newest_last_checkpoint(self.run_dir)
        if newest is None:
            return f"starting again from step 0 (no complete checkpoint in {self.run_dir} yet)"
        step = checkpoint_step(newest)
        return f"resuming from {newest}" + ("" if step is None else f" (step {step})")


def was_preempted(error: BaseException) -> bool:
    """A worker whose node was preempted (Ray's ``RayActorError.preempted``, inside the failed
    health check that reports it)."""
    return bool(getattr(getattr(error, "health_check_failure", error), "preempted", False))


def failed_ranks(worker_exceptions: dict[int, BaseException]) -> str:
    """The ranks whose workers died, else the first whose task raised other than for a lost peer."""
    from hydra_plugins.litscale_plugins.jobs import described
    from litscale.app.launch import is_knock_on_failure

    died = sorted(rank for rank, error in worker_exceptions.items() if hasattr(error, "health_check_failure"))
    if died:
        ranks = ", ".join(map(str, died))
        return f"rank {ranks}'s Ray worker died" if len(died) == 1 else f"the Ray workers of ranks {ranks} died"
    rank, error = min(worker_exceptions.items(), key=lambda item: (is_knock_on_failure(item[1]), item[0]))
    return f"rank {rank} failed ({described(error)})"


def checkpoint_step(path: str) -> int | None:
    """The step a Lightning checkpoint holds (a file, or a sharded directory's ``meta.pt``); None
    where it cannot be read without running what it holds."""
    import torch

    target = os.path.join(path, "meta.pt") if os.path.isdir(path) else path
    try:
        step = torch.load(target, map_location="cpu", weights_only=True, mmap=True).get("global_step")
    except Exception:  # noqa: BLE001 - a DeepSpeed directory, an unreadable file: the path alone is said
        return None
    return int(step) if isinstance(step, int) else None
