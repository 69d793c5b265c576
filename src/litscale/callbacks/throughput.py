"""Steady-state training throughput and MFU, logged under ``perf/*``.

Lightning's ``ThroughputMonitor`` is not used here: it reports a rolling window per logging
step and multiplies by the world size, where litscale wants the whole run's steady-state
average and counts data-parallel ranks only (tensor- and pipeline-parallel ranks share a
batch). What remains is two timestamps and a division; FLOPs come from ``litscale.measure.flops``.

A CPU's peak is a probe's (``litscale.measure.flops.cpu_peak``): where it was not probed on a quiet machine,
or this run went faster than it, MFU is provisional and ``perf/mfu_provisional`` says why; where the
run computes in 16 bits on a CPU whose 16-bit matmuls are slower than its fp32 ones (no bf16 units),
``perf/peak_vs_fp32`` says how much. The load average at the start and end of the timed steps
(``machine/*``) lets a scaling report tell a baseline timed beside other work.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from litscale.constraints import NonNegativeInt
from litscale.loggers import is_logging_step, log_to_loggers
from litscale.measure import flops
from litscale.measure.flops import (
    CpuPeak,
    corrected_cpu_peak,
    cpu_peak,
    flops_per_sample,
    peak_flops_per_device,
)
from litscale.parallel.contract import data_parallel_size

_COMPUTE_DTYPES = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16,
                   "16-mixed": torch.float16, "16-true": torch.float16}


def ddp_communication_share(trainer: Trainer, step_time_s: float) -> dict[str, float]:
    """Gradient all-reduce time as a share of a step, from DDP's own runtime statistics
    (sampled by its reducer at iterations 10, 20, ..., in ns), and the share not hidden behind
    backward compute. Other strategies keep no such figures: nothing is reported for them."""
    from torch.nn.parallel import DistributedDataParallel

    model = getattr(trainer.strategy, "model", None)
    if not isinstance(model, DistributedDataParallel):
        return {}
    stats = model._get_ddp_logging_data()
    comm, overlap = stats.get("avg_backward_comm_time"), stats.get("avg_backward_compute_comm_overlap_time")
    if not comm:
        return {}
    result = {"perf/comm_time_s": comm / 1e9, "perf/comm_share": comm / 1e9 / step_time_s}
    if overlap is not None:
        result["perf/comm_exposed_share"] = max(0, comm - overlap) / 1e9 / step_time_s
    return result


class ThroughputCallback(Callback):
    """Samples/s, tokens/s (total and per device), step time and MFU over the whole job,
    after ``warmup_steps`` optimizer steps.

    Times are taken every ``log_every_n_steps`` only, so a CUDA run synchronises the device
    at most once per logging interval, not once per step. MFU = model FLOPs per second /
    (peak FLOP/s of one device x world size); set ``mfu=false`` to skip the CPU peak probe.
    Rows that pack documents count each document's attention, not the whole row's
    (``flops_per_sample``'s ``attended_length``, as the data module states it).
    """

    def __init__(self, *, warmup_steps: NonNegativeInt = 10, mfu: bool = True) -> None:
        self.warmup_steps = warmup_steps
        self.mfu = mfu
        self.result: dict[str, float] = {}

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Before the strategy shards or cuts the net: FLOPs are those of the whole model.
        net = getattr(pl_module, "net", pl_module)
        self._tokens_per_sample = getattr(trainer.datamodule, "tokens_per_sample", None)
        # Packed rows: attention counted over each document, at the figure the data states (the
        # planner's too), not read off each batch: a rank's batch is its data-parallel share, and
        # under context parallel its sequence chunks, whose documents are cut (counting the
        # global batch's would take a collective per step).
        self._attended_length = getattr(trainer.datamodule, "attended_length", None)
        self._flops_per_sample: float | None = None
        self._net_for_flops = None
        if not self.mfu or stage != "fit":
            return
        if hasattr(net, "flops_per_token") and self._tokens_per_sample:
            self._flops_per_sample = flops_per_sample(net, None, self._tokens_per_sample, self._attended_length)
        else:  # counted at the first batch, whose shape it needs
            self._net_for_flops = copy.deepcopy(net).to("meta")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start: tuple[float, int] | None = None
        self._reported_step: int | None = None
        self._paused_s = 0.0  # validation time inside the measured interval, not training
        self._samples_per_step = 0
        self._peak: CpuPeak | None = None
        self._peak_vs_fp32: float | None = None
        self._load_start = flops.load_average()
        if self.mfu:
            self._dtype = _COMPUTE_DTYPES.get(str(trainer.precision), torch.float32)
            if pl_module.device.type == "cpu":
                threads = torch.get_num_threads()
                siblings = _siblings(threads)
                self._peak = cpu_peak(self._dtype, threads, siblings)
                if self._dtype != torch.float32:  # a CPU without 16-bit units emulates them: say how slow
                    self._peak_vs_fp32 = self._peak.flops / cpu_peak(torch.float32, threads, siblings).flops
            else:
                peak = peak_flops_per_device(pl_module.device, self._dtype)
                self._peak = None if peak is None else CpuPeak(peak)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._samples_per_step:
            micro_batch = len(batch[0])
            self._samples_per_step = micro_batch * data_parallel_size(trainer.strategy) * trainer.accumulate_grad_batches
            if self._net_for_flops is not None:
                self._flops_per_sample = flops_per_sample(self._net_for_flops, batch[0],
                                                          self._tokens_per_sample, self._attended_length)
                self._net_for_flops = None
        step = trainer.global_step
        if self._start is None:
            # A short run still gets a figure: warm-up is at most a quarter of its steps.
            warmup = min(self.warmup_steps, max(1, trainer.max_steps // 4)) if trainer.max_steps > 0 \
                else self.warmup_steps
            if step >= warmup:
                self._start = (self._now(pl_module), step)
            return
        if step in (self._start[1], self._reported_step) or not is_logging_step(trainer, step):
            return
        self._reported_step = step  # once per optimizer step, not per accumulated micro batch
        self.result = self._summarise(trainer, self._now(pl_module), step)
        log_to_loggers(trainer, self.result)
        if self._flops_per_sample:
            self.result["perf/flops_per_sample"] = self._flops_per_sample

    @staticmethod
    def _now(pl_module: LightningModule) -> float:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)  # time the GPU's work, not its queueing
        return time.perf_counter()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._validation_started = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if getattr(self, "_start", None) is not None:
            self._paused_s += time.perf_counter() - self._validation_started

    def _summarise(self, trainer: Trainer, now: float, step: int) -> dict[str, float]:
        elapsed, steps = now - self._start[0] - self._paused_s, step - self._start[1]
        world_size = trainer.world_size
        samples_per_sec = steps * self._samples_per_step / elapsed
        result = {"perf/samples_per_sec": samples_per_sec,
                  "perf/samples_per_sec_per_device": samples_per_sec / world_size,
                  "perf/step_time_s": elapsed / steps}
        if self._tokens_per_sample:
            result["perf/tokens_per_sec"] = samples_per_sec * self._tokens_per_sample
            result["perf/tokens_per_sec_per_device"] = result["perf/tokens_per_sec"] / world_size
        result.update(ddp_communication_share(trainer, elapsed / steps))
        result.update({"machine/load_average_start": round(self._load_start, 2),
                       "machine/load_average_end": round(flops.load_average(), 2), "machine/cores": flops.cores()})
        if self._flops_per_sample and self._peak:
            achieved = samples_per_sec * self._flops_per_sample
            if achieved > self._peak.flops * world_size and trainer.strategy.root_device.type == "cpu":
                threads = torch.get_num_threads()
                self._peak = corrected_cpu_peak(self._dtype, threads, achieved / world_size, _siblings(threads))
            result["perf/tflops"] = achieved / 1e12
            result["perf/mfu"] = achieved / (self._peak.flops * world_size)
            result["perf/peak_flops_per_device"] = self._peak.flops
            if self._peak.provisional:
                result["perf/mfu_provisional"] = self._peak.provisional
            if self._peak_vs_fp32 is not None:
                result["perf/peak_vs_fp32"] = self._peak_vs_fp32
        return result


def _siblings(threads: int) -> float:
    """The cores this job's other ranks on this machine keep busy while this one probes the CPU's
    peak (every rank probes at the start of fit): not another program's load."""
    return (int(os.environ.get("LOCAL_WORLD_SIZE", "1")) - 1) * threads
