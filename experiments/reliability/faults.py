"""Fault-injection suite: twelve faults, each a reproducible scenario on its engine, graded by
what the user gets.

    python experiments/reliability/faults.py                      # every scenario, once
    python experiments/reliability/faults.py --only sigkill nan   # some of them
    python experiments/reliability/faults.py --clean 3 --steps 500  # false alarms of clean runs

Each scenario (2-rank CPU DDP, GPT-nano, a checkpoint every 4 steps, 24 steps; the watchdog's step
limit 8 s) injects its fault, reads the job's lines as they come and grades: the line the user
sees (the first ``error:``/``litscale:`` line of the kind that names the fault), whether one
came (detected), the seconds from the fault to it, the steps lost (trained again after the
resume), data lost (a visible checkpoint that is not whole, a summary missing or short), and
whether the job finished: by itself, or after the same command with ``ckpt_path=auto``.
``--clean N``: N runs without a fault, the watchdog and straggler report at their defaults,
counting their alarms. Results: ``faults.json`` and the table in ``README.md`` between the
faults markers (``--clean`` adds its line there).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fault_runs import (
    HERE,
    REPO,
    TOLD,
    Run,
    SmallDisk,
    fault_record,
    launch,
    verdict,
    when_recorded,
)

from litscale.checkpoint.resume import (
    is_complete_checkpoint,
    newest_last_checkpoint,
    resumable_checkpoints,
)

STEPS, CHECKPOINT_EVERY, FAULT_STEP = 24, 4, 10
WATCHDOG_LIMIT_S = 8  # the default is max(60 s, 20 median steps): the hangs below would take a minute each
# GPT-nano on 2 CPU ranks (the tests' small run); RUN adds the scenarios' cadence.
BASE = ("trainer.accelerator=cpu", "trainer.devices=2", "strategy=ddp", "data.batch_size=8", "data.seq_len=32",
        "data.max_bytes=400000", "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false")
RUN = (*BASE, f"trainer.max_steps={STEPS}", f"trainer.val_check_interval={CHECKPOINT_EVERY}",
       "callbacks.preemption.check_every_n_steps=2", "callbacks.nonfinite_guard.patience=2",
       "callbacks.nonfinite_guard.check_every_n_steps=2", "callbacks.straggler.every_n_steps=4",
       "callbacks.straggler.windows=2")
QUICK_WATCHDOG = (f"callbacks.watchdog.timeout_s={WATCHDOG_LIMIT_S}",)
TIMEOUT_S = 240
# Lines a health check prints when it alarms (``--clean`` counts them).
ALARM = re.compile(r"^(error: |doctor: )|litscale: straggler|litscale: .*(heartbeat|hang watchdog)")


@dataclass
class Context:
    outputs: Path
    step_s: float  # the reference run's median step
    checkpoint_bytes: int  # its last.ckpt


def fault(kind: str, record: Path, *, step: int = FAULT_STEP, rank: int | None = None, **extra) -> list[str]:
    overrides = ["+callbacks.fault._target_=litscale.callbacks.faults.InjectFault", f"+callbacks.fault.kind={kind}",
                 f"+callbacks.fault.at_step={step}", f"+callbacks.fault.record={record}"]
    if rank is not None:
        overrides.append(f"+callbacks.fault.rank={rank}")
    return overrides + [f"+callbacks.fault.{key}={value}" for key, value in extra.items()]


def train(ctx: Context, name: str, *overrides: str, act=None, timeout: float = TIMEOUT_S) -> Run:
    """``python train.py`` with the suite's run and ``overrides``, in ``<outputs>/<name>``."""
    return launch([sys.executable, str(REPO / "train.py"), *RUN, *overrides, f"name={name}",
                   f"hydra.run.dir={ctx.outputs}/{name}"], outputs=ctx.outputs, timeout=timeout, act=act)


def checkpoint_step(path: str | None) -> int | None:
    import torch

    return None if path is None else int(torch.load(path, map_location="cpu", weights_only=True,
                                                     mmap=True)["global_step"])


def summary_steps(run_dir: Path, since: float = 0.0) -> int | None:
    """The steps of the run's summary, if one was written after ``since``."""
    path = run_dir / "summary.json"
    if not path.exists() or path.stat().st_mtime < since:
        return None
    return json.loads(path.read_text()).get("steps")


