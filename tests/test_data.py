"""Tests of litscale.data: sharding parity, determinism, byte caches, and each dataset."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from litscale.data import (
    ByteCorpusDataModule,
    DigitsDataModule,
    ShardedDataModule,
    StdlibCodeDataModule,
    SyntheticDataModule,
    expand_paths,
    missing_paths_error,
)
from litscale.data.stdlib_code import stdlib_files

CONF_DIR = Path(__file__).resolve().parents[1] / "conf" / "data"


class IndexDataModule(ShardedDataModule):
    """Samples are their own indices, so loader output shows exactly which samples a step saw."""

    def __init__(self, *, n: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.n = n

    def setup(self, stage: str | None = None) -> None:
        self.train_dataset = TensorDataset(torch.arange(self.n))
        self.val_dataset = TensorDataset(torch.arange(self.n))


def attach(dm: ShardedDataModule, num_replicas: int, rank: int) -> ShardedDataModule:
    kwargs = {"num_replicas": num_replicas, "rank": rank}
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs=kwargs))
    return dm


def steps(loader, epoch: int = 0) -> list[list[int]]:
    loader.sampler.set_epoch(epoch)
    return [batch[0].tolist() for batch in loader]


def index_loader(n: int, batch_size: int, replicas: int, rank: int, seed: int = 0, train=True):
    dm = attach(IndexDataModule(n=n, batch_size=batch_size, seed=seed), replicas, rank)
    dm.setup()
    return dm.train_dataloader() if train else dm.val_dataloader()


# --- sharding -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [103, 96])
@pytest.mark.parametrize("epoch", [0, 3])
def test_two_ranks_see_the_global_batches_of_one_process(n, epoch):
    single = steps(index_loader(n, 8, 1, 0), epoch)
    rank0 = steps(index_loader(n, 4, 2, 0), epoch)
    rank1 = steps(index_loader(n, 4, 2, 1), epoch)
    assert len(single) == len(rank0) == len(rank1) == n // 8
    for k, batch in enumerate(single):
        assert len(batch) == 8
        assert sorted(rank0[k] + rank1[k]) == sorted(batch)


def test_four_ranks_match_one_process():
    single = steps(index_loader(200, 12, 1, 0), 1)
    ranks = [steps(index_loader(200, 3, 4, r), 1) for r in range(4)]
    assert all(len(r) == len(single) for r in ranks)
    for k, batch in enumerate(single):
        assert sorted(sum((r[k] for r in ranks), [])) == sorted(batch)


def test_order_is_seeded_and_reshuffled_per_epoch():
    first = steps(index_loader(64, 8, 1, 0, seed=5), 0)
    assert steps(index_loader(64, 8, 1, 0, seed=5), 0) == first
    assert steps(index_loader(64, 8, 1, 0, seed=5), 1) != first
    assert steps(index_loader(64, 8, 1, 0, seed=6), 0) != first
    assert sorted(sum(first, [])) == list(range(64))


def test_ranks_see_disjoint_samples_within_an_epoch():
    seen = [set(sum(steps(index_loader(101, 5, 2, r), 2), [])) for r in range(2)]
    assert not seen[0] & seen[1]
    assert len(seen[0]) == len(seen[1]) == 50


def test_val_loader_is_ordered_and_complete():
    single = sum(steps(index_loader(10, 4, 1, 0, train=False)), [])
    assert single == list(range(10))
    ranks = [sum(steps(index_loader(10, 4, 2, r, train=False)), []) for r in range(2)]
    assert sorted(ranks[0] + ranks[1]) == list(range(10))


def test_replicas_default_to_one_process():
    dm = IndexDataModule(n=4, batch_size=2)
    assert dm.replicas() == (1, 0)
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace())  # single-device strategy
    assert dm.replicas() == (1, 0)
    dm.setup()
    loader = dm.train_dataloader()
    assert isinstance(loader.sampler, DistributedSampler)
    assert loader.drop_last and loader.sampler.num_replicas == 1


def test_loaders_need_setup():
    with pytest.raises(RuntimeError, match="setup"):
        IndexDataModule(n=4, batch_size=2).train_dataloader()


# --- byte corpus ----------------------------------------------------------------------------


def write_corpus(root: Path, count: int = 40) -> dict[str, bytes]:
    contents = {}
    for i in range(count):
        rel = f"part{i % 3}/doc{i:02d}.txt"
        data = "".join(f"line {j} of document {i}: ÿ héllo\n" for j in range(5 + i % 7))
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode())
        contents[str(path)] = data.encode()
    (root / "notes.md").write_text("not matched by *.txt")
    return contents


def corpus_dm(tmp_path: Path, **kwargs) -> ByteCorpusDataModule:
    defaults = {
        "paths": str(tmp_path / "corpus" / "**" / "*.txt"),
        "seq_len": 16,
        "batch_size": 4,
        "cache_dir": str(tmp_path / "cache"),
    }
    return ByteCorpusDataModule(**{**defaults, **kwargs})


def test_expand_paths_sorted_deduplicated(tmp_path):
    contents = write_corpus(tmp_path / "corpus")
    pattern = str(tmp_path / "corpus" / "**" / "*.txt")
    files = expand_paths([pattern, pattern, str(tmp_path / "corpus" / "part1" / "*.txt")])
    assert files == sorted(contents)
    assert missing_paths_error(pattern) is None


def test_glob_matching_nothing_raises_exact_message(tmp_path):
    paths = str(tmp_path / "nothing" / "**" / "*.txt")
    expected = (
        f"data.paths={paths!r} matches no files; give a glob of text files, "
        "e.g. data.paths='~/corpus/**/*.txt'"
    )
    assert missing_paths_error(paths) == expected
    with pytest.raises(ValueError) as info:
        expand_paths(paths)
    assert str(info.value) == expected
    dm = ByteCorpusDataModule(paths=paths, seq_len=8, batch_size=2, cache_dir=str(tmp_path))
    with pytest.raises(ValueError) as info:
        dm.prepare_data()
    assert str(info.value) == expected


def test_home_is_expanded(tmp_path, monkeypatch):
    write_corpus(tmp_path / "corpus", count=3)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert len(expand_paths("~/corpus/**/*.txt")) == 3


def test_byte_corpus_windows_round_trip(tmp_path):
    contents = write_corpus(tmp_path / "corpus")
    dm = corpus_dm(tmp_path)
    dm.prepare_data()
    dm.setup()
    assert dm.task == "causal_lm" and dm.tokens_per_sample == 16 and dm.vocab_size == 256
    # The cache is the files' bytes concatenated in sorted path order.
    cache = np.fromfile(dm.cache_path(), dtype=np.uint8).tobytes()
    corpus = b"".join(contents[p] for p in sorted(contents))
    assert cache == corpus
    assert dm.split_by_file and dm.train_files and dm.val_files
    assert not set(dm.train_files) & set(dm.val_files)
    assert len(dm.train_files) + len(dm.val_files) == len(contents)
    for dataset in (dm.train_dataset, dm.val_dataset):
        assert len(dataset) > 0
        for i in range(len(dataset)):
            x, y = dataset[i]
            assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (16,)
            assert torch.equal(x[1:], y[:-1])
            assert bytes(x.tolist()) + bytes([int(y[-1])]) in corpus
    # Val windows come only from val files.
    val_bytes = [contents[str(tmp_path / "corpus" / rel)] for rel in dm.val_files]
    x, y = dm.val_dataset[0]
    assert any(bytes(x.tolist()) in data for data in val_bytes)
    first = dm.train_dataset.ranges[0][0]
    assert bytes(dm.train_dataset[0][0].tolist()) == cache[first : first + 16]
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_val_files_do_not_depend_on_order(tmp_path):
    write_corpus(tmp_path / "corpus")
    dm = corpus_dm(tmp_path)
    dm.setup()
    more = corpus_dm(
        tmp_path,
        paths=[
            str(tmp_path / "corpus" / "part2" / "*.txt"),
            str(tmp_path / "corpus" / "**" / "*.txt"),
        ],
    )
    more.setup()
    assert more.val_files == dm.val_files


def test_byte_cache_written_once_and_reused(tmp_path):
    contents = write_corpus(tmp_path / "corpus", count=6)
    dm = corpus_dm(tmp_path)
    dm.prepare_data()
    path = dm.cache_path()
    stamp = os.stat(path).st_mtime_ns, os.stat(path + ".json").st_mtime_ns
    again = corpus_dm(tmp_path)
    again.prepare_data()
    again.setup()
    assert again.cache_path() == path
    assert (os.stat(path).st_mtime_ns, os.stat(path + ".json").st_mtime_ns) == stamp
    assert sorted(os.listdir(tmp_path / "cache")) == sorted(
        [Path(path).name, Path(path).name + ".json"]
    )
    # Changing a file (size or mtime) gives a new cache.
    Path(sorted(contents)[0]).write_text("changed")
    assert corpus_dm(tmp_path).cache_path() != path


def test_max_bytes_and_small_corpus_fallback(tmp_path):
    write_corpus(tmp_path / "corpus")
    dm = corpus_dm(tmp_path, max_bytes=1000)
    dm.setup()
    assert os.path.getsize(dm.cache_path()) == 1000
    one = tmp_path / "one.txt"
    one.write_bytes(bytes(range(256)) * 4)
    dm = corpus_dm(tmp_path, paths=str(one), seq_len=8)
    dm.setup()
    # One file cannot be split by file: the tail of the bytes is val instead.
    assert not dm.split_by_file
    ((train_start, train_end),) = dm.train_dataset.ranges
    ((val_start, val_end),) = dm.val_dataset.ranges
    assert train_start == 0 and train_end == val_start and val_end == 1024
    assert len(dm.val_dataset) >= 1
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("short")
    with pytest.raises(ValueError, match="too small"):
        corpus_dm(tmp_path, paths=str(tiny)).setup()


def test_byte_corpus_validates_arguments(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="vocab_size"):
        corpus_dm(tmp_path, vocab_size=512)
    with pytest.raises(ValueError, match="val_fraction"):
        corpus_dm(tmp_path, val_fraction=0.0)
    monkeypatch.setenv("LITSCALE_CACHE", str(tmp_path / "env-cache"))
    assert corpus_dm(tmp_path, cache_dir=None).cache_dir == str(tmp_path / "env-cache")


# --- stdlib ---------------------------------------------------------------------------------


def test_stdlib_file_list_deterministic_and_source_only():
    files = stdlib_files()
    assert files and files == stdlib_files()
    root = sysconfig.get_paths()["stdlib"]
    rel = [os.path.relpath(f, root) for f in files]
    assert rel == sorted(rel)
    assert "os.py" in rel
    for path in rel:
        parts = path.split(os.sep)
        assert path.endswith(".py")
        assert not {
            "site-packages",
            "dist-packages",
            "__pycache__",
            "test",
            "tests",
            "idle_test",
        } & set(parts)
    assert len(stdlib_files(include_tests=True)) > len(files)


def test_stdlib_code_splits_by_file(tmp_path):
    dm = StdlibCodeDataModule(
        seq_len=64, batch_size=8, max_bytes=1_500_000, cache_dir=str(tmp_path)
    )
    dm.prepare_data()
    dm.setup()
    assert os.path.getsize(dm.cache_path()) == 1_500_000
    assert dm.split_by_file and dm.train_files and dm.val_files
    assert not set(dm.train_files) & set(dm.val_files)
    assert len(dm.train_dataset) > 10 * len(dm.val_dataset) > 0
    train = set(map(tuple, dm.train_dataset.ranges))
    assert all(not (a < d and c < b) for a, b in train for c, d in dm.val_dataset.ranges)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 64) and torch.equal(x[:, 1:], y[:, :-1])
    cache = np.fromfile(dm.cache_path(), dtype=np.uint8).tobytes()
    assert b"def " in cache and b"import " in cache


# --- digits ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_digits_shapes_classes_and_normalisation():
    dm = DigitsDataModule(batch_size=32)
    dm.setup()
    assert dm.task == "classification" and dm.tokens_per_sample is None
    assert len(dm.train_dataset) + len(dm.val_dataset) == 1797
    assert len(dm.val_dataset) == round(1797 * 0.2)
    train_x, train_y = dm.train_dataset.tensors
    assert train_x.shape[1:] == dm.input_shape == (1, 8, 8) and dm.num_classes == 10
    assert abs(float(train_x.mean())) < 1e-5 and abs(float(train_x.std()) - 1) < 1e-4
    # Undoing the normalisation gives pixels in [0, 1] (the raw data goes up to 16).
    raw = train_x * dm.std + dm.mean
    assert float(raw.min()) > -1e-5 and abs(float(raw.max()) - 1) < 1e-5
    assert set(train_y.tolist()) == set(range(10))
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (32, 1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64


def test_digits_split_fixed_by_split_seed():
    a, b, c = (
        DigitsDataModule(batch_size=8, seed=s, split_seed=ss) for s, ss in [(0, 0), (9, 0), (0, 1)]
    )
    for dm in (a, b, c):
        dm.setup()
    assert torch.equal(a.val_dataset.tensors[1], b.val_dataset.tensors[1])
    assert torch.equal(a.val_dataset.tensors[0], b.val_dataset.tensors[0])
    assert not torch.equal(a.val_dataset.tensors[0], c.val_dataset.tensors[0])


def test_digits_rejects_mismatched_keys():
    with pytest.raises(ValueError, match="input_shape"):
        DigitsDataModule(batch_size=8, input_shape=[3, 32, 32])
    with pytest.raises(ValueError, match="num_classes"):
        DigitsDataModule(batch_size=8, num_classes=100)


# --- synthetic ------------------------------------------------------------------------------


def test_synthetic_lm_deterministic_and_shifted():
    a = SyntheticDataModule(batch_size=4, num_samples=50, seq_len=12, vocab_size=37, seed=1)
    b = SyntheticDataModule(batch_size=4, num_samples=50, seq_len=12, vocab_size=37, seed=1)
    other = SyntheticDataModule(batch_size=4, num_samples=50, seq_len=12, vocab_size=37, seed=2)
    for dm in (a, b, other):
        dm.setup()
    assert a.task == "causal_lm" and a.tokens_per_sample == 12
    x, y = a.train_dataset[7]
    assert x.dtype == torch.int64 and x.shape == (12,) and torch.equal(x[1:], y[:-1])
    assert int(x.min()) >= 0 and int(y.max()) < 37
    assert all(torch.equal(a.train_dataset[i][0], b.train_dataset[i][0]) for i in range(50))
    assert any(not torch.equal(a.train_dataset[i][0], other.train_dataset[i][0]) for i in range(50))
    assert not torch.equal(a.train_dataset[0][0], a.val_dataset[0][0])
    # Learnable: each token always has the same successor.
    successor = {}
    for i in range(50):
        x, y = a.train_dataset[i]
        for t, u in zip(x.tolist(), y.tolist(), strict=True):
            assert successor.setdefault(t, u) == u


def test_synthetic_huge_is_lazy():
    dm = SyntheticDataModule(batch_size=2, num_samples=10**9, seq_len=8)
    dm.setup()
    assert len(dm.train_dataset) == 10**9
    assert dm.train_dataset[10**9 - 1][0].shape == (8,)


def test_synthetic_classification_labels():
    dm = SyntheticDataModule(
        batch_size=16,
        task="classification",
        num_samples=200,
        input_shape=[1, 8, 8],
        num_classes=5,
        seed=3,
    )
    dm.setup()
    assert dm.task == "classification" and dm.tokens_per_sample is None
    labels = [int(dm.train_dataset[i][1]) for i in range(200)]
    assert set(labels) <= set(range(5)) and len(set(labels)) > 1
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (16, 1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert torch.equal(dm.train_dataset[5][0], dm.train_dataset[5][0])
    with pytest.raises(ValueError, match="task"):
        SyntheticDataModule(batch_size=2, task="regression")


# --- configs and Lightning ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["stdlib_code", "digits", "synthetic", "text_files"])
def test_configs_instantiate(name, tmp_path):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    data = OmegaConf.load(CONF_DIR / f"{name}.yaml")
    assert (CONF_DIR / f"{name}.yaml").read_text().startswith("# ")
    if name == "text_files":
        assert OmegaConf.is_missing(data, "paths")
        write_corpus(tmp_path / "corpus", count=3)
        data.paths = str(tmp_path / "corpus" / "**" / "*.txt")
    cfg = OmegaConf.create({"seed": 11, "data": data})
    dm = instantiate(cfg.data)
    assert isinstance(dm, ShardedDataModule) and dm.seed == 11
    assert dm.batch_size == {"digits": 64}.get(name, 16)
    if dm.task == "causal_lm":
        assert dm.seq_len == 128 and dm.vocab_size == 256


def test_lightning_keeps_our_sampler():
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(64, 10)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.layer(x.flatten(1)), y)

        def validation_step(self, batch, batch_idx):
            pass

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(
        max_epochs=2,
        limit_train_batches=2,
        limit_val_batches=1,
        use_distributed_sampler=False,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    dm = DigitsDataModule(batch_size=16, seed=4)
    trainer.fit(Tiny(), datamodule=dm)
    sampler = trainer.train_dataloader.sampler
    assert isinstance(sampler, DistributedSampler) and sampler.seed == 4
    assert sampler.epoch == 1  # Lightning reshuffles per epoch through set_epoch


def _synthetic(num_samples: int, seed: int = 0):
    from litscale.data.synthetic import SyntheticDataModule

    data = SyntheticDataModule(batch_size=4, num_samples=num_samples, val_samples=8, seed=seed)
    data.setup()
    return data


def test_a_checkpoints_loader_position_of_another_training_set_is_refused_in_one_line():
    saved = {"epoch": 0, "samples_drawn": 32, "seed": 0, "dataset_samples": 64}
    data = _synthetic(128)
    data.load_state_dict(saved)
    with pytest.raises(ValueError) as error:
        data.train_dataloader()
    assert str(error.value) == ("data: the checkpoint's training set has 64 samples, this run's 128; resume with "
                                "the data it was trained on, or start fresh with ckpt_path=null")


def test_a_checkpoints_seed_is_the_order_a_resume_continues():
    data = _synthetic(64, seed=5)
    data.load_state_dict({"epoch": 0, "samples_drawn": 0, "seed": 3, "dataset_samples": 64})
    data.train_dataloader()
    assert data.seed == 3 and data.state_dict()["seed"] == 3


def resumed_steps(samples_drawn: int, ranks: int, *, batch_size: int = 1, elastic: bool = False,
                  block: int | None = None) -> list[list[list[int]]]:
    """Each of ``ranks`` ranks' batches of epoch 0 after a resume from ``samples_drawn``."""
    loaders = []
    for rank in range(ranks):
        data = attach(IndexDataModule(n=64, batch_size=batch_size), ranks, rank)
        data.setup()
        data.elastic, data.rank_block = elastic, block
        data.load_state_dict({"epoch": 0, "samples_drawn": samples_drawn, "seed": 0, "dataset_samples": 64})
        loaders.append(data.train_dataloader())
    return [steps(loader) for loader in loaders]


