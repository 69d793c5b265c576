"""data=tokens: the offline tokenizers, the token cache, packing, the document split, sharding
and resume, the one-line errors, and (slow) a run through train.py that resumes exactly."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.cli import explain, final_weights, summaries, train_losses
from helpers.configs import CONF_DIR, compose_job
from helpers.inprocess import train_on_pool
from omegaconf import OmegaConf

from litscale.app.build import build
from litscale.app.checks.validation import ConfigError, validate
from litscale.data import TokenDataModule, load_tokenizer
from litscale.data.documents import corpus_files
from litscale.data.stdlib_code import stdlib_files
from litscale.data.token_cache import build_cache, load_cache, token_dtype
from litscale.data.tokenizer import BPE_ASSET, END_OF_TEXT

ALLOWED = "byte, bpe, or the path of a tokenizer.json or of a directory holding one"


def write_texts(root: Path, count: int = 60) -> dict[str, str]:
    """``count`` small source-like text files of different lengths: path -> text."""
    root.mkdir(parents=True, exist_ok=True)
    texts = {}
    for i in range(count):
        text = "".join(f"def f{i}_{j}(x):\n    return x * {j}  # héllo ✓\n" for j in range(3 + i % 5))
        path = root / f"doc{i:03d}.txt"
        path.write_text(text, encoding="utf-8")
        texts[str(path)] = text
    return texts


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")


def token_dm(tmp_path: Path, **kwargs) -> TokenDataModule:
    defaults = {"paths": str(tmp_path / "corpus" / "*.txt"), "seq_len": 16, "batch_size": 4,
                "cache_dir": str(tmp_path / "cache")}
    return TokenDataModule(**{**defaults, **kwargs})


def stream_of(dataset) -> list[int]:
    """The tokens a dataset's sequences cover, in order: each sequence's inputs, then the last
    target (consecutive sequences overlap by that one token)."""
    tokens = []
    for index in range(len(dataset)):
        x, y = dataset[index]
        assert torch.equal(x[1:], y[:-1])
        tokens += x.tolist()
    return tokens + [int(dataset[len(dataset) - 1][1][-1])]


# --- tokenizers -----------------------------------------------------------------------------


def test_shipped_bpe_round_trips_stdlib_source():
    bpe = load_tokenizer("bpe")
    assert BPE_ASSET.is_file() and bpe.vocab_size == 4096
    assert json.loads(BPE_ASSET.read_text())["added_tokens"][0]["content"] == END_OF_TEXT
    assert bpe.eos_id == 0
    texts = [Path(p).read_text(encoding="utf-8") for p in stdlib_files()[::40]]
    texts += ["naïve café — 你好 🐍\r\n\tx = 1  \n", " leading space", ""]
    encoded = bpe.encode_batch(texts)
    for text, ids in zip(texts, encoded, strict=True):
        assert bpe.decode(ids) == text
        assert int(ids.max(initial=0)) < bpe.vocab_size
    # A trained BPE, not bytes: several bytes per token on the code it was trained on.
    total_bytes = sum(len(t.encode("utf-8")) for t in texts)
    assert total_bytes / sum(len(ids) for ids in encoded) > 3


def test_byte_tokenizer_is_the_byte_scheme_plus_end_of_text():
    byte = load_tokenizer("byte")
    assert (byte.vocab_size, byte.eos_id) == (257, 256)
    (ids,) = byte.encode_batch(["héllo"])
    assert ids.tolist() == list("héllo".encode())
    assert byte.decode([*ids.tolist(), 256]) == "héllo"


@pytest.mark.parametrize(("tokenizer", "vocab_size"), [("bpe", 4096), ("byte", 257)])
def test_vocab_size_reaches_the_model_through_the_composed_config(tokenizer, vocab_size, tmp_path,
                                                                  outputs_root):
    write_texts(tmp_path / "corpus")
    cfg, choices = compose_job(["model=llama", "data=tokens", f"data.tokenizer={tokenizer}",
                                f"data.paths={tmp_path}/corpus/*.txt"], tmp_path / "run")
    validate(cfg, choices=choices)
    assert cfg.data.vocab_size == cfg.model.net.vocab_size == vocab_size
    net = build(cfg.model.net)
    assert net.embed_tokens.num_embeddings == net.lm_head.out_features == vocab_size


def test_a_tokenizer_that_does_not_exist_is_one_line_before_any_rank(tmp_path, outputs_root):
    cfg, choices = compose_job(["model=llama", "data=tokens", "data.tokenizer=gpt5"], tmp_path / "run")
    with pytest.raises(ConfigError) as info:
        validate(cfg, choices=choices)
    assert str(info.value) == (f"data.tokenizer='gpt5' does not exist; expected {ALLOWED} "
                               "(tokenizers are never downloaded)")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError) as info:
        token_dm(tmp_path, tokenizer=str(tmp_path / "empty"))
    assert str(info.value) == (f"data.tokenizer={str(tmp_path / 'empty')!r} is a directory "
                               f"without a tokenizer.json; expected {ALLOWED}")


def test_a_tokenizer_json_that_cannot_serve_is_one_line(tmp_path):
    from tokenizers import Tokenizer, models

    broken = tmp_path / "broken.json"
    broken.write_text("{}")
    without_eos = tmp_path / "no-eos.json"
    Tokenizer(models.WordLevel(vocab={"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(without_eos))
    for path, expected in [
        (broken, f"data.tokenizer='{broken}': {broken} is not a tokenizer.json the tokenizers "
                 "library can read ("),
        (without_eos, f"data.tokenizer='{without_eos}' has no end-of-text token to separate "
                      f"documents: none of {END_OF_TEXT}, "),
    ]:
        with pytest.raises(ValueError) as info:
            load_tokenizer(str(path))
        assert str(info.value).startswith(expected) and "\n" not in str(info.value)


def _word_level_tokenizer(directory: Path, vocab_size: int) -> None:
    """A Hugging Face tokenizer directory whose vocabulary needs uint32 token ids, and whose
    tokenizer_config.json names the end-of-text token (as a downloaded model's does)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size - 2)}
    vocab.update({"[UNK]": vocab_size - 2, "</s>": vocab_size - 1})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))


