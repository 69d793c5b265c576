"""What replica groups cost without a fault: ``fault_tolerance=replicas`` against DDP and FSDP
at the same number of processes, the same global batch and the same steps.

Four pairs, each a baseline (A) and replica groups (B) of the same ranks:

- GPT-nano and Llama-tiny (``model=gpt``, ``model=llama``; micro batch 8 of 32 tokens, CPU);
- DDP on 2 ranks against 2 groups of 1 rank (``strategy=single`` in each);
- FSDP on 4 ranks against 2 groups of 2 FSDP ranks (HSDP with the groups as its replicate axis).

Every job trains ``--steps`` steps (no validation); the pairs' jobs run interleaved, A B A B
(``--rounds`` of each), so that load which comes and goes on the machine falls on both. A step's
time is the time between two optimizer steps of rank 0 (group 0's rank 0 for the groups), from
a callback this script adds to every job; the figure is the median over the steps after
``--warmup``, all rounds pooled, and the ratio B / A is the cost.

The per-step latencies of fault tolerance, two ways:

- in the replica jobs, each step's waits for the other groups (group 0's step record): the part
  of the quorum the forward and backward did not hide, the one sum over the groups (gradients and
  counts), the commit vote;
- alone (``--latency-groups``): G groups of 1 rank in this process (torchft managers on
  threads, one lighthouse, as a job's): a whole quorum's round trip, waited for, and a commit
  vote, for each G; the fit of the quorum's time against G is what ``docs/reliability.md``
  extrapolates to 8, 64 and 1,024 groups.

    python experiments/reliability/overhead.py            # record: about 25 min on 2 idle cores
    python experiments/reliability/overhead.py --steps 10 --rounds 1 --no-record   # try it

Record on a quiet machine (the script says the load average before and after, and refuses to
record above ``--max-load`` unless told). Results: ``overhead.json`` and the table between this
script's markers in ``README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback

from litscale.measure import flops

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TARGET = 1.05  # replica groups' median step over the baseline's (issue 59)
COMMON = ["trainer.accelerator=cpu", "data.batch_size=8", "data.seq_len=32", "data.max_bytes=400000",
          "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "logger=csv",
          "launcher.oversubscribe=true", "allowed_targets=[overhead]",
          "+callbacks.step_times._target_=overhead.StepTimes",
          "+callbacks.step_times.path=${paths.output_dir}/step_times.json"]
MODELS = {"GPT-nano": ["model=gpt", "model.net.preset=nano"], "Llama-tiny": ["model=llama", "model.net.preset=tiny"]}
LAYOUTS = {  # name: (baseline, replica groups), the same ranks
    "DDP 2 ranks vs 2 groups x 1": (["strategy=ddp", "trainer.devices=2"],
                                    ["fault_tolerance=replicas", "fault_tolerance.groups=2", "strategy=single",
                                     "trainer.devices=1"]),
    "FSDP 4 ranks vs 2 groups x 2 FSDP": (["strategy=fsdp", "trainer.devices=4"],
                                          ["fault_tolerance=replicas", "fault_tolerance.groups=2", "strategy=fsdp",
                                           "trainer.devices=2"]),
}


class StepTimes(Callback):
    """Rank 0's clock at the end of each optimizer step, written to ``path`` at the end of fit
    (the script adds it to every job; a replica group's copy writes in the group's own dir)."""

    def __init__(self, *, path: str) -> None:
        self.path = path
        self.times: list[float] = []
        self._step = -1

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self._step:  # an optimizer step ended (a dropped one does not count)
            self._step = trainer.global_step
            self.times.append(time.perf_counter())

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_rank == 0:
            Path(self.path).write_text(json.dumps(self.times))


def step_seconds(times: list[float], warmup: int) -> list[float]:
    """Each step's seconds after the first ``warmup`` steps."""
    return [b - a for a, b in zip(times[warmup:], times[warmup + 1:], strict=False)]


def median_step(job: dict, warmup: int) -> float:
    return statistics.median(step_seconds(job["times"], warmup))


