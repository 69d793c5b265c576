"""The parity table in ``tests/README.md`` keeps every cell: each cell's test, listed under the
table, is collected by pytest, and in the run the list puts it in (``make test``, ``make test-full``
or ``make test-soak``); a cell collected but not listed fails too, so the list is the matrix."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
PARITY_TEST = "tests/test_parity.py::test_strategy_matches_one_process_step_by_step"

# Collects the parity module in a fresh interpreter (collection imports it, and test modules do
# not import each other) and prints each cell's id and the run it is in.
COLLECT = """
import json, sys, pytest
class Cells:
    found = {}
    def pytest_collection_modifyitems(self, items):
        for item in items:
            Cells.found[item.nodeid] = next((f"make test-{run}" for run in ("soak", "full")
                                             if item.get_closest_marker(run)), "make test")
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-n", "0", sys.argv[1]], plugins=[Cells()])
print("CELLS" + json.dumps(Cells.found))
sys.exit(code)
"""


RUNS = ("make test", "make test-full", "make test-soak")
HEADINGS = {f"{run}:" for run in RUNS}


def listed_cells() -> dict[str, str]:
    """``{cell id: the run it is in}`` from the list under the README's parity table."""
    text = (TESTS / "README.md").read_text()
    block = re.search(r"<!-- parity cells -->\n```text\n(.*?)```", text, re.S)
    assert block, "tests/README.md has no <!-- parity cells --> list under the parity table"
    cells, run = {}, None
    for line in block.group(1).splitlines():
        if line.strip() in HEADINGS:
            run = line.strip()[:-1]
        elif line.strip():
            assert run is not None, f"{line!r} comes before a heading naming its run ({', '.join(RUNS)})"
            cells[line.strip()] = run
    return cells


@pytest.mark.full
@pytest.mark.slow  # collects in a subprocess
@pytest.mark.timeout(120)
def test_every_cell_of_the_parity_table_is_collected_where_the_table_says():
    process = subprocess.run([sys.executable, "-c", COLLECT, "tests/test_parity.py"], cwd=TESTS.parent,
                             capture_output=True, text=True, timeout=110)
    assert process.returncode == 0, process.stdout[-2000:] + process.stderr[-2000:]
    collected = json.loads(process.stdout.split("CELLS", 1)[1])
    collected = {node[len(PARITY_TEST) + 1:-1]: run for node, run in collected.items()
                 if node.startswith(PARITY_TEST + "[")}
    listed = listed_cells()
    assert len(listed) > 100
    assert sorted(set(listed) - set(collected)) == [], "listed in tests/README.md but not collected"
    assert sorted(set(collected) - set(listed)) == [], "collected but missing from tests/README.md's list"
    moved = sorted(cell for cell in listed if listed[cell] != collected[cell])
    assert moved == [], "in another run than tests/README.md says (make test, make test-full, make test-soak)"
