"""``python -m litscale.app.generate``: a run dir's ``model.pt`` and the Hugging Face directory
exported from the same weights (with the run's tokenizer and chat template) give the same
greedy answer, one through litscale's loop and one through transformers' ``generate``; the
exported directory's tokenizer renders and tokenizes a conversation as litscale trained on it
(transformers' own ``apply_chat_template``); sampled answers follow their seed; a path that is
no model is one line."""

from __future__ import annotations

import pytest
import torch
from helpers.configs import compose_job
from omegaconf import OmegaConf

from litscale.app.build import build
from litscale.app.generate import Sampling, answers, load, main

QUESTION = "What is 12 + 30?"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run dir as a data=sft run of model=llama leaves it (its config and model.pt, random
    weights), and its Hugging Face export with the tokenizer, as export_hf=true writes them."""
    from litscale.data.sft import SFTDataModule
    from litscale.models.hf_writing import save_hf_directory

    run = tmp_path_factory.mktemp("run")
    cfg, _ = compose_job(["model=llama", "data=sft", "data.seq_len=64"], run)
    (run / ".hydra").mkdir()
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    torch.manual_seed(3)
    net = build(cfg.model.net)
    torch.save(net.state_dict(), run / "model.pt")
    save_hf_directory(net, net.state_dict(), str(run / "hf"))
    SFTDataModule(seq_len=64, batch_size=1, cache_dir=str(run / "cache")).save_tokenizer(str(run / "hf"))
    return run


@pytest.mark.slow  # builds and exports a model, loads transformers (over a second alone)
def test_a_run_and_its_export_give_the_same_greedy_answer_and_sample_by_seed(run_dir):
    from transformers import AutoTokenizer

    from_run, from_export = load(str(run_dir)), load(str(run_dir / "hf"))
    greedy = Sampling(max_new_tokens=12)
    answer = answers(from_run, QUESTION, sampling=greedy)
    assert answer == answers(from_export, QUESTION, sampling=greedy) and answer[0]
    # the exported tokenizer, read by transformers, prompts as litscale does
    tokenizer = AutoTokenizer.from_pretrained(str(run_dir / "hf"), local_files_only=True)
    messages = [{"role": "user", "content": QUESTION}]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    from litscale.data.chat import prompt_tokens

    assert prompt_tokens(from_run.tokenizer, from_run.template, messages).tolist() == expected["input_ids"]
    sampled = Sampling(max_new_tokens=12, temperature=1.0, top_k=50)
    first = answers(from_run, QUESTION, sampling=sampled, samples=3, seed=7)
    assert first == answers(from_run, QUESTION, sampling=sampled, samples=3, seed=7)
    assert len(set(first)) > 1 and first != answers(from_run, QUESTION, sampling=sampled, samples=3, seed=8)


@pytest.mark.parametrize("arguments, message", [
    (["/no/such/run", "hi"], "error: generate: /no/such/run is not a model to load; allowed: a run dir (model.pt "
                             "and .hydra/config.yaml) or a Hugging Face directory"),
    (["/no/such/run", "hi", "--temperature", "-1"], "error: --temperature=-1 is not valid; allowed: 0 (greedy) or "
                                                    "above (sampled)"),
    (["/no/such/run", "hi", "--samples", "3"], "error: --samples=3 draws the same greedy answer each time; "
                                               "allowed: --temperature above 0 to sample"),
])
def test_a_bad_argument_is_one_line(arguments, message, capsys):
    assert main(arguments) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1
