"""A config that needs an optional package (an extra of ``pyproject.toml``) that is not
installed is refused in one line naming what asked for it and the ``pip install`` line, before
any run dir or rank exists (``litscale.extras``, ``litscale.app.checks.extras``).

The checks run in this process (``check_command_line``, the pre-flight ``train.py`` runs before
Hydra makes a run dir), with the package hidden from ``importlib.util.find_spec``; the tests
marked ``slow`` start ``train.py`` with the packages hidden from every process
(``helpers/without_extras.py``) and look for the run dir it must not make.
"""

from __future__ import annotations

import importlib.util
import re
import tomllib

import pytest
from helpers.cli import REPO, check_command, explain, run_train
from helpers.without_extras import environment

INSTALL = "which is not installed; install it with: pip install"

# (overrides, the modules hidden, the one line); {tmp}: the test's tmp dir.
CASES = {
    "wandb": (["logger=wandb"], ("wandb",),
              f"logger=wandb needs the wandb package, {INSTALL} 'litscale[extras]'"),
    "tensorboard": (["logger=tensorboard"], ("tensorboard", "tensorboardX"),
                    f"logger=tensorboard needs the tensorboard package, {INSTALL} 'litscale[extras]'"),
    "scikit-learn": (["experiment=digits_mlp"], ("sklearn",),
                     f"data=digits needs the scikit-learn package, {INSTALL} 'litscale[extras]'"),
    "deepspeed": (["strategy=deepspeed_zero"], ("deepspeed",),
                  f"strategy=deepspeed_zero needs the deepspeed package, {INSTALL} 'litscale[extras]'"),
    "transformers-model": (["model=hf"], ("transformers",),
                           f"model=hf needs the transformers package, {INSTALL} 'litscale[hf]'"),
    "transformers-from-hf": (["model=llama", "model.net.from_hf={tmp}/qwen3"], ("transformers",),
                             f"model.net.from_hf='{{tmp}}/qwen3' needs the transformers package, {INSTALL} "
                             "'litscale[hf]'"),
    "transformers-export": (["model=llama", "export_hf=true"], ("transformers",),
                            f"export_hf=true needs the transformers package, {INSTALL} 'litscale[hf]'"),
    "torchft": (["fault_tolerance=replicas", "fault_tolerance.groups=2", "launcher.oversubscribe=true"],
                ("torchft",), f"fault_tolerance=replicas needs the torchft package, {INSTALL} 'litscale[ft]'"),
    "ray": (["-m", "hydra/launcher=ray"], ("ray",),
            f"hydra/launcher=ray needs the ray package, {INSTALL} 'litscale[ray]'"),
    "jsonschema-k8s": (["-m", "hydra/launcher=k8s"], ("jsonschema",),
                       f"hydra/launcher=k8s needs the jsonschema package, {INSTALL} 'litscale[k8s]'"),
    "kubernetes": (["-m", "hydra/launcher=k8s", "hydra.launcher.submit=true"], ("kubernetes",),
                   f"hydra.launcher.submit=true needs the kubernetes package, {INSTALL} 'litscale[k8s]'"),
    "jsonschema-skypilot": (["-m", "hydra/launcher=skypilot"], ("jsonschema",),
                            f"hydra/launcher=skypilot needs the jsonschema package, {INSTALL} 'litscale[skypilot]'"),
    "skypilot": (["-m", "hydra/launcher=skypilot", "hydra.launcher.submit=true"], ("sky",),
                 f"hydra.launcher.submit=true needs the skypilot package, {INSTALL} 'litscale[skypilot]'"),
    "submitit": (["-m", "hydra/launcher=slurm"], ("hydra_plugins.hydra_submitit_launcher",),
                 f"hydra/launcher=slurm needs the hydra-submitit-launcher package, {INSTALL} 'litscale[extras]'"),
    "submitit-local": (["-m", "hydra/launcher=slurm_local"], ("hydra_plugins.hydra_submitit_launcher",),
                       f"hydra/launcher=slurm_local needs the hydra-submitit-launcher package, {INSTALL} "
                       "'litscale[extras]'"),
    "optuna": (["-m", "hydra/sweeper=optuna"], ("optuna",),
               f"hydra/sweeper=optuna needs the optuna package, {INSTALL} 'litscale[optuna]'"),
}


