"""The soak set's slices (``helpers.soak_slices``): every soak test in exactly one, about equal
time each, cut alike in every process; CI runs the commit's."""

from __future__ import annotations

import pytest
from helpers.soak_slices import SLICES, parse_slice, slices


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
