"""Fixtures every test module may ask for; shared harnesses live in ``tests/helpers/``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


@pytest.fixture
def outputs_root(tmp_path, monkeypatch) -> Path:
    """A tmp outputs root (``LITSCALE_OUTPUTS``) and data cache, so nothing lands in the repo."""
    root = tmp_path / "outputs"
    root.mkdir()
    monkeypatch.setenv("LITSCALE_OUTPUTS", str(root))
    monkeypatch.setenv("LITSCALE_CACHE", str(tmp_path / "cache"))
    return root


def pytest_sessionfinish(session) -> None:
    """Kill the rank pools ``helpers.distributed`` kept for the session (if a test used one):
    at once, rather than at interpreter exit."""
    distributed = sys.modules.get("helpers.distributed")
    if distributed is not None:
        distributed.shutdown_pools()
