"""``data=sft`` in one process: conversations rendered and masked as transformers renders and
masks them, bad rows refused in one line naming file and row before any rank starts, examples
cut or dropped and counted, packing that moves every example whole into a row, and mixtures
whose realised shares match their weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.configs import compose_job

from litscale.app.checks.validation import ConfigError, validate
from litscale.data.chat import (
    BUILTIN_TEMPLATE,
    ChatTemplate,
    assistant_spans,
    tokens_with_mask,
)
from litscale.data.mixture import interleave
from litscale.data.packing import pack_rows
from litscale.data.sft import SFTDataModule
from litscale.data.token_batch import IGNORE_INDEX
from litscale.data.tokenizer import BPE_ASSET, load_tokenizer

# ChatML, the assistant's turns marked for transformers' own assistant mask (the reference).
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
          "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{{ '\\n' }}{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": "2 + 3 = 5."}, {"role": "user", "content": "And 4 * 4?"},
                {"role": "assistant", "content": "4 * 4 = 16."}]


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory) -> Path:
    """The shipped BPE with ChatML's two special tokens and a tokenizer_config.json whose
    chat_template is ChatML: a tokenizer directory as Hugging Face writes one."""
    from tokenizers import Tokenizer

    directory = tmp_path_factory.mktemp("chatml")
    tokenizer = Tokenizer.from_file(str(BPE_ASSET))
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": CHATML, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory


def _module(tmp_path, **options) -> SFTDataModule:
    return SFTDataModule(seq_len=options.pop("seq_len", 64), batch_size=2, cache_dir=str(tmp_path / "cache"), **options)


def test_a_tokenizer_directorys_template_renders_and_masks_as_transformers_does(chatml_tokenizer):
    """The text, the tokens and which of them are the assistant's: transformers' own
    ``apply_chat_template`` with its assistant mask (from the template's generation blocks)."""
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_file=str(chatml_tokenizer / "tokenizer.json"), eos_token="<|im_end|>")
    reference.chat_template = CHATML
    expected = reference.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
    module = SFTDataModule(seq_len=64, batch_size=2, tokenizer=str(chatml_tokenizer))
    text, spans = assistant_spans(module.template, CONVERSATION, "assistant", "a row")
    assert text == reference.apply_chat_template(CONVERSATION, tokenize=False)
    ids, trained = tokens_with_mask(module.tokenizer, text, spans, module.template.eos_token)
    assert ids.tolist() == expected["input_ids"]
    assert trained.astype(int).tolist() == expected["assistant_masks"]


def test_the_builtin_template_trains_on_each_answer_and_its_end_of_text():
    tokenizer = load_tokenizer("bpe")
    template = ChatTemplate(BUILTIN_TEMPLATE, "builtin", tokenizer.eos_token)
    for train_on, answers in (("assistant", ["2 + 3 = 5.", "4 * 4 = 16."]), ("last_assistant", ["4 * 4 = 16."])):
        text, spans = assistant_spans(template, CONVERSATION, train_on, "a row")
        ids, trained = tokens_with_mask(tokenizer, text, spans, template.eos_token)
        runs = np.split(ids, np.flatnonzero(np.diff(trained.astype(int))) + 1)
        kept = [run for run in runs if trained[list(ids).index(run[0])]] if len(runs) > 1 else runs
        assert [tokenizer.decode(run[:-1]) for run in kept] == answers
        assert all(run[-1] == tokenizer.eos_id for run in kept)


