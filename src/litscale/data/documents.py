"""The documents of a corpus: a text file is one document, a JSONL line or a Parquet row one more.

Files are told apart by their suffix (``.jsonl``, ``.parquet``; anything else is text). Each
reader yields ``(text, bytes_read)`` so the tokenizer's progress bar can count bytes; an
empty text is no document (the pipeline skips it) but still moves the bar.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence

from litscale.data.byte_corpus import expand_paths
from litscale.data.stdlib_code import stdlib_files

PARQUET_EXTRA = "parquet"
_SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet"}


def file_kind(path: str) -> str:
    """``"text"``, ``"jsonl"`` or ``"parquet"``, by suffix."""
    return _SUFFIXES.get(os.path.splitext(path)[1].lower(), "text")


def missing_paths_error(paths: str | Sequence[str] | None) -> str | None:
    """The error for ``data.paths`` when it matches no file (None: the stdlib corpus), else None."""
    if paths is None:
        return None
    try:
        expand_paths(paths)
    except ValueError:
        return (
            f"data.paths={paths!r} matches no files; give a glob of text, JSONL or Parquet files, "
            f"e.g. data.paths='~/corpus/**/*.jsonl', or null for the Python standard library"
        )
    return None


def corpus_files(paths: str | Sequence[str] | None) -> list[str]:
    """The corpus's files in document order: the stdlib's ``.py`` files when ``paths`` is None,
    else the sorted matches of the globs."""
    if paths is None:
        return stdlib_files()
    message = missing_paths_error(paths)
    if message:
        raise ValueError(message)
    return expand_paths(paths)


def read_documents(files: Sequence[str], text_field: str, *,
                   with_source: bool = False) -> Iterator[tuple[str, int] | tuple[str, int, int]]:
    """``(text, bytes_read)`` for every document of ``files``, in order; with ``with_source``,
    ``(text, bytes_read, index of its file in files)``."""
    readers = {"text": _read_text, "jsonl": _read_jsonl, "parquet": _read_parquet}
    for index, path in enumerate(files):
        for document in readers[file_kind(path)](path, text_field):
            yield (*document, index) if with_source else document


def _read_text(path: str, text_field: str) -> Iterator[tuple[str, int]]:
    with open(path, "rb") as handle:
        data = handle.read()
    # Tokenizers take text: a stray non-UTF-8 byte becomes U+FFFD rather than stopping the run.
    yield data.decode("utf-8", errors="replace"), len(data)


def _read_jsonl(path: str, text_field: str) -> Iterator[tuple[str, int]]:
    for record, size, where in read_records(path):
        yield ("", size) if record is None else (_text_of(record, text_field, where), size)


def _read_parquet(path: str, text_field: str) -> Iterator[tuple[str, int]]:
    for record, size, where in read_records(path):
        yield ("", size) if record is None else (_text_of(record, text_field, where), size)


def read_records(path: str) -> Iterator[tuple[dict | None, int, str]]:
    """``(record, bytes_read, where)`` for each line of a JSONL file or row of a Parquet file
    (``where``: "line 3 of <path>"); a blank line, or the end of a Parquet file, is a None
    record that still moves a progress bar by its bytes."""
    if file_kind(path) == "parquet":
        yield from _parquet_records(path)
        return
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                yield None, len(line), f"line {number} of {path}"
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"data.paths: line {number} of {path} is not JSON ({error.msg})") from None
            yield record, len(line), f"line {number} of {path}"


def _parquet_records(path: str) -> Iterator[tuple[dict | None, int, str]]:
    try:
        import datasets  # an optional extra: imported only when a Parquet file is read
    except ImportError:
        raise ValueError(
            f"data.paths matches Parquet files ({path}), which are read with Hugging Face datasets; "
            f"install it with: pip install 'litscale[{PARQUET_EXTRA}]'"
        ) from None
    # Streaming reads the local file row group by row group, with no copy in the datasets cache.
    rows = datasets.load_dataset("parquet", data_files=[path], split="train", streaming=True)
    for number, row in enumerate(rows, start=1):
        yield row, 0, f"row {number} of {path}"
    yield None, os.path.getsize(path), f"the end of {path}"


def _text_of(record: object, text_field: str, where: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        raise ValueError(
            f"data.text_field={text_field!r} is missing from {where}; "
            "set data.text_field to the field that holds the text"
        )
    text = record[text_field]
    if text is None:  # a null text is an empty document, as a nullable Parquet column has
        return ""
    if not isinstance(text, str):
        raise ValueError(
            f"data.text_field={text_field!r} is {type(text).__name__}, not text, in {where}"
        )
    return text
