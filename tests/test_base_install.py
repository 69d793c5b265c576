"""The main commands on an install without the optional extras (``pip install -e .``, as
``make train`` installs it): the default run trains with no warning, a strategy whose package
is missing is refused in one line that says how to install it, and the planner recommends
nothing that cannot run here. The extras' packages are hidden from every process of the
command (``helpers/without_extras.py``): a second virtual environment is too slow for
``make test``."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers.cli import REPO, explain, run_train, summaries
from helpers.without_extras import OPTIONAL_MODULES, environment

pytestmark = pytest.mark.slow  # every test here starts train.py

WARNING = re.compile(r"warn|Traceback|\[Hydra plugins scanner\]", re.IGNORECASE)


def without_extras(*overrides: str, outputs) -> subprocess.CompletedProcess:
    return run_train(*overrides, outputs=outputs, timeout=400, env=environment())


def test_the_extras_are_hidden_from_a_process_and_its_children():
    probe = ("import importlib.util, subprocess, sys\n"
             f"assert all(importlib.util.find_spec(module) is None for module in {OPTIONAL_MODULES!r})\n"
             "try:\n    import deepspeed\nexcept ModuleNotFoundError as error:\n    print(error)\n"
             "subprocess.run([sys.executable, '-c', 'import pytest'], check=False)\n")
    process = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                             timeout=60, env={**os.environ, **environment()})
    assert process.returncode == 0, explain(process)
    assert process.stdout == "No module named 'deepspeed'\n"
    assert process.stderr.rstrip().endswith("ModuleNotFoundError: No module named 'pytest'"), explain(process)


@pytest.mark.full
@pytest.mark.timeout(600)
def test_the_default_run_trains_without_a_warning(tmp_path):
    process = without_extras("trainer.max_steps=2", outputs=tmp_path)
    assert process.returncode == 0, explain(process)
    warnings = [line for line in (process.stdout + process.stderr).splitlines() if WARNING.search(line)]
    assert warnings == [], explain(process)
    assert "litscale: done: 2 steps" in process.stdout and summaries(tmp_path), explain(process)


@pytest.mark.full
@pytest.mark.timeout(600)
def test_a_strategy_whose_package_is_missing_is_refused_in_one_line(tmp_path):
    process = without_extras("strategy=deepspeed_zero", "trainer.devices=1", "trainer.max_steps=1", outputs=tmp_path)
    assert process.returncode != 0, explain(process)
    errors = [line for line in (process.stdout + process.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1, explain(process)
    assert "deepspeed" in errors[0] and "pip install 'litscale[" in errors[0], errors[0]
    assert not summaries(tmp_path)


@pytest.mark.full
@pytest.mark.timeout(600)
def test_the_planner_recommends_no_strategy_whose_package_is_missing(tmp_path):
    # On the H100 cluster file: ranked from FLOPs, where this machine's cluster would first be
    # calibrated and each plan timed (about 100 s on 2 cores); the installed strategies are
    # pruned before either.
    process = without_extras("plan=show", "strategy=ddp", "trainer.devices=2", "cluster=h100_8x",
                             outputs=tmp_path)
    assert process.returncode == 0, explain(process)
    ranked = [line for line in process.stdout.splitlines() if re.match(r"^\d+\s", line)]
    fastest = [line for line in process.stdout.splitlines() if line.startswith("litscale: fastest:")]
    assert ranked and len(fastest) == 1, explain(process)
    assert [line for line in ranked + fastest if "deepspeed" in line] == [], explain(process)
