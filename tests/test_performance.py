"""Performance plumbing: the default run imports nothing heavy and trains exactly as the plain
PyTorch loop of the benchmark does, ``callbacks=profile`` writes a trace, ``model.compile``
compiles in place, and ``train/loss`` is logged on the steps the loggers write."""

from __future__ import annotations

import csv
import glob
import json
import re
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers.cli import REPO, cli_env, explain, run_train, summaries
from helpers.inprocess import train_on_pool

from litscale.loggers import is_logging_step
from litscale.models.gpt import build_gpt
from litscale.modules import CausalLMModule

sys.path.insert(0, str(REPO / "experiments" / "bench"))
import plain_loop  # noqa: E402

# A GPT small enough that 10 steps take a fraction of a second: the test is about the run.
TINY_MODEL = ("+model.net.n_layer=1", "+model.net.n_embd=32", "+model.net.n_head=2")
TINY_RUN = ("data=synthetic", "data.seq_len=16", "data.batch_size=4", *TINY_MODEL,
            "trainer.accelerator=cpu", "trainer.max_steps=12", "trainer.val_check_interval=12",
            "trainer.limit_val_batches=1", "trainer.log_every_n_steps=5",
            "trainer.enable_progress_bar=false")
HEAVY = ("deepspeed", "wandb", "sklearn", "matplotlib", "scipy", "pandas", "pytorch_optimizer")
# Importers that own a heavy import (Lightning's torchmetrics imports matplotlib and scipy itself).
OWNERS = ("litscale", "lightning", "torchmetrics", "torch", "hydra", "omegaconf")


def import_tree(stderr: str) -> list[tuple[int, str]]:
    """``(depth, module)`` per ``-X importtime`` line, in its order (children first)."""
    lines = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|( *)(\S+)$", stderr, flags=re.MULTILINE)
    return [(len(indent), module) for indent, module in lines]


