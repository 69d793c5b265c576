"""What a newcomer types on a fresh clone, checked before Hydra runs.

Command lines Hydra itself rejects (a group set to null, a key without ``+``, a key of an
option not selected, a malformed override, an empty sweep) are one ``error:`` line naming the
override and what to type instead, exit code 2, nothing written. And the first commands of
the README work or say why: a device sweep skips the cells it cannot run, more gloo ranks than
cores on request, model=llama's own keys, the run's lines in ``train.log``, a checkpoint of
another model refused before any rank starts.

The checks run in this process (``check_command_line``); the tests marked ``slow`` start
``train.py`` as a user would.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch
from helpers.cli import check_command, run_train
from helpers.configs import CONF_DIR, compose_full, compose_job, group_options
from hydra.utils import instantiate
from omegaconf import OmegaConf

from litscale.app.checks.validation import ConfigError, validate
from litscale.app.preflight import SKIPPED_JOBS_ENV, cells_to_skip, check_command_line
from litscale.app.run_log import log_printed_lines

CORES = len(os.sched_getaffinity(0))
TWO_CORES = pytest.mark.skipif(CORES < 2, reason="needs 2 CPU cores")


check = check_command


def _options(group: str) -> str:
    return ", ".join(group_options(group))


def _trainer_keys() -> str:
    return ", ".join(sorted(str(k) for k in compose_full().trainer if not str(k).startswith("_")))


GPT_ADDABLE = "bias, n_embd, n_head, n_layer, tie_embeddings"
ERRORS = {
    "cluster-null": (["cluster=null"],
                     f"cluster=null: the cluster group needs an option; choose one of: {_options('cluster')}"),
    "strategy-null": (["strategy=null"],
                      f"strategy=null: the strategy group needs an option; choose one of: {_options('strategy')}"),
    "model-null": (["model=null"],
                   f"model=null: the model group needs an option; choose one of: {_options('model')}"),
    "experiment-null": (["experiment=null"],
                        "experiment=null: the experiment group needs an option; choose one of: "
                        f"{_options('experiment')} (or leave experiment out: it has none by default)"),
    "new-trainer-key": (["trainer.foo=1"],
                        f"trainer.foo is not a known key; trainer has: {_trainer_keys()}; "
                        "+trainer.<key>=<value> adds another argument of lightning.pytorch.Trainer"),
    "gpt-unknown-key": (["model.net.nonsense=3"],
                        "model.net.nonsense is not a known key; model.net has: block_size, dropout, "
                        f"preset, vocab_size; +model.net.<key>=<value> adds one of: {GPT_ADDABLE}"),
    "gpt-close-key": (["model.net.n_layers=3"],
                      "model.net.n_layers is not a known key; did you mean +model.net.n_layer=3? model.net "
                      f"has: block_size, dropout, preset, vocab_size; +model.net.<key>=<value> adds one of: "
                      f"{GPT_ADDABLE}"),
    "llama-unknown-key": (["model=llama", "model.net.nonsense=3"],  # Llama's keys, not GPT's
                          "model.net.nonsense is not a known key; model.net has: block_size, from_hf, "
                          "n_kv_heads, preset, qk_norm, rope_scaling, vocab_size; +model.net.<key>=<value> adds one of: "
                          "ffn_hidden_size, n_embd, n_head, n_layer, norm_eps, rope_theta, tie_embeddings"),
    "llama-key-needs-plus": (["model=llama", "model.net.n_layer=4"],
                             "model.net.n_layer is not in the config yet; add it with +model.net.n_layer=4"),
    "plus-on-a-present-key": (["+model.net.preset=micro"],
                              "+model.net.preset=micro: model.net.preset is already in the config; set it "
                              "without +: model.net.preset=micro"),
    "compression-not-selected": (["compression.rank=4"],
                                 "compression.rank belongs to compression=powersgd, not the selected "
                                 "compression=none; select one, e.g. compression=powersgd compression.rank=4"),
    "strategy-not-selected": (["strategy=ddp", "strategy.tensor_parallel_size=2"],
                              "strategy.tensor_parallel_size belongs to strategy=pipeline or "
                              "strategy=tensor_parallel, not the selected strategy=ddp; select one, e.g. "
                              "strategy=pipeline strategy.tensor_parallel_size=2"),
    "llama-key-on-gpt": (["model.net.n_kv_heads=2"],
                         "model.net.n_kv_heads belongs to model=llama, not the selected model=gpt; select "
                         "one, e.g. model=llama model.net.n_kv_heads=2"),
    "group-deleted": (["~model"], f"~model: the model group needs an option; choose one of: {_options('model')}"),
    "plus-on-a-group": (["+strategy=ddp"],
                        "+strategy=ddp: strategy has an option already; pick another without +: strategy=ddp"),
    "list-without-brackets": (["trainer.devices=0,1"],
                              "trainer.devices=0,1 is ambiguous: a list is trainer.devices=[0,1], a string "
                              "trainer.devices='0,1', and a sweep over its values needs -m (python train.py -m "
                              "trainer.devices=0,1)"),
    "two-modes": (["-m", "trainer.devices=1,2", "--cfg", "job"],
                  "-m and --cfg cannot be given together: use one of them at a time"),
    "no-equals": (["trainer.devices"],
                  "trainer.devices has no value: write trainer.devices=<value>; an override is key=value, "
                  "+key=value adds a key, ~key deletes one"),
    "no-value": (["trainer.devices="],
                 "trainer.devices= has no value: write trainer.devices=<value> (trainer.devices='' for an "
                 "empty string, trainer.devices=null for none)"),
    "no-key": (["=3"],
               "=3 names no key: an override is key=value, +key=value adds a key, ~key deletes one, "
               "e.g. trainer.devices=3"),
    "unbalanced-brackets": (["trainer.devices=[0,1"],
                            "cannot parse trainer.devices=[0,1: its brackets do not balance; a list is "
                            "key=[a,b], a dict key={a:1}, and a value holding brackets or commas is quoted: "
                            "key='...'"),
    "empty-sweep": (["-m", "trainer.devices="],
                    "trainer.devices= sweeps no value: a sweep needs at least one value, e.g. -m "
                    "trainer.devices=<a>,<b>"),
    "empty-range-sweep": (["-m", "trainer.devices=range(1,1)"],
                          "trainer.devices=range(1,1) sweeps no value: a sweep needs at least one value, "
                          "e.g. -m trainer.devices=<a>,<b>"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", ERRORS)
def test_what_hydra_rejects_is_one_line(case, capsys, outputs_root):
    overrides, expected = ERRORS[case]
    assert check(overrides, capsys) == (2, "", f"error: {expected}\n")
    assert list(outputs_root.iterdir()) == []


# --- a device sweep skips the cells that cannot run -------------------------------------------

GRID = [["trainer.devices=1", "strategy=single"], ["trainer.devices=1", "strategy=ddp"],
        ["trainer.devices=2", "strategy=single"], ["trainer.devices=2", "strategy=ddp"]]


def test_only_a_combination_that_cannot_run_is_skipped():
    assert cells_to_skip(GRID, {2: "single runs one process"}) == [2]
    assert cells_to_skip(GRID, {2: "too many", 3: "too many"}) == []  # nothing runs at 2 devices
    assert cells_to_skip(GRID, {0: "bad", 2: "bad"}) == []  # strategy=single runs at no count
    assert cells_to_skip([["seed=1"], ["seed=2"]], {1: "bad"}) == []  # no device count swept


def test_a_launcher_that_runs_jobs_elsewhere_answers_for_each_job_itself(tmp_path, monkeypatch):
    """The sweep's check finds the launcher's class from ``hydra.launcher._target_`` and asks it
    (``runs_jobs_elsewhere``, ``check_job``): a launcher of any package, none named by the app."""
    from litscale.app.preflight import check_cluster_resources, runs_jobs_elsewhere

    (tmp_path / "team_launchers.py").write_text(
        "class Elsewhere:\n"
        "    runs_jobs_elsewhere = True\n"
        "    asked = []\n\n"
        "    @classmethod\n"
        "    def check_job(cls, params, *, devices, strategy_target):\n"
        "        cls.asked.append((params['nodes'], devices, strategy_target))\n"
        "        return True\n\n\n"
        "class Here:\n"
        "    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ddp = "litscale.strategies.ddp.DDPStrategy"

    def job(launcher: str):
        return OmegaConf.create({"hydra": {"launcher": {"_target_": f"team_launchers.{launcher}", "nodes": 2}},
                                 "trainer": {"devices": 4}, "strategy": {"_target_": ddp}})

    assert runs_jobs_elsewhere(job("Elsewhere")) and check_cluster_resources(job("Elsewhere")) is True
    from team_launchers import Elsewhere

    assert Elsewhere.asked == [(2, 4, ddp)]
    assert not runs_jobs_elsewhere(job("Here")) and check_cluster_resources(job("Here")) is False


@pytest.mark.slow  # over a second alone: out of the quick loop
@TWO_CORES
def test_a_device_sweep_names_and_skips_strategy_single_at_two_devices(capsys, outputs_root):
    skipped = check_command_line(["-m", "trainer.devices=1,2", "strategy=single,ddp", "seed=3"],
                                 config_dir=str(CONF_DIR), config_name="train")
    assert skipped == [["trainer.devices=2", "strategy=single", "seed=3"]]
    captured = capsys.readouterr()
    assert captured.out == ("litscale: skipping trainer.devices=2 strategy=single: strategy=single runs one "
                            "process but trainer.devices=2; use strategy=ddp (or another multi-device "
                            "strategy)\n")
    assert captured.err == ""


@pytest.mark.slow
@TWO_CORES
def test_a_device_sweep_of_strategy_single_alone_is_refused(capsys, outputs_root):
    assert check(["-m", "trainer.devices=1,2"], capsys) == (
        2, "", "error: strategy=single runs one process but trainer.devices=2; use strategy=ddp "
               "(or another multi-device strategy)\n")


def test_the_sweeper_leaves_out_what_train_py_skips(monkeypatch):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hydra_plugins.litscale_plugins.sweeper import SkippingSweeper

    assert compose_full().hydra.sweeper._target_ == "hydra_plugins.litscale_plugins.sweeper.SkippingSweeper"
    monkeypatch.setenv(SKIPPED_JOBS_ENV, json.dumps([["strategy=single", "trainer.devices=2"]]))
    sweeper = SkippingSweeper(max_batch_size=None)
    assert SKIPPED_JOBS_ENV not in os.environ  # the jobs a sweep starts do not inherit it
    overrides = OverridesParser.create().parse_overrides(["trainer.devices=1,2", "strategy=single,ddp"])
    assert sweeper.split_arguments(overrides, None) == [[GRID[0], GRID[1], GRID[3]]]


# --- more gloo ranks than cores, on request ---------------------------------------------------


@pytest.mark.slow
def test_more_gloo_ranks_than_cores_only_on_request(tmp_path, outputs_root):
    ranks = CORES + 2
    overrides = ["strategy=ddp", "trainer.accelerator=cpu", f"trainer.devices={ranks}"]
    cfg, choices = compose_job(overrides, tmp_path / "run")
    with pytest.raises(ConfigError) as error:
        validate(cfg, choices=choices)
    assert str(error.value) == (
        f"trainer.devices={ranks} is more than this machine has: {CORES} CPU cores (allowed: 1..{CORES}, "
        f"or add launcher.oversubscribe=true to run {ranks} gloo ranks on {CORES} cores, one thread each)")
    cfg, choices = compose_job([*overrides, "launcher.oversubscribe=true"], tmp_path / "run")
    assert validate(cfg, choices=choices).processes_per_node == ranks


# --- model=llama's own keys -------------------------------------------------------------------


@pytest.mark.slow
def test_llama_takes_n_kv_heads_as_the_readme_writes_it(capsys, tmp_path, outputs_root):
    assert check(["model=llama", "model.net.n_kv_heads=2", "trainer.max_steps=2"], capsys) == (0, "", "")
    cfg, _ = compose_job(["model=llama", "model.net.n_kv_heads=1"], tmp_path / "run")
    net = instantiate(cfg.model.net)
    assert net.config.n_kv_heads == 1 and net.config.n_head == 4  # the preset's n_head, its own kv heads
    tokens = torch.randint(0, net.config.vocab_size, (2, 8))
    net(tokens).logsumexp(-1).mean().backward()  # a training step's forward and backward
    assert all(p.grad is not None for p in net.parameters())


# --- the run's lines in train.log -------------------------------------------------------------


def test_printed_lines_reach_the_log_file_and_the_console_is_unchanged(tmp_path, capsys):
    log, console = tmp_path / "train.log", sys.stdout
    handler = logging.FileHandler(log)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s - %(message)s"))
    logging.getLogger().addHandler(handler)
    try:
        with log_printed_lines():
            print("litscale: start")
            print("a line of its own")
            sys.stdout.write("\rEpoch 0:  50%|#####| 1/2")  # a progress bar, then a print beside it
            print("litscale: memory per rank")
            print("error: a rank failed", file=sys.stderr)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    captured = capsys.readouterr()
    assert captured.out == ("litscale: start\na line of its own\n"
                            "\rEpoch 0:  50%|#####| 1/2litscale: memory per rank\n")
    assert captured.err == "error: a rank failed\n"
    assert log.read_text().splitlines() == ["litscale INFO - litscale: start",
                                            "litscale INFO - litscale: memory per rank",
                                            "litscale ERROR - error: a rank failed"]
    assert sys.stdout is console  # put back


# --- a checkpoint of another model ------------------------------------------------------------


def _checkpoint_of(overrides: list[str], outputs_root: Path) -> Path:
    """A run dir under ``outputs_root`` as a run of ``overrides`` leaves it: its network's
    weights in ``checkpoints/last.ckpt``, its config in ``.hydra/``."""
    full = compose_full(overrides)
    run = outputs_root / "default" / "runs" / "earlier"
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    OmegaConf.save({"hydra": {"runtime": {"choices": dict(full.hydra.runtime.choices)}}},
                   run / ".hydra" / "hydra.yaml")
    OmegaConf.save({"model": OmegaConf.to_container(full.model)}, run / ".hydra" / "config.yaml")
    net = instantiate(full.model.net)
    path = run / "checkpoints" / "last.ckpt"
    torch.save({"state_dict": {f"net.{k}": v for k, v in net.state_dict().items()}, "global_step": 2}, path)
    return path


@pytest.mark.slow
def test_resuming_another_models_checkpoint_is_refused_before_it_starts(tmp_path, outputs_root):
    path = _checkpoint_of([], outputs_root)  # model=gpt
    cfg, choices = compose_job(["model=llama", "ckpt_path=last"], tmp_path / "run")
    with pytest.raises(ConfigError) as error:
        validate(cfg, choices=choices)
    assert str(error.value) == (
        f"ckpt_path=last ({path}): the checkpoint holds model=gpt (preset nano), the run configures "
        "model=llama (preset tiny): net.blocks.0.attn.k_proj.bias is not in the run's network; resume "
        "with the model it was trained with, or start fresh with ckpt_path=null")
    cfg, choices = compose_job(["model.net.preset=micro", f"ckpt_path={path}"], tmp_path / "run")
    with pytest.raises(ConfigError) as error:
        validate(cfg, choices=choices)
    assert str(error.value) == (
        f"ckpt_path={str(path)!r}: the checkpoint holds model=gpt (preset nano), the run configures "
        "model=gpt (preset micro): it lacks net.blocks.4.attn.k_proj.bias; resume with the model it was "
        "trained with, or start fresh with ckpt_path=null")
    cfg, choices = compose_job([f"ckpt_path={path}"], tmp_path / "run")
    assert validate(cfg, choices=choices).ckpt_path == str(path)  # its own model resumes


# --- as a user types it -----------------------------------------------------------------------

QUICK = ("trainer.accelerator=cpu", "trainer.enable_progress_bar=false", "data.max_bytes=200000",
         "trainer.limit_val_batches=1")


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_llama_trains_logs_its_lines_and_its_checkpoint_is_not_resumed_as_gpt(tmp_path):
    run = run_train("model=llama", "model.net.n_kv_heads=1", "trainer.max_steps=2", *QUICK, outputs=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    (log,) = tmp_path.rglob("train.log")
    logged = [line.split(" - ", 1)[1] for line in log.read_text().splitlines()]
    printed = [line for line in run.stdout.splitlines() if line.startswith("litscale: ")]
    assert printed and set(printed) <= set(logged)
    assert any(line.startswith("litscale: memory per rank") for line in logged)  # Lightning's logger's
    (checkpoint,) = tmp_path.rglob("last.ckpt")
    runs = sorted(tmp_path.rglob("runs/*"))
    refused = run_train(f"ckpt_path={checkpoint}", *QUICK, outputs=tmp_path)
    assert (refused.returncode, refused.stdout) == (2, "")
    assert refused.stderr == (
        f"error: ckpt_path={str(checkpoint)!r}: the checkpoint holds model=llama (preset tiny), the run "
        "configures model=gpt (preset nano): net.embed_tokens.weight is not in the run's network; resume "
        "with the model it was trained with, or start fresh with ckpt_path=null\n")
    assert sorted(tmp_path.rglob("runs/*")) == runs  # no run dir for the refused run


@pytest.mark.soak  # make test-full: three jobs, one of them 2 ranks
@pytest.mark.slow
@pytest.mark.timeout(400)
@TWO_CORES
def test_a_scaling_sweep_runs_all_but_the_skipped_cell(tmp_path):
    run = run_train("-m", "trainer.devices=1,2", "strategy=single,ddp", "trainer.max_steps=2", *QUICK,
                    outputs=tmp_path, timeout=380)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [line for line in run.stdout.splitlines() if "skipping" in line] == [
        "litscale: skipping trainer.devices=2 strategy=single: strategy=single runs one process but "
        "trainer.devices=2; use strategy=ddp (or another multi-device strategy)"]
    (sweep,) = tmp_path.glob("default/multiruns/*")
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == ["0", "1", "2"]
    cells = [[o for o in OmegaConf.load(sweep / job / ".hydra" / "overrides.yaml")
              if o.startswith(("trainer.devices=", "strategy="))] for job in jobs]
    assert cells == [GRID[0], GRID[1], GRID[3]]
    assert all((sweep / job / "summary.json").is_file() for job in jobs)
    assert "litscale: done" in (sweep / "2" / "train.log").read_text()  # written by the ranks


@pytest.mark.soak  # make test-soak: 4 ranks on 2 cores, about a minute (test_moving_runs.py oversubscribes 4 FSDP ranks in make test-full)
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_more_ranks_than_cores_train_with_launcher_oversubscribe(tmp_path):
    ranks = CORES + 2
    run = run_train("strategy=ddp", f"trainer.devices={ranks}", "launcher.oversubscribe=true",
                    "trainer.max_steps=2", *QUICK, outputs=tmp_path, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    (summary,) = tmp_path.rglob("summary.json")
    assert json.loads(summary.read_text())["world_size"] == ranks