def test_a_row_trains_only_on_the_assistants_next_tokens(tmp_path):
    """Each counted target is an assistant's token; the targets of the prompt are ignored."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Say {n}.", "response": f"{n}"}) + "\n" for n in range(40)))
    module = _module(tmp_path, paths=str(rows))
    module.prepare_data()
    module.setup("fit")
    for index in range(len(module.train_dataset)):
        row = module.train_dataset[index]
        counted = row.targets[row.targets != IGNORE_INDEX]
        text = module.tokenizer.decode(counted[:-1].tolist())
        assert text.isdigit() and counted[-1] == module.tokenizer.eos_id
        assert text in module.tokenizer.decode(row.tokens.tolist())


@pytest.mark.parametrize("line, message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "has no assistant turn"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
     "message 2 of line 3 of {file} is an empty assistant turn"),
    ({"messages": [{"role": "narrator", "content": "hi"}, {"role": "assistant", "content": "yes"}]},
     "message 1 of line 3 of {file} has role 'narrator', which the chat template (builtin) does not know"),
    ({"question": "hi"}, "line 3 of {file} has no 'messages' or 'prompt' and 'response' field"),
    ("not json", "line 3 of {file} is not JSON"),
])
def test_a_bad_row_is_refused_in_one_line_naming_its_file_and_row_before_any_rank_starts(tmp_path, line, message):
    rows = tmp_path / "rows.jsonl"
    good = json.dumps({"prompt": "a", "response": "b"})
    rows.write_text(f"{good}\n{good}\n{line if isinstance(line, str) else json.dumps(line)}\n{good}\n")
    cfg, choices = compose_job(["model=llama", "data=sft", f"data.paths={rows}", "data.seq_len=32",
                                f"data.cache_dir={tmp_path / 'cache'}", "trainer.accelerator=cpu"], tmp_path / "run")
    with pytest.raises(ConfigError) as refused:
        validate(cfg, choices=choices)
    assert message.format(file=rows) in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "run").exists()


def test_packing_needs_a_model_that_attends_within_documents(tmp_path):
    cfg, choices = compose_job(["model=gpt", "data=sft", "data.pack=true", "data.seq_len=32", "trainer.accelerator=cpu",
                                f"data.cache_dir={tmp_path / 'cache'}"], tmp_path / "run")
    with pytest.raises(ConfigError, match=r"data.pack=true packs documents into a row, which model=gpt would let "
                                          r"attend to each other .*allowed: model=llama, moe or hf"):
        validate(cfg, choices=choices)


def test_overlong_examples_are_cut_or_dropped_and_counted(tmp_path):
    module = _module(tmp_path, seq_len=40)
    module.prepare_data()
    cache = module._cache(module.sources[0])
    train, _ = module._split(cache)
    positions = (cache.starts[1:] - cache.starts[:-1])[train] - 1
    trained = cache.trained()
    # an example cut to 40 positions trains on nothing when its answer starts after them
    nothing = sum(1 for i in train if positions[list(train).index(i)] > 40
                  and not trained[cache.starts[i] + 1:cache.starts[i] + 41].any())
    module.setup("fit")
    assert module.example_counts["truncated"] == int((positions > 40).sum()) > 0
    assert module.example_counts["dropped_nothing_to_train"] == nothing
    dropped = _module(tmp_path, seq_len=40, overlong="drop")
    dropped.setup("fit")
    assert dropped.example_counts["dropped_overlong"] == int((positions > 40).sum())
    assert len(dropped.train_dataset) == int((positions <= 40).sum())


def test_packed_rows_hold_every_example_whole_each_from_position_zero(tmp_path):
    alone, packed = _module(tmp_path, seq_len=128), _module(tmp_path, seq_len=128, pack=True)
    for module in (alone, packed):
        module.prepare_data()
        module.setup("fit")
    assert len(packed.train_dataset) < 0.4 * len(alone.train_dataset)
    examples = {}
    for index in range(len(alone.train_dataset)):
        row = alone.train_dataset[index]
        length = int((row.positions[1:] != 0).long().cumprod(0).sum()) + 1
        examples[(tuple(row.tokens[:length].tolist()), tuple(row.targets[:length].tolist()))] = examples.get(
            (tuple(row.tokens[:length].tolist()), tuple(row.targets[:length].tolist())), 0) + 1
    found: dict = {}
    for index in range(len(packed.train_dataset)):
        row = packed.train_dataset[index]
        starts = torch.nonzero(row.positions == 0).flatten().tolist() + [128]
        for start, end in zip(starts, starts[1:], strict=False):
            key = (tuple(row.tokens[start:end].tolist()), tuple(row.targets[start:end].tolist()))
            if any(t != IGNORE_INDEX for t in key[1]):
                found[key] = found.get(key, 0) + 1
    assert found == examples
    real = sum(int(packed.train_dataset.real_tokens()[i]) for i in range(len(packed.train_dataset)))
    assert real == sum(len(k[0]) for k, n in examples.items() for _ in range(n))


def test_best_fit_packing_fills_rows_and_never_overflows_one():
    lengths = np.random.default_rng(0).integers(1, 65, 500)
    rows = pack_rows(lengths, 64, pack=True)
    assert sorted(i for row in rows for i in row) == list(range(500))
    assert all(lengths[row].sum() <= 64 for row in rows)
    # within 6% of the fewest rows any packing could use
    assert len(rows) <= 1.06 * np.ceil(lengths.sum() / 64)


@pytest.mark.parametrize("weights", [(0.7, 0.3), (0.5, 0.5), (0.2, 0.5, 0.3), (0.01, 0.99)])
def test_a_mixtures_realised_shares_are_within_one_percent_of_its_weights_over_10000_samples(weights):
    owners = interleave(weights, 10_000, seed=3)
    shares = np.bincount(owners, minlength=len(weights)) / 10_000
    assert np.abs(shares - np.asarray(weights) / sum(weights)).max() < 0.01
    # and over every shorter stretch as well: no source comes in bursts
    for start in range(0, 10_000, 1_000):
        stretch = np.bincount(owners[start:start + 1_000], minlength=len(weights)) / 1_000
        assert np.abs(stretch - np.asarray(weights) / sum(weights)).max() <= 0.002
    assert np.array_equal(owners, interleave(weights, 10_000, seed=3))
    assert not np.array_equal(owners, interleave(weights, 10_000, seed=4))


@pytest.mark.slow  # over half a second alone
def test_a_two_source_mixture_draws_each_source_at_its_weight_through_the_training_order(tmp_path):
    """Sources of conversations and of plain text at 0.7 / 0.3: the first 10,000 samples the
    ranks draw (several epochs of the mixture) come from each within 1%, and each source's rows
    are taken in turn, none twice before all are."""
    text = tmp_path / "notes.jsonl"
    text.write_text("".join(json.dumps({"text": f"note {n}: " + "word " * (n % 9)}) + "\n" for n in range(300)))
    module = _module(tmp_path, sources=[{"paths": None, "weight": 0.7, "name": "chats"},
                                         {"paths": str(text), "weight": 0.3, "kind": "text", "name": "notes"}])
    module.prepare_data()
    module.setup("fit")
    dataset = module.train_dataset
    drawn, epoch = [], 0
    while len(drawn) < 10_000:
        drawn += [dataset.row_of(i, epoch) for i in range(len(dataset))]
        epoch += 1
    drawn = drawn[:10_000]
    shares = np.bincount([source for source, _ in drawn], minlength=2) / 10_000
    assert abs(shares[0] - 0.7) < 0.01 and abs(shares[1] - 0.3) < 0.01
    for source in range(2):
        rows = [row for s, row in drawn if s == source]
        size = len(dataset.sources[source])
        assert sorted(rows[:size]) == list(range(size))


@pytest.mark.parametrize("sources, message", [
    ("[{paths: null, weight: 0}]", "data.sources[0].weight=0 is not valid; allowed: a number above 0"),
    ("[{paths: null, kind: audio}]", "data.sources[0].kind='audio' is not valid; allowed: sft (conversations) or "
                                     "text (documents)"),
    ("[{paths: null}, {paths: null, wieght: 2}]", "data.sources[1].wieght is not a key of a source; allowed: paths, "
                                                  "weight, kind, name"),
    ("[]", "data.sources=[] has no source; allowed: a list of {paths, weight, kind}"),
    ("[{paths: /nowhere/*.jsonl}]", "data.sources[0].paths='/nowhere/*.jsonl' matches no files; allowed: a glob of "
                                    ".jsonl or .parquet files"),
])
def test_a_bad_source_of_a_mixture_is_refused_in_one_line_before_any_rank_starts(tmp_path, sources, message):
    cfg, choices = compose_job(["model=llama", "data=sft", f"data.sources={sources}", "trainer.accelerator=cpu",
                                f"data.cache_dir={tmp_path / 'cache'}"], tmp_path / "run")
    with pytest.raises(ConfigError) as refused:
        validate(cfg, choices=choices)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # validates and prepares a two-source run's data (over a second alone)
def test_a_resume_of_a_mixture_with_other_weights_is_refused_before_any_rank_starts(tmp_path):
    """The checkpoint's data state names the sources and weights it drew from: a resume that
    would draw other rows at the same position is one line, not a run on other data."""
    checkpoint = tmp_path / "saved.ckpt"
    drawn = [{"name": "chats", "weight": 0.7, "drawn": 17}, {"name": "more", "weight": 0.3, "drawn": 7}]
    torch.save({"state_dict": {}, "global_step": 3, "SFTDataModule": {
        "epoch": 0, "samples_drawn": 24, "seed": 1, "dataset_samples": 900, "sources": drawn}}, checkpoint)

    def resume(weights):
        sources = ", ".join(f"{{paths: null, weight: {w}, name: {n}}}" for n, w in zip(("chats", "more"), weights,
                                                                                         strict=True))
        cfg, choices = compose_job(["model=llama", "data=sft", f"data.sources=[{sources}]", "trainer.accelerator=cpu",
                                    f"data.cache_dir={tmp_path / 'cache'}", f"ckpt_path={checkpoint}"], tmp_path / "run")
        return validate(cfg, choices=choices)

    with pytest.raises(ConfigError, match=r"^data.sources=.* is not the mixture the checkpoint was trained on "
                                          r"\(chats 0.7, more 0.3\); allowed: the checkpoint's sources"):
        resume((0.5, 0.5))
    resume((0.7, 0.3))


def test_a_template_that_names_no_role_renders_every_role_and_one_that_names_some_knows_only_those():
    generic = ChatTemplate("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
                           "{% endfor %}", "generic", "<|im_end|>")
    assert generic.knows_role("system") and generic.knows_role("tool")
    naming = ChatTemplate(CHATML, "chatml", "<|im_end|>")
    assert naming.knows_role("assistant") and not naming.knows_role("narrator")
