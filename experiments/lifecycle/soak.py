"""Soak: repeat short 2-process CPU DDP runs and count aborts and hangs.

    python experiments/lifecycle/soak.py --runs 20            # litscale and plain Lightning
    python experiments/lifecycle/soak.py --runs 3 --only litscale

A run counts as an abort when it exits non-zero or prints `terminate called` (the C++ abort
of a process group left alive at exit), and as a hang when it outlives --timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

COMMANDS = {
    "litscale": [sys.executable, str(REPO / "train.py"), "strategy=ddp", "trainer.accelerator=cpu",
                 "trainer.devices=2", "trainer.max_steps=5", "trainer.val_check_interval=5",
                 "trainer.limit_val_batches=1", "data.seq_len=32", "data.max_bytes=200000",
                 "logger=none", "trainer.enable_progress_bar=false"],
    "plain_lightning": [sys.executable, str(HERE / "plain_lightning.py")],
}


def run_once(command: list[str], timeout: float, outputs: str) -> dict:
    started = time.perf_counter()
    env = {**os.environ, "LITSCALE_OUTPUTS": outputs, "PYTHONUNBUFFERED": "1"}
    try:
        process = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                 cwd=REPO, env=env)
    except subprocess.TimeoutExpired:
        return {"outcome": "hang", "seconds": timeout}
    aborted = process.returncode != 0 or "terminate called" in process.stderr + process.stdout
    result = {"outcome": "abort" if aborted else "clean", "exit_code": process.returncode,
              "seconds": round(time.perf_counter() - started, 2)}
    if aborted:
        result["stderr_tail"] = process.stderr[-600:]
    return result


def soak(name: str, runs: int, timeout: float) -> dict:
    results = []
    with tempfile.TemporaryDirectory() as outputs:
        for index in range(runs):
            results.append(run_once(COMMANDS[name], timeout, outputs))
            print(f"{name} run {index + 1}/{runs}: {results[-1]}", flush=True)
    count = {o: sum(r["outcome"] == o for r in results) for o in ("clean", "abort", "hang")}
    seconds = sorted(r["seconds"] for r in results)
    return {"runs": runs, **count, "median_seconds": seconds[len(seconds) // 2], "results": results}


def write_readme(report: dict, readme: Path) -> None:
    """Replace the results block of the README with a table of ``report``."""
    rows = ["| command | runs | clean | aborts | hangs | median s |", "| --- | --- | --- | --- | --- | --- |"]
    for name, r in report.items():
        rows.append(f"| {name} | {r['runs']} | {r['clean']} | {r['abort']} | {r['hang']} | "
                    f"{r['median_seconds']} |")
    text = readme.read_text()
    start, end = "<!-- results: written by soak.py -->", "<!-- end results -->"
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    readme.write_text(f"{head}{start}\n" + "\n".join(rows) + f"\n{end}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=180)
    parser.add_argument("--only", choices=sorted(COMMANDS))
    parser.add_argument("--out", type=Path, default=HERE / "results.json")
    parser.add_argument("--report-only", action="store_true",
                        help="only rewrite README.md's results from --out")
    args = parser.parse_args()
    if args.report_only:
        write_readme(json.loads(args.out.read_text()), HERE / "README.md")
        return
    names = [args.only] if args.only else list(COMMANDS)
    report = {name: soak(name, args.runs, args.timeout) for name in names}
    args.out.write_text(json.dumps(report, indent=2))
    if args.out == HERE / "results.json":
        write_readme(report, HERE / "README.md")
    for name, result in report.items():
        print(f"{name}: {result['clean']} clean, {result['abort']} aborts, {result['hang']} hangs "
              f"of {result['runs']} (median {result['median_seconds']} s)")
    sys.exit(0 if all(r["abort"] == r["hang"] == 0 for n, r in report.items() if n == "litscale") else 1)


if __name__ == "__main__":
    main()
