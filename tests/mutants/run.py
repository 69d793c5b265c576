"""``make mutants``: each planted defect of ``catalog.py`` run against the tests that must
catch it, and the table of what they did written into ``tests/README.md``.

    python tests/mutants/run.py                     # every row; the README's table rewritten
    python tests/mutants/run.py --only ddp-sum-not-mean fsdp-gradient-halved
    python tests/mutants/run.py --list              # the rows, without running them

The chosen rows' tests run clean first, all in one pytest session (one start, one rank pool, a
parity family's cells fitted together), then each row's tests with its defect, in a session of
their own that stops at its first failure. A row is **caught** when its tests pass clean, fail
with the defect, and the planted function ran (every interpreter that runs it says so in a
log): a failure in tests that never reached the defect is not a catch. Otherwise it
**survived** (the tests passed with the defect in, which ran), was **not reached** (the
function never ran, whether the tests passed or failed), or the row is **broken** (its tests
fail without the defect too, or pytest could not run them). The exit code is 0 only when
every row is caught.
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
# The clean session runs every test to the end and reports each one's outcome.
CLEAN_PYTEST = ["-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", "-rA"]
FAIL_FAST_ENV = "LITSCALE_COMBINATIONS_FAIL_FAST"
WHOLE_RUN = "(every row)"  # results.json: the seconds of the last run of every row


def _catalog():
    sys.path.insert(0, str(HERE))
    import plant

    return plant, plant.load_catalog()


def run_tests(tests: tuple[str, ...], env: dict[str, str], timeout: float) -> tuple[int, str, str, float]:
    """pytest on ``tests`` in ``env``: (exit code, the first failed test or "", pytest's one
    line on why it failed, seconds)."""
    started = time.monotonic()
    try:
        process = subprocess.run([sys.executable, *PYTEST, *tests], cwd=REPO, env=env, capture_output=True,
                                 text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, "timed out", "", time.monotonic() - started
    failed = re.search(r"^FAILED (\S+)(?: - (.*))?$", process.stdout, re.M)
    return (process.returncode, failed.group(1) if failed else "", (failed.group(2) or "")[:300] if failed else "",
            time.monotonic() - started)


def run_clean(tests: list[str], timeout: float) -> dict[str, str]:
    """``tests`` in one pytest session without a defect: each node id's outcome (a test
    function given without its parameters: each of its cases), PASSED, FAILED or ERROR."""
    try:
        process = subprocess.run([sys.executable, *CLEAN_PYTEST, *tests], cwd=REPO, env={**os.environ},
                                 capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {}
    return {test: outcome for outcome, test in re.findall(r"^(PASSED|FAILED|ERROR) (\S+)", process.stdout, re.M)}


def clean_failure(tests: tuple[str, ...], outcomes: dict[str, str]) -> str:
    """Why ``tests`` did not all pass in the clean session ("" when they did)."""
    for test in tests:
        found = {node: outcome for node, outcome in outcomes.items() if node == test or node.startswith(test + "[")}
        if not found:
            return f"{test} did not run without the defect"
        failed = [node for node, outcome in found.items() if outcome != "PASSED"]
        if failed:
            return f"{failed[0]} fails without the defect"
    return ""


def run_row(mutant, plant, clean: dict[str, str], timeout: float) -> dict:
    """The row's tests with its defect planted: its verdict, what failed, the seconds."""
    broken = clean_failure(mutant.tests, clean)
    if broken:
        return {"verdict": "broken", "detail": broken}
    with tempfile.NamedTemporaryFile("r", suffix=".log") as log:
        # COLUMNS: pytest cuts its one-line reason at the terminal's width, which a pipe lacks
        env = {**os.environ, "COLUMNS": "400", plant.MUTANT_ENV: mutant.name, plant.LOG_ENV: log.name, FAIL_FAST_ENV: "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE / "site"), os.environ.get("PYTHONPATH")]))}
        code, failed, why, seconds = run_tests(mutant.tests, env, timeout)
        reached = bool(log.read().strip())
    if code == 1 and reached:
        verdict = "caught"
    elif code in (0, 1) and not reached:
        verdict = "not reached"
    elif code == 0:
        verdict = "survived"
    else:
        verdict = "broken"
    return {"verdict": verdict, "caught_by": failed, "failure": why, "exit": code, "seconds": round(seconds, 1)}


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
    whole = results.get(WHOLE_RUN)
    timing = (f" The last run of every row: {whole['seconds'] / 60:.0f} min ({whole['clean_seconds'] / 60:.0f} min "
              f"of it the clean session), on {whole['machine']}." if whole else "")
    return "\n".join([f"{caught} of {len(rows)} planted defects caught.{timing}", "", *lines])


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
    tests = list(dict.fromkeys(test for mutant in chosen for test in mutant.tests))
    print(f"clean: {len(tests)} tests in one session", flush=True)
    started = time.monotonic()
    clean = run_clean(tests, args.timeout * len(tests))
    clean_seconds = time.monotonic() - started
    print(f"clean: {sum(o == 'PASSED' for o in clean.values())} of {len(clean)} passed "
          f"({clean_seconds:.0f} s)", flush=True)
    for mutant in chosen:
        result = results[mutant.name] = run_row(mutant, plant, clean, args.timeout)
        print(f"{mutant.name}: {result['verdict']} {result.get('caught_by', result.get('detail', ''))} "
              f"({result.get('seconds', 0)} s)", flush=True)
        RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    if not args.only:
        results[WHOLE_RUN] = {"seconds": round(time.monotonic() - started), "clean_seconds": round(clean_seconds),
                              "machine": f"{os.cpu_count()} cores, 15-minute load {os.getloadavg()[2]:.1f} at the end"}
        RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    write_readme(table(rows, results))
    missed = [m.name for m in chosen if results[m.name]["verdict"] != "caught"]
    print(f"{len(chosen) - len(missed)} of {len(chosen)} caught" + (f"; not: {', '.join(missed)}" if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
