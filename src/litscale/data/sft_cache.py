"""Examples for fine-tuning on disk: their tokens, which tokens are trained on, an index.

``sft-<key>.bin`` holds every example's tokens back to back (uint16 or uint32, as the token
cache's), ``sft-<key>.mask.bin`` one byte per token (1: an assistant's token, trained on), and
``sft-<key>.index.npz`` where each example starts, a hash of its rendered text (its split), the
file it came from and its row there. An example of a ``text`` source is a document with every
token trained on, ended by the end-of-text token. The key hashes what the tokens and masks
depend on: the files' contents, the tokenizer, the chat template, the fields read and which
turns are trained on. As the token cache (``token_cache``), the files are written under
temporary names and renamed, the token file last: its presence marks a complete cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
from tqdm import tqdm

from litscale.data.atomic import atomic_file
from litscale.data.chat import (
    ChatTemplate,
    Fields,
    TrainOn,
    assistant_spans,
    conversation_of,
    tokens_with_mask,
)
from litscale.data.documents import read_documents, read_records
from litscale.data.token_cache import _content_digest, split_key, token_dtype, write_index
from litscale.data.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

CACHE_FORMAT = 1
SourceKind = Literal["sft", "text"]


@dataclass(frozen=True)
class Recipe:
    """How rows become examples: what the cache key hashes beside the files."""

    kind: SourceKind
    fields: Fields
    train_on: TrainOn
    text_field: str = "text"

    def key_parts(self, tokenizer: TextTokenizer, template: ChatTemplate) -> list:
        if self.kind == "text":
            return [CACHE_FORMAT, tokenizer.fingerprint, "text", self.text_field]
        return [CACHE_FORMAT, tokenizer.fingerprint, "sft", template.text, template.eos_token, template.bos_token,
                asdict(self.fields), self.train_on]


def sft_cache_stem(cache_dir: str, files: list[str], tokenizer: TextTokenizer, template: ChatTemplate,
                   recipe: Recipe) -> str:
    """``<cache_dir>/sft-<key>``."""
    parts = [*recipe.key_parts(tokenizer, template), [_content_digest(f) for f in files]]
    key = hashlib.sha256(json.dumps(parts).encode("utf-8")).hexdigest()[:24]
    return os.path.join(cache_dir, f"sft-{key}")


@dataclass(frozen=True)
class ExampleCache:
    """A built cache: example ``i`` is ``tokens[starts[i]:starts[i + 1]]``, and ``trained`` the
    same slice of the mask."""

    stem: str
    dtype: np.dtype
    starts: np.ndarray
    split_keys: np.ndarray
    sources: np.ndarray  # the file of each example, by index among the source's files
    rows: np.ndarray  # its row (line) in that file, from 1

    @property
    def num_examples(self) -> int:
        return len(self.split_keys)

    def tokens(self) -> np.memmap:
        return np.memmap(self.stem + ".bin", dtype=self.dtype, mode="r")

    def trained(self) -> np.memmap:
        return np.memmap(self.stem + ".mask.bin", dtype=np.uint8, mode="r")


def is_complete(stem: str) -> bool:
    return all(os.path.exists(stem + suffix) for suffix in (".index.npz", ".mask.bin", ".bin"))


def load_example_cache(stem: str) -> ExampleCache:
    with np.load(stem + ".index.npz") as index:
        return ExampleCache(stem=stem, dtype=np.dtype(str(index["dtype"])), starts=index["starts"],
                            split_keys=index["split_keys"], sources=index["sources"], rows=index["rows"])


def _examples(files: list[str], tokenizer: TextTokenizer, template: ChatTemplate, recipe: Recipe,
              progress: tqdm) -> Iterator[tuple[np.ndarray, np.ndarray, int, int, int]]:
    """``(tokens, trained, split key, file index, row)`` of each example, in file order."""
    if recipe.kind == "text":
        rows: dict[int, int] = {}
        for text, size, index in read_documents(files, recipe.text_field, with_source=True):
            progress.update(size)
            rows[index] = rows.get(index, 0) + 1
            if text:
                ids = np.append(np.asarray(tokenizer.encode_batch([text])[0], dtype=np.int64), tokenizer.eos_id)
                yield ids, np.ones(len(ids), dtype=bool), split_key(text), index, rows[index]
        return
    for index, path in enumerate(files):
        for number, (record, size, where) in enumerate(read_records(path), start=1):
            progress.update(size)
            if record is None:
                continue
            messages = conversation_of(record, recipe.fields, template, where)
            text, spans = assistant_spans(template, messages, recipe.train_on, where)
            ids, trained = tokens_with_mask(tokenizer, text, spans, template.eos_token)
            yield ids, trained, split_key(text), index, number


def build_example_cache(stem: str, files: list[str], tokenizer: TextTokenizer, template: ChatTemplate,
                        recipe: Recipe, *, source: str) -> None:
    """Tokenize the rows of ``files`` into the cache at ``stem``, with a progress bar; a one-line
    ``ValueError`` naming the file and row of the first bad one, or ``source`` (the key naming
    the files) when they hold no example."""
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    starts, keys, sources, rows = [0], [], [], []
    with atomic_file(stem + ".bin") as out, atomic_file(stem + ".mask.bin") as mask, \
            tqdm(total=sum(os.path.getsize(f) for f in files), unit="B", unit_scale=True,
                 desc=f"tokenizing conversations ({tokenizer.name})", disable=None) as progress:
        for ids, trained, key, file_index, row in _examples(files, tokenizer, template, recipe, progress):
            ids.astype(dtype).tofile(out)
            trained.astype(np.uint8).tofile(mask)
            starts.append(starts[-1] + len(ids))
            keys.append(key)
            sources.append(file_index)
            rows.append(row)
        if not keys:
            raise ValueError(f"{source} holds no example: every matched file or row is empty")
        write_index(stem, dtype, starts=starts, split_keys=keys, sources=sources, rows=rows)
    log.info("tokenized %d examples into %d tokens: %s.bin", len(keys), starts[-1], stem)
