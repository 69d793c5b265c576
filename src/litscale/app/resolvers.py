"""OmegaConf resolvers the configs use, registered when ``litscale.app`` is imported, so that
every way of composing them (``train.py``, ``--cfg job --resolve``, the tests, a notebook
importing the app) resolves the same.

- ``${tokenizer_vocab_size:<data.tokenizer>}``: ``data=tokens`` sizes the model's vocabulary
  from its tokenizer.
"""

from __future__ import annotations

from omegaconf import OmegaConf


def tokenizer_vocab_size(name: str) -> int:
    from litscale.data.tokenizer import tokenizer_vocab_size as vocab_size  # torch: only when used

    return vocab_size(name)


OmegaConf.register_new_resolver("tokenizer_vocab_size", tokenizer_vocab_size, replace=True)