def test_token_file_is_uint16_when_the_vocabulary_fits_else_uint32(tmp_path):
    assert token_dtype(257) == token_dtype(4096) == token_dtype(2**16) == np.uint16
    assert token_dtype(2**16 + 1) == token_dtype(151936) == np.uint32
    _word_level_tokenizer(tmp_path / "big-tokenizer", vocab_size=70_000)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("w1 w69997 w65536 nope")
    dm = token_dm(tmp_path, tokenizer=str(tmp_path / "big-tokenizer"), seq_len=2)
    assert (dm.vocab_size, dm.tokenizer.eos_id) == (70_000, 69_999)
    dm.prepare_data()
    cache = load_cache(dm.cache_stem())
    assert cache.dtype == np.uint32
    assert cache.tokens().tolist() == [1, 69_997, 65_536, 69_998, 69_999]  # nope is [UNK]
    small = token_dm(tmp_path, tokenizer="bpe")
    small.prepare_data()
    assert load_cache(small.cache_stem()).dtype == np.uint16


# --- the cache ------------------------------------------------------------------------------


def test_cache_written_once_reused_and_invalidated_by_content_or_tokenizer(tmp_path):
    texts = write_texts(tmp_path / "corpus", count=8)
    dm = token_dm(tmp_path)
    dm.prepare_data()
    stem = dm.cache_stem()
    files = [stem + ".bin", stem + ".index.npz"]
    stamps = [os.stat(f).st_mtime_ns for f in files]
    again = token_dm(tmp_path)
    again.prepare_data()
    again.setup()
    assert again.cache_stem() == stem
    assert [os.stat(f).st_mtime_ns for f in files] == stamps
    assert sorted(os.listdir(tmp_path / "cache")) == sorted(Path(f).name for f in files)
    # Keyed by content: a file touched but unchanged keeps the cache; a changed one does not.
    first = sorted(texts)[0]
    os.utime(first, ns=(1, 1))
    assert token_dm(tmp_path).cache_stem() == stem
    Path(first).write_text(texts[first] + "# one more line\n", encoding="utf-8")
    changed = token_dm(tmp_path).cache_stem()
    assert changed != stem
    assert token_dm(tmp_path, tokenizer="byte").cache_stem() not in (stem, changed)
    # Keyed by the tokenizer's content too: a copy of the shipped file is the same tokenizer,
    # wherever it lies; the copy edited is another.
    own = tmp_path / "own" / "tokenizer.json"
    own.parent.mkdir()
    own.write_bytes(BPE_ASSET.read_bytes())
    assert token_dm(tmp_path, tokenizer=str(own.parent)).cache_stem() == changed
    assert token_dm(tmp_path, tokenizer=str(own)).cache_stem() == changed
    edited = json.loads(own.read_text())
    edited["model"]["merges"] = edited["model"]["merges"][:-1]
    own.write_text(json.dumps(edited))
    assert token_dm(tmp_path, tokenizer=str(own)).cache_stem() != changed


