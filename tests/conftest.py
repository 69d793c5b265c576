"""Fixtures every test module may ask for; shared harnesses live in ``tests/helpers/``."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# As train.py does for itself and its ranks: the torchmetrics that Lightning imports skips
# transformers and scipy, here and in every process a test starts (about 3 s of each one's
# start; litscale/torchmetrics_backends.py). Imported here, before any test module imports
# Lightning; the tests that use transformers import it themselves, as litscale does.
os.environ.setdefault("LITSCALE_SKIP_TORCHMETRICS_BACKENDS", "1")
# Python's default, where the environment turned it off (PYTHONDONTWRITEBYTECODE): the
# compiled tests and sources are kept in __pycache__/, so that each pytest worker, rank and
# train.py a test starts reads them instead of compiling again (about 2 s of each worker's
# collection: pytest rewrites the asserts of every test module it imports).
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
# The suite loads the machine itself (two workers, multi-rank runs): the planner would refuse to
# keep what a test times (litscale/planner/machine.py). The tests of that refusal set it.
os.environ.setdefault("LITSCALE_MAX_LOAD", "1000")
# The cache of every run a test starts (this machine's calibration, timed profiles, tokenized
# data) is the session's own, not the user's (~/.cache/litscale or $LITSCALE_CACHE): the suite left
# its runs' contradicted predictions in the user's profile cache, and its runs read the user's
# calibration (each then paid the planner's prediction after fit, where CI's fresh machine has
# none). Made by the first process that imports this file (pytest's, before its workers start:
# they inherit it and share what one of them calibrated); removed when that process exits.
SESSION_CACHE_ENV = "LITSCALE_TESTS_CACHE"
if SESSION_CACHE_ENV not in os.environ:
    os.environ[SESSION_CACHE_ENV] = tempfile.mkdtemp(prefix="litscale-tests-cache-")
    atexit.register(shutil.rmtree, os.environ[SESSION_CACHE_ENV], ignore_errors=True)
os.environ["LITSCALE_CACHE"] = os.environ[SESSION_CACHE_ENV]
import litscale  # noqa: E402, F401


@pytest.fixture
def outputs_root(tmp_path, monkeypatch) -> Path:
    """A tmp outputs root (``LITSCALE_OUTPUTS``) and data cache, so nothing lands in the repo."""
    root = tmp_path / "outputs"
    root.mkdir()
    monkeypatch.setenv("LITSCALE_OUTPUTS", str(root))
    monkeypatch.setenv("LITSCALE_CACHE", str(tmp_path / "cache"))
    return root


# The longest modules (tests/README.md's per-file seconds), handed out first (pyproject's
# `--no-loadscope-reorder` keeps this order; xdist's default hands out the modules with the most
# tests first, and a long module of few tests left to the end runs on one core while the other
# idles).
LONGEST_FIRST = ("test_parity.py", "test_combinations.py", "test_moving_runs.py", "test_hf.py", "test_reliability.py",
                 "test_docs.py", "test_validation.py", "test_configs.py", "test_scaling.py", "test_watchdog.py",
                 "test_torchrun_reliability.py", "test_checkpoints.py", "test_memory_table.py",
                 "test_planner_strategies.py", "test_fault_tolerance.py", "test_planner.py", "test_determinism.py",
                 "test_multinode.py", "test_rank_pool.py", "test_lr_scaling.py")


def pytest_addoption(parser) -> None:
    parser.addoption("--soak-slice", default=None, metavar="K/N",
                     help="of the soak tests, run only slice K of N (cut by time: tests/helpers/soak_slices.py)")
    parser.addoption("--soak-slice-seconds", default=None, metavar="FILE",
                     help="with --soak-slice: write the slice's expected wall seconds there (.ci/run, with --collect-only)")


def pytest_collection_modifyitems(config, items) -> None:
    """Each module's tests stay together and in order; the longest modules come first. With
    ``--soak-slice``, the soak tests of other slices are deselected.

    NOTE: whole modules, not the parity table's families one by one: xdist 3.8's `loadgroup`
    renames a test to add its group, which pytest 9.2's node ids no longer take, so every test
    went out alone and each worker ran the module fixtures (and fit each parity family) again."""
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    if config.getoption("--soak-slice"):
        _keep_soak_slice(config, items)


def _keep_soak_slice(config, items) -> None:
    from helpers.soak_slices import (
        expected_wall_seconds,
        groups_sharing,
        parse_slice,
        recorded_seconds,
        slices,
    )

    index, count = parse_slice(config.getoption("--soak-slice"))
    seconds = recorded_seconds()
    soak = {item.nodeid: _module_fixtures(item) for item in items if item.get_closest_marker("soak")}
    part = slices(groups_sharing(soak), seconds, count)[index]
    if config.getoption("--soak-slice-seconds"):
        Path(config.getoption("--soak-slice-seconds")).write_text(f"{expected_wall_seconds(part, seconds)}\n")
    kept = set(part)
    dropped = [item for item in items if item.get_closest_marker("soak") and item.nodeid not in kept]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        gone = {id(item) for item in dropped}
        items[:] = [item for item in items if id(item) not in gone]


def _module_fixtures(item) -> list[str]:
    """The module-scoped fixtures ``item`` asks for, directly or through other fixtures."""
    definitions = item._fixtureinfo.name2fixturedefs
    return [name for name in item.fixturenames if definitions.get(name) and definitions[name][-1].scope == "module"]


def pytest_sessionfinish(session) -> None:
    """Kill the rank pools ``helpers.distributed`` kept for the session (if a test used one):
    at once, rather than at interpreter exit."""
    distributed = sys.modules.get("helpers.distributed")
    if distributed is not None:
        distributed.shutdown_pools()
