"""Config validation: the type checker, device counting, and the one-line errors users see.

The end-to-end cases run ``python train.py <overrides>`` as a user would: each must exit 2
with exactly one ``error: ...`` line on stderr, before any run dir or rank exists.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import pytest
import torch
from annotated_types import Ge, Gt, Interval, Le
from helpers.configs import REPO_ROOT, compose_full, compose_job, group_options
from helpers.fork_server import ForkServer
from omegaconf import ListConfig

from litscale.app.checks.devices import count_devices
from litscale.app.checks.validation import ConfigError, validate
from litscale.arguments import check_value, describe
from litscale.constraints import (
    Fraction,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
)

CORES = len(os.sched_getaffinity(0))

# --- typecheck: check_value / describe ------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "annotation", "expected"),
    [
        (1, int, None),
        (True, int, "an int"),  # bool is not an int in a config
        (1.0, int, "an int"),
        ("1", int, "an int"),
        (True, bool, None),
        (1, bool, "true or false"),
        (3, float, None),  # an int is a fine float
        (0.5, float, None),
        (True, float, "a number"),
        ("0.5", float, "a number"),
        ("x", str, None),
        (1, str, "a string"),
        (None, Optional[int], None),  # noqa: UP045  (the spelling users' constructors use)
        (2, int | None, None),
        ("2", int | None, "an int or null"),
        (None, int, "an int"),
        ("nano", Literal["nano", "small"], None),
        ("huge", Literal["nano", "small"], "one of: 'nano', 'small'"),
        (1, Literal[1, 2], None),
        (True, Literal[1, 2], "one of: 1, 2"),  # True == 1, but it is not the int 1
        (1.0, Literal[1, 2], "one of: 1, 2"),
        ([1, 2], list[PositiveInt], None),
        ((1, 2), list[PositiveInt], None),
        ([], list[PositiveInt], None),
        ([1, 0], list[PositiveInt], "a list of ints >= 1"),
        ([True], list[PositiveInt], "a list of ints >= 1"),
        (1, list[PositiveInt], "a list of ints >= 1"),
        ("12", list[PositiveInt], "a list of ints >= 1"),
        ([0.9, 0.95], tuple[float, float], None),
        ([1, 2], tuple[float, float], None),
        ([0.9], tuple[float, float], "a list of 2 numbers"),
        ([0.9, 0.9, 0.9], tuple[float, float], "a list of 2 numbers"),
        ([0.9, "x"], tuple[float, float], "a list of 2 numbers"),
        ([1, 2, 3], tuple[int, ...], None),
        ([1, "2"], tuple[int, ...], "a list of ints"),
        ({"a": 1}, dict[str, int], None),
        ([1], dict[str, int], "a mapping"),
        (object(), Any, None),
        (1, PositiveInt, None),
        (0, PositiveInt, "an int >= 1"),
        (1.5, PositiveInt, "an int >= 1"),
        (0, NonNegativeInt, None),
        (-1, NonNegativeInt, "an int >= 0"),
        (1e-12, PositiveFloat, None),
        (0, PositiveFloat, "a number > 0"),
        (0.0, PositiveFloat, "a number > 0"),
        (-1, PositiveFloat, "a number > 0"),
        (0, NonNegativeFloat, None),
        (0, Fraction, None),
        (1, Fraction, None),
        (1.01, Fraction, "a number >= 0 and <= 1"),
        (-0.01, Fraction, "a number >= 0 and <= 1"),
        (None, PositiveInt | None, None),
        (0, PositiveInt | None, "an int >= 1 or null"),
        ("a", str | list[str], None),
        (["a", "b"], str | list[str], None),
        ([1], str | list[str], "a string or a list of strings"),
    ],
)
def test_check_value(value, annotation, expected):
    assert check_value(value, annotation) == expected


@pytest.mark.parametrize(
    ("annotation", "text"),
    [
        (int, "an int"),
        (float, "a number"),
        (str, "a string"),
        (bool, "true or false"),
        (type(None), "null"),
        (PositiveInt, "an int >= 1"),
        (NonNegativeInt, "an int >= 0"),
        (PositiveFloat, "a number > 0"),
        (NonNegativeFloat, "a number >= 0"),
        (Fraction, "a number >= 0 and <= 1"),
        (Annotated[int, Interval(ge=2, le=5)], "an int >= 2 and <= 5"),
        (Annotated[float, Le(0.5)], "a number <= 0.5"),
        (Annotated[float, Gt(1e-3)], "a number > 0.001"),
        (PositiveInt | None, "an int >= 1 or null"),
        (Optional[str], "a string or null"),  # noqa: UP045
        (int | float, "an int or a number"),
        (int | int | None, "an int or null"),
        (list[PositiveInt], "a list of ints >= 1"),
        (list[str], "a list of strings"),
        (list[float], "a list of numbers"),
        (list[bool], "a list of booleans"),
        (list[Literal["a"]], "a list of items that are one of: 'a'"),
        (tuple[int, ...], "a list of ints"),
        (str | list[str], "a string or a list of strings"),
        (Literal["nano", "micro"], "one of: 'nano', 'micro'"),
        (Literal[1, 2], "one of: 1, 2"),
        (dict[str, int], "a mapping"),
    ],
)
def test_describe(annotation, text):
    assert describe(annotation) == text


def test_describe_names_the_length_of_a_fixed_tuple():
    assert describe(tuple[float, float]) == "a list of 2 numbers"


@pytest.mark.parametrize(("annotation", "text"), [(list, "a list"), (dict, "a mapping")])
def test_describe_bare_containers(annotation, text):
    assert describe(annotation) == text


@pytest.mark.parametrize(
    ("bounds", "inside", "outside", "text"),
    [
        (Ge(1), [1, 1.5, 10**9], [0, 0.999, -1], ">= 1"),
        (Gt(0), [1e-9, 1], [0, 0.0, -1e-9], "> 0"),
        (Le(1), [1, 0, -5], [1.0001, 2], "<= 1"),
        (Interval(ge=0, le=1), [0, 0.5, 1], [-0.1, 1.1], ">= 0 and <= 1"),
        (Interval(gt=0, le=1), [0.5, 1], [0, 1.5], "> 0 and <= 1"),
        (Interval(), [-1e9, 0, 1e9], [], ""),
    ],
)
def test_range(bounds, inside, outside, text):
    annotation = Annotated[float, bounds]
    assert all(check_value(v, annotation) is None for v in inside)
    assert all(check_value(v, annotation) for v in outside)
    assert describe(annotation) == f"a number {text}".strip()


# --- count_devices --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("devices", "accelerator", "expected"),
    [
        (1, "cpu", 1),
        (3, "cpu", 3),  # not capped here: check_devices compares with the machine
        (-1, "cpu", 4),
        (-1, "gpu", 4),
        (0, "cpu", None),
        (-2, "cpu", None),
        ("auto", "cpu", 1),
        ("auto", "gpu", 4),
        (" auto ", "cpu", 1),
        ("2", "cpu", 2),
        ("-1", "gpu", 4),
        ("0", "gpu", None),
        ("0,1", "gpu", 2),
        ("0, 1, 3", "gpu", 3),
        ("1,", "gpu", 1),
        ([0, 1], "gpu", 2),
        ([2], "gpu", 1),
        (ListConfig([0, 1, 2]), "gpu", 3),
        ([], "gpu", None),
        ([-1], "gpu", None),
        ([True, False], "gpu", None),
        ([0, "1"], "gpu", None),
        (True, "cpu", None),
        (False, "cpu", None),
        (1.0, "cpu", None),
        (None, "cpu", None),
        ("abc", "cpu", None),
        ("", "cpu", None),
        ("0,x", "gpu", None),
        (",", "gpu", None),
    ],
)
def test_count_devices(devices, accelerator, expected):
    assert count_devices(devices, 4, accelerator) == expected


# --- in-process validation ------------------------------------------------------------------


def validate_overrides(overrides: list[str], tmp_path: Path) -> None:
    cfg, choices = compose_job(overrides, tmp_path / "run")
    validate(cfg, choices=choices)


@pytest.mark.slow
def test_plus_adds_a_trainer_argument(tmp_path, outputs_root):
    cfg, choices = compose_job(["+trainer.enable_checkpointing=false"], tmp_path / "run")
    assert cfg.trainer.enable_checkpointing is False
    validate(cfg, choices=choices)


def test_plus_addition_is_still_type_checked(tmp_path, outputs_root):
    with pytest.raises(ConfigError) as info:
        validate_overrides(["+trainer.enable_checkpointing=maybe"], tmp_path)
    assert str(info.value) == (
        "trainer.enable_checkpointing='maybe' is not valid: expected true or false or null"
    )


@pytest.mark.skipif(CORES < 2, reason="needs 2 CPU cores")
def test_ddp_on_two_cpu_processes_validates(tmp_path, outputs_root):
    validate_overrides(["strategy=ddp", "trainer.accelerator=cpu", "trainer.devices=2"], tmp_path)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["data=synthetic", "data.num_samples=0"], "data.num_samples"),
        (["data=synthetic", "data.val_samples=0"], "data.val_samples"),
        (["trainer.num_nodes=0"], "trainer.num_nodes"),
    ],
    ids=["synthetic-num_samples", "synthetic-val_samples", "num_nodes"],
)
def test_bad_values_caught_before_the_run(overrides, key, tmp_path, outputs_root):
    with pytest.raises(ConfigError, match=f"^{key}=0 is not valid"):
        validate_overrides(overrides, tmp_path)


# --- end to end: python train.py <overrides> ------------------------------------------------


@dataclass
class Case:
    args: list[str]
    expected: str
    skip: str | None = None


def _trainer_keys() -> str:
    trainer = compose_full().trainer
    return ", ".join(sorted(str(k) for k in trainer if not str(k).startswith("_")))


TOO_MANY = 64
CASES = {
    "unknown-strategy": Case(
        ["strategy=fsdpp"],
        f"strategy=fsdpp is not an option; choose one of: {', '.join(group_options('strategy'))}",
    ),
    "devices-abc": Case(
        ["trainer.devices=abc"],
        "trainer.devices='abc' is not valid: expected a positive int, -1 (all), 'auto' or a "
        "list of device indices",
    ),
    "devices-typo": Case(
        ["trainer.devicez=2"],
        "trainer.devicez is not a known key; did you mean trainer.devices? trainer has: "
        + _trainer_keys() + "; +trainer.<key>=<value> adds another argument of lightning.pytorch.Trainer",
    ),
    "batch-size-0": Case(["data.batch_size=0"], "data.batch_size=0 is not valid: expected an int >= 1"),
    "too-many-devices": Case(
        [f"trainer.devices={TOO_MANY}", "trainer.accelerator=cpu"],
        f"trainer.devices={TOO_MANY} is more than this machine has: {CORES} CPU cores "
        f"(allowed: 1..{CORES}, or add launcher.oversubscribe=true to run {TOO_MANY} gloo ranks on "
        f"{CORES} cores, one thread each)",
        skip=f"this machine has {TOO_MANY} cores or more" if CORES >= TOO_MANY else None,
    ),
    "fp16-on-cpu": Case(
        ["precision=fp16_mixed", "trainer.accelerator=cpu"],
        "precision=fp16_mixed is not supported on cpu; choose one of: fp32, bf16_mixed, bf16_true",
    ),
    "fp16-with-fsdp": Case(
        ["precision=fp16_mixed", "strategy=fsdp", "trainer.accelerator=cpu"],
        "precision=fp16_mixed is not supported with strategy=fsdp: FSDP2 and DTensor strategies have no "
        "sharded loss scaler; allowed: precision=bf16_mixed or bf16_true",
    ),
    "paths-match-nothing": Case(
        ["data=text_files", "data.paths=/nonexistent/*.txt"],
        "data.paths='/nonexistent/*.txt' matches no files; give a glob of text files, "
        "e.g. data.paths='~/corpus/**/*.txt'",
    ),
    "paths-missing": Case(
        ["data=text_files"], "data.paths is required: expected a string or a list of strings"
    ),
    "task-mismatch": Case(
        ["model=mlp"],
        "model=mlp trains on classification data but data=stdlib_code provides causal_lm; "
        "use data=digits (or experiment=digits_mlp / digits_resnet)",
    ),
    "single-two-devices": Case(
        ["trainer.devices=2"],
        "strategy=single runs one process but trainer.devices=2; use strategy=ddp "
        "(or another multi-device strategy)",
        skip="needs 2 CPU cores" if CORES < 2 else None,
    ),
    "negative-lr": Case(["optimizer.lr=-1"], "optimizer.lr=-1 is not valid: expected a number > 0"),
    "missing-ckpt": Case(
        ["ckpt_path=/nonexistent.ckpt"],
        "ckpt_path='/nonexistent.ckpt' is not a file; give a checkpoint path, last, auto, here or null",
    ),
    "unknown-preset": Case(
        ["model.net.preset=huge"],
        "model.net.preset='huge' is not valid: expected one of: 'nano', 'micro', 'small', 'medium'",
    ),
    "multirun-second-job-bad": Case(
        ["-m", "trainer.devices=1,2"],
        "strategy=single runs one process but trainer.devices=2; use strategy=ddp "
        "(or another multi-device strategy)",
        skip="needs 2 CPU cores" if CORES < 2 else None,
    ),
    "gpu-without-cuda": Case(
        ["trainer.accelerator=gpu"],
        "trainer.accelerator=gpu but no CUDA device is visible; use trainer.accelerator=cpu or auto",
        skip="CUDA is available" if torch.cuda.is_available() else None,
    ),
    "scaling-baseline-missing": Case(
        ["scaling.baseline=/no/such/run"],
        "scaling.baseline='/no/such/run' has no summary.json; give a finished 1-device run's "
        "summary.json or its run dir, or null",
    ),
    "strong-scaling-indivisible": Case(
        ["strategy=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "scaling.global_batch=5"],
        "scaling.global_batch=5 does not split over 2 data-parallel rank(s) x 1 accumulation "
        "step(s); allowed: multiples of 2",
        skip="needs 2 CPU cores" if CORES < 2 else None,
    ),
    "expert-parallel-indivisible": Case(
        ["model=moe", "strategy=fsdp", "strategy.expert_parallel_size=3", "trainer.accelerator=cpu",
         "trainer.devices=2"],
        "strategy.expert_parallel_size=3 does not divide the data x context ranks (2 x 1 = 2); "
        "allowed: a divisor of 2",
        skip="needs 2 CPU cores" if CORES < 2 else None,
    ),
    "zero3-moe": Case(
        ["model=moe", "strategy=deepspeed_zero", "strategy.stage=3", "trainer.accelerator=cpu"],
        "model=moe is not supported with strategy=deepspeed_zero strategy.stage=3: DeepSpeed's ZeRO-3 does not "
        "train a mixture of experts yet (its backward reads an expert weight the engine has released: \"The size "
        "of tensor a (0) must match the size of tensor b (64)\"); allowed: strategy=fsdp, tensor_parallel or "
        "deepspeed_zero stage 1 or 2",
    ),
    "group-null": Case(
        ["cluster=null"],
        f"cluster=null: the cluster group needs an option; choose one of: {', '.join(group_options('cluster'))}",
    ),
    "empty-sweep": Case(
        ["-m", "trainer.devices="],
        "trainer.devices= sweeps no value: a sweep needs at least one value, e.g. -m trainer.devices=<a>,<b>",
    ),
    "context-parallel-does-not-divide": Case(
        ["model=llama", "strategy=fsdp", "strategy.context_parallel_size=3", "trainer.devices=2"],
        "strategy.context_parallel_size=3 must divide the world size (2); allowed: a divisor of 2",
    ),
    "context-parallel-seq-len": Case(
        ["model=llama", "strategy=fsdp", "strategy.context_parallel_size=2", "data.seq_len=130", "trainer.devices=2"],
        "data.seq_len=130 does not split into 2 x strategy.context_parallel_size=2 equal chunks; "
        "allowed: a multiple of 4",
    ),
    "context-parallel-no-attention": Case(
        ["model=mlp", "data=digits", "strategy=fsdp", "strategy.context_parallel_size=2", "trainer.devices=2"],
        "strategy.context_parallel_size=2 needs a model with attention that declares "
        "context_parallel_attention; MLP does not; allowed: 1 (or model=llama, model=moe)",
    ),
    "context-parallel-moe-capacity": Case(
        ["model=moe", "model.net.capacity_factor=1.25", "strategy=fsdp", "strategy.context_parallel_size=2",
         "trainer.devices=2"],
        "model.net.capacity_factor=1.25 with strategy.context_parallel_size=2: each rank would drop tokens by its "
        "own share of the sequence, not by the whole sequence as one process does; allowed: "
        "model.net.capacity_factor=null (dropless) or strategy.context_parallel_size=1",
    ),
    "set-absent-trainer-arg": Case(
        ["trainer.enable_checkpointing=false"],
        "trainer.enable_checkpointing is not in the config yet; add it with "
        "+trainer.enable_checkpointing=false",
    ),
    # Meshes that cannot be cut (pipeline and tensor parallel sizes against the world and the model).
    "pipeline-mesh-product": Case(
        ["strategy=pipeline", "strategy.pipeline_parallel_size=2", "strategy.data_parallel_size=2",
         "strategy.tensor_parallel_size=2", "trainer.accelerator=cpu", "trainer.devices=2"],
        "strategy.pipeline_parallel_size=2 x strategy.data_parallel_size=2 x strategy.tensor_parallel_size=2 "
        "= 8 but the world size is 2 (trainer.devices x trainer.num_nodes); the product must equal it",
    ),
    "tensor-parallel-heads": Case(
        ["strategy=tensor_parallel", "strategy.tensor_parallel_size=2", "+model.net.n_head=3",
         "+model.net.n_embd=96", "trainer.accelerator=cpu", "trainer.devices=2"],
        "strategy.tensor_parallel_size=2 does not divide model.net.n_head=3; allowed: a divisor of 3",
    ),
    "pipeline-too-few-blocks": Case(
        ["strategy=pipeline", "strategy.schedule=interleaved_1f1b", "strategy.virtual_stages=4",
         "trainer.accelerator=cpu", "trainer.devices=2"],
        "strategy.pipeline_parallel_size=2 needs 8 pipeline stages but the model declares only 6 blocks to "
        "cut between; allowed: at most 6 stages (pipeline_parallel_size x virtual_stages)",
    ),
}


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    root: Path


def _clean_env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "LOCAL_RANK", "RANK", "SLURM_NTASKS", "SLURM_PROCID")}
    env.update(LITSCALE_OUTPUTS=str(root), LITSCALE_CACHE=str(root.parent / "cache"))
    return env


def run_train(args: list[str], root: Path) -> Outcome:
    """``python train.py <args>`` in a fresh interpreter."""
    root.mkdir(parents=True)
    result = subprocess.run(
        [sys.executable, "train.py", *args], cwd=REPO_ROOT, env=_clean_env(root),
        capture_output=True, text=True, timeout=120,
    )
    return Outcome(result.returncode, result.stdout, result.stderr, root)


# A few cases also run in a fresh interpreter (EXEC_CASES) as a cross-check of the fork server's.
def serve(jobs: list[tuple[str, list[str], Path]], sentinel: Path) -> dict[str, Outcome]:
    """Run ``(name, args, outputs_root)`` jobs one after another in one fork server."""
    sentinel.mkdir(parents=True)
    outcomes = {}
    with ForkServer(_clean_env(sentinel)) as server:
        for name, args, root in jobs:
            root.mkdir(parents=True)
            code, out, err = server.run(args, root.parent, {"LITSCALE_OUTPUTS": str(root)})
            outcomes[name] = Outcome(code, out, err, root)
    return outcomes


def processes_for(root: Path) -> list[int]:
    """Live processes whose environment points at ``root`` (any descendant of a run)."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and (
                    proc.environ().get("LITSCALE_OUTPUTS") == str(root)):
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