# --- documents, packing and the split -------------------------------------------------------


def documents_of(dm: TokenDataModule) -> list[tuple[int, int, bool]]:
    """``(start, end, in val)`` of each document of ``dm``'s cache, read from its datasets."""
    cache = load_cache(dm.cache_stem())
    bounds = zip(cache.starts[:-1].tolist(), cache.starts[1:].tolist(), strict=True)
    return [(a, b, any(s <= a and b <= e for s, e in dm.val_dataset.ranges)) for a, b in bounds]


def test_documents_end_in_eos_and_packing_loses_no_token(tmp_path):
    texts = write_texts(tmp_path / "corpus", count=30)
    dm = token_dm(tmp_path, seq_len=16, val_fraction=0.2)
    dm.setup()
    assert dm.split_by_document
    cache = load_cache(dm.cache_stem())
    tokens = cache.tokens()
    eos = dm.tokenizer.eos_id
    assert cache.num_documents == 30 and cache.num_tokens == len(tokens)
    for index, path in enumerate(sorted(texts)):  # documents in file order
        document = tokens[cache.starts[index]:cache.starts[index + 1]]
        assert document[-1] == eos and eos not in document[:-1]
        assert document[:-1].tolist() == dm.tokenizer.encode_batch([texts[path]])[0].tolist()
    # A split is its documents back to back, cut into windows of 17 tokens, one every 16.
    for dataset, in_val in ((dm.train_dataset, False), (dm.val_dataset, True)):
        split = [t for a, b, val in documents_of(dm) if val == in_val for t in tokens[a:b].tolist()]
        assert len(dataset) == (len(split) - 1) // 16 > 0
        assert stream_of(dataset) == split[: len(dataset) * 16 + 1]
        assert len(split) - (len(dataset) * 16 + 1) < 16  # only the tail shorter than a window


