"""The soak set's slices (``helpers.soak_slices``): every soak test in exactly one, about equal
time each, the tests that share a module fixture in one, cut alike in every process; CI runs
the commit's if its expected time fits."""

from __future__ import annotations

import pytest
from helpers.soak_slices import SLICES, expected_wall_seconds, groups_sharing, parse_slice, slices


def alone(nodes) -> list[list[str]]:
    return [[node] for node in nodes]


def test_every_test_is_in_exactly_one_slice_and_the_slices_take_about_equal_time():
    seconds = {f"tests/test_x.py::test_{i}": float(i % 17 + 1) for i in range(60)}
    cut = slices(alone(seconds), seconds)
    assert sorted(node for part in cut for node in part) == sorted(seconds)
    totals = [sum(seconds[node] for node in part) for part in cut]
    assert len(cut) == SLICES and max(totals) - min(totals) <= max(seconds.values())


def test_the_cut_is_the_same_whatever_order_the_tests_come_in():
    seconds = {"a": 3.0, "b": 3.0, "c": 1.0}
    nodes = ["a", "b", "c", "d"]  # d: not timed, counted as the median
    assert slices(alone(nodes), seconds, 2) == slices(alone(reversed(nodes)), seconds, 2)
    assert slices([["c", "a"], ["b"]], seconds, 2) == slices([["b"], ["a", "c"]], seconds, 2)


@pytest.mark.parametrize("text", ["5/5", "-1/5", "x"])
def test_a_slice_outside_the_set_is_refused(text):
    with pytest.raises(ValueError):
        parse_slice(text)


def test_tests_of_one_module_sharing_a_module_fixture_run_in_one_slice():
    """A Ray cluster set up for two tests is paid once, by the slice that holds both: cut apart,
    each slice paid it (slice 0 ran 806 s where its recorded tests said 649)."""
    fixtures = {
        "tests/test_ray.py::test_jobs": ["sweeps"],
        "tests/test_ray.py::test_restart": ["sweeps"],
        "tests/test_ray.py::test_alone": [],
        "tests/test_cluster.py::test_a": ["cluster"],
        "tests/test_cluster.py::test_b": ["cluster", "runs"],
        "tests/test_cluster.py::test_c": ["runs"],  # bound to test_a through test_b
        "tests/test_other.py::test_jobs": ["sweeps"],  # another module's fixture of that name
        "tests/test_combinations.py::test_chunk[0]": ["root"],  # a directory binds nothing
        "tests/test_combinations.py::test_chunk[1]": ["root"],
    }
    groups = sorted(groups_sharing(fixtures))
    assert groups == [["tests/test_cluster.py::test_a", "tests/test_cluster.py::test_b", "tests/test_cluster.py::test_c"],
                      ["tests/test_combinations.py::test_chunk[0]"], ["tests/test_combinations.py::test_chunk[1]"],
                      ["tests/test_other.py::test_jobs"], ["tests/test_ray.py::test_alone"],
                      ["tests/test_ray.py::test_jobs", "tests/test_ray.py::test_restart"]]
    seconds = {"tests/test_ray.py::test_jobs": 300.0, "tests/test_ray.py::test_restart": 5.0}
    for part in slices(groups, seconds, 3):
        assert ("tests/test_ray.py::test_jobs" in part) == ("tests/test_ray.py::test_restart" in part)


def test_a_slices_expected_time_is_its_tests_seconds_shared_by_the_workers_but_not_below_its_longest_module():
    """What ``.ci/run`` weighs against the time CI has left before it starts the commit's slice:
    each module runs whole on one worker (``--dist loadfile``)."""
    seconds = {"tests/test_a.py::x": 100.0, "tests/test_b.py::y": 60.0, "tests/test_c.py::z": 80.0}
    assert expected_wall_seconds(list(seconds), seconds, workers=2) == 120
    assert expected_wall_seconds(["tests/test_a.py::x", "tests/test_c.py::z"], seconds, workers=2) == 100
    assert expected_wall_seconds([], seconds, workers=2) == 0