ORDER = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()  # epoch 0's, seed 0


def test_an_elastic_resume_skips_ahead_to_a_position_the_new_ranks_share_out(caplog):
    """4 samples drawn (4 ranks, one step), 3 ranks now: 4 does not split in three. An elastic
    job's ranks skip positions 4 and 5 and take 6, 7 and 8 (every third from 6), in one line;
    anyone else's is refused."""
    with caplog.at_level("INFO"):
        ranks = resumed_steps(4, 3, elastic=True)
    assert [rank[:2] for rank in ranks] == [[[ORDER[6]], [ORDER[9]]], [[ORDER[7]], [ORDER[10]]],
                                            [[ORDER[8]], [ORDER[11]]]]
    assert [r.getMessage() for r in caplog.records if "elastic" in r.getMessage()] == [
        "litscale: elastic resume: the checkpoint stopped at sample 4 of epoch 0, which 3 data-parallel ranks cannot "
        "share out evenly: skipped samples 4 to 5 of the epoch's order (2 samples, not trained in this epoch); the "
        "run continues at sample 6"] * 3  # once per rank here: rank_zero_info, and every rank is rank 0 without a trainer
    with pytest.raises(ValueError) as refused:
        resumed_steps(4, 3)
    assert str(refused.value) == (
        "trainer.devices: the checkpoint stopped at sample 4 of epoch 0, which 3 data-parallel ranks cannot share "
        "out evenly; allowed: a count of data-parallel ranks that divides it, elastic=true to skip ahead to sample "
        "6, or start fresh with ckpt_path=null")


def test_a_layout_invariant_resume_shares_out_whole_global_batches_only():
    """Each rank takes one contiguous block of every global batch (``ContiguousBlockSampler``):
    2 samples drawn split over 2 ranks, but not in their blocks of 2, which start at multiples
    of 4. Before, rank 0 began at position 1 (trained again) and rank 1 at 3, and 2 was never
    trained; now it is refused, or an elastic job skips to position 4."""
    with pytest.raises(ValueError, match="^trainer.devices: the checkpoint stopped at sample 2 of epoch 0, which 2 "
                                         "data-parallel ranks cannot share out evenly in blocks of 2 samples per rank"):
        resumed_steps(2, 2, batch_size=2, block=2)
    rank0, rank1 = resumed_steps(2, 2, batch_size=2, block=2, elastic=True)
    assert (rank0[0], rank1[0]) == (ORDER[4:6], ORDER[6:8])
    assert resumed_steps(4, 2, batch_size=2, block=2)[1][0] == ORDER[6:8]  # a whole global batch: as saved
