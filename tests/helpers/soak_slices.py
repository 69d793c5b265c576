"""The ``soak`` tests cut into ``SLICES`` slices of about equal time, for CI to run one of.

CI's 30 minutes hold ``make test``, ``make test-full`` and one fifth of ``make test-soak``:
``.ci/run`` runs slice ``(number of commits) mod SLICES`` (``make test-soak-slice``), so over any
``SLICES`` consecutive commits every soak test runs once. A test goes to the slice with the
least time so far, longest first, by its seconds in the last whole soak run
(``tests/soak_seconds.json``, written by ``make soak-seconds`` from that run's JUnit XML); a test
that run did not time counts as the median and takes its place among the others.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

SLICES = 5
SECONDS = Path(__file__).resolve().parents[1] / "soak_seconds.json"


def recorded_seconds() -> dict[str, float]:
    return json.loads(SECONDS.read_text()) if SECONDS.exists() else {}


def slices(node_ids: list[str], seconds: dict[str, float], count: int = SLICES) -> list[list[str]]:
    """``node_ids`` cut into ``count`` slices of about equal recorded time (longest first, each to
    the slice with the least so far; ties by node id, so every process cuts alike)."""
    usual = statistics.median(seconds.values()) if seconds else 1.0
    cost = {node: seconds.get(node, usual) for node in node_ids}
    cut: list[list[str]] = [[] for _ in range(count)]
    totals = [0.0] * count
    for node in sorted(node_ids, key=lambda node: (-cost[node], node)):
        lightest = min(range(count), key=lambda index: (totals[index], index))
        cut[lightest].append(node)
        totals[lightest] += cost[node]
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


def expected_wall_seconds(index: int, count: int = SLICES, workers: int = 2) -> int:
    """About how long slice ``index`` runs on ``workers`` test processes: its tests' seconds in
    the last whole soak run (the tests of that run, cut as ``slices`` cuts them), shared out."""
    seconds = recorded_seconds()
    part = slices(list(seconds), seconds, count)[index]
    return round(sum(seconds[node] for node in part) / workers)


if __name__ == "__main__":
    import sys

    # `soak_slices.py`: the commit's slice; `soak_slices.py --seconds K`: slice K's expected wall time.
    if sys.argv[1:2] == ["--seconds"]:
        print(expected_wall_seconds(int(sys.argv[2])))
    else:
        print(slice_of_this_commit())
