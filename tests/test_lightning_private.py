"""The Lightning-private names litscale uses are all still there: an upgrade that removes or
moves one fails here, by name, not in the middle of a run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import litscale.lightning_private as lightning_private

SRC = Path(__file__).resolve().parents[1] / "src"
LIGHTNING_PACKAGES = ("lightning", "lightning_fabric", "pytorch_lightning")


@pytest.mark.parametrize("name", [n for n in lightning_private.__all__ if n != "CHECKPOINT_METADATA_FILENAME"])
def test_each_private_function_is_importable_and_callable(name):
    assert callable(getattr(lightning_private, name))


def test_checkpoint_metadata_filename_is_a_file_name():
    name = lightning_private.CHECKPOINT_METADATA_FILENAME
    assert isinstance(name, str) and name and "/" not in name


def _private_lightning_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIGHTNING_PACKAGES:
            private_module = any(part.startswith("_") for part in node.module.split("."))
            found += [f"{node.module}.{a.name}" for a in node.names if private_module or a.name.startswith("_")]
    return found


@pytest.mark.slow
def test_no_other_module_imports_lightning_private_names():
    fence = SRC / "litscale" / "lightning_private.py"
    offenders = {str(path.relative_to(SRC)): names for path in SRC.rglob("*.py")
                 if path != fence and (names := _private_lightning_imports(path))}
    assert offenders == {}


STRATEGIES = ("DDPStrategy", "FSDPStrategy", "TensorParallelStrategy", "PipelineParallelStrategy",
              "DeepSpeedZeroStrategy", "LocalSGDStrategy", "FederatedStrategy")


@pytest.mark.slow
@pytest.mark.parametrize("name", STRATEGIES)
def test_one_process_gets_no_launcher_and_several_keep_lightnings(name, monkeypatch):
    """Lightning's script launcher in one process starts no rank but a thread watching none
    that outlives ``fit`` by five seconds; for several processes (a user's own script) it is
    what starts the other ranks."""
    import lightning.pytorch as pl

    import litscale.strategies as strategies

    for variable in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(variable, raising=False)
    one = pl.Trainer(strategy=getattr(strategies, name)(), accelerator="cpu", devices=1, logger=False)
    two = pl.Trainer(strategy=getattr(strategies, name)(), accelerator="cpu", devices=2, logger=False)
    assert one.strategy.launcher is None
    assert type(two.strategy.launcher).__name__ == "_SubprocessScriptLauncher"
