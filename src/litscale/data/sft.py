"""Supervised fine-tuning on conversations (``data=sft``): JSONL or Parquet rows of chat messages
or prompt/response pairs, rendered with a chat template, trained on the assistant's tokens only.

Each source's rows are tokenized once into a memory-mapped cache (``sft_cache``), split into
train and val by a hash of each example's text, fitted to rows of ``seq_len`` positions and
optionally packed several to a row (``packing``). Several sources (``data.sources``) are drawn at
their weights in one seeded order (``mixture``). Batches are ``TokenBatch``es
(``litscale.data.token_batch``): the loss is the mean over the global batch's trained tokens on
every layout, and packed documents never see each other (``litscale.models.documents``).

Validation builds the caches and the rows before any rank starts (``prepare_before_launch``):
a bad row (a missing field, a role the template does not know, an empty assistant turn) is one
line naming its file and row.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from torch.utils.data import ConcatDataset

from litscale.arguments import checked_arguments
from litscale.constraints import NonNegativeInt, OpenFraction, PositiveInt
from litscale.data.base import ShardedDataModule
from litscale.data.byte_corpus import default_cache_dir, expand_paths
from litscale.data.chat import Fields, TrainOn, load_chat_template
from litscale.data.documents import file_kind
from litscale.data.mixture import MixtureRows
from litscale.data.packing import ExampleRows, Overlong, take_examples
from litscale.data.sft_cache import (
    ExampleCache,
    Recipe,
    SourceKind,
    build_example_cache,
    is_complete,
    load_example_cache,
    sft_cache_stem,
)
from litscale.data.tokenizer import load_tokenizer
from litscale.data.tokenizer_directory import write_tokenizer_directory
from litscale.user_paths import user_path

log = logging.getLogger(__name__)

#: The conversations ``data=sft`` trains on when ``data.paths`` is null: short arithmetic chats
#: (``assets/sft-arithmetic.jsonl``), enough to see a fine-tune learn on a CPU.
EXAMPLE_CONVERSATIONS = Path(__file__).resolve().parent / "assets" / "sft-arithmetic.jsonl"
_ALLOWED_FILES = "a glob of .jsonl or .parquet files, e.g. data.paths='~/chats/*.jsonl'"


def missing_paths_error(paths: str | list[str] | None) -> str | None:
    """The error for ``data.paths`` when it matches no JSONL or Parquet file, else None."""
    if paths is None:
        return None
    try:
        files = expand_paths(paths)
    except ValueError:
        return f"data.paths={paths!r} matches no files; allowed: {_ALLOWED_FILES}"
    text = [f for f in files if file_kind(f) == "text"]
    if text:
        return f"data.paths={paths!r} matches {text[0]}, which is not .jsonl or .parquet; allowed: {_ALLOWED_FILES}"
    return None


@dataclass(frozen=True)
class Source:
    """One source of a mixture: its files, its weight, and what its rows are (``sft``:
    conversations; ``text``: documents trained on whole, ``data.text_field``)."""

    paths: str | list[str] | None
    weight: float = 1.0
    kind: SourceKind = "sft"
    name: str = ""


def sources_of(paths: Any, sources: list[dict[str, Any]] | None) -> list[Source]:
    """``data.sources`` checked (one line naming ``data.sources[i].<key>``), or ``data.paths``
    as the one source."""
    if sources is None:
        return [Source(paths=paths, name="data")]
    if paths is not None:
        raise ValueError(f"data.paths={paths!r} and data.sources are both set; allowed: one of them")
    if not sources:
        raise ValueError("data.sources=[] has no source; allowed: a list of {paths, weight, kind}")
    found = []
    for number, entry in enumerate(sources):
        key = f"data.sources[{number}]"
        if not isinstance(entry, dict) or "paths" not in entry:
            raise ValueError(f"{key}={entry!r} is not a source; allowed: {{paths: <glob>, weight: <number>, kind: sft|text}}")
        unknown = sorted(set(entry) - {"paths", "weight", "kind", "name"})
        if unknown:
            raise ValueError(f"{key}.{unknown[0]} is not a key of a source; allowed: paths, weight, kind, name")
        weight, kind = entry.get("weight", 1.0), entry.get("kind", "sft")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"{key}.weight={weight!r} is not valid; allowed: a number above 0")
        if kind not in ("sft", "text"):
            raise ValueError(f"{key}.kind={kind!r} is not valid; allowed: sft (conversations) or text (documents)")
        message = missing_paths_error(entry["paths"])
        if message:
            raise ValueError(message.replace("data.paths", f"{key}.paths"))
        found.append(Source(paths=entry["paths"], weight=float(weight), kind=kind,
                            name=str(entry.get("name") or f"source{number}")))
    return found


class SFTDataModule(ShardedDataModule):
    """Fine-tuning on conversations; batches are ``TokenBatch``es (module docstring).

    Args:
        seq_len: Positions per row (a row holds ``seq_len`` inputs and their next tokens).
        batch_size: Per-device micro batch size, in rows.
        tokenizer: ``bpe``, ``byte`` or a local tokenizer directory (its ``tokenizer.json``, and
            the chat template of its ``tokenizer_config.json`` or ``chat_template.jinja``).
        paths: Glob(s) of ``.jsonl`` or ``.parquet`` rows; null: litscale's example chats.
        format: ``messages``, ``prompt_response``, or ``auto`` (whichever fields a row has).
        messages_field: The field holding a row's list of ``{role, content}`` messages.
        prompt_field: The field holding a row's prompt (``prompt_response``).
        response_field: The field holding a row's response.
        text_field: The field of a ``text`` source's documents.
        chat_template: null (the tokenizer directory's, else litscale's own), ``builtin``, or a
            ``.jinja`` file.
        train_on: ``assistant`` (every assistant turn) or ``last_assistant`` (the last one).
        overlong: An example longer than ``seq_len``: ``truncate`` it or ``drop`` it.
        pack: Several examples per row, each attending only within itself.
        sources: A mixture: a list of ``{paths, weight, kind: sft|text, name}`` drawn at their
            weights in one seeded order, instead of ``paths``.
        vocab_size: The model's vocabulary; None for the tokenizer's.
        val_fraction: Expected fraction of each source's examples held out.
        cache_dir: Where the caches go; default ``$LITSCALE_CACHE`` or ``~/.cache/litscale/data``.
        num_workers: DataLoader workers per rank.
        seed: Seed of the training order and of the mixture.
    """

    task = "causal_lm"
    #: litscale.app.checks.validation prepares and sets up the data before any rank starts.
    prepare_before_launch = True
    #: Its batches are TokenBatches (the strategy contract's Option.TOKEN_BATCHES).
    yields_token_batches = True

    @checked_arguments("data")
    def __init__(
        self,
        *,
        seq_len: PositiveInt,
        batch_size: PositiveInt,
        tokenizer: str = "bpe",
        paths: str | list[str] | None = None,
        format: Literal["auto", "messages", "prompt_response"] = "auto",
        messages_field: str = "messages",
        prompt_field: str = "prompt",
        response_field: str = "response",
        text_field: str = "text",
        chat_template: str | None = None,
        train_on: TrainOn = "assistant",
        overlong: Overlong = "truncate",
        pack: bool = False,
        sources: list[dict[str, Any]] | None = None,
        vocab_size: PositiveInt | None = None,
        val_fraction: OpenFraction = 0.05,
        cache_dir: str | None = None,
        num_workers: NonNegativeInt = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        self.tokenizer = load_tokenizer(tokenizer)
        if vocab_size is not None and vocab_size < self.tokenizer.vocab_size:
            raise ValueError(f"data.vocab_size={vocab_size} is smaller than the {self.tokenizer.vocab_size} tokens of "
                             f"data.tokenizer={tokenizer!r}; leave it null for the tokenizer's")
        self.vocab_size = int(vocab_size or self.tokenizer.vocab_size)
        self.sources = sources_of(paths, sources)
        self.template = load_chat_template(tokenizer, chat_template, self.tokenizer.eos_token)
        self.fields = Fields(format=format, messages=messages_field, prompt=prompt_field, response=response_field)
        self.seq_len, self.train_on, self.overlong, self.pack = int(seq_len), train_on, overlong, bool(pack)
        self.text_field, self.val_fraction = text_field, float(val_fraction)
        self.cache_dir = user_path(cache_dir) if cache_dir else default_cache_dir()
        self.shuffle_order = len(self.sources) == 1  # a mixture's own interleave is the order
        self.example_counts: dict[str, int] = {}

    @property
    def tokens_per_sample(self) -> int | None:
        return self.seq_len

    @property
    def attended_length(self) -> float | None:
        """Of packed rows, exact over a data epoch's rows (each row's documents are known
        before launch, and an epoch draws every row of a source, or a mixture's rows at
        their weights): a figure the planner predicts with and MFU counts by, the same."""
        if not self.pack or self.train_dataset is None:
            return None
        return float(self.train_dataset.attended_tokens(0).mean()) / self.seq_len

    # --- building -------------------------------------------------------------------------------

    def _files(self, source: Source) -> list[str]:
        return [str(EXAMPLE_CONVERSATIONS)] if source.paths is None else expand_paths(source.paths)

    def _recipe(self, source: Source) -> Recipe:
        return Recipe(kind=source.kind, fields=self.fields, train_on=self.train_on, text_field=self.text_field)

    def _cache(self, source: Source) -> ExampleCache:
        """The source's cache, tokenizing its rows first unless it exists."""
        files, recipe = self._files(source), self._recipe(source)
        stem = sft_cache_stem(self.cache_dir, files, self.tokenizer, self.template, recipe)
        if not is_complete(stem):
            log.info("tokenizing %d files of %s with %s into %s", len(files), source.name, self.tokenizer.name, stem)
            key = "data.paths" if source.name == "data" else f"data.sources ({source.name})"
            build_example_cache(stem, files, self.tokenizer, self.template, recipe, source=key)
        return load_example_cache(stem)

    def prepare_data(self) -> None:
        for source in self.sources:
            self._cache(source)

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        train_sets, val_sets, counts = [], [], {}
        for source in self.sources:
            cache = self._cache(source)
            train, val = self._split(cache)
            taken = take_examples(cache, train, self.seq_len, self.overlong, windows=source.kind == "text")
            held = take_examples(cache, val, self.seq_len, self.overlong, windows=source.kind == "text")
            for name, count in taken.counts.items():
                counts[name] = counts.get(name, 0) + count
            rows = dict(seq_len=self.seq_len, pack=self.pack, pad_id=self.tokenizer.eos_id)
            train_sets.append(ExampleRows(cache, taken, **rows))
            val_sets.append(ExampleRows(cache, held, **rows))
        self.example_counts = counts
        if len(train_sets) == 1:
            self.train_dataset = train_sets[0]
        else:
            self.train_dataset = MixtureRows(train_sets, [s.weight for s in self.sources],
                                             length=sum(len(d) for d in train_sets), seed=self.seed, seq_len=self.seq_len)
        self.val_dataset = val_sets[0] if len(val_sets) == 1 else ConcatDataset(val_sets)
        if len(self.train_dataset) == 0 or len(self.val_dataset) == 0:
            raise ValueError(f"data.paths: {counts.get('examples', 0)} examples leave no "
                             f"{'training' if len(self.train_dataset) == 0 else 'validation'} row at data.seq_len="
                             f"{self.seq_len} (truncated {counts['truncated']}, dropped {counts['dropped_overlong']} "
                             f"too long and {counts['dropped_nothing_to_train']} with nothing to train on); allowed: "
                             "more rows, a longer data.seq_len, or data.overlong=truncate")
        log.info("%d train and %d val rows of %d positions (%s)", len(self.train_dataset), len(self.val_dataset),
                 self.seq_len, "packed" if self.pack else "one example each")

    def _split(self, cache: ExampleCache) -> tuple[np.ndarray, np.ndarray]:
        """Examples for train and for val, by a hash of their text; the last ``val_fraction`` of
        them (at least one) where that leaves either split empty."""
        in_val = cache.split_keys < np.uint64(int(self.val_fraction * 2.0**64))
        if in_val.all() or not in_val.any():
            count = cache.num_examples
            if count < 2:
                raise ValueError(f"data.paths holds {count} example: one train and one val example are needed")
            in_val = np.arange(count) >= count - max(1, math.ceil(count * self.val_fraction))
        return np.flatnonzero(~in_val), np.flatnonzero(in_val)

    # --- what it says ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The base position (global samples of a data epoch), and for a mixture each source's
        rows drawn so far: a resume on any layout continues each where it stopped."""
        state = super().state_dict()
        if isinstance(self.train_dataset, MixtureRows):
            positions = self.train_dataset.positions(int(state["epoch"]), int(state["samples_drawn"]))
            state["sources"] = [{"name": s.name, "weight": s.weight, "drawn": drawn}
                                for s, drawn in zip(self.sources, positions, strict=True)]
        return state

    @staticmethod
    def saved_state_mismatch(saved: dict[str, Any], data: dict[str, Any]) -> str | None:
        """Why a checkpoint's data state (``saved``) cannot continue under the data config
        ``data`` (resolved), in one line, before any rank starts: it drew from other sources or
        at other weights. None where it can, or where ``data.sources`` is itself wrong (the
        data module's own check says so)."""
        try:
            ours = sources_of(data.get("paths"), data.get("sources"))
        except ValueError:
            return None
        theirs = [(str(s.get("name")), float(s.get("weight", 0))) for s in saved.get("sources") or []]
        mine = [(s.name, s.weight) for s in ours] if len(ours) > 1 else []
        if theirs == mine:
            return None
        shown = ", ".join(f"{name} {weight:g}" for name, weight in theirs) or "one source (data.paths)"
        return (f"data.sources={data.get('sources')!r} is not the mixture the checkpoint was trained on ({shown}); "
                "allowed: the checkpoint's sources, names and weights, or start fresh with ckpt_path=null")

    def save_tokenizer(self, directory: str) -> list[str]:
        """The tokenizer and the chat template this run trained with, as transformers reads them
        (an exported Hugging Face directory's)."""
        return write_tokenizer_directory(self.tokenizer, self.template, directory)

    def _continue_restored_order(self) -> None:
        super()._continue_restored_order()
        restored = self._restored_state
        if restored is None or "sources" not in restored or not isinstance(self.train_dataset, MixtureRows):
            return
        ours = self.train_dataset.positions(int(restored["epoch"]), int(restored["samples_drawn"]))
        saved = [int(s["drawn"]) for s in restored["sources"]]
        if ours != saved or len(restored["sources"]) != len(self.sources):
            raise ValueError(f"data.sources: the checkpoint's sources had drawn {saved} rows, this run's mixture "
                             f"would have drawn {ours} at the same position; resume with the sources and weights "
                             "it was trained with, or start fresh with ckpt_path=null")

    def run_facts(self) -> dict[str, Any]:
        """What the run trained on, for ``summary.json``: the examples cut or left out, the tokens
        trained on (the counted targets) beside the tokens seen (every real, unpadded position),
        the packing efficiency (the share of the rows' positions that hold an example), and each
        source's share of the samples."""
        facts: dict[str, Any] = {f"examples_{k}" if k != "examples" else "examples": v
                                 for k, v in self.example_counts.items()}
        dataset = self.train_dataset
        if dataset is None:
            return facts
        drawn = self.drawn_samples()
        counted = sum(int(dataset.counted_tokens(epoch)[indices].sum()) for epoch, indices in drawn)
        real = sum(int(dataset.real_tokens(epoch)[indices].sum()) for epoch, indices in drawn)
        samples = sum(len(indices) for _, indices in drawn)
        facts.update({"tokens_trained": counted, "tokens_seen": real, "positions_seen": samples * self.seq_len,
                      "packing_efficiency": real / (samples * self.seq_len) if samples else
                      float(dataset.real_tokens(0).sum()) / (len(dataset) * self.seq_len)})
        if isinstance(dataset, MixtureRows):
            shares = np.bincount(np.concatenate([dataset.owner[i] for _, i in drawn] or [np.zeros(0, int)]),
                                 minlength=len(self.sources))
            facts["source_shares"] = {s.name: float(c) / max(1, samples) for s, c in zip(self.sources, shares, strict=True)}
            facts["source_weights"] = {s.name: s.weight / sum(t.weight for t in self.sources) for s in self.sources}
        return facts

    def drawn_samples(self) -> list[tuple[int, np.ndarray]]:
        """``(data epoch, the samples of it)`` this run's training loop has drawn, all ranks
        together, from the shared order."""
        sampler = getattr(self, "_sampler", None)
        if sampler is None or self._epoch_start is None:
            return []
        state = self.state_dict()
        epoch, start = self._first_position
        found = []
        for data_epoch in range(epoch, int(state["epoch"]) + 1):
            end = int(state["samples_drawn"]) if data_epoch == int(state["epoch"]) else sampler.drawn_per_epoch()
            first = start if data_epoch == epoch else 0
            found.append((data_epoch, sampler.epoch_order(data_epoch)[first:end]))
        return found

    def train_sampler(self):
        sampler = super().train_sampler()
        self._sampler = sampler
        return sampler

    def _epoch_began(self, epoch: int, skipped: int) -> None:
        super()._epoch_began(epoch, skipped)
        if not hasattr(self, "_first_position"):
            self._first_position = (epoch, skipped * self.train_replicas()[0])
