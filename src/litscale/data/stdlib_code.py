"""Byte-level causal LM over the Python standard library's own source: real text, offline."""

from __future__ import annotations

import os
import sysconfig
from typing import Literal

from litscale.arguments import checked_arguments
from litscale.constraints import NonNegativeInt, OpenFraction, PositiveInt
from litscale.data.byte_corpus import ByteCorpusDataModule

# Installed third-party code is not stdlib and differs between machines.
_ALWAYS_SKIPPED = frozenset({"site-packages", "dist-packages", "__pycache__"})
# Test suites are large, full of generated or deliberately broken files (lib2to3/tests/data,
# idlelib/idle_test), and would dominate the byte budget; leave them out unless asked.
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


def stdlib_root() -> str:
    """Directory of the running interpreter's standard library."""
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str | None = None, *, include_tests: bool = False) -> list[str]:
    """Absolute paths of the stdlib ``.py`` files, ordered by relative path."""
    root = os.path.abspath(root or stdlib_root())
    skipped = _ALWAYS_SKIPPED if include_tests else _ALWAYS_SKIPPED | _TEST_DIRS
    rel_paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skipped]
        for name in filenames:
            if name.endswith(".py"):
                rel_paths.append(os.path.relpath(os.path.join(dirpath, name), root))
    # Sorted relative paths (with "/" separators) make the order independent of the
    # filesystem's listing order and of where Python is installed.
    rel_paths.sort(key=lambda p: p.replace(os.sep, "/"))
    return [os.path.join(root, p) for p in rel_paths]


class StdlibCodeDataModule(ByteCorpusDataModule):
    """Byte-level causal LM over the ``.py`` files of the running Python's standard library.

    The file list is the stdlib sorted by relative path, without ``site-packages``,
    ``dist-packages``, ``__pycache__`` and (unless ``include_tests``) ``test``/``tests``/
    ``idle_test`` directories, capped at ``max_bytes``. Works offline on any machine; the
    exact bytes depend on the Python version. Arguments are those of
    :class:`~litscale.data.byte_corpus.ByteCorpusDataModule` without ``paths``.

    Args:
        include_tests: Also take the stdlib test suites.
    """

    @checked_arguments("data")
    def __init__(
        self,
        *,
        seq_len: PositiveInt,
        batch_size: PositiveInt,
        vocab_size: Literal[256] = 256,
        val_fraction: OpenFraction = 0.05,
        max_bytes: PositiveInt | None = 8_000_000,
        cache_dir: str | None = None,
        include_tests: bool = False,
        num_workers: NonNegativeInt = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(
            paths=os.path.join(stdlib_root(), "**", "*.py"),
            seq_len=seq_len,
            batch_size=batch_size,
            vocab_size=vocab_size,
            val_fraction=val_fraction,
            max_bytes=max_bytes,
            cache_dir=cache_dir,
            num_workers=num_workers,
            seed=seed,
        )
        self.include_tests = bool(include_tests)

    def list_files(self) -> tuple[str, list[str]]:
        root = os.path.abspath(stdlib_root())
        files = stdlib_files(root, include_tests=self.include_tests)
        if not files:
            raise ValueError(f"no .py files found in the standard library at {root}")
        return root, files
