"""A tokenized corpus on disk: one flat file of tokens and an index of its documents.

``tokens-<key>.bin`` holds every document's tokens followed by the end-of-text token, back to
back, as uint16 (a vocabulary of at most 65536) or uint32; ``tokens-<key>.index.npz`` holds
where each document starts, its text's UTF-8 bytes (bits per byte are per byte of text, whatever
the tokenizer), a hash of its text, which decides its split, and the index of the file it
came from (its source, for ``data.partition=source``; -1 when not given). The key hashes
the files' contents, the tokenizer and the format, so a cache is reused exactly when it
would come out the same. Both files are written under temporary names and renamed into
place, the index first: the token file's presence marks a complete cache, and ranks or jobs
that build the same cache at once each rename a complete copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from litscale.data.atomic import atomic_file
from litscale.data.documents import file_kind
from litscale.data.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

# Bump when the layout changes so stale caches are not read with new code.
CACHE_FORMAT = 3  # 2: the UTF-8 bytes of each document, for bits per byte; 3: its source file
# Texts handed to the tokenizer at once: its batch encoding spreads them over the cores.
_BATCH_BYTES = 4 << 20


def write_index(stem: str, dtype: np.dtype, *, split_keys: list[int], **columns: list[int]) -> None:
    """A cache's ``.index.npz``, written whole or not at all: its token dtype, each entry's split
    key (a text's hash, uint64) and the other per-entry columns (``starts``, ``sources``...) as int64."""
    with atomic_file(stem + ".index.npz") as index:
        np.savez(index, dtype=np.array(dtype.name), split_keys=np.array(split_keys, dtype=np.uint64),
                 **{name: np.array(values, dtype=np.int64) for name, values in columns.items()})


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every token id."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def _content_digest(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def cache_stem(cache_dir: str, files: list[str], tokenizer: TextTokenizer, text_field: str) -> str:
    """``<cache_dir>/tokens-<key>``: the key hashes what the tokens depend on, and nothing else
    (a corpus moved elsewhere keeps its cache)."""
    parts: list[object] = [CACHE_FORMAT, tokenizer.fingerprint]
    if any(file_kind(f) != "text" for f in files):
        parts.append(text_field)
    parts.append([[file_kind(f), _content_digest(f)] for f in files])
    key = hashlib.sha256(json.dumps(parts).encode("utf-8")).hexdigest()[:24]
    return os.path.join(cache_dir, f"tokens-{key}")


def is_complete(stem: str) -> bool:
    return os.path.exists(stem + ".index.npz") and os.path.exists(stem + ".bin")


@dataclass(frozen=True)
class TokenCache:
    """A built cache: document ``i`` is ``tokens[starts[i]:starts[i + 1]]``, its end-of-text last."""

    path: str
    dtype: np.dtype
    starts: np.ndarray  # int64, one more than there are documents
    split_keys: np.ndarray  # uint64 hash of each document's text
    text_bytes: np.ndarray  # int64 UTF-8 bytes of each document's text
    sources: np.ndarray  # int64 index of each document's file among the corpus's files (-1: unknown)

    @property
    def num_tokens(self) -> int:
        return int(self.starts[-1])

    @property
    def num_documents(self) -> int:
        return len(self.split_keys)

    def tokens(self) -> np.memmap:
        return np.memmap(self.path, dtype=self.dtype, mode="r")


def load_cache(stem: str) -> TokenCache:
    with np.load(stem + ".index.npz") as index:
        return TokenCache(path=stem + ".bin", dtype=np.dtype(str(index["dtype"])),
                          starts=index["starts"], split_keys=index["split_keys"],
                          text_bytes=index["text_bytes"],
                          sources=index["sources"] if "sources" in index else np.full(len(index["split_keys"]), -1))


def split_key(text: str) -> int:
    # The text's own hash: the same document falls in the same split wherever it appears,
    # so a duplicate cannot sit in train and val at once.
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def _batches(documents: Iterable[tuple], progress: tqdm) -> Iterator[list[tuple[str, int]]]:
    """Batches of ``(text, source)``; a document is ``(text, bytes_read)`` or
    ``(text, bytes_read, source)``."""
    batch: list[tuple[str, int]] = []
    size = 0
    for text, bytes_read, *source in documents:
        progress.update(bytes_read)
        if text:
            batch.append((text, source[0] if source else -1))
            size += len(text)
        if size >= _BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def build_cache(stem: str, documents: Iterable[tuple], tokenizer: TextTokenizer,
                *, total_bytes: int, source: str) -> None:
    """Tokenize ``documents`` into the cache at ``stem``; a ``ValueError`` starting with
    ``source`` (the key that names the corpus) if they hold no text. A document is ``(text,
    bytes_read)`` or, with the index of its file, ``(text, bytes_read, file_index)``."""
    directory = os.path.dirname(stem)
    os.makedirs(directory, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    starts, keys, text_bytes, sources = [0], [], [], []
    # The token file lands last (at the end of the block): its presence marks a complete cache.
    with atomic_file(stem + ".bin") as out, tqdm(total=total_bytes, unit="B", unit_scale=True,
                                                  desc=f"tokenizing ({tokenizer.name})",
                                                  disable=None) as progress:
        for batch in _batches(documents, progress):
            texts = [text for text, _ in batch]
            for (text, file_index), ids in zip(batch, tokenizer.encode_batch(texts), strict=True):
                if len(ids) == 0 or ids[-1] != tokenizer.eos_id:
                    ids = np.append(ids, tokenizer.eos_id)
                ids.astype(dtype).tofile(out)
                starts.append(starts[-1] + len(ids))
                keys.append(split_key(text))
                text_bytes.append(len(text.encode("utf-8")))
                sources.append(file_index)
        if not keys:
            raise ValueError(f"{source} holds no text: every matched file or record is empty")
        write_index(stem, dtype, starts=starts, split_keys=keys, text_bytes=text_bytes, sources=sources)
    log.info("tokenized %d documents into %d tokens: %s.bin", len(keys), starts[-1], stem)
