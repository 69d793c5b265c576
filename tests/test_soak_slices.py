"""The soak set's slices (``helpers.soak_slices``): every soak test in exactly one, about equal
time each, cut alike in every process; CI runs the commit's."""

from __future__ import annotations

import pytest
from helpers import soak_slices
from helpers.soak_slices import SLICES, expected_wall_seconds, parse_slice, slices


def test_every_test_is_in_exactly_one_slice_and_the_slices_take_about_equal_time():
    seconds = {f"tests/test_x.py::test_{i}": float(i % 17 + 1) for i in range(60)}
    cut = slices(list(seconds), seconds)
    assert sorted(node for part in cut for node in part) == sorted(seconds)
    totals = [sum(seconds[node] for node in part) for part in cut]
    assert len(cut) == SLICES and max(totals) - min(totals) <= max(seconds.values())


def test_the_cut_is_the_same_whatever_order_the_tests_come_in():
    seconds = {"a": 3.0, "b": 3.0, "c": 1.0}
    nodes = ["a", "b", "c", "d"]  # d: not timed, counted as the median
    assert slices(nodes, seconds, 2) == slices(list(reversed(nodes)), seconds, 2)


@pytest.mark.parametrize("text", ["5/5", "-1/5", "x"])
def test_a_slice_outside_the_set_is_refused(text):
    with pytest.raises(ValueError):
        parse_slice(text)


def test_a_slices_expected_time_is_its_tests_recorded_seconds_shared_by_the_workers(monkeypatch):
    """What ``.ci/run`` weighs against the time CI has left before it starts the commit's slice."""
    seconds = {"a": 100.0, "b": 60.0, "c": 50.0, "d": 30.0}
    monkeypatch.setattr(soak_slices, "recorded_seconds", lambda: seconds)
    # longest first, each to the lightest slice so far: [a], [b], [c, d]
    assert [expected_wall_seconds(index, count=3, workers=2) for index in range(3)] == [50, 30, 40]