@pytest.fixture
def hidden(monkeypatch):
    """``hidden(modules)``: from now on ``importlib.util.find_spec`` finds none of them."""
    find_spec = importlib.util.find_spec

    def hide(modules: tuple[str, ...]) -> None:
        def find(name, *args, **kwargs):
            if any(name == module or name.startswith(module + ".") for module in modules):
                return None
            return find_spec(name, *args, **kwargs)

        monkeypatch.setattr(importlib.util, "find_spec", find)

    return hide


def hf_directory(tmp_path) -> None:
    """What model.net.from_hf's path check reads first: a directory with a config.json and
    safetensors weights (never loaded: the package check comes before)."""
    directory = tmp_path / "qwen3"
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "qwen3"}')
    (directory / "model.safetensors").write_bytes(b"")


@pytest.mark.parametrize("case", list(CASES))
def test_a_missing_optional_package_is_one_line_before_any_run_dir(case, hidden, tmp_path, outputs_root, capsys):
    overrides, modules, line = CASES[case]
    hf_directory(tmp_path)
    hidden(modules)
    code, out, err = check_command([o.format(tmp=tmp_path) for o in overrides], capsys)
    assert (code, err) == (2, f"error: {line.format(tmp=tmp_path)}\n"), out + err
    assert list(outputs_root.iterdir()) == []


def test_a_jobs_packages_are_checked_where_its_ranks_start(hidden, tmp_path, outputs_root):
    """precision=fp8's torchao, asked directly (a float8 GPU's own check comes first, and this
    machine has none): refused where the ranks start; validation for a job that runs on another
    machine, or is only planned, which imports nothing, does not ask for it."""
    from helpers.configs import compose_job

    from litscale.app.checks.extras import check_job_extras
    from litscale.app.checks.validation import validate
    from litscale.errors import ConfigError

    hidden(("torchao",))
    cfg, choices = compose_job(["precision=fp8", "cluster=h100_8x"], tmp_path / "run")
    with pytest.raises(ConfigError) as error:
        check_job_extras(cfg, choices)
    assert str(error.value) == f"precision.float8=tensorwise needs the torchao package, {INSTALL} 'litscale[fp8]'"
    validate(cfg, choices=choices, this_machine=False)


def test_each_package_is_in_the_extra_its_line_names():
    """Every package a config can need is declared once (``litscale.extras``), in the extra of
    ``pyproject.toml`` that installs it; the extras' other packages need no check: matplotlib
    (a plot, skipped without it), safetensors (comes with transformers) and datasets (read only
    for Parquet files not yet tokenized: the reader says so in one line, test_tokens.py)."""
    from litscale import extras

    optional = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def installs(extra: str) -> set[str]:
        names = set()
        for requirement in optional[extra]:
            name = re.match(r"[\w.-]+", requirement).group(0)
            nested = re.fullmatch(r"litscale\[([\w,-]+)\]", requirement)
            names |= {n for e in nested.group(1).split(",") for n in installs(e)} if nested else {name}
        return names

    declared = [value for value in vars(extras).values() if isinstance(value, extras.Requirement)]
    for requirement in declared:
        assert requirement.package in installs(requirement.extra), requirement
    unchecked = {name for extra in optional if extra != "dev" for name in installs(extra)} - {
        r.package for r in declared}
    assert unchecked == {"matplotlib", "safetensors", "datasets"}


@pytest.mark.slow  # starts train.py
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["wandb", "scikit-learn", "submitit", "ray"])
def test_train_py_makes_no_run_dir_for_a_missing_package(case, tmp_path):
    """As a user on a base install sees it: the issue's two (``logger=wandb``,
    ``experiment=digits_mlp``), a launcher whose own config comes with its package (Hydra cannot
    compose ``hydra/launcher=slurm`` without it) and a sweep's launcher."""
    overrides, _, line = CASES[case]
    outputs = tmp_path / "outputs"
    process = run_train(*overrides, "trainer.max_steps=1", outputs=outputs, env=environment())
    shown = [text for text in (process.stdout + process.stderr).splitlines() if text.strip()]
    assert (process.returncode, shown) == (2, [f"error: {line}"]), explain(process)
    assert not outputs.exists() or list(outputs.iterdir()) == []