def test_split_is_by_document_and_deterministic(tmp_path):
    texts = write_texts(tmp_path / "corpus", count=200)
    dm = token_dm(tmp_path, val_fraction=0.2)
    dm.setup()
    assert dm.split_by_document
    assert dm.train_documents + dm.val_documents == 200 and 20 <= dm.val_documents <= 60
    # Each document lies whole in one split, and together the splits hold every token once.
    documents = documents_of(dm)
    assert sum(val for _, _, val in documents) == dm.val_documents
    covered = sorted(dm.train_dataset.ranges + dm.val_dataset.ranges)
    assert all(a[1] <= b[0] for a, b in zip(covered, covered[1:], strict=False))
    assert sum(b - a for a, b in covered) == load_cache(dm.cache_stem()).num_tokens

    def val_texts(module: TokenDataModule) -> set[str]:
        data = load_cache(module.cache_stem()).tokens()
        return {module.tokenizer.decode(data[a:b]) for a, b, val in documents_of(module) if val}

    same = token_dm(tmp_path, val_fraction=0.2)
    same.setup()
    assert same.val_dataset.ranges == dm.val_dataset.ranges
    assert val_texts(dm) <= set(texts.values())
    # A document's split follows its text: a file added before it does not move it.
    (tmp_path / "corpus" / "aaa-first.txt").write_text("print('a new first file')\n")
    more = token_dm(tmp_path, val_fraction=0.2)
    more.setup()
    assert val_texts(dm) <= val_texts(more)


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_val_bytes_per_token_is_the_val_texts_bytes_over_their_tokens(tokenizer, tmp_path):
    """What ``val/bpb`` divides by: the UTF-8 bytes of the val documents' texts over their
    tokens, end-of-text included, counted here from the texts themselves."""
    texts = write_texts(tmp_path / "corpus", count=80)
    dm = token_dm(tmp_path, tokenizer=tokenizer, val_fraction=0.3)
    dm.setup()
    assert dm.split_by_document
    data = load_cache(dm.cache_stem()).tokens()
    val = [dm.tokenizer.decode(data[a:b - 1]) for a, b, in_val in documents_of(dm) if in_val]
    assert set(val) <= set(texts.values())
    tokens = sum(b - a for a, b, in_val in documents_of(dm) if in_val)
    expected = sum(len(text.encode("utf-8")) for text in val) / tokens
    assert dm.val_bytes_per_token == pytest.approx(expected, rel=1e-12)
    if tokenizer == "byte":  # one token per byte, and one end-of-text per document
        assert dm.val_bytes_per_token == pytest.approx(1 - len(val) / tokens, rel=1e-12)
    else:
        assert dm.val_bytes_per_token > 1.5  # a subword stands for more than one byte


def test_a_validation_of_fewer_batches_is_scored_on_the_bytes_of_those_sequences(tmp_path):
    """``trainer.limit_val_batches``: val/bpb divides by the bytes per token of the sequences
    evaluated, the first ones, counted here from whole documents' texts."""
    from litscale.data.tokens import first_tokens

    assert first_tokens([(0, 5), (10, 20), (30, 40)], 8) == [(0, 5), (10, 13)]
    write_texts(tmp_path / "corpus", count=80)
    dm = token_dm(tmp_path, tokenizer="bpe", val_fraction=0.3)
    dm.setup()
    first = next((a, b) for a, b, in_val in documents_of(dm) if in_val)
    data = load_cache(dm.cache_stem()).tokens()
    whole_document = len(dm.tokenizer.decode(data[first[0]:first[1] - 1]).encode("utf-8")) / (first[1] - first[0])
    assert first[1] - first[0] >= dm.seq_len  # so the first sequence lies in the first held-out document
    assert dm.val_bytes_per_token_over(1) == pytest.approx(whole_document, rel=1e-12)
    every = dm.val_bytes_per_token_over(len(dm.val_dataset))
    assert every == pytest.approx(dm.val_bytes_per_token, rel=0.05)  # all but the last partial sequence


def test_a_corpus_of_one_document_splits_by_position(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "one.txt").write_text("x = 1\n" * 200)
    dm = token_dm(tmp_path, seq_len=8, tokenizer="byte")
    dm.setup()
    assert not dm.split_by_document
    ((train_start, train_end),) = dm.train_dataset.ranges
    ((val_start, val_end),) = dm.val_dataset.ranges
    assert train_start == 0 and train_end == val_start and val_end == 1201 and len(dm.val_dataset)
    with pytest.raises(ValueError) as info:
        token_dm(tmp_path, seq_len=700, tokenizer="byte").setup()
    assert str(info.value) == (f"data.seq_len=700 is too long for data.paths="
                               f"{str(tmp_path / 'corpus' / '*.txt')!r}, which tokenizes to 1201 "
                               "tokens: one train and one val sequence need 1402")


# --- ranks and resume -----------------------------------------------------------------------