def data_lost(run_dir: Path, finished: bool, torn_by_the_fault: tuple[str, ...] = ()) -> str:
    """'none', or what a user lost: a visible checkpoint that is not whole (other than those
    the fault itself tore, which are named as left), a summary missing or short."""
    torn = sorted(Path(p).name for p in resumable_checkpoints(str(run_dir)) if not is_complete_checkpoint(p))
    lost = [name for name in torn if name not in torn_by_the_fault]
    problems = [f"incomplete {', '.join(lost)}"] if lost else []
    if finished and summary_steps(run_dir) != STEPS:
        problems.append("summary.json missing or short")
    left = [name for name in torn if name in torn_by_the_fault]
    return "; ".join(problems) or ("none" + (f" (the torn {', '.join(left)} left in place)" if left else ""))


def graded(ctx: Context, name: str, first: Run, *, told: str, fault_at: float | None, fault_step: int | None,
           resume_overrides: tuple[str, ...] = (), note: str = "", torn_by_the_fault: tuple[str, ...] = ()) -> dict:
    """Grade a scenario's run; when it did not finish, run the same command with
    ``ckpt_path=auto`` (the user's next move) and grade the two together."""
    run_dir = ctx.outputs / name
    # finished: the run's summary, all steps in it (a launcher killed while its ranks went on counts)
    finished, resumed_from, runs = summary_steps(run_dir, first.started) == STEPS, None, [first]
    if not finished:
        resumed_from = checkpoint_step(newest_last_checkpoint(str(run_dir)))
        again = train(ctx, name, *resume_overrides, "ckpt_path=auto")
        runs.append(again)
        finished = again.exit == 0 and summary_steps(run_dir, again.started) == STEPS
    lines = [line for run in runs for line in run.lines]
    said = verdict(lines, fault_at or first.started, re.compile(told))
    # what the fault's own run printed after it, for a reader of faults.json
    printed = [line for at, line in first.lines if at >= (fault_at or first.started) and TOLD.search(line)][:4]
    lost = 0 if resumed_from is None and finished and len(runs) == 1 else (
        None if fault_step is None else max(0, fault_step - (resumed_from or 0)))
    return {"verdict": said.line, "detected": said.detected, "seconds": said.seconds, "steps_lost": lost,
            "resumed_from_step": resumed_from, "data_lost": data_lost(run_dir, finished, torn_by_the_fault),
            "finished": finished,
            "exits": [run.exit for run in runs], "stray": [p for run in runs for p in run.stray],
            "run_seconds": round(sum(run.seconds for run in runs), 1), "printed_after_the_fault": printed,
            "note": note}


def injected(ctx: Context, name: str, kind: str, told: str, *, extra: tuple[str, ...] = (), note: str = "",
             **fault_options) -> dict:
    """A fault ``InjectFault`` makes inside the job, timed from its own record of acting."""
    record = ctx.outputs / f"{name}.fault.jsonl"
    first = train(ctx, name, *fault(kind, record, **fault_options), *extra)
    acted = fault_record(record)
    return graded(ctx, name, first, told=told, fault_at=acted and acted["time"],
                  fault_step=acted and acted["step"], note=note)


# --- the scenarios -----------------------------------------------------------------------------

def sigkill(ctx: Context) -> dict:
    return injected(ctx, "sigkill", "sigkill", r"^error: rank 1 failed", rank=1)


def freeze(ctx: Context) -> dict:
    return injected(ctx, "freeze", "freeze", r"^error: hang at step", rank=0, extra=QUICK_WATCHDOG,
                    note="rank 0 (whose watchdog freezes with it): the standby on rank 1 names it")


def skip_collective(ctx: Context) -> dict:
    return injected(ctx, "skip_collective", "skip_collective", r"^error: hang at step", rank=1, extra=QUICK_WATCHDOG)


def wrong_shape(ctx: Context) -> dict:
    return injected(ctx, "wrong_shape", "wrong_shape", r"^error: hang at step", rank=1, extra=QUICK_WATCHDOG,
                    note="the hang line blames rank 0 (waiting outside a declared collective); the doctor's "
                         "line names both sides of the all-reduce")


def nan(ctx: Context) -> dict:
    # (a run named "nan" would read as a float)
    return injected(ctx, "nan_weights", "nan_weights", r"^error: .*NonFiniteLossError")


