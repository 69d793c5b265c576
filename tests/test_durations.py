"""``tests/durations.py``: seconds per test and per file, read from pytest's JUnit XML."""

from __future__ import annotations

import durations

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_a" name="test_one" time="1.5" />
<testcase classname="tests.test_a" name="test_two[x]" time="2.0" />
<testcase classname="tests.test_b.TestGroup" name="test_three" time="10.25" />
<testcase classname="tests.test_b" name="test_skipped" time="0.0"><skipped /></testcase>
</testsuite></testsuites>"""


def test_seconds_are_added_up_per_file_slowest_first(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    times = durations.test_times(str(path))
    assert times["tests/test_a.py::test_two[x]"] == 2.0 and times["tests/test_b.py::test_three"] == 10.25
    assert durations.per_file(times) == {"tests/test_b.py": (10.25, 2), "tests/test_a.py": (3.5, 2)}
    text = durations.report(times, top=2, markdown=False)
    assert text.splitlines()[0] == "4 tests, 14 s in all (0.2 min)"
    assert text.splitlines()[-2:] == ["    10.2 s  tests/test_b.py::test_three", "     2.0 s  tests/test_a.py::test_two[x]"]
    assert "| `tests/test_b.py` | 2 | 10.2 | 74.5% |" in durations.report(times, top=2, markdown=True)
