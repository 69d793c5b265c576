"""What a test run cost: the slowest tests and the seconds per file, from pytest's JUnit XML.

    python -m pytest -m "not full" --junitxml=junit.xml   # or `make test`, which writes it
    python tests/durations.py junit.xml                    # the 20 slowest tests, every file
    python tests/durations.py junit.xml --top 50 --markdown

pytest's own ``--durations`` lists tests one by one and splits each into set-up, call and
tear-down; what a new capability costs CI is easier to read per file, so this adds them up.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict


def test_times(junit_path: str) -> dict[str, float]:
    """``{node id: seconds}`` of every test case in a JUnit XML file (set-up and tear-down included)."""
    times: dict[str, float] = {}
    for case in ElementTree.parse(junit_path).getroot().iter("testcase"):
        module = case.get("classname", "")
        path = "tests/" + module.removeprefix("tests.").split(".")[0] + ".py"
        times[f"{path}::{case.get('name')}"] = times.get(f"{path}::{case.get('name')}", 0.0) + float(
            case.get("time", 0.0))
    return times


def per_file(times: dict[str, float]) -> dict[str, tuple[float, int]]:
    """``{file: (seconds, tests)}``, slowest first."""
    files: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for node, seconds in times.items():
        files[node.split("::")[0]][0] += seconds
        files[node.split("::")[0]][1] += 1
    return dict(sorted(((f, (s, n)) for f, (s, n) in files.items()), key=lambda item: -item[1][0]))


def report(times: dict[str, float], *, top: int, markdown: bool) -> str:
    total = sum(times.values())
    slowest = sorted(times.items(), key=lambda item: -item[1])[:top]
    lines = [f"{len(times)} tests, {total:.0f} s in all ({total / 60:.1f} min)", ""]
    if markdown:
        lines += ["| file | tests | seconds | share |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| `{f}` | {n} | {s:.1f} | {s / total:.1%} |" for f, (s, n) in per_file(times).items()]
        lines += ["", "| slowest tests | seconds |", "| --- | ---: |"]
        lines += [f"| `{node}` | {s:.1f} |" for node, s in slowest]
    else:
        lines += [f"{s:8.1f} s {n:4d} tests  {f}" for f, (s, n) in per_file(times).items()]
        lines += ["", f"the {len(slowest)} slowest tests:"]
        lines += [f"{s:8.1f} s  {node}" for node, s in slowest]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", nargs="+", help="JUnit XML files (pytest --junitxml); several are added up")
    parser.add_argument("--top", type=int, default=20, help="how many of the slowest tests to list")
    parser.add_argument("--markdown", action="store_true", help="tables for tests/README.md")
    parser.add_argument("--soak-seconds", metavar="JSON", help="write each test's seconds there: the time the "
                        "soak slices are cut by (tests/helpers/soak_slices.py), from a whole soak run's XML")
    args = parser.parse_args(argv)
    times: dict[str, float] = {}
    for path in args.junit:
        for node, seconds in test_times(path).items():
            times[node] = times.get(node, 0.0) + seconds
    if args.soak_seconds:
        with open(args.soak_seconds, "w") as handle:
            json.dump({node: round(seconds, 1) for node, seconds in sorted(times.items())}, handle, indent=0)
            handle.write("\n")
    print(report(times, top=args.top, markdown=args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