EXEC_CASES = ("unknown-strategy", "negative-lr", "multirun-second-job-bad", "group-null")
RUNS = [(name, "fork") for name in CASES] + [(name, "exec") for name in EXEC_CASES]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[tuple[str, str], Outcome]:
    """Every case: two fork servers and the fresh-interpreter cases, side by side."""
    base = tmp_path_factory.mktemp("train_py")
    todo = [name for name, case in CASES.items() if case.skip is None]
    forked = [(name, CASES[name].args, base / "fork" / name / "outputs") for name in todo]
    with ThreadPoolExecutor(max_workers=3) as pool:
        servers = [pool.submit(serve, forked[i::2], base / f"server{i}") for i in range(2)]
        execs = {name: pool.submit(run_train, CASES[name].args, base / "exec" / name / "outputs")
                 for name in EXEC_CASES if name in todo}
        results = {(name, "fork"): o for s in servers for name, o in s.result().items()}
        results.update({(name, "exec"): f.result() for name, f in execs.items()})
    results["servers"] = [base / f"server{i}" for i in range(2)]
    return results


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("name", "mode"),
    [pytest.param(n, m, marks=pytest.mark.skipif(bool(CASES[n].skip), reason=CASES[n].skip or ""))
     for n, m in RUNS],
    ids=[f"{n}-{m}" for n, m in RUNS],
)
def test_train_py_rejects_in_one_line(name, mode, outcomes):
    outcome = outcomes[(name, mode)]
    assert outcome.stderr.splitlines() == [f"error: {CASES[name].expected}"], outcome.stderr
    assert outcome.stderr.endswith("\n")
    assert outcome.returncode == 2
    assert outcome.stdout == ""
    assert list(outcome.root.iterdir()) == [], "a run dir was created"
    assert processes_for(outcome.root) == [], "a process of the run outlived it"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fork_servers_left_nothing_running(outcomes):
    for sentinel in outcomes["servers"]:
        assert processes_for(sentinel) == []
        assert list(sentinel.iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_process_check_sees_a_live_run(tmp_path):
    """The leftover-process check above finds a process that carries the run's env."""
    root = tmp_path / "outputs"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             env=_clean_env(root))
    try:
        assert processes_for(root) == [child.pid]
    finally:
        child.kill()
        child.wait()
    assert processes_for(root) == []
