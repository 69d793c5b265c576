"""A model's traced facts are traced once and read back: by the same model config, data shape,
precision and code only, equal to a fresh trace, with the network rebuilt; never for a network
read from files; and a file that cannot be read is traced again, not trusted."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.configs import compose_job, described

from litscale.app.checks.validation import meta_net
from litscale.app.plan.runs import facts_of
from litscale.planner import facts_cache, model_facts, profile_cache

pytestmark = pytest.mark.slow  # composes jobs and traces models (a second each)


@pytest.fixture
def traces(tmp_path, monkeypatch):
    """The cache in ``tmp_path``; counts each trace ``facts_of`` makes (the real ones)."""
    monkeypatch.setenv("LITSCALE_CACHE", str(tmp_path / "cache"))
    made = []
    real = model_facts.model_facts

    def counted(net, **shape):
        made.append(shape)
        return real(net, **shape)

    monkeypatch.setattr("litscale.app.plan.runs.model_facts", counted)
    return made


def without_network(facts):
    return dataclasses.replace(facts, net=None)


@pytest.mark.parametrize("model", ["gpt", "moe"])
def test_a_model_is_traced_once_and_read_back_equal_with_its_network(tmp_path, traces, model):
    cfg, choices = compose_job([f"model={model}", "data.seq_len=32"], tmp_path / "job")
    run = described(cfg, choices)
    traced, read = facts_of(run), facts_of(run)
    assert len(traces) == 1
    assert without_network(read) == without_network(traced)
    fresh = model_facts.model_facts(meta_net(cfg), seq_len=32, vocab_size=int(cfg.data.vocab_size))
    assert without_network(read) == without_network(fresh)
    assert isinstance(read.net, type(fresh.net)) and read.net is not traced.net
    assert len(list((tmp_path / "cache" / "facts").glob("*.json"))) == 1


def test_another_shape_precision_or_code_is_traced_again(tmp_path, traces, monkeypatch):
    base = ["model=gpt", "data.seq_len=32"]
    for overrides in (base, [*base[:1], "data.seq_len=64"], [*base, "precision=bf16_mixed"]):
        facts_of(described(*compose_job(overrides, tmp_path / "job")))
    assert len(traces) == 3
    monkeypatch.setattr(profile_cache, "code_digest", lambda: "another checkout")
    facts_of(described(*compose_job(base, tmp_path / "job")))
    assert len(traces) == 4


@pytest.mark.parametrize("read_from", [{"path": "checkpoint"}, {"from_hf": "checkpoint"},
                                       {"config": "checkpoint/config.json"}], ids=["path", "from_hf", "config_file"])
def test_a_network_read_from_files_is_not_cached(tmp_path, read_from):
    shape = {"seq_len": 8, "vocab_size": 8, "compute_dtype": "float32", "param_dtype": "float32"}
    assert facts_cache.identity({"_target_": "build", **read_from}, **shape) is None
    assert facts_cache.identity({"_target_": "build", "config": {"hidden_size": 8}}, **shape) is not None


def test_an_unreadable_file_is_traced_again_and_rewritten(tmp_path, traces):
    run = described(*compose_job(["model=gpt", "data.seq_len=32"], tmp_path / "job"))
    first = facts_of(run)
    (stored,) = (tmp_path / "cache" / "facts").glob("*.json")
    stored.write_text('{"facts": {"num_params": "half a file')
    assert without_network(facts_of(run)) == without_network(first) and len(traces) == 2
    assert without_network(facts_of(run)) == without_network(first) and len(traces) == 2
