"""torchmetrics in litscale's processes skips transformers and scipy (litscale.torchmetrics_backends):
the packages read as not installed while torchmetrics' ``__init__`` runs, as torchmetrics asks,
and import as ever afterwards."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import pytest
from lightning_utilities.core.imports import RequirementCache, package_available

from litscale.torchmetrics_backends import BACKENDS, SKIP_ENV, backends_not_installed


@pytest.fixture
def installed_package(tmp_path, monkeypatch):
    """A package and its distribution metadata, installed in a directory of ``sys.path``."""
    (tmp_path / "litscale_probe").mkdir()
    (tmp_path / "litscale_probe" / "__init__.py").write_text("VALUE = 1\n")
    (tmp_path / "litscale_probe-1.2.dist-info").mkdir()
    (tmp_path / "litscale_probe-1.2.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: litscale-probe\nVersion: 1.2\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield "litscale_probe"
    sys.modules.pop("litscale_probe", None)


def test_a_hidden_package_is_not_installed_to_every_check_torchmetrics_makes_and_is_back_after(
    installed_package,
):
    with backends_not_installed({installed_package: "litscale-probe"}):
        assert importlib.util.find_spec(installed_package) is None
        assert not package_available(installed_package)  # torchmetrics/__init__.py's check
        assert not RequirementCache("litscale-probe>=1.0")  # utilities/imports.py's checks
        assert not RequirementCache("litscale-probe", module=installed_package)
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version("litscale_probe")
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(installed_package)
    assert importlib.metadata.version("litscale-probe") == "1.2"
    assert RequirementCache("litscale-probe>=1.0") and package_available(installed_package)
    assert importlib.import_module(installed_package).VALUE == 1


def test_a_package_imported_before_is_left_alone(installed_package):
    module = importlib.import_module(installed_package)
    with backends_not_installed({installed_package: "litscale-probe"}):
        assert sys.modules[installed_package] is module
    assert sys.modules[installed_package] is module


@pytest.mark.soak
@pytest.mark.slow  # a new interpreter: this one imported torchmetrics long ago
@pytest.mark.timeout(240)
def test_lightning_in_a_litscale_process_skips_them_and_litscale_still_uses_them():
    code = """
import sys
import litscale, lightning.pytorch
from torchmetrics.aggregation import MeanMetric
skipped = [m for m in ("transformers", "scipy", "sklearn") if m in sys.modules]
metric = MeanMetric()
metric.update(2.0)
metric.update(4.0)
import torch
from transformers import LlamaConfig, LlamaForCausalLM  # model=hf and the export
config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=64)
logits = LlamaForCausalLM(config)(torch.zeros(1, 4, dtype=torch.long)).logits
from sklearn.datasets import load_digits  # data=digits (scipy under it)
print(skipped, float(metric.compute()), tuple(logits.shape), load_digits().data.shape)
"""
    env = {**os.environ, SKIP_ENV: "1"}
    process = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=200
    )
    assert process.returncode == 0, process.stderr[-3000:]
    assert process.stdout.splitlines()[-1] == "[] 3.0 (1, 4, 64) (1797, 64)", process.stdout
    assert set(BACKENDS) == {"transformers", "scipy"}
