"""``~`` is the home directory in every path a user types (``litscale.user_paths``): each key
of ``conf/`` that names a local path (and each environment variable that does) finds what lies
under ``~``, with ``HOME`` pointed at a tmp dir."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.cli import check_command
from helpers.configs import compose_full, compose_job
from omegaconf import OmegaConf

import litscale.app  # noqa: F401  (the configs' resolvers)

VOCAB = 256


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A home dir of the test's own, holding a tiny Qwen3 directory's config and (empty)
    safetensors weights, a corpus, a tokenizer, a checkpoint file, a finished run's summary."""
    from transformers import AutoConfig

    from litscale.data.tokenizer import BPE_ASSET
    from litscale.models.hf import TINY_CONFIG

    home = tmp_path / "home"
    model = home / "models" / "qwen3"
    model.mkdir(parents=True)
    fields = {k: v for k, v in TINY_CONFIG.items() if k != "model_type"}
    AutoConfig.for_model(TINY_CONFIG["model_type"], **fields, vocab_size=VOCAB).to_json_file(model / "config.json")
    (model / "model.safetensors").write_bytes(b"")  # read only off the meta device
    (home / "corpus").mkdir()
    (home / "corpus" / "a.txt").write_text("some text\n")
    (home / "tok").mkdir()
    shutil.copy(BPE_ASSET, home / "tok" / "tokenizer.json")
    (home / "ckpt").mkdir()
    torch.save({"state_dict": {}, "pytorch-lightning_version": "2.6.6"}, home / "ckpt" / "last.ckpt")
    (home / "runs" / "one").mkdir(parents=True)
    (home / "runs" / "one" / "summary.json").write_text(json.dumps({"moe/tokens_per_expert": [[3, 1]]}))
    (home / "project").mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


def model_path(home, monkeypatch):
    from litscale.models.hf import build_hf

    with torch.device("meta"):
        net = build_hf(path="~/models/qwen3", vocab_size=VOCAB, block_size=32)
    return net.config.checkpoint, str(home / "models" / "qwen3")


def model_config(home, monkeypatch):
    from litscale.models.hf import build_hf

    with torch.device("meta"):
        net = build_hf(config="~/models/qwen3/config.json", vocab_size=VOCAB, block_size=32)
    return net.config.vocab_size, VOCAB


def model_from_hf(home, monkeypatch):
    from litscale.models.llama import build_llama

    with torch.device("meta"):
        net = build_llama(from_hf="~/models/qwen3", vocab_size=VOCAB, block_size=32)
    return net.config.n_embd, 128


def data_paths(home, monkeypatch):
    from litscale.data.byte_corpus import expand_paths

    return expand_paths("~/corpus/*.txt"), [str(home / "corpus" / "a.txt")]


def data_tokenizer(home, monkeypatch):
    from litscale.data.tokenizer import tokenizer_file

    return tokenizer_file("~/tok/tokenizer.json"), home / "tok" / "tokenizer.json"


def data_cache_dir(home, monkeypatch):
    from litscale.data.tokens import TokenDataModule

    return TokenDataModule(seq_len=16, batch_size=1, cache_dir="~/cache").cache_dir, str(home / "cache")


def litscale_cache(home, monkeypatch):
    from litscale.data.byte_corpus import default_cache_dir

    monkeypatch.setenv("LITSCALE_CACHE", "~/cache")
    return default_cache_dir(), str(home / "cache")


def ckpt_path(home, monkeypatch):
    from litscale.checkpoint.resume import resolve_ckpt_path

    return resolve_ckpt_path("~/ckpt/last.ckpt", search_dir=str(home)), str(home / "ckpt" / "last.ckpt")


def calibrate_from(home, monkeypatch):
    from litscale.app.checks.validation import calibrate_from_paths, check_calibrate_from

    check_calibrate_from(OmegaConf.create({"mode": "show", "calibrate_from": "~/runs"}))
    return calibrate_from_paths(["~/runs"]), [str(home / "runs")]


def moe_load_from(home, monkeypatch):
    from types import SimpleNamespace

    from litscale.app.plan.runs import measured_tokens_per_expert

    return measured_tokens_per_expert("~/runs/one/summary.json", SimpleNamespace(n_experts=2)), ((3.0, 1.0),)


def scaling_baseline(home, monkeypatch):
    from litscale.app.scaling_study import baseline_summary_path

    return baseline_summary_path("~/runs/one"), str(home / "runs" / "one" / "summary.json")


def paths_root_dir(home, monkeypatch):
    """Typed on the command line: the run dir Hydra makes, and where ``ckpt_path=last`` looks."""
    from litscale.app.checks.validation import resume_search_dir

    cfg = compose_full(["paths.root_dir='~/outputs'", "hydra.job.name=x"])
    run_dir = OmegaConf.select(cfg, "hydra.run.dir").rsplit("/", 1)[0]
    job, _ = compose_job(["paths.root_dir='~/outputs'"], home / "run")
    return (run_dir, resume_search_dir(job)), (f"{home}/outputs/default/runs", f"{home}/outputs/default")


def litscale_outputs(home, monkeypatch):
    monkeypatch.setenv("LITSCALE_OUTPUTS", "~/outputs")
    return compose_full([]).paths.root_dir, str(home / "outputs")


def ray_working_dir(home, monkeypatch):
    from hydra_plugins.litscale_plugins.ray_settings import working_dir

    return working_dir({"working_dir": "~/project"}, task_function=None), str(home / "project")


# key -> (what the key's reader finds for a `~` path, what lies there)
PATH_KEYS = {
    "model.net.path": model_path,
    "model.net.config": model_config,
    "model.net.from_hf": model_from_hf,
    "data.paths": data_paths,
    "data.tokenizer": data_tokenizer,
    "data.cache_dir": data_cache_dir,
    "LITSCALE_CACHE": litscale_cache,
    "ckpt_path": ckpt_path,
    "plan.calibrate_from": calibrate_from,
    "plan.moe_load_from": moe_load_from,
    "scaling.baseline": scaling_baseline,
    "paths.root_dir": paths_root_dir,
    "LITSCALE_OUTPUTS": litscale_outputs,
    "hydra.launcher.working_dir": ray_working_dir,
}


@pytest.mark.parametrize("key", list(PATH_KEYS))
def test_a_path_under_home_is_found(key, home, monkeypatch):
    found, expected = PATH_KEYS[key](home, monkeypatch)
    assert found == expected


def test_the_hf_model_command_of_the_docs_passes_its_checks(home, outputs_root, capsys):
    """docs/llm.md: ``"model.net.path='~/models/qwen3'"`` (quoted, as Hydra's grammar needs)."""
    code, out, err = check_command(["model=hf", "model.net.path='~/models/qwen3'", "data=synthetic",
                                    f"data.vocab_size={VOCAB}", "data.seq_len=32"], capsys)
    assert (code, err) == (0, ""), out + err
