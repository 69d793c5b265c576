"""Train the byte-level BPE that ``data.tokenizer=bpe`` loads, on the built-in stdlib corpus.

    python experiments/tokenizer/train_bpe.py            # writes src/litscale/data/assets/bpe-4k.json
    python experiments/tokenizer/train_bpe.py --check    # retrains and compares with the shipped file

The corpus is the ``.py`` files of the running Python's standard library, as ``data=tokens``
reads it by default (``litscale.data.stdlib_code.stdlib_files``: sorted by relative path, test
suites left out), so the same Python version gives the same file, byte for byte.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from litscale.data.stdlib_code import stdlib_files
from litscale.data.tokenizer import BPE_ASSET, END_OF_TEXT

VOCAB_SIZE = 4096
# The end-of-text token first (id 0), then padding for batched inference.
SPECIAL_TOKENS = [END_OF_TEXT, "<|pad|>"]


def corpus() -> list[str]:
    # errors="replace": the stdlib's sources are UTF-8 (PEP 3120); a stray byte must not stop
    # the training, and data=tokens reads files the same way.
    return [Path(path).read_text(encoding="utf-8", errors="replace") for path in stdlib_files()]


def train() -> Tokenizer:
    """GPT-2's byte-level scheme: any string round-trips, no unknown token is ever needed."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    return tokenizer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=BPE_ASSET)
    parser.add_argument("--check", action="store_true",
                        help="retrain and exit 1 if the result differs from --out")
    args = parser.parse_args()
    text = train().to_str(pretty=True) + "\n"
    if args.check:
        same = args.out.read_text(encoding="utf-8") == text
        print(f"{args.out}: {'identical' if same else 'DIFFERS'}")
        return 0 if same else 1
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out} ({len(text) / 1e3:.0f} kB, vocab {VOCAB_SIZE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
