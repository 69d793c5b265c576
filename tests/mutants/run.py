"""``make mutants``: each planted defect of ``catalog.py`` run against the tests that must
catch it, and the table of what they did written into ``tests/README.md``.

    python tests/mutants/run.py                     # every row; the README's table rewritten
    python tests/mutants/run.py --only ddp-sum-not-mean fsdp-gradient-halved
    python tests/mutants/run.py --list              # the rows, without running them

A row is **caught** when its tests pass without the defect (each set of tests is run clean
once per invocation) and fail with it, and the planted function ran (every interpreter that
runs it says so in a log): a failure in tests that never reached the defect is not a catch.
Otherwise it **survived** (the tests passed with the defect in), was **not reached** (they
failed, but the function never ran), or the row is **broken** (its tests fail without the
defect too, or pytest could not run them). The exit code is 0 only when every row is caught.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
README = REPO / "tests" / "README.md"
RESULTS = HERE / "results.json"
BEGIN, END = "<!-- mutants: written by tests/mutants/run.py -->", "<!-- end mutants -->"
# Each row's tests stop at their first failure, and the combination sample at its first
# combination that differs from one process (the defect is caught by then).
PYTEST = ["-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-x", "-q", "-rf"]
FAIL_FAST_ENV = "LITSCALE_COMBINATIONS_FAIL_FAST"


def _catalog():
    sys.path.insert(0, str(HERE))
    import plant

    return plant, plant.load_catalog()


def run_tests(tests: tuple[str, ...], env: dict[str, str], timeout: float) -> tuple[int, str, float]:
    """pytest on ``tests`` in ``env``: (exit code, the first failed test or "", seconds)."""
    started = time.monotonic()
    try:
        process = subprocess.run([sys.executable, *PYTEST, *tests], cwd=REPO, env=env, capture_output=True,
                                 text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, "timed out", time.monotonic() - started
    failed = re.search(r"^FAILED (\S+)", process.stdout, re.M)
    return process.returncode, failed.group(1) if failed else "", time.monotonic() - started


def run_row(mutant, plant, clean: dict, timeout: float) -> dict:
    """The row's tests with its defect planted: its verdict, what failed, the seconds."""
    if clean[mutant.tests] != 0:
        return {"verdict": "broken", "detail": f"its tests fail without the defect (exit {clean[mutant.tests]})"}
    with tempfile.NamedTemporaryFile("r", suffix=".log") as log:
        env = {**os.environ, plant.MUTANT_ENV: mutant.name, plant.LOG_ENV: log.name, FAIL_FAST_ENV: "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE / "site"), os.environ.get("PYTHONPATH")]))}
        code, failed, seconds = run_tests(mutant.tests, env, timeout)
        reached = bool(log.read().strip())
    if code == 1 and reached:
        verdict = "caught"
    elif code == 0:
        verdict = "survived"
    elif code == 1:
        verdict = "not reached"
    else:
        verdict = "broken"
    return {"verdict": verdict, "caught_by": failed, "exit": code, "seconds": round(seconds, 1)}


def table(rows: list, results: dict) -> str:
    lines = ["| defect planted | function replaced | tests run | verdict (failed first) | s |",
             "| --- | --- | --- | --- | ---: |"]
    for mutant in rows:
        result = results.get(mutant.name, {"verdict": "not run"})
        tests = "<br>".join(f"`{test.removeprefix('tests/')}`" for test in mutant.tests)
        verdict = result["verdict"] + (f": `{result['caught_by'].removeprefix('tests/')}`"
                                       if result.get("caught_by") else "")
        lines.append(f"| **{mutant.name}**: {mutant.defect} | `{mutant.target}` | {tests} | {verdict} | "
                     f"{result.get('seconds', '')} |")
    caught = sum(results.get(m.name, {}).get("verdict") == "caught" for m in rows)
    return "\n".join([f"{caught} of {len(rows)} planted defects caught.", "", *lines])


def write_readme(block: str) -> None:
    text = README.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    README.write_text(text[:start] + "\n" + block + "\n" + text[end:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", help="run only these rows (by name)")
    parser.add_argument("--list", action="store_true", help="list the rows and exit")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a row's tests may take")
    args = parser.parse_args()
    plant, catalog = _catalog()
    rows = list(catalog.MUTANTS.values())
    if args.list:
        for mutant in rows:
            print(f"{mutant.name}: {mutant.defect}\n    {mutant.target}\n    " + "\n    ".join(mutant.tests))
        return 0
    chosen = [catalog.MUTANTS[name] for name in args.only] if args.only else rows
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    clean = {}
    for mutant in chosen:
        if mutant.tests not in clean:
            print(f"clean: {' '.join(mutant.tests)}", flush=True)
            clean[mutant.tests] = run_tests(mutant.tests, {**os.environ}, args.timeout)[0]
        result = results[mutant.name] = run_row(mutant, plant, clean, args.timeout)
        print(f"{mutant.name}: {result['verdict']} {result.get('caught_by', result.get('detail', ''))} "
              f"({result.get('seconds', 0)} s)", flush=True)
        RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    write_readme(table(rows, results))
    missed = [m.name for m in chosen if results[m.name]["verdict"] != "caught"]
    print(f"{len(chosen) - len(missed)} of {len(chosen)} caught" + (f"; not: {', '.join(missed)}" if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