def attach(dm: TokenDataModule, num_replicas: int, rank: int, *, resumed_batches: int = 0):
    """``dm`` as rank ``rank`` of ``num_replicas`` sees it, resuming after ``resumed_batches``
    batches of epoch 0 when given (the trainer state Lightning restores from a checkpoint)."""
    progress = SimpleNamespace(current=SimpleNamespace(ready=resumed_batches))
    dm.trainer = SimpleNamespace(
        strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": num_replicas,
                                                             "rank": rank}),
        fit_loop=SimpleNamespace(restarting=bool(resumed_batches),
                                 epoch_loop=SimpleNamespace(batch_progress=progress)),
        current_epoch=0)
    return dm


def batches(dm: TokenDataModule, epoch: int = 0) -> list[list[tuple[int, ...]]]:
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(epoch)
    return [[tuple(row) for row in x.tolist()] for x, _ in loader]


def test_two_ranks_shard_disjointly_and_cover_the_epoch(tmp_path):
    write_texts(tmp_path / "corpus", count=80)
    single = attach(token_dm(tmp_path, batch_size=8), 1, 0)
    single.setup()
    ranks = [attach(token_dm(tmp_path, batch_size=4), 2, r) for r in range(2)]
    for dm in ranks:
        dm.setup()
    for epoch in (0, 1):
        expected = batches(single, epoch)
        seen = [batches(dm, epoch) for dm in ranks]
        assert len(expected) == len(seen[0]) == len(seen[1]) == len(single.train_dataset) // 8 > 3
        for step, batch in enumerate(expected):
            assert sorted(seen[0][step] + seen[1][step]) == sorted(batch)
        indices = [set(dm.train_dataloader().sampler) for dm in ranks]
        assert not indices[0] & indices[1]
        assert len(indices[0]) == len(indices[1]) == len(single.train_dataset) // 2


def test_resume_inside_an_epoch_continues_where_it_stopped(tmp_path):
    write_texts(tmp_path / "corpus", count=80)
    for rank in range(2):
        whole = attach(token_dm(tmp_path), 2, rank)
        whole.setup()
        resumed = attach(token_dm(tmp_path), 2, rank, resumed_batches=3)
        resumed.setup()
        assert batches(resumed) == batches(whole)[3:]


# --- sources and their errors ---------------------------------------------------------------


def test_default_corpus_is_the_standard_library():
    node = OmegaConf.load(CONF_DIR / "data" / "tokens.yaml")
    assert node.paths is None and node.tokenizer == "bpe" and node.text_field == "text"
    assert corpus_files(None) == stdlib_files()


@pytest.mark.slow
def test_jsonl_records_are_documents_and_a_missing_field_is_one_line(tmp_path, outputs_root):
    write_jsonl(tmp_path / "corpus" / "a.jsonl", [{"body": "first"}, {"body": "second"}])
    dm = token_dm(tmp_path, paths=str(tmp_path / "corpus" / "*.jsonl"), text_field="body",
                  tokenizer="byte", seq_len=2)
    dm.prepare_data()
    assert load_cache(dm.cache_stem()).tokens().tolist() == [*b"first", 256, *b"second", 256]
    path = tmp_path / "corpus" / "b.jsonl"
    write_jsonl(path, [{"text": "fine"}, {"title": "no text here"}])
    cfg, choices = compose_job(["model=llama", "data=tokens", f"data.paths={path}"], tmp_path / "run")
    with pytest.raises(ConfigError) as info:
        validate(cfg, choices=choices)
    assert str(info.value) == (f"data.text_field='text' is missing from line 2 of {path}; "
                               "set data.text_field to the field that holds the text")


def test_a_glob_matching_nothing_or_only_empty_files_is_one_line(tmp_path, outputs_root):
    pattern = str(tmp_path / "nothing" / "**" / "*.jsonl")
    cfg, choices = compose_job(["model=llama", "data=tokens", f"data.paths={pattern}"],
                               tmp_path / "run")
    with pytest.raises(ConfigError) as info:
        validate(cfg, choices=choices)
    expected = (f"data.paths={pattern!r} matches no files; give a glob of text, JSONL or Parquet "
                "files, e.g. data.paths='~/corpus/**/*.jsonl', or null for the Python standard library")
    assert str(info.value) == expected
    with pytest.raises(ValueError) as info:
        token_dm(tmp_path, paths=pattern).prepare_data()
    assert str(info.value) == expected
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("")
    write_jsonl(tmp_path / "corpus" / "b.jsonl", [{"text": ""}])
    empty = str(tmp_path / "corpus" / "*")
    cfg, choices = compose_job(["model=llama", "data=tokens", f"data.paths={empty}"], tmp_path / "run")
    with pytest.raises(ConfigError) as info:
        validate(cfg, choices=choices)
    assert str(info.value) == (f"data.paths={empty!r} holds no text: every matched file or "
                               "record is empty")