def heavy_imports_by_litscale(tree: list[tuple[int, str]]) -> list[str]:
    """Heavy modules whose nearest owning importer is litscale (not Lightning, torch, ...)."""
    found = []
    for index, (depth, module) in enumerate(tree):
        if module.split(".")[0] not in HEAVY or "." in module:
            continue
        for parent_depth, parent in tree[index + 1:]:  # ancestors come later, less indented
            if parent_depth < depth:
                depth = parent_depth
                if parent.split(".")[0] in OWNERS:
                    if parent.split(".")[0] == "litscale":
                        found.append(f"{module} (imported by {parent})")
                    break
        else:
            found.append(f"{module} (imported by train.py)")
    return found


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    outputs = tmp_path_factory.mktemp("outputs")
    process = run_train(*TINY_RUN, outputs=outputs, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert process.returncode == 0, explain(process)
    (summary,) = summaries(outputs)
    return process, summary


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_default_run_imports_nothing_heavy(default_run):
    process, _ = default_run
    tree = import_tree(process.stderr)
    assert len(tree) > 1000 and any(module == "litscale.app.run" for _, module in tree)
    assert heavy_imports_by_litscale(tree) == []


def test_heavy_import_attribution_reads_the_tree():
    tree = [(5, "matplotlib"), (3, "torchmetrics.utilities.plot"), (1, "litscale.app.build"),
            (3, "wandb"), (1, "litscale.loggers"), (1, "sklearn")]
    assert heavy_imports_by_litscale(tree) == ["wandb (imported by litscale.loggers)",
                                               "sklearn (imported by train.py)"]


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_default_run_matches_plain_pytorch_loop(default_run, monkeypatch):
    """The benchmark's premise: train.py and plain_loop.py train the same model on the same
    batches with the same optimizer, schedule and clipping, so their losses agree."""
    _, summary = default_run
    args = SimpleNamespace(preset="nano", n_layer=1, n_embd=32, n_head=2, seq_len=16, batch_size=4,
                           steps=12, warmup=10, num_samples=100_000, strategy="single")
    threads = torch.get_num_threads()
    try:
        plain = plain_loop.train(0, 1, args)
    finally:
        torch.set_num_threads(threads)
    assert plain["step_time_s"] > 0
    assert summary["train/loss"] == pytest.approx(plain["last_loss"], rel=1e-5)


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.parametrize(("key", "logger_steps"), [
    ("train/loss", [4, 9]),  # log_every_n_steps=5 over 12 steps (0-based logger steps)
    ("lr_scaling/lr", [4, 9]),
    ("perf/samples_per_sec", [4, 9, 11]),  # written straight to the loggers, the last step too
])
def test_per_step_values_logged_on_the_steps_loggers_write(default_run, key, logger_steps):
    _, summary = default_run
    (metrics,) = glob.glob(f"{summary['output_dir']}/**/metrics.csv", recursive=True)
    with open(metrics) as file:
        rows = [row for row in csv.DictReader(file) if row.get(key)]
    assert [int(row["step"]) for row in rows] == logger_steps
    if key.startswith("perf/"):  # the summary's figure is the last one logged
        assert float(rows[-1][key]) == pytest.approx(summary[key])
    assert summary["train/loss"] > 0  # the last step's value, for the summary


def test_logging_steps_follow_the_trainer():
    assert is_logging_step(None, 7)  # no trainer: log as Lightning would
    trainer = SimpleNamespace(log_every_n_steps=10, is_last_batch=False, max_steps=95, world_size=1)
    logged = [step for step in range(1, 96) if is_logging_step(trainer, step)]
    assert logged == [10, 20, 30, 40, 50, 60, 70, 80, 90, 95]  # and the last step, for the summary
    trainer.is_last_batch = True
    assert is_logging_step(trainer, 4)
    # Not with several ranks: each may end its epoch at its own step (federated clients), and
    # the logged loss is averaged over the ranks, which must all log the same steps.
    trainer.world_size = 2
    assert not is_logging_step(trainer, 4)
    trainer.log_every_n_steps, trainer.is_last_batch = 1, False
    assert is_logging_step(trainer, 3)


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_profile_callbacks_write_a_trace_of_the_active_steps(tmp_path):
    process = train_on_pool(*TINY_RUN, "callbacks=profile", "callbacks.profiler.wait=2",
                            "callbacks.profiler.warmup=1", "callbacks.profiler.active=3",
                            outputs=tmp_path)
    assert process.returncode == 0, explain(process)
    (summary,) = summaries(tmp_path)
    trace = f"{summary['output_dir']}/profile/trace_rank0.json"
    assert f"litscale: profiler: batches 4-6 of rank 0 -> {trace}" in process.stdout
    with open(trace) as file:
        events = json.load(file)["traceEvents"]
    steps = {event["name"] for event in events if event.get("name", "").startswith("ProfilerStep#")}
    assert len(steps) == 3
    assert any(event.get("name") == "aten::mm" for event in events)
    table = open(f"{summary['output_dir']}/profile/ops_rank0.txt").read()
    assert "Self CPU" in table and "aten::" in table
    assert summary["perf/step_time_s"] > 0  # the default callbacks ran beside it


@pytest.mark.slow  # over a second alone: out of the quick loop
def test_compile_option_compiles_in_place():
    torch.manual_seed(0)
    net = build_gpt(n_layer=1, n_embd=32, n_head=2, block_size=8)
    eager_keys = list(net.state_dict())
    tokens = torch.randint(0, 256, (2, 8))
    expected = net(tokens)
    module = CausalLMModule(net=net, optimizer=torch.optim.SGD, compile=True)
    module.configure_model()
    module.configure_model()  # Lightning may call it again: nothing is compiled twice
    assert module.net is net and net._compiled_call_impl is not None
    assert [key for key in module.state_dict() if key.startswith("net.")] == [
        f"net.{key}" for key in eager_keys]  # checkpoints of eager and compiled runs agree
    # Inductor needs a C compiler and a minute on a 2-core CPU; the wiring is what is tested
    # here, the compiled kernels on a GPU (experiment=gpt2_small_h100).
    with torch.compiler.set_stance("force_eager"):
        torch.testing.assert_close(module(tokens), expected)
        targets = torch.randint(0, 256, (2, 8))
        torch.testing.assert_close(module.loss((tokens, targets)),
                                   torch.nn.functional.cross_entropy(expected.flatten(0, 1), targets.flatten()))


@pytest.mark.slow  # one interpreter, about 1 s
def test_a_refused_option_is_answered_without_importing_torch_or_lightning(tmp_path):
    """Hydra imports every plugin module to list its plugins before the command line is
    checked: a plugin that imported Lightning made each one-line refusal pay 6 s of imports
    (8.8 s in all, 0.7 s without)."""
    import subprocess

    probe = ("import runpy, sys\nsys.argv = ['train.py', 'strategy=fsdpp']\ntry:\n"
             "    runpy.run_path('train.py', run_name='__main__')\nexcept SystemExit as exit:\n"
             "    print(exit.code, sorted(m for m in ('torch', 'lightning') if m in sys.modules))\n")
    process = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120,
                             env=cli_env(tmp_path))
    assert process.stdout.splitlines()[-1] == "2 []", explain(process)