def slow(ctx: Context) -> dict:
    delay = round(0.3 * ctx.step_s, 3)
    return injected(ctx, "slow", "slow", r"^litscale: straggler: rank 1", rank=1, step=0, delay_s=delay,
                    note=f"+{delay} s in every step of rank 1 (30% of the {ctx.step_s:.3f} s median step); "
                         "straggler windows of 4 steps, 2 in a row")


def preempted(ctx: Context) -> dict:
    return injected(ctx, "preempted", "sigterm", r"termination signal", rank=0,
                    note="SIGTERM to the job's launcher, as a spot reclaim or SLURM sends it; ranks agree "
                         "every 2 steps")


def full_disk(ctx: Context) -> dict:
    """The checkpoints dir on a tmpfs with room for 2.5 checkpoints: the step-4 save (its step
    file and last.ckpt) fits, the step-8 save's staging copy does not. A real file system that
    fills up, rather than an injected ENOSPC: what the save leaves behind is part of the grade."""
    name, record, size = "full_disk", ctx.outputs / "full_disk.fault.jsonl", int(2.5 * ctx.checkpoint_bytes)
    save_step = 2 * CHECKPOINT_EVERY
    try:
        with SmallDisk(ctx.outputs / name / "checkpoints", size):
            # a clock, not a fault: it marks the start of step 8, whose end saves
            first = train(ctx, name, *fault("slow", record, step=save_step - 1, rank=0, delay_s=0.001, for_steps=1))
    except subprocess.CalledProcessError as error:  # not root, or no tmpfs: say so, run the rest
        return {"verdict": f"not run: {' '.join(error.cmd[:3])} failed ({error.stderr.strip()})", "detected": False,
                "seconds": None, "steps_lost": None, "resumed_from_step": None, "data_lost": "n/a",
                "finished": False, "exits": [], "stray": [], "run_seconds": None, "note": ""}
    marker = fault_record(record)
    return graded(ctx, name, first, told=r"^error: .*(No space|space left|ENOSPC|[Ww]rit)",
                  fault_at=marker and marker["time"], fault_step=save_step,
                  note=f"tmpfs of {size} bytes on checkpoints/ (mount as root); seconds from the start of step 8, "
                       "whose end saves; the files put back on the real disk before the resume")


def lost_store(ctx: Context) -> dict:
    """SIGKILL to the process hosting the job's TCPStore: litscale's launcher, whose torch elastic
    agent hosts the rendezvous store its ranks (and their heartbeats) use, at step 10."""
    import os
    import signal

    name, record = "lost_store", ctx.outputs / "lost_store.fault.jsonl"
    clock = fault("slow", record, rank=0, delay_s=0.001, for_steps=1)  # marks step 10, changes nothing
    first = train(ctx, name, *clock, act=when_recorded(record, lambda p: os.kill(p.pid, signal.SIGKILL)),
                  timeout=120)
    # the line that names the cause: a health thread's "heartbeat stopped" does not
    return graded(ctx, name, first, told=r"^error: |litscale: launcher lost",
                  fault_at=first.acted_at, fault_step=FAULT_STEP,
                  note="the launcher SIGKILLed; its ranks lose the store")


