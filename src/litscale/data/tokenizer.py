"""The tokenizers ``data.tokenizer`` names, all read from local files: nothing is downloaded.

- ``byte``: the UTF-8 bytes are the tokens 0..255, the scheme of ``data=stdlib_code`` and
  ``data=text_files``, plus token 256 to end a document;
- ``bpe``: a byte-level BPE of 4096 tokens trained on the standard library's source, shipped
  with litscale (``experiments/tokenizer/train_bpe.py`` made it);
- the path of a ``tokenizer.json``, or of a directory holding one (a Hugging Face tokenizer
  saved or downloaded beforehand), read with the ``tokenizers`` library.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from litscale.user_paths import user_path

BUILTIN = ("byte", "bpe")
END_OF_TEXT = "<|endoftext|>"
BPE_ASSET = Path(__file__).resolve().parent / "assets" / "bpe-4k.json"
# How common tokenizers spell their end-of-text token; tried in this order when no
# tokenizer_config.json beside the tokenizer.json names its eos_token.
_END_OF_TEXT_NAMES = (END_OF_TEXT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
_ALLOWED = "byte, bpe, or the path of a tokenizer.json or of a directory holding one"


class TextTokenizer(Protocol):
    """What the token pipeline needs from a tokenizer."""

    name: str
    vocab_size: int  # one more than the largest token id: the model's embedding rows
    eos_id: int  # ends each document in the token stream
    eos_token: str  # how a chat template writes it
    fingerprint: str  # changes whenever the tokens of some text would

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[np.ndarray]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255; token 256 ends a document."""

    name = "byte"
    vocab_size = 257
    eos_id = 256
    eos_token = END_OF_TEXT
    fingerprint = "byte:1"

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class SubwordTokenizer:
    """A ``tokenizer.json`` read by the ``tokenizers`` library, with its end-of-text token."""

    def __init__(self, name: str, path: Path) -> None:
        from tokenizers import Tokenizer  # here: byte-level runs never pay for the import

        self.name = name
        content = path.read_bytes()
        try:
            self._tokenizer = Tokenizer.from_str(content.decode("utf-8"))
        except Exception as error:  # noqa: BLE001 - the library raises plain Exception, and
            # a file that is not UTF-8 a UnicodeDecodeError: either way, not a tokenizer.json
            raise ValueError(
                f"data.tokenizer={name!r}: {path} is not a tokenizer.json the tokenizers library "
                f"can read ({_first_line(error)})"
            ) from None
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        # Added tokens may sit past the base vocabulary, with gaps: size by the largest id.
        self.vocab_size = max(vocab.values()) + 1
        eos = _end_of_text(name, path, vocab)
        self.eos_id, self.eos_token = vocab[eos], eos
        self.fingerprint = hashlib.sha256(content + eos.encode("utf-8")).hexdigest()

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[np.ndarray]:
        # The tokenizer's own special tokens stay (a Llama tokenizer starts each text with
        # <|begin_of_text|>); the pipeline ends each document with eos_id. A chat template
        # writes them itself (add_special_tokens=False).
        encodings = self._tokenizer.encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)
        return [np.asarray(encoding.ids, dtype=np.uint32) for encoding in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _end_of_text(name: str, path: Path, vocab: dict[str, int]) -> str:
    config = path.with_name("tokenizer_config.json")
    if config.is_file():
        try:
            settings = json.loads(config.read_text(encoding="utf-8"))
        except ValueError as error:
            raise ValueError(f"data.tokenizer={name!r}: {config} is not JSON ({error})") from None
        eos = settings.get("eos_token") if isinstance(settings, dict) else None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and eos in vocab:
            return eos
    found = next((token for token in _END_OF_TEXT_NAMES if token in vocab), None)
    if found is None:
        raise ValueError(
            f"data.tokenizer={name!r} has no end-of-text token to separate documents: none of "
            f"{', '.join(_END_OF_TEXT_NAMES)}, and no eos_token in a tokenizer_config.json beside it"
        )
    return found


def tokenizer_file(name: str) -> Path | None:
    """The ``tokenizer.json`` that ``name`` stands for (None for ``byte``), or a one-line error."""
    if name == "byte":
        return None
    if name == "bpe":
        return BPE_ASSET
    path = Path(user_path(name))
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return path / "tokenizer.json"
        raise ValueError(f"data.tokenizer={name!r} is a directory without a tokenizer.json; "
                         f"expected {_ALLOWED}")
    if path.is_file():
        return path
    raise ValueError(f"data.tokenizer={name!r} does not exist; expected {_ALLOWED} "
                     "(tokenizers are never downloaded)")


def tokenizer_error(name: object) -> str | None:
    """The one-line error for ``data.tokenizer=name`` when it names no tokenizer, else None."""
    if not isinstance(name, str):
        return f"data.tokenizer={name} is not valid: expected {_ALLOWED}"
    try:
        load_tokenizer(name)
    except ValueError as error:
        return str(error)
    return None


def load_tokenizer(name: str) -> TextTokenizer:
    """The tokenizer ``name`` stands for; a one-line ``ValueError`` naming ``data.tokenizer``."""
    path = tokenizer_file(name)
    if path is None:
        return ByteTokenizer()
    stat = path.stat()
    return _load_subword(name, str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _load_subword(name: str, path: str, size: int, mtime_ns: int) -> SubwordTokenizer:
    # Keyed by size and mtime too, so an edited file is read again. A large tokenizer.json
    # (Llama 3's is 9 MB) takes a while to parse, and validation asks more than once.
    return SubwordTokenizer(name, Path(path))


def tokenizer_vocab_size(name: str) -> int:
    """The vocabulary size of ``data.tokenizer=name``: what ``${data.vocab_size}`` resolves to."""
    return load_tokenizer(name).vocab_size
