"""Byte-level causal language modelling over a list of text files, cached as one uint8 file."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from typing import Any, Literal

from litscale.arguments import checked_arguments
from litscale.constraints import NonNegativeInt, OpenFraction, PositiveInt
from litscale.data.atomic import atomic_file
from litscale.data.base import ShardedDataModule
from litscale.data.byte_windows import ByteWindows, coalesce, held_out_cut, num_windows
from litscale.user_paths import user_path

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = "~/.cache/litscale/data"
# Bump when the cache layout changes so stale caches are not read with new code.
_CACHE_FORMAT = 1
_READ_CHUNK = 1 << 20


def default_cache_dir() -> str:
    """``$LITSCALE_CACHE`` if set, else ``~/.cache/litscale/data``."""
    return user_path(os.environ.get("LITSCALE_CACHE") or DEFAULT_CACHE_DIR)


def _patterns(paths: str | Sequence[str] | None) -> list[str]:
    if paths is None:
        return []
    if isinstance(paths, str):
        return [paths]
    # Hydra hands over ListConfig, not list; any sequence of strings will do.
    return [str(p) for p in paths]


def _match(paths: str | Sequence[str] | None) -> list[str]:
    found = set()
    for pattern in _patterns(paths):
        for path in glob.glob(user_path(pattern), recursive=True):
            if os.path.isfile(path):
                found.add(os.path.abspath(path))
    return sorted(found)


def missing_paths_error(paths: str | Sequence[str] | None) -> str | None:
    """The error message for ``data.paths`` when it matches no file, else None."""
    if _match(paths):
        return None
    return (
        f"data.paths={paths!r} matches no files; give a glob of text files, "
        f"e.g. data.paths='~/corpus/**/*.txt'"
    )


def expand_paths(paths: str | Sequence[str]) -> list[str]:
    """Expand glob patterns (``~`` and ``**`` allowed) to a sorted, de-duplicated file list."""
    files = _match(paths)
    if not files:
        raise ValueError(missing_paths_error(paths))
    return files


def _in_val(rel_path: str, val_fraction: float) -> bool:
    # A hash of the path, not the position in the list, so adding or reordering files never
    # moves an existing file between train and val.
    digest = hashlib.sha1(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < val_fraction


class ByteCorpusDataModule(ShardedDataModule):
    """Byte-level causal LM (vocabulary 256) over text files matched by glob patterns.

    ``prepare_data`` concatenates the files (sorted, capped at ``max_bytes``) into a cached
    uint8 file named by a hash of the file list, sizes, mtimes and ``max_bytes``; ``setup``
    memory-maps it. Files go to val by a hash of their relative path; when that leaves either
    split without a full window, the last ``val_fraction`` of the bytes is val instead.

    Args:
        paths: Glob pattern or list of patterns; ``~`` and ``**`` are expanded.
        seq_len: Tokens per sample; a sample is ``seq_len + 1`` consecutive bytes.
        batch_size: Per-device micro batch size.
        vocab_size: Must be 256; a key so model configs can interpolate ``${data.vocab_size}``.
        val_fraction: Expected fraction of files (or bytes, in the fallback) held out.
        max_bytes: Cap on the corpus size in bytes; None for no cap.
        cache_dir: Where the token file goes; default ``$LITSCALE_CACHE`` or
            ``~/.cache/litscale/data``.
        num_workers: DataLoader workers per rank.
        seed: Seed of the training order.
    """

    task = "causal_lm"

    @checked_arguments("data")
    def __init__(
        self,
        *,
        paths: str | list[str],
        seq_len: PositiveInt,
        batch_size: PositiveInt,
        vocab_size: Literal[256] = 256,
        val_fraction: OpenFraction = 0.05,
        max_bytes: PositiveInt | None = None,
        cache_dir: str | None = None,
        num_workers: NonNegativeInt = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        self.paths = paths
        self.seq_len = int(seq_len)
        self.vocab_size = 256
        self.val_fraction = float(val_fraction)
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        self.cache_dir = user_path(cache_dir) if cache_dir else default_cache_dir()
        self.train_files: list[str] = []
        self.val_files: list[str] = []
        self.split_by_file = True

    @property
    def tokens_per_sample(self) -> int | None:
        return self.seq_len

    def list_files(self) -> tuple[str, list[str]]:
        """``(root, files)``: absolute file paths in corpus order and the directory that
        relative paths (which decide the split) are taken from."""
        files = expand_paths(self.paths)
        return os.path.commonpath([os.path.dirname(f) for f in files]), files

    def cache_path(self) -> str:
        """Path of the token file for the files as they are now on disk."""
        _, files = self.list_files()
        return self._cache_path(files)

    def _cache_path(self, files: list[str]) -> str:
        stats = []
        for path in files:
            st = os.stat(path)
            stats.append([path, st.st_size, st.st_mtime_ns])
        key = json.dumps([_CACHE_FORMAT, stats, self.max_bytes]).encode("utf-8")
        name = f"bytes-{hashlib.sha256(key).hexdigest()[:24]}.u8"
        return os.path.join(self.cache_dir, name)

    def prepare_data(self) -> None:
        root, files = self.list_files()
        path = self._cache_path(files)
        if os.path.exists(path) and os.path.exists(path + ".json"):
            return
        os.makedirs(self.cache_dir, exist_ok=True)
        log.info("building byte cache %s from %d files", path, len(files))
        entries = []
        offset = 0
        budget = self.max_bytes
        # The byte file lands last (at the end of the block): its presence marks a complete cache.
        with atomic_file(path) as out:
            for file in files:
                if budget is not None and offset >= budget:
                    break
                length = 0
                with open(file, "rb") as src:
                    while chunk := src.read(_READ_CHUNK):
                        if budget is not None:
                            chunk = chunk[: budget - offset - length]
                        out.write(chunk)
                        length += len(chunk)
                        if budget is not None and offset + length >= budget:
                            break
                entries.append([os.path.relpath(file, root), offset, length])
                offset += length
            if offset == 0:
                raise ValueError(f"data.paths={self.paths!r}: all matched files are empty")
            meta = {"format": _CACHE_FORMAT, "root": root, "total": offset, "files": entries}
            with atomic_file(path + ".json") as handle:
                handle.write(json.dumps(meta).encode("utf-8"))

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        _, files = self.list_files()
        path = self._cache_path(files)
        if not (os.path.exists(path) and os.path.exists(path + ".json")):
            # Without Lightning (or with a cache dir not shared across nodes) prepare_data may
            # not have run here; building is atomic, so a concurrent build is harmless.
            self.prepare_data()
        with open(path + ".json", encoding="utf-8") as f:
            meta = json.load(f)
        train, val = self._split(meta)
        self.train_dataset = ByteWindows(path, train, self.seq_len)
        self.val_dataset = ByteWindows(path, val, self.seq_len)

    def _split(self, meta: dict[str, Any]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        train: list[tuple[int, int]] = []
        val: list[tuple[int, int]] = []
        self.train_files, self.val_files = [], []
        for rel_path, offset, length in meta["files"]:
            is_val = _in_val(rel_path, self.val_fraction)
            (val if is_val else train).append((offset, offset + length))
            (self.val_files if is_val else self.train_files).append(rel_path)
        if num_windows(coalesce(train), self.seq_len) and num_windows(coalesce(val), self.seq_len):
            self.split_by_file = True
            return train, val
        total = int(meta["total"])
        cut = held_out_cut(total, self.val_fraction, self.seq_len)
        if cut < self.seq_len + 1:
            raise ValueError(
                f"corpus of {total} bytes is too small for seq_len={self.seq_len}: "
                f"need at least {2 * (self.seq_len + 1)} bytes for one train and one val sample"
            )
        self.split_by_file = False
        files = meta["files"]
        self.train_files = [rel for rel, offset, _ in files if offset < cut]
        self.val_files = [rel for rel, offset, length in files if offset + length > cut]
        return [(0, cut)], [(cut, total)]
