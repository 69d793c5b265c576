"""litscale against plain PyTorch, side by side in one invocation: step-time overhead, start-up
time and CPU scaling efficiency. Each repetition runs litscale and its plain counterpart back
to back (alternating which goes first), so load on a shared machine falls on both; the
figures are medians over repetitions, and ratios litscale / plain.

    python experiments/bench/bench.py                      # everything, writes results here
    python experiments/bench/bench.py --studies overhead --repeats 3

- overhead: ``python train.py`` (default groups: callbacks, CSV logger, progress bar,
  scheduler, clipping) vs ``plain_loop.py``, 1 process and DDP with 2 CPU ranks; the step time
  is ``perf/step_time_s`` from summary.json vs the same interval timed in the plain loop.
- startup: launch of ``python train.py`` to the end of its first optimizer step, vs
  ``python -c "import torch, lightning"`` (and the plain loop's own time to its first step).
- one_step: a whole ``python train.py trainer.max_steps=1`` with every default, on a machine
  whose ``cluster=local_cpu`` calibration exists (so the run's summary carries the planner's
  prediction), launch to exit, vs ``python -c "import torch, lightning"``; minimum and median.
- scaling: DDP and FSDP, 1 rank (pinned to one core) and 2 ranks (one thread each), litscale vs
  plain torch DDP / FSDP2; efficiency = throughput(2) / (2 x throughput(1)).
- health: the cost of the hang watchdog's heartbeats and the straggler report: GPT-nano DDP on
  2 CPU ranks with every default vs the same without ``callbacks.watchdog`` and
  ``callbacks.straggler`` (goal: below 0.5% of a step).

Results: ``results.json``, ``scaling.png`` and the tables in ``README.md`` (between the
results markers), all written by this script.
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
from dataclasses import dataclass
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PYTHON = sys.executable
SOURCE: dict[str, str] = {}  # PYTHONPATH of another litscale source tree (--src), for before/after


@dataclass(frozen=True)
class Workload:
    """Model, batch and steps, the same on both sides."""

    preset: str = "nano"
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 60
    warmup: int = 10
    sizes: tuple[tuple[str, int], ...] = ()  # (n_layer|n_embd|n_head, value): preset overrides

    def litscale(self, strategy: str, devices: int) -> list[str]:
        """The train.py command line that matches ``plain_loop.py`` with ``plain()``."""
        return [
            "data=synthetic", f"data.seq_len={self.seq_len}", f"data.batch_size={self.batch_size}",
            f"model.net.preset={self.preset}", *(f"+model.net.{k}={v}" for k, v in self.sizes),
            "trainer.accelerator=cpu", f"trainer.max_steps={self.steps}",
            # the one validation pass comes after the last step, outside the timed interval
            f"trainer.val_check_interval={self.steps}", "trainer.limit_val_batches=2",
            f"callbacks.throughput.warmup_steps={self.warmup}", f"strategy={strategy}",
            f"trainer.devices={devices}", "name=bench",
        ]

    def plain(self, strategy: str, devices: int) -> list[str]:
        return [f"--strategy={strategy}", f"--devices={devices}", f"--preset={self.preset}",
                *(f"--{k.replace('_', '-')}={v}" for k, v in self.sizes),
                f"--seq-len={self.seq_len}", f"--batch-size={self.batch_size}",
                f"--steps={self.steps}", f"--warmup={self.warmup}"]


def workload(args: argparse.Namespace) -> Workload:
    return Workload(preset=args.preset, seq_len=args.seq_len, batch_size=args.batch_size,
                    steps=args.steps, warmup=args.warmup)


# Small enough that a step is a few milliseconds: what remains is the framework's own cost.
TINY = Workload(seq_len=16, batch_size=4, steps=400, sizes=(("n_layer", 1), ("n_embd", 32), ("n_head", 2)))


def pin(cores: int | None) -> list[str]:
    """``taskset`` prefix that limits a run (and its ranks) to the first ``cores`` cores."""
    return ["taskset", "-c", ",".join(map(str, range(cores)))] if cores else []


def run(command: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    process = subprocess.run(command, cwd=REPO, env={**os.environ, **(env or {})},
                             capture_output=True, text=True, timeout=900)
    if process.returncode:
        sys.exit(f"failed: {' '.join(command)}\n{process.stdout[-2000:]}\n{process.stderr[-3000:]}")
    return process


def litscale_step_time(work: Workload, strategy: str, devices: int, cores: int | None, tmp: Path,
                       extra: tuple[str, ...] = ()) -> float:
    outputs = Path(tempfile.mkdtemp(dir=tmp))
    run(pin(cores) + [PYTHON, "train.py", *work.litscale(strategy, devices), *extra],
        env={"LITSCALE_OUTPUTS": str(outputs), **SOURCE})
    (summary,) = outputs.glob("**/summary.json")
    return json.loads(summary.read_text())["perf/step_time_s"]


def plain_step_time(work: Workload, strategy: str, devices: int, cores: int | None, tmp: Path) -> float:
    out = tmp / "plain.json"
    run(pin(cores) + [PYTHON, str(HERE / "plain_loop.py"), *work.plain(strategy, devices), f"--out={out}"])
    return json.loads(out.read_text())["step_time_s"]


def paired(args, measure_a, measure_b) -> tuple[list[float], list[float]]:
    """``args.repeats`` measurements of each, interleaved, alternating which runs first."""
    a_times, b_times = [], []
    for repeat in range(args.repeats):
        order = [(measure_a, a_times), (measure_b, b_times)]
        for measure, times in order if repeat % 2 == 0 else order[::-1]:
            times.append(measure())
    return a_times, b_times


def summarize(litscale: list[float], plain: list[float]) -> dict:
    ratios = [a / b for a, b in zip(litscale, plain, strict=True)]
    return {"litscale_s": litscale, "plain_s": plain,
            "litscale_median_s": statistics.median(litscale),
            "plain_median_s": statistics.median(plain),
            "ratio_of_medians": statistics.median(litscale) / statistics.median(plain),
            "median_paired_ratio": statistics.median(ratios)}


def study_overhead(args, tmp: Path) -> dict:
    results = {}
    for label, work, strategy, devices in (
            ("GPT-nano, 1 process", workload(args), "single", 1),
            ("GPT-nano, DDP 2 CPU ranks", workload(args), "ddp", 2),
            ("tiny GPT (1 layer, d 32, seq 16, batch 4), 1 process", TINY, "single", 1)):
        print(f"overhead: {label}", flush=True)
        results[label] = summarize(*paired(
            args, partial(litscale_step_time, work, strategy, devices, None, tmp),
            partial(plain_step_time, work, strategy, devices, None, tmp)))
    return results


def timed_first_step(args, tmp: Path) -> float:
    marker = tmp / "first_step.json"
    marker.unlink(missing_ok=True)
    outputs = Path(tempfile.mkdtemp(dir=tmp))
    command = [PYTHON, "train.py", *workload(args).litscale("single", 1), "allowed_targets=[first_step]",
               "+callbacks.first_step._target_=first_step.FirstStepTime",
               f"+callbacks.first_step.path={marker}"]
    started = time.time()
    path = os.pathsep.join(filter(None, [SOURCE.get("PYTHONPATH"), str(HERE)]))
    run(command, env={"LITSCALE_OUTPUTS": str(outputs), "PYTHONPATH": path})
    return json.loads(marker.read_text())["first_step_end"] - started


def timed(command: list[str]) -> float:
    started = time.perf_counter()
    run(command)
    return time.perf_counter() - started


def study_startup(args, tmp: Path) -> dict:
    print("startup", flush=True)
    first_step, imports = paired(args, lambda: timed_first_step(args, tmp),
                                 lambda: timed([PYTHON, "-c", "import torch, lightning"]))
    result = summarize(first_step, imports)
    result["extra_s"] = result["litscale_median_s"] - result["plain_median_s"]
    return result


def timed_one_step_run(tmp: Path) -> float:
    outputs = Path(tempfile.mkdtemp(dir=tmp))
    started = time.perf_counter()
    run([PYTHON, "train.py", "trainer.max_steps=1"], env={"LITSCALE_OUTPUTS": str(outputs), **SOURCE})
    elapsed = time.perf_counter() - started
    (summary,) = outputs.glob("**/summary.json")
    if "plan/predicted_step_s" not in json.loads(summary.read_text()):
        sys.exit("one_step: the run's summary has no prediction: is this machine calibrated?")
    return elapsed


def study_one_step(args, tmp: Path) -> dict:
    """A whole 1-step run with every default on a calibrated machine, against the imports."""
    print("one_step", flush=True)
    check = "from litscale.planner.calibrate import calibration_path as c; print(c().exists())"
    if run([PYTHON, "-c", check], env=SOURCE).stdout.strip() != "True":
        run([PYTHON, "-m", "litscale.planner.calibrate"], env=SOURCE)
    timed_one_step_run(tmp)  # untimed: builds the byte corpus's cache and the bytecode once
    runs, imports = paired(args, lambda: timed_one_step_run(tmp),
                           lambda: timed([PYTHON, "-c", "import torch, lightning"]))
    result = summarize(runs, imports)
    result.update(litscale_min_s=min(runs), plain_min_s=min(imports), extra_min_s=min(runs) - min(imports))
    return result


def study_scaling(args, tmp: Path) -> dict:
    results = {}
    for strategy in ("ddp", "fsdp"):
        for devices in (1, 2):
            cores = 1 if devices == 1 else None  # one thread per rank either way
            print(f"scaling: {strategy} x {devices}", flush=True)
            results[f"{strategy} x {devices}"] = summarize(*paired(
                args, partial(litscale_step_time, workload(args), strategy, devices, cores, tmp),
                partial(plain_step_time, workload(args), strategy, devices, cores, tmp)))
        one, two = results[f"{strategy} x 1"], results[f"{strategy} x 2"]
        # Weak scaling (fixed micro batch): throughput ratio = step-time ratio.
        results[f"{strategy} efficiency"] = {
            side: one[f"{side}_median_s"] / two[f"{side}_median_s"] for side in ("litscale", "plain")}
    return results


# The callbacks of the health study's "without" side.
HEALTH_CALLBACKS = ("~callbacks.watchdog", "~callbacks.straggler")


def study_health(args, tmp: Path) -> dict:
    print("health: GPT-nano, DDP 2 CPU ranks, with / without the watchdog and straggler report", flush=True)
    work = workload(args)
    result = summarize(*paired(args, partial(litscale_step_time, work, "ddp", 2, None, tmp),
                               partial(litscale_step_time, work, "ddp", 2, None, tmp, HEALTH_CALLBACKS)))
    # A whole step's difference drowns in a shared machine's noise; the hooks' own time per
    # step, measured alone, says what they add.
    result["hooks_s_per_step"] = health_hooks_time()
    result["hooks_share"] = result["hooks_s_per_step"] / result["plain_median_s"]
    return result


def health_hooks_time(steps: int = 20000) -> float:
    """Seconds per step spent in the watchdog's and the straggler report's hooks on rank 0 (the
    one that also reads the others' figures), with its heartbeat thread publishing to a store."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from litscale.callbacks.straggler import StragglerReport
    from litscale.callbacks.watchdog import HangWatchdog
    from litscale.health.heartbeat import Heartbeat

    store = dist.HashStore()
    trainer = SimpleNamespace(global_step=0, global_rank=0, world_size=2, loggers=[], logger=None)
    watchdog, straggler = HangWatchdog(dirpath="unused"), StragglerReport(threshold=1e9)  # no report printed
    watchdog.heartbeat = Heartbeat(store, 0).start()
    straggler._store = store
    for rank in (1,):  # the other rank's figures, as it would publish them
        for window in range(steps // straggler.every_n_steps + 1):
            store.set(f"window/{window}/{rank}", json.dumps({"forward_s": 0.05, "step_s": 0.1}).encode())
    started = time.perf_counter()
    for step in range(steps):
        trainer.global_step = step
        for callback in (watchdog, straggler):
            callback.on_train_batch_start(trainer, None, None, step)
            callback.on_before_backward(trainer, None, None)
            callback.on_before_optimizer_step(trainer, None, None)
        trainer.global_step = step + 1
        for callback in (watchdog, straggler):
            callback.on_train_batch_end(trainer, None, None, None, step)
    elapsed = time.perf_counter() - started
    watchdog.heartbeat.close()
    return elapsed / steps


def machine() -> str:
    import lightning
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()
    return (f"{os.cpu_count()} cores ({cpu}), {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}, "
            f"lightning {lightning.__version__}")


def overhead_table(title: str, result: dict) -> list[str]:
    lines = [f"### {title}: median s/step (goal: ratio <= 1.03)", "",
             "| run | litscale | plain PyTorch | ratio of medians | median paired ratio |",
             "| --- | --- | --- | --- | --- |"]
    for label, r in result.items():
        lines.append(f"| {label} | {r['litscale_median_s']:.4f} | {r['plain_median_s']:.4f} | "
                     f"{r['ratio_of_medians']:.3f} | {r['median_paired_ratio']:.3f} |")
    return lines + [""]


def startup_table(title: str, r: dict) -> list[str]:
    return [f"### {title}: median s (goal: at most 1.5 s more than the imports)", "",
            "| `python train.py` to end of first step | `python -c \"import torch, lightning\"` | difference |",
            "| --- | --- | --- |",
            f"| {r['litscale_median_s']:.2f} | {r['plain_median_s']:.2f} | {r['extra_s']:+.2f} |", ""]


def one_step_table(title: str, r: dict) -> list[str]:
    return [f"### {title}: s, launch to exit (goal: within 3 s of the imports, minimum of the repetitions)", "",
            "| | `python train.py trainer.max_steps=1` (calibrated) | `python -c \"import torch, lightning\"` "
            "| difference |", "| --- | --- | --- | --- |",
            f"| minimum | {r['litscale_min_s']:.2f} | {r['plain_min_s']:.2f} | {r['extra_min_s']:+.2f} |",
            f"| median | {r['litscale_median_s']:.2f} | {r['plain_median_s']:.2f} | "
            f"{r['litscale_median_s'] - r['plain_median_s']:+.2f} |", ""]


def scaling_table(title: str, s: dict) -> list[str]:
    lines = [f"### {title}: 1 vs 2 ranks, one thread per rank (goal: within 2 points)", "",
             "| strategy | litscale s/step, 1 / 2 ranks | plain s/step, 1 / 2 ranks | "
             "litscale efficiency | plain efficiency | difference (points) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for strategy in ("ddp", "fsdp"):
        one, two, eff = s[f"{strategy} x 1"], s[f"{strategy} x 2"], s[f"{strategy} efficiency"]
        lines.append(
            f"| {strategy} | {one['litscale_median_s']:.4f} / {two['litscale_median_s']:.4f} | "
            f"{one['plain_median_s']:.4f} / {two['plain_median_s']:.4f} | "
            f"{eff['litscale']:.1%} | {eff['plain']:.1%} | "
            f"{100 * (eff['litscale'] - eff['plain']):+.1f} |")
    return lines + [""]


def health_table(title: str, r: dict) -> list[str]:
    return [f"### {title}: median s/step, GPT-nano DDP 2 CPU ranks (goal: below 0.5% of a step)", "",
            "| with the watchdog and straggler report | without | ratio of medians | median paired ratio "
            "| the hooks alone, per step | share of a step |",
            "| --- | --- | --- | --- | --- | --- |",
            f"| {r['litscale_median_s']:.4f} | {r['plain_median_s']:.4f} | {r['ratio_of_medians']:.4f} | "
            f"{r['median_paired_ratio']:.4f} | {r['hooks_s_per_step'] * 1e6:.1f} us | {r['hooks_share']:.3%} |", ""]


TABLES = {"overhead": ("Step-time overhead", overhead_table),
          "startup": ("Start-up", startup_table),
          "one_step": ("A 1-step run", one_step_table),
          "scaling": ("CPU scaling", scaling_table),
          "health": ("Health monitoring cost", health_table)}


def tables(results: dict) -> str:
    """Every recorded study (a tagged rerun, ``overhead (before)``, gets its own table)."""
    lines = []
    for key, result in results.items():
        study, _, tag = key.partition(" (")
        if study in TABLES:
            title, table = TABLES[study]
            lines += table(f"{title} ({tag}" if tag else title, result)
    return "\n".join(lines)


def plot_scaling(scaling: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strategies = ["ddp", "fsdp"]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for offset, side in ((-0.2, "litscale"), (0.2, "plain")):
        values = [100 * scaling[f"{s} efficiency"][side] for s in strategies]
        ax.bar([i + offset for i in range(len(strategies))], values, width=0.4,
               label="litscale" if side == "litscale" else "plain PyTorch")
    ax.set_xticks(range(len(strategies)), [s.upper() for s in strategies])
    ax.set_ylabel("scaling efficiency, 2 CPU ranks (%)")
    ax.axhline(100, color="grey", linewidth=0.8)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_readme(results: dict) -> None:
    readme = HERE / "README.md"
    text = readme.read_text()
    begin, end = "<!-- results: written by bench.py -->", "<!-- end results -->"
    runs = "\n".join(f"- {key}: `{run['command']}` ({run['repeats']} repetitions each, "
                     f"{run['date']})" for key, run in results["runs"].items())
    block = f"{begin}\nMachine: {results['machine']}.\n\n{runs}\n\n{tables(results)}{end}"
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    readme.write_text(head + block + tail)


STUDIES = {"overhead": study_overhead, "startup": study_startup, "one_step": study_one_step,
           "scaling": study_scaling, "health": study_health}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--studies", nargs="+", choices=list(STUDIES), default=list(STUDIES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--preset", default="nano")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--tag", help="record the results as '<study> (<tag>)', e.g. before a fix")
    parser.add_argument("--src", help="litscale's src/ to benchmark instead of this tree's "
                        "(e.g. an older checkout's, with --tag before)")
    parser.add_argument("--no-write", action="store_true", help="print the tables only")
    args = parser.parse_args(argv)
    if args.src:
        SOURCE["PYTHONPATH"] = str(Path(args.src).resolve())
    command = "python experiments/bench/bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.studies:
            results[f"{name} ({args.tag})" if args.tag else name] = STUDIES[name](args, Path(tmp))
    print(tables(results))
    if args.no_write:
        return
    path = HERE / "results.json"
    recorded = json.loads(path.read_text()) if path.exists() else {}
    recorded.update(results)  # a partial rerun keeps the other studies' last results
    recorded["machine"] = machine()
    run = {"command": command.strip(), "repeats": args.repeats, "date": time.strftime("%Y-%m-%d")}
    recorded.setdefault("runs", {}).update({key: run for key in results})
    path.write_text(json.dumps(recorded, indent=2) + "\n")
    if "scaling" in recorded:  # the untagged run
        plot_scaling(recorded["scaling"], HERE / "scaling.png")
    write_readme(recorded)


if __name__ == "__main__":
    main()
