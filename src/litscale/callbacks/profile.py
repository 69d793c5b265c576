"""A PyTorch profiler trace of a few training steps after warm-up (``callbacks=profile``).

Lightning's ``PyTorchProfiler`` is not used: it takes the Trainer's single ``profiler`` slot
rather than composing with the other callbacks of the ``callbacks`` group, wraps every hook
in a ``record_function`` for the whole run (overhead outside the profiled window too), and
prints its summary table on every rank at the end. This callback drives
``torch.profiler.profile`` directly with its ``schedule(wait, warmup, active)``, stops the
profiler once the window is recorded, and writes one Chrome/Perfetto trace plus a table of
the costliest operators per profiled rank.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from litscale.constraints import NonNegativeInt, PositiveInt


class ProfilerCallback(Callback):
    """Profiles training batches ``wait + warmup + 1`` to ``wait + warmup + active``.

    The first ``wait`` batches run unprofiled (compilation, allocator and cache warm-up),
    the next ``warmup`` are profiled and discarded (the profiler's own start-up), and the
    ``active`` ones are recorded. Then the trace is written to
    ``<dirpath>/trace_rank<R>.json`` (open it in https://ui.perfetto.dev or
    chrome://tracing) beside ``ops_rank<R>.txt``, the operators sorted by self time.

    Steps in the trace are training batches (micro batches with gradient accumulation).
    Profiling slows the recorded steps, so throughput figures of a profiled run read low.

    Args:
        dirpath: Folder for the trace files (``${paths.output_dir}/profile`` in the config).
        wait: Batches skipped before the profiler starts.
        warmup: Batches profiled and discarded.
        active: Batches recorded in the trace.
        record_shapes: Record operator input shapes (groups the table by shape too).
        profile_memory: Record tensor allocations and frees.
        with_stack: Record Python call stacks (large traces).
        all_ranks: Write a trace on every rank, not only on rank 0.
    """

    def __init__(
        self,
        *,
        dirpath: str,
        wait: NonNegativeInt = 5,
        warmup: NonNegativeInt = 2,
        active: PositiveInt = 3,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        all_ranks: bool = False,
    ) -> None:
        self.dirpath = dirpath
        self.wait, self.warmup, self.active = wait, warmup, active
        self.options = {"record_shapes": record_shapes, "profile_memory": profile_memory,
                        "with_stack": with_stack}
        self.all_ranks = all_ranks
        self.trace_path: str | None = None
        self._profiler: torch.profiler.profile | None = None
        self._batches = 0

    @property
    def window(self) -> int:
        """Batches from the start of training to the end of the recorded ones."""
        return self.wait + self.warmup + self.active

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.max_steps > 0 and trainer.max_steps * trainer.accumulate_grad_batches < self.window:
            rank_zero_info(f"litscale: profiler: the run has fewer batches than wait + warmup + "
                           f"active = {self.window}; no trace will be written")
        if not (self.all_ranks or trainer.is_global_zero):
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if pl_module.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = torch.profiler.schedule(wait=self.wait, warmup=self.warmup, active=self.active,
                                           repeat=1)
        self._rank = trainer.global_rank
        self._profiler = torch.profiler.profile(activities=activities, schedule=schedule,
                                                on_trace_ready=self._write, **self.options)
        self._profiler.start()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self._profiler is None:
            return
        self._profiler.step()
        self._batches += 1
        if self._batches >= self.window:  # recorded and written: profile nothing more
            self._stop()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.stop()

    def _write(self, profiler: torch.profiler.profile) -> None:
        os.makedirs(self.dirpath, exist_ok=True)
        self.trace_path = os.path.join(self.dirpath, f"trace_rank{self._rank}.json")
        profiler.export_chrome_trace(self.trace_path)
        sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = profiler.key_averages(group_by_input_shape=self.options["record_shapes"]).table(
            sort_by=sort_by, row_limit=30)
        with open(os.path.join(self.dirpath, f"ops_rank{self._rank}.txt"), "w") as file:
            file.write(table + "\n")
        first = self.wait + self.warmup + 1
        print(f"litscale: profiler: batches {first}-{self.window} of rank {self._rank} -> "
              f"{self.trace_path} (open in https://ui.perfetto.dev)", flush=True)
