"""The ``soak`` tests cut into ``SLICES`` slices of about equal time, for CI to run one of.

CI's 30 minutes hold ``make test``, ``make test-full`` and one fifth of ``make test-soak``:
``.ci/run`` runs slice ``(number of commits) mod SLICES`` (``make test-soak-slice``), so over any
``SLICES`` consecutive commits every soak test runs once.

The cut's unit is a group of tests that must run together: the soak tests of one module that
share a module-scoped fixture (a Ray cluster and its sweeps, a killed Optuna study), which a
slice holding any of them pays for whole. Cut test by test, such a fixture was paid in every
slice that held one of its tests, and counted in one (slice 0 of 2026-12-07: 806 s where its
recorded tests said 649, the Ray cluster's 360 s set-up paid twice). ``UNBINDING_FIXTURES``
names the module fixtures that only make a directory and so bind nothing.

A group goes to the slice with the least time so far, longest first, by its tests' seconds in
the last whole soak run (``tests/soak_seconds.json``, written by ``make soak-seconds`` from that
run's JUnit XML: a shared fixture is counted once there, in the test that set it up); a test
that run did not time counts as the median.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path

SLICES = 5
SECONDS = Path(__file__).resolve().parents[1] / "soak_seconds.json"
# Module-scoped fixtures that tie no tests together: a directory for the tests' runs (the
# combination draw's chunks share one, and are cut apart so that no slice holds the whole draw).
UNBINDING_FIXTURES = frozenset({"root"})


def recorded_seconds() -> dict[str, float]:
    return json.loads(SECONDS.read_text()) if SECONDS.exists() else {}


def seconds_of(seconds: dict[str, float]) -> Callable[[str], float]:
    """A test's recorded seconds; a test the record did not time counts as the median."""
    usual = statistics.median(seconds.values()) if seconds else 1.0
    return lambda node: seconds.get(node, usual)


def groups_sharing(node_fixtures: dict[str, Iterable[str]]) -> list[list[str]]:
    """Node ids grouped by the module-scoped fixtures they share (``node -> those fixtures'
    names``; a node id's module is the part before ``::``): two tests of one module asking for
    the same binding fixture are in one group, transitively; a test sharing none is alone."""
    parent = {node: node for node in node_fixtures}

    def root(node: str) -> str:
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    first_with: dict[tuple[str, str], str] = {}
    for node in sorted(node_fixtures):
        module = node.split("::", 1)[0]
        for fixture in sorted(set(node_fixtures[node]) - UNBINDING_FIXTURES):
            other = first_with.setdefault((module, fixture), node)
            parent[root(node)] = root(other)
    members: dict[str, list[str]] = {}
    for node in sorted(node_fixtures):
        members.setdefault(root(node), []).append(node)
    return list(members.values())


def slices(groups: list[list[str]], seconds: dict[str, float], count: int = SLICES) -> list[list[str]]:
    """``groups`` (lists of node ids that run together) cut into ``count`` slices of about equal
    recorded time (longest first, each to the slice with the least so far; ties by node id, so
    every process cuts alike)."""
    recorded = seconds_of(seconds)

    def cost(group: list[str]) -> float:
        return sum(recorded(node) for node in group)

    cut: list[list[str]] = [[] for _ in range(count)]
    totals = [0.0] * count
    for group in sorted((sorted(group) for group in groups), key=lambda group: (-cost(group), group)):
        lightest = min(range(count), key=lambda index: (totals[index], index))
        cut[lightest] += group
        totals[lightest] += cost(group)
    return cut


def parse_slice(text: str) -> tuple[int, int]:
    """``"K/N"`` (slice K of N, from 0) as ``(K, N)``."""
    index, _, count = text.partition("/")
    number, total = int(index), int(count or SLICES)
    if not 0 <= number < total:
        raise ValueError(f"--soak-slice={text}: the slice must be 0 to {total - 1}")
    return number, total


def slice_of_this_commit(count: int = SLICES) -> int:
    """The slice CI runs at the checked-out commit: the number of commits to it, mod ``count``
    (a shallow clone, which cannot count them: its hash, mod ``count``)."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()

    try:
        if git("rev-parse", "--is-shallow-repository") == "false":
            return int(git("rev-list", "--count", "HEAD")) % count
        return int(git("rev-parse", "HEAD"), 16) % count
    except (OSError, subprocess.CalledProcessError, ValueError):
        return 0


def expected_wall_seconds(part: list[str], seconds: dict[str, float], workers: int = 2) -> int:
    """About how long a slice of these node ids runs on ``workers`` test processes: its tests'
    recorded seconds shared out, but no less than its longest module's (each module runs whole
    on one worker: pyproject's ``--dist loadfile``)."""
    recorded = seconds_of(seconds)
    by_module: dict[str, float] = {}
    for node in part:
        module = node.split("::", 1)[0]
        by_module[module] = by_module.get(module, 0.0) + recorded(node)
    return round(max(sum(by_module.values()) / workers, max(by_module.values(), default=0.0)))


if __name__ == "__main__":
    # The commit's slice (``.ci/run``; its time: pytest --soak-slice=K/5 --soak-slice-seconds=FILE).
    print(slice_of_this_commit())