def run_job(overrides: list[str], outputs: Path, steps: int) -> dict:
    """One job; its step times (rank 0's, group 0's rank 0's for replica groups) and, for replica
    groups, group 0's step record."""
    command = [sys.executable, "train.py", *COMMON, f"trainer.max_steps={steps}", *overrides]
    env = {**os.environ, "LITSCALE_OUTPUTS": str(outputs), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    started, load_at_start, clock = time.monotonic(), os.getloadavg()[0], flops.cpu_clock()
    process = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=3600, env=env)
    if process.returncode != 0:
        raise SystemExit(f"failed ({process.returncode}): {' '.join(command)}\n"
                         f"{process.stdout[-2000:]}{process.stderr[-2000:]}")
    found = sorted(p for p in outputs.glob("**/step_times.json")
                   if "replicas" not in p.parts or p.parent.name == "0")
    if len(found) != 1:
        raise SystemExit(f"expected one step_times.json of rank 0 (group 0) under {outputs}, found {found}")
    record = found[0].parent / "steps.jsonl"
    rows = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return {"wall_s": time.monotonic() - started, "times": json.loads(found[0].read_text()),
            "steps": [row for row in rows if "committed" in row],
            "load": [load_at_start, os.getloadavg()[0]],
            # cores other processes kept busy while it ran (the job, once reaped, is this script's own)
            "others_load": flops.others_load(clock)}


def measure_pairs(args: argparse.Namespace, scratch: Path) -> dict:
    results = {f"{model}, {layout}": {"baseline": [], "replica_groups": []} for model in MODELS for layout in LAYOUTS
               if args.only in f"{model}, {layout}"}
    for round_index in range(args.rounds):
        for model, model_overrides in MODELS.items():
            for layout, (baseline, groups) in LAYOUTS.items():
                name = f"{model}, {layout}"
                if name not in results:
                    continue
                for side, overrides in (("baseline", baseline), ("replica_groups", groups)):
                    outputs = scratch / f"{len(os.listdir(scratch)):03d}"
                    print(f"round {round_index + 1}: {name}: {side} ...", end="", flush=True)
                    job = run_job([*model_overrides, *overrides], outputs, args.steps)
                    print(f" {job['wall_s']:.0f} s, median step {median_step(job, args.warmup) * 1000:.1f} ms, "
                          f"load {job['load'][0]:.1f} -> {job['load'][1]:.1f}", flush=True)
                    results[name][side].append(job)
    return {name: summarize(jobs, args.warmup) for name, jobs in results.items()}


def summarize(jobs: dict, warmup: int) -> dict:
    baseline = [s for job in jobs["baseline"] for s in step_seconds(job["times"], warmup)]
    groups = [s for job in jobs["replica_groups"] for s in step_seconds(job["times"], warmup)]
    rows = [row for job in jobs["replica_groups"] for row in job["steps"][warmup:]]
    waits = {name: statistics.median(values) for name in ("quorum_wait_s", "reduce_s", "commit_s")
             if (values := [row[name] for row in rows if name in row])}
    a, b = statistics.median(baseline), statistics.median(groups)
    # Each round's B over its A, the two jobs run one after the other: load that comes and goes
    # between rounds falls on both sides of a round's ratio.
    rounds = [median_step(b_job, warmup) / median_step(a_job, warmup)
              for a_job, b_job in zip(jobs["baseline"], jobs["replica_groups"], strict=True)]
    return {"baseline_median_step_s": a, "replica_groups_median_step_s": b, "ratio": b / a,
            "ratio_per_round": rounds, "median_ratio_of_rounds": statistics.median(rounds),
            "load_per_job": {side: [job["load"] for job in runs] for side, runs in jobs.items()},
            "others_load_per_job": {side: [job.get("others_load") for job in runs] for side, runs in jobs.items()},
            "steps_timed": {"baseline": len(baseline), "replica_groups": len(groups)},
            "per_run_median_step_s": {side: [median_step(job, warmup) for job in runs] for side, runs in jobs.items()},
            "wall_s": {side: [job["wall_s"] for job in runs] for side, runs in jobs.items()},
            "replica_groups_median_waits_s": waits,
            "steps_with_fewer_groups": sum(1 for row in rows if row.get("groups", 2) < 2),
            "steps_dropped": sum(1 for row in rows if not row["committed"])}