@pytest.mark.slow
def test_parquet_rows_are_documents(tmp_path):
    pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "corpus").mkdir()
    pq.write_table(pa.table({"text": ["one", None, "two"], "n": [1, 2, 3]}),
                   tmp_path / "corpus" / "a.parquet")
    dm = token_dm(tmp_path, paths=str(tmp_path / "corpus" / "*.parquet"), tokenizer="byte",
                  seq_len=2)
    dm.prepare_data()
    assert load_cache(dm.cache_stem()).tokens().tolist() == [*b"one", 256, *b"two", 256]
    with pytest.raises(ValueError, match=r"^data.text_field='body' is missing from row 1 of "):
        token_dm(tmp_path, paths=str(tmp_path / "corpus" / "*.parquet"), text_field="body",
                 cache_dir=str(tmp_path / "other")).prepare_data()


def test_parquet_without_datasets_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "corpus").mkdir()
    path = tmp_path / "corpus" / "a.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    with pytest.raises(ValueError) as info:
        token_dm(tmp_path, paths=str(path)).prepare_data()
    assert str(info.value) == (f"data.paths matches Parquet files ({path}), which are read with "
                               "Hugging Face datasets; install it with: pip install 'litscale[parquet]'")


def test_build_cache_refuses_a_corpus_without_text(tmp_path):
    with pytest.raises(ValueError, match="^the corpus holds no text"):
        build_cache(str(tmp_path / "tokens-x"), iter([("", 0)]), load_tokenizer("byte"),
                    total_bytes=0, source="the corpus")
    assert os.listdir(tmp_path) == []  # nothing half-written is left behind


# --- end to end -----------------------------------------------------------------------------


@pytest.mark.full
@pytest.mark.slow
def test_train_py_rejects_bad_token_data_in_one_line_before_any_rank(tmp_path):
    path = tmp_path / "a.jsonl"
    write_jsonl(path, [{"title": "no text"}])
    for overrides, expected in [
        (["data.tokenizer=gpt5"], f"data.tokenizer='gpt5' does not exist; expected {ALLOWED}"),
        ([f"data.paths={path}"], f"data.text_field='text' is missing from line 1 of {path}"),
    ]:
        process = train_on_pool("model=llama", "data=tokens", *overrides, outputs=tmp_path)
        assert process.returncode == 2, explain(process)
        assert process.stderr.strip().splitlines()[-1].startswith(f"error: {expected}")
        assert not (tmp_path / "default").exists()  # no run dir: nothing started