def torn_checkpoint(ctx: Context) -> dict:
    """The reference run's checkpoints (one every 4 steps, all kept), its newest save (step 24:
    last.ckpt and step000024.ckpt) cut in half, newer than the rest; then ``ckpt_path=auto``."""
    name = "torn"
    shutil.copytree(ctx.outputs / "reference", ctx.outputs / name)
    (ctx.outputs / name / "summary.json").unlink()
    checkpoints = ctx.outputs / name / "checkpoints"
    torn_names = ("last.ckpt", f"step{STEPS:06d}.ckpt")
    for torn in (checkpoints / torn_name for torn_name in torn_names):
        data = torn.read_bytes()
        torn.write_bytes(data[: len(data) // 2])
    started = time.time()
    first = Run(exit=1, lines=[], started=started, seconds=0.0)  # nothing ran: the fault is on disk
    # resumed as the run that wrote them saved (every checkpoint kept)
    return graded(ctx, name, first, told=r"(torn|incomplete|truncated|skipp|cut short)", fault_at=started,
                  fault_step=STEPS, resume_overrides=("callbacks.model_checkpoint.save_top_k=-1",),
                  torn_by_the_fault=torn_names,
                  note="the newest save (last.ckpt, step000024.ckpt) truncated to half; seconds from the "
                       "resume's start")


SCENARIOS: dict[str, tuple[str, str, Callable[[Context], dict]]] = {
    "sigkill": ("SIGKILL of rank 1 at step 10", "litscale launcher", sigkill),
    "freeze": ("SIGSTOP of rank 0 at step 10 (frozen process)", "litscale launcher", freeze),
    "skip_collective": ("rank 1 skips its gradient all-reduce at step 10", "litscale launcher", skip_collective),
    "wrong_shape": ("rank 1 all-reduces a metric of the wrong shape at step 10", "litscale launcher", wrong_shape),
    "nan": ("NaN weights on every rank at step 10", "litscale launcher", nan),
    "slow": ("rank 1 slow (1.3x step) from step 0", "litscale launcher", slow),
    "full_disk": ("disk full during the step-8 save", "litscale launcher", full_disk),
    "lost_store": ("the TCPStore's host killed at step 10", "litscale launcher", lost_store),
    "preempted": ("spot node preempted (SIGTERM) at step 10", "litscale launcher", preempted),
    "torn": ("torn checkpoint (newest save truncated)", "litscale launcher", torn_checkpoint),
}


def reference(ctx: Context) -> tuple[float, int]:
    """A run without a fault, every checkpoint kept: its median step and checkpoint size."""
    run = train(ctx, "reference", "callbacks.model_checkpoint.save_top_k=-1")
    summary_path = ctx.outputs / "reference" / "summary.json"
    if run.exit != 0 or not summary_path.exists():
        sys.exit(f"the reference run failed:\n{run.text()[-3000:]}")
    summary = json.loads(summary_path.read_text())
    return float(summary["perf/step_time_s"]), (ctx.outputs / "reference" / "checkpoints" / "last.ckpt").stat().st_size


def pod_deleted(ctx: Context) -> dict:
    from fault_engines import pod_deleted as on_the_stub

    return on_the_stub(ctx.outputs)


def ray_worker_killed(ctx: Context) -> dict:
    from fault_engines import ray_worker_killed as on_local_ray

    record = ctx.outputs / "ray.fault.jsonl"
    return on_local_ray(ctx.outputs, RUN, fault("sigkill", record, rank=1), record, STEPS, TIMEOUT_S + 120)


SCENARIOS.update({
    "pod_deleted": ("Kubernetes pod deleted (TrainJob)", "k8s launcher, stub API server", pod_deleted),
    "ray": ("Ray worker of rank 1 killed at step 10", "hydra/launcher=ray, local Ray", ray_worker_killed),
})


# --- clean runs: false alarms ---------------------------------------------------------------------

def clean_run(ctx: Context, index: int, steps: int) -> dict:
    """A run without a fault, the health checks at their defaults (watchdog, straggler report)."""
    name = f"clean{index:02d}"
    run = launch([sys.executable, str(REPO / "train.py"), *BASE, f"trainer.max_steps={steps}",
                  "trainer.val_check_interval=100", f"name={name}", f"hydra.run.dir={ctx.outputs}/{name}"],
                 outputs=ctx.outputs, timeout=max(TIMEOUT_S, 3 * steps))
    alarms = [line for _, line in run.lines if ALARM.search(line)]
    failed = run.exit != 0  # why, for a reader of faults.json
    return {"exit": run.exit, "steps": summary_steps(ctx.outputs / name), "alarms": alarms,
            "seconds": round(run.seconds, 1), "stray": run.stray,
            "last_lines": [line for _, line in run.lines][-6:] if failed else []}


# --- the record -----------------------------------------------------------------------------------

def machine() -> str:
    import os
    import platform

    import torch

    return (f"{os.cpu_count()} cores, {platform.system()} {platform.release()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}")


def cell(value) -> str:
    """A table cell: yes/NO, n/a for none, a temporary outputs dir left out of paths."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "**NO**"
    return re.sub(r"/tmp/tmp\w+/", "", str(value)).replace("|", "\\|")


def table(results: dict) -> str:
    rows = results.get("faults", [])
    commands = sorted({row.get("command", results["command"]) for row in rows}) or [results["command"]]
    lines = [f"Machine: {results['machine']}. {'Commands' if len(commands) > 1 else 'Command'}: "
             f"{'; '.join(f'`{c}`' for c in commands)} ({results['date']}).", ""]
    if rows:
        detected = sum(row["detected"] for row in rows)
        finished = sum(row["finished"] for row in rows)
        lines += [f"{detected}/{len(rows)} faults named by a litscale line, {finished}/{len(rows)} jobs finished.", "",
                  "| fault | engine | what the user sees | detected | s to the line | steps lost | data lost | "
                  "finished | stray |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {row['fault']} | {row['engine']} | `{cell(row['verdict'])}` | {cell(row['detected'])} | "
                  f"{cell(row['seconds'])} | {cell(row['steps_lost'])} | {cell(row['data_lost'])} | "
                  f"{cell(row['finished'])} | {'YES' if row['stray'] else 'none'} |" for row in rows]
        notes = [f"- {row['fault']}: {row['note']}" for row in rows if row.get("note")]
        lines += ["", *notes] if notes else []
    clean = results.get("clean")
    if clean:
        alarms = sum(len(run["alarms"]) for run in clean["runs"])
        ok = sum(run["exit"] == 0 and run["steps"] == clean["steps"] for run in clean["runs"])
        lines += ["", f"Clean runs (`{clean['command']}`, {clean['date']}): {len(clean['runs'])} runs of "
                      f"{clean['steps']} steps, 2 ranks, watchdog and straggler report at their defaults: "
                      f"{ok} finished, {alarms} false alarms (an `error:` line, the doctor's, a straggler or a "
                      "health thread's warning)."]
    return "\n".join(lines) + "\n"


def write_readme(results: dict) -> None:
    readme = HERE / "README.md"
    begin, end = "<!-- faults: written by faults.py -->", "<!-- end faults -->"
    text = readme.read_text()
    if begin not in text:
        text += f"\n{begin}\n{end}\n"
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    readme.write_text(f"{head}{begin}\n{table(results)}{end}{tail}")


def run_scenarios(names: list[str], outputs: Path) -> tuple[list[dict], float]:
    ctx = Context(outputs, 0.0, 0)
    ctx.step_s, ctx.checkpoint_bytes = reference(ctx)
    rows = []
    for name in names:
        title, engine, scenario = SCENARIOS[name]
        started = time.monotonic()
        row = {"scenario": name, "fault": title, "engine": engine, **scenario(ctx)}
        rows.append(row)
        print(f"{name} ({time.monotonic() - started:.0f} s): {json.dumps(row)}", flush=True)
    return rows, ctx.step_s


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(SCENARIOS), help="these scenarios (default: all)")
    parser.add_argument("--clean", type=int, default=0, help="N clean runs instead of the faults")
    parser.add_argument("--steps", type=int, default=500, help="steps of each clean run")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--outputs", help="keep the runs' dirs here (default: a temporary dir)")
    args = parser.parse_args(argv)
    command = "python experiments/reliability/faults.py " + " ".join(argv if argv is not None else sys.argv[1:])
    recorded = HERE / "faults.json"
    results = json.loads(recorded.read_text()) if recorded.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = args.outputs or tmp
        if args.clean:
            ctx = Context(Path(tmp), 0.0, 0)
            runs = []
            for index in range(args.clean):
                runs.append(clean_run(ctx, index, args.steps))
                print(f"clean {index}: {json.dumps(runs[-1])}", flush=True)
            results["clean"] = {"command": command.strip(), "date": time.strftime("%Y-%m-%d"),
                                "steps": args.steps, "runs": runs}
        else:
            rows, step_s = run_scenarios(args.only or list(SCENARIOS), Path(tmp))
            # a scenario run again replaces its row; the others keep theirs
            by_name = {row["scenario"]: row for row in [*results.get("faults", []), *rows]}
            for row in rows:
                row["command"] = command.strip()
            results.update(faults=[by_name[name] for name in SCENARIOS if name in by_name], step_s=step_s,
                           command=command.strip(), date=time.strftime("%Y-%m-%d"))
    results.setdefault("command", command.strip())
    results.setdefault("date", time.strftime("%Y-%m-%d"))
    results["machine"] = machine()
    print(table(results))
    if not args.no_write:
        recorded.write_text(json.dumps(results, indent=2) + "\n")
        write_readme(results)


if __name__ == "__main__":
    main()
