"""Pipeline bubble, measured: per-stage idle fraction for p=2 stages and m=1,2,4,8 micro-batches
against the (p-1)/(m+p-1) of GPipe and 1F1B (Huang et al. 2019; Narayanan et al. 2021).

Each of 2 gloo CPU ranks runs one stage (an equal stack of Linear+GELU layers, so the stages
are balanced as the formula assumes) under torch's ``ScheduleGPipe`` / ``Schedule1F1B``. The
busy time of a stage is measured inside it: wall-clock around every micro-batch forward, and
from the moment the gradient reaches the stage's output to the moment it leaves its input for
every backward (marker autograd functions at both ends). Idle fraction = 1 - busy / step time
(the step ends when the slowest stage ends), the median over the measured steps. Communication (gloo, in-process on one machine) counts as
idle, as it does on real hardware without overlap.

By default a stage's compute is fixed-duration work (``--compute fixed``: a sleep in forward
and twice as long in backward): on a shared 2-core machine, wall-clock compute time depends on
what else runs, and the bubble is a property of the schedule. ``--compute matmul`` uses real
Linear layers instead.

    python experiments/pipeline/bubble.py          # writes README.md, results.json, bubble.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

HERE = Path(__file__).resolve().parent
STAGES, MICROBATCH_COUNTS = 2, (1, 2, 4, 8)


class _Mark(torch.autograd.Function):
    """Identity that stamps the time its backward runs (``label`` into ``log``)."""

    @staticmethod
    def forward(ctx, x, anchor, log, label):
        ctx.log, ctx.label = log, label
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append((ctx.label, time.perf_counter()))
        return grad, torch.zeros(1), None, None


class _FixedWork(torch.autograd.Function):
    """Stage compute of fixed duration: sleeps ``forward_s`` in forward and twice that in backward
    (the usual backward:forward cost ratio), so the timing shows the schedule, not the load of
    a shared machine."""

    @staticmethod
    def forward(ctx, x, weight, forward_s):
        ctx.forward_s = forward_s
        time.sleep(forward_s)
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.forward_s)
        return grad, torch.zeros(1), None


class FixedWork(nn.Module):
    def __init__(self, forward_s: float) -> None:
        super().__init__()
        self.weight, self.forward_s = nn.Parameter(torch.ones(1)), forward_s

    def forward(self, x):
        return _FixedWork.apply(x, self.weight, self.forward_s)


class TimedStage(nn.Module):
    """A stage (Linear+GELU layers, or fixed-duration work) that records its forward intervals
    and backward stamps."""

    def __init__(self, width: int, depth: int, forward_ms: float | None) -> None:
        super().__init__()
        if forward_ms:
            self.layers = FixedWork(forward_ms / 1000)
        else:
            self.layers = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())])
        self.anchor = nn.Parameter(torch.zeros(1))  # lets the input marker's backward run on stage 0
        self.forward_intervals: list[tuple[float, float]] = []
        self.backward_stamps: list[tuple[str, float]] = []

    def forward(self, x):
        start = time.perf_counter()
        x = _Mark.apply(x, self.anchor, self.backward_stamps, "end")
        y = _Mark.apply(self.layers(x), self.anchor, self.backward_stamps, "start")
        self.forward_intervals.append((start, time.perf_counter()))
        return y

    def busy_seconds(self) -> float:
        forward = sum(end - start for start, end in self.forward_intervals)
        starts = [t for label, t in self.backward_stamps if label == "start"]
        ends = [t for label, t in self.backward_stamps if label == "end"]
        return forward + sum(end - start for start, end in zip(starts, ends, strict=True))

    def reset(self) -> None:
        self.forward_intervals.clear()
        self.backward_stamps.clear()


def measure(rank: int, args, schedule_name: str, microbatches: int) -> list[float]:
    """Idle fraction of this rank's stage for each measured step."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.manual_seed(rank)
    stage_module = TimedStage(args.width, args.depth, args.forward_ms if args.compute == "fixed" else None)
    stage = PipelineStage(stage_module, rank, STAGES, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    schedule = cls(stage, n_microbatches=microbatches, loss_fn=lambda y, t: (y - t).pow(2).mean())
    batch = torch.randn(microbatches * args.microbatch_size, args.width)
    fractions = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        stage_module.reset()
        start = time.perf_counter()
        if rank == 0:
            schedule.step(batch)
        else:
            schedule.step(target=batch)
        # The step ends when the last stage is done: the slowest rank's time is every rank's step.
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        elapsed = float(elapsed)
        if step >= args.warmup:
            fractions.append(1 - stage_module.busy_seconds() / elapsed)
    return fractions


def worker(rank: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=STAGES)
    try:
        for schedule_name in ("gpipe", "1f1b"):
            for m in MICROBATCH_COUNTS:
                if schedule_name == "1f1b" and m < STAGES:
                    continue  # torch's 1F1B needs at least as many micro-batches as stages
                results[(rank, schedule_name, m)] = statistics.median(measure(rank, args, schedule_name, m))
    finally:
        dist.destroy_process_group()


def theory(m: int, p: int = STAGES) -> float:
    return (p - 1) / (m + p - 1)


def run(args) -> list[dict]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = mp.get_context("spawn").Manager().dict()
    mp.start_processes(worker, args=(port, args, results), nprocs=STAGES, start_method="spawn")
    rows = []
    for schedule_name in ("gpipe", "1f1b"):
        for m in MICROBATCH_COUNTS:
            if (0, schedule_name, m) in results:
                rows.append({"schedule": schedule_name, "microbatches": m, "theory": theory(m),
                             **{f"stage{r}": results[(r, schedule_name, m)] for r in range(STAGES)}})
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ms = list(MICROBATCH_COUNTS)
    ax.plot(ms, [theory(m) for m in ms], "k--", label="(p-1)/(m+p-1)")
    for schedule_name, marker in (("gpipe", "o"), ("1f1b", "s")):
        for stage, colour in ((0, "tab:blue"), (1, "tab:orange")):
            points = [(r["microbatches"], r[f"stage{stage}"]) for r in rows if r["schedule"] == schedule_name]
            ax.plot(*zip(*points, strict=True), marker=marker, color=colour, alpha=0.8,
                    linestyle="-" if schedule_name == "gpipe" else ":",
                    label=f"{schedule_name}, stage {stage}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_xlabel("micro-batches per step (m)")
    ax.set_ylabel("idle fraction of the step")
    ax.set_title(f"Pipeline bubble, p={STAGES} stages (CPU, gloo)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_readme(rows: list[dict], args) -> None:
    table = ["| schedule | m | theory (p-1)/(m+p-1) | stage 0 idle | stage 1 idle |",
             "|---|---|---|---|---|"]
    table += [f"| {r['schedule']} | {r['microbatches']} | {r['theory']:.3f} | {r['stage0']:.3f} | "
              f"{r['stage1']:.3f} |" for r in rows]
    command = "python experiments/pipeline/bubble.py " + " ".join(sys.argv[1:])
    text = (HERE / "README.template.md").read_text().format(
        command=command.strip(), table="\n".join(table), machine=f"{platform.machine()}, "
        f"{os.cpu_count()} CPU cores (load average {os.getloadavg()[0]:.1f} at the end), "
        f"torch {torch.__version__}, 1 thread per rank",
        settings=(f"fixed-duration stage work, forward {args.forward_ms:g} ms and backward "
                  f"{2 * args.forward_ms:g} ms per micro-batch" if args.compute == "fixed" else
                  f"Linear+GELU stages, width {args.width}, {args.depth} layers")
        + f", micro-batch {args.microbatch_size} x {args.width} floats sent between stages, "
          f"{args.warmup} warm-up + {args.steps} measured steps (median)")
    (HERE / "README.md").write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compute", choices=("fixed", "matmul"), default="fixed",
                        help="fixed: each micro-batch's forward takes --forward-ms (backward twice that); "
                             "matmul: real Linear layers (timings then include the machine's load)")
    parser.add_argument("--forward-ms", type=float, default=20.0)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--microbatch-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    rows = run(args)
    (HERE / "results.json").write_text(json.dumps(rows, indent=2))
    plot(rows, HERE / "bubble.png")
    write_readme(rows, args)
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