RUN = ("model=llama", "data=tokens", "data.tokenizer=bpe", "data.seq_len=32", "data.batch_size=4",
       "trainer.accelerator=cpu", "trainer.val_check_interval=3", "trainer.limit_val_batches=2",
       "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "scheduler=constant")


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_py_on_bpe_tokens_resumes_exactly_inside_an_epoch(tmp_path):
    """A run on the default corpus with the shipped BPE trains a model of its vocabulary; one
    stopped at step 3 (mid-epoch) and resumed with ckpt_path=last has the uninterrupted
    run's losses at steps 4-6 and its final weights, bit for bit. (train.py's runs on the
    rank pool: the claim is the data's and the checkpoint's, not the launcher's.)"""
    env = {"LITSCALE_CACHE": str(tmp_path / "cache")}  # tokenized once, by the first run
    full = train_on_pool(*RUN, "trainer.max_steps=6", "name=full", outputs=tmp_path, env=env)
    assert full.returncode == 0, explain(full)
    [reference] = summaries(tmp_path / "full")
    embedding = final_weights(reference)["net.embed_tokens.weight"]
    assert embedding.shape[0] == load_tokenizer("bpe").vocab_size == 4096
    expected_params = sum(p.numel() for p in build(OmegaConf.create(
        {"_target_": "litscale.models.llama.build_llama", "vocab_size": 4096, "block_size": 32}
    )).parameters())
    assert reference["num_params"] == expected_params
    assert reference["choices"]["data"] == "tokens"
    facts = reference["data"]  # what a reader of summary.json sees of the data
    assert {k: facts[k] for k in ("tokenizer", "vocab_size", "seq_len")} == {
        "tokenizer": "bpe", "vocab_size": 4096, "seq_len": 32}
    assert 2.0 < facts["val_bytes_per_token"] < 6.0  # a subword tokenizer: several bytes a token

    part = train_on_pool(*RUN, "trainer.max_steps=3", "name=part", outputs=tmp_path, env=env)
    assert part.returncode == 0, explain(part)
    resumed = train_on_pool(*RUN, "trainer.max_steps=6", "name=part", "ckpt_path=last",
                            outputs=tmp_path, env=env)
    assert resumed.returncode == 0, explain(resumed)
    after = summaries(tmp_path / "part")[-1]
    assert after["steps"] == 6
    expected, actual = train_losses(reference["output_dir"]), train_losses(after["output_dir"])
    assert sorted(actual) == [3, 4, 5]  # Lightning's 0-based step index: the 4th to 6th steps
    for step in actual:
        assert actual[step] == expected[step], step
    for name, tensor in final_weights(reference).items():
        assert torch.equal(final_weights(after)[name], tensor), name


def _letters(dm: TokenDataModule, indices) -> set[str]:
    return {chr(t) for i in indices for t in dm.train_dataset[i][0].tolist() if t < 256}


def test_partition_by_source_gives_each_client_whole_files(tmp_path):
    """data.partition=source over 3 clients: 24 files, each of one letter, in 6 directories;
    each file's tokens reach one client only, every train file reaches one, and the split is
    the same at every build."""
    root = tmp_path / "corpus"
    for i in range(24):
        (root / f"pkg{i // 4}").mkdir(parents=True, exist_ok=True)
        (root / f"pkg{i // 4}" / f"m{i:02d}.txt").write_text(chr(65 + i) * (60 + 13 * i))
    options = {"paths": str(root / "**" / "*.txt"), "tokenizer": "byte", "partition": "source",
               "seq_len": 8, "batch_size": 2, "val_fraction": 0.25}
    clients = [attach(token_dm(tmp_path, **options), 3, rank) for rank in range(3)]
    for dm in clients:
        dm.setup()
    parts = [list(dm.train_sampler().indices.tolist()) for dm in clients]
    letters = [_letters(dm, part) for dm, part in zip(clients, parts, strict=True)]
    assert all(letters) and not (letters[0] & letters[1] or letters[1] & letters[2] or letters[0] & letters[2])
    facts = clients[0].partition_facts
    train_files = facts["sources"]
    assert {chr(65 + int(name[-6:-4])) for name in train_files} == letters[0] | letters[1] | letters[2]
    assert all(name.startswith("pkg") for name in train_files)
    histograms = np.array(facts["label_histograms"])
    assert histograms.shape == (3, len(train_files))
    assert ((histograms > 0).sum(axis=0) == 1).all()  # every source on exactly one client
    assert facts["client_samples"] == [len(part) for part in parts]
    assert facts["label_skew"] > 0.5
    again = attach(token_dm(tmp_path, **options), 3, 1)
    again.setup()
    assert again.train_sampler().indices.tolist() == parts[1]


def test_partition_by_source_is_for_token_data_only(tmp_path, outputs_root):
    cfg, choices = compose_job(["data=digits", "model=mlp", "data.partition=source"], tmp_path / "run")
    with pytest.raises(ConfigError) as info:
        validate(cfg, choices=choices)
    assert str(info.value).startswith("data.partition='source' is not valid: expected one of: 'iid', 'dirichlet', 'shards'")