# --- latencies of the quorum and the commit vote, G groups in this process --------------------


def quorum_latencies(groups: int, repeats: int) -> dict:
    """``groups`` groups of 1 rank, each a thread with its own torchft Manager (its own manager
    server and store), one lighthouse as the job's launcher starts it: the medians of a whole
    quorum's round trip (started and waited for together by every group), of a sum of one float
    over the groups (the collective's latency alone: its bytes are the gradients' under DDP too)
    and of a commit vote (group-local). A quorum's and a sum's time is each repeat's slowest
    group's: every group waits for the last."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer

    from litscale.app.replica_launch import HEARTBEAT_TIMEOUT_MS, QUORUM_TICK_MS
    from litscale.reliability.replica_groups import _quiet_torchft

    _quiet_torchft()
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=groups, join_timeout_ms=30000,
                                  heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS, quorum_tick_ms=QUORUM_TICK_MS)
    barrier = threading.Barrier(groups, timeout=120)
    timeout = timedelta(seconds=60)

    def group(index: int) -> tuple[list[float], list[float], list[float]]:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=lambda state: None,
                          state_dict=lambda: {}, min_replica_size=1, use_async_quorum=False, timeout=timeout,
                          quorum_timeout=timeout, connect_timeout=timeout, rank=0, world_size=1,
                          store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lighthouse.address(),
                          replica_id=f"group_{index}")
        quorums, sums, commits = [], [], []
        try:
            for repeat in range(repeats + 1):
                barrier.wait()
                started = time.perf_counter()
                manager.start_quorum()
                quorum_s = time.perf_counter() - started
                started = time.perf_counter()
                manager.allreduce(torch.zeros(1)).wait()
                sum_s = time.perf_counter() - started
                started = time.perf_counter()
                manager.should_commit()
                commit_s = time.perf_counter() - started
                if repeat:  # the first forms the groups' process group: not a step's
                    quorums.append(quorum_s)
                    sums.append(sum_s)
                    commits.append(commit_s)
            return quorums, sums, commits
        finally:
            manager.shutdown(wait=False)

    try:
        with ThreadPoolExecutor(groups) as pool:
            per_group = list(pool.map(group, range(groups)))
    finally:
        lighthouse.shutdown()
    def slowest(which: int) -> float:  # each repeat's slowest group (every group waits for the last)
        return statistics.median(max(times) for times in zip(*(timings[which] for timings in per_group), strict=True))

    return {"groups": groups, "repeats": repeats, "quorum_s": slowest(0), "sum_s": slowest(1),
            "commit_s": statistics.median(t for *_, commits in per_group for t in commits)}


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ``seconds = a + b x groups``."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


EXTRAPOLATE_TO = (8, 64, 1024)


def extrapolate(latencies: list[dict]) -> dict:
    """The model ``docs/reliability.md`` states, fitted to the latencies measured alone:

    - a quorum: ``a + b x groups`` (the lighthouse takes each group's request in turn under one
      lock and answers all of them; the rest is a round trip's);
    - the sum over the groups: ``c + d x (groups - 1)`` (gloo's ring: each of its 2 (G - 1)
      hops has a latency; the bytes are the gradients', the same as DDP's over the same ranks);
    - a commit vote: the median, whatever the groups (it is decided inside a group).

    A fit whose slope comes out below zero is taken as flat (the median). Empty with fewer than
    two group counts measured."""
    if len({row["groups"] for row in latencies}) < 2:
        return {}
    # A slope below 0 is the noise of a few close points, not a cost that falls with groups.
    a, b = fit_line([(row["groups"], row["quorum_s"]) for row in latencies])
    c, d = fit_line([(row["groups"] - 1, row["sum_s"]) for row in latencies])
    if b < 0:
        a, b = statistics.median(row["quorum_s"] for row in latencies), 0.0
    if d < 0:
        c, d = statistics.median(row["sum_s"] for row in latencies), 0.0
    commit = statistics.median(row["commit_s"] for row in latencies)
    return {"fit_s": {"quorum": [a, b], "sum": [c, d], "commit": commit},
            "rows": [{"groups": groups, "quorum_s": a + b * groups, "sum_latency_s": c + d * (groups - 1),
                      "commit_s": commit} for groups in EXTRAPOLATE_TO]}


# --- the record --------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of each job's median")
    parser.add_argument("--rounds", type=int, default=3, help="A B rounds of each pair")
    parser.add_argument("--latency-groups", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--latency-repeats", type=int, default=30)
    parser.add_argument("--max-load", type=float, default=1.5, help="refuse to record above this 1-minute load")
    parser.add_argument("--no-record", action="store_true", help="print the table, write nothing")
    parser.add_argument("--record-under-load", action="store_true", help="record whatever the load")
    parser.add_argument("--only", default="", help="the pairs whose name holds this, e.g. 'GPT-nano, DDP'")
    args = parser.parse_args()
    args.warmup = min(args.warmup, max(0, args.steps // 2 - 1))
    load_before = os.getloadavg()
    if not args.no_record and not args.record_under_load and load_before[0] > args.max_load:
        raise SystemExit(f"load average {load_before[0]:.1f} > --max-load {args.max_load}: timings would be "
                         "other work's; run on a quiet machine, or pass --no-record (or --record-under-load)")
    with tempfile.TemporaryDirectory() as scratch:
        pairs = measure_pairs(args, Path(scratch))
    latencies = [quorum_latencies(groups, args.latency_repeats) for groups in args.latency_groups]
    record = {"machine": f"{os.cpu_count()} cores, {platform.platform()}, Python {platform.python_version()}, "
                         f"torch {__import__('torch').__version__}",
              "date": time.strftime("%Y-%m-%d"),
              "command": "python experiments/reliability/overhead.py " + " ".join(sys.argv[1:]),
              "load_average": {"before": load_before, "after": os.getloadavg()},
              "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "target_ratio": TARGET,
              "pairs": pairs, "latencies": latencies, "extrapolated": extrapolate(latencies)}
    print(table(record))
    if args.no_record:
        return
    (HERE / "overhead.json").write_text(json.dumps(record, indent=1) + "\n")
    write_between(HERE / "README.md", "<!-- overhead: written by overhead.py -->", "<!-- end overhead -->",
                  table(record))
    if record["extrapolated"]:
        write_between(REPO / "docs" / "reliability.md",
                      "<!-- overhead extrapolation: written by experiments/reliability/overhead.py -->",
                      "<!-- end overhead extrapolation -->", docs_table(record))


def write_between(path: Path, start: str, end: str, text: str) -> None:
    """``text`` between the markers ``start`` and ``end`` of ``path``."""
    content = path.read_text()
    before, _, rest = content.partition(start)
    _, _, after = rest.partition(end)
    path.write_text(f"{before}{start}\n{text}\n{end}{after}")


def docs_table(record: dict) -> str:
    """The latencies measured and extrapolated, and what a step pays for them: the quorum's part
    beyond the forward and backward it runs beside (``F``), and the commit vote."""
    nano = [row["baseline_median_step_s"] for name, row in record["pairs"].items()
            if name.startswith("GPT-nano, DDP")]
    spans = ([("this machine's GPT-nano DDP step", nano[0])] if nano else []) + [("1 s", 1.0)]
    rows = [("measured", row["groups"], row["quorum_s"], row["sum_s"], row["commit_s"]) for row in record["latencies"]]
    rows += [("extrapolated", row["groups"], row["quorum_s"], row["sum_latency_s"], row["commit_s"])
             for row in record["extrapolated"]["rows"]]
    load = record["load_average"]["before"]
    lines = [f"From `overhead.json` ({record['date']}, {record['machine']}; load average {load[0]:.1f} at its "
             "start). A step's cost is the quorum's time beyond the forward and backward (F) it runs beside, "
             "plus the commit vote; the sum's latency is DDP's too over the same ranks.", "",
             "| groups | | quorum round trip, ms | commit vote, ms | sum's latency, ms | "
             + " | ".join(f"a step's cost, F = {label} ({seconds * 1000:.0f} ms), ms" for label, seconds in spans) + " |",
             "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in spans) + " |"]
    for kind, groups, quorum, total, commit in rows:
        costs = " | ".join(f"{(max(0.0, quorum - seconds) + commit) * 1000:.1f}" for _, seconds in spans)
        lines.append(f"| {groups} | {kind} | {quorum * 1000:.1f} | {commit * 1000:.2f} | {total * 1000:.1f} | {costs} |")
    return "\n".join(lines)


def table(record: dict) -> str:
    load = record["load_average"]
    lines = [f"Machine: {record['machine']}. Command: `{record['command']}` ({record['date']}). "
             f"{record['steps']} steps a job, the first {record['warmup']} left out, {record['rounds']} A B "
             f"round(s). Load average (1, 5, 15 min) {' / '.join(f'{x:.1f}' for x in load['before'])} before, "
             f"{' / '.join(f'{x:.1f}' for x in load['after'])} after.", "",
             "| model, layout | baseline median step, ms | replica groups, ms | ratio (target <= "
             f"{record['target_ratio']}) | each round's ratio | load at each job's start (A B ...; others: cores other "
             "processes kept busy while each ran) | quorum wait, ms | "
             "sum over the groups, ms | commit vote, ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in record["pairs"].items():
        waits = row["replica_groups_median_waits_s"]
        cells = [f"{waits[key] * 1000:.2f}" if key in waits else "-" for key in ("quorum_wait_s", "reduce_s", "commit_s")]
        met = "" if row["ratio"] <= record["target_ratio"] else " (missed)"
        loads = " ".join(f"{a[0]:.1f} {b[0]:.1f}" for a, b in zip(row["load_per_job"]["baseline"],
                                                                   row["load_per_job"]["replica_groups"], strict=True))
        others = row.get("others_load_per_job")
        if others:  # what other processes took of the cores while each job ran
            loads += " (others " + " ".join("-" if x is None else f"{x:.2f}" for a, b in zip(
                others["baseline"], others["replica_groups"], strict=True) for x in (a, b)) + ")"
        lines.append(f"| {name} | {row['baseline_median_step_s'] * 1000:.1f} | "
                     f"{row['replica_groups_median_step_s'] * 1000:.1f} | {row['ratio']:.3f}{met} | "
                     f"{', '.join(f'{r:.3f}' for r in row['ratio_per_round'])} | {loads} | {' | '.join(cells)} |")
    if record["latencies"]:
        lines += ["", "Alone (G groups of 1 rank in one process, on the same cores), median of "
                  f"{record['latencies'][0]['repeats']} (measured): a whole quorum waited for, a sum of one "
                  "float over the groups, a commit vote.", "",
                  "| groups | quorum round trip, ms | sum's latency, ms | commit vote, ms |", "| --- | --- | --- | --- |"]
        lines += [f"| {row['groups']} | {row['quorum_s'] * 1000:.2f} | {row['sum_s'] * 1000:.2f} | "
                  f"{row['commit_s'] * 1000:.2f} |" for row in record["latencies"]]
    if record.get("extrapolated"):
        (a, b), (c, d) = record["extrapolated"]["fit_s"]["quorum"], record["extrapolated"]["fit_s"]["sum"]
        lines += ["", f"Extrapolated (not measured): quorum = {a * 1000:.2f} + {b * 1000:.3f} x groups ms; sum's "
                  f"latency = {c * 1000:.2f} + {d * 1000:.3f} x (groups - 1) ms; commit vote constant.", "",
                  "| groups | quorum round trip, ms | sum's latency, ms | commit vote, ms |", "| --- | --- | --- | --- |"]
        lines += [f"| {row['groups']} | {row['quorum_s'] * 1000:.1f} | {row['sum_latency_s'] * 1000:.1f} | "
                  f"{row['commit_s'] * 1000:.2f} |" for row in record["extrapolated"]["rows"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
