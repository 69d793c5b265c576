"""OmegaConf resolvers the configs use, registered when ``litscale.app`` is imported, so that
every way of composing them (``train.py``, ``--cfg job --resolve``, the tests, a notebook
importing the app) resolves the same.

- ``${tokenizer_vocab_size:<data.tokenizer>}``: ``data=tokens`` sizes the model's vocabulary
  from its tokenizer.
- ``${user_path:<path>}``: ``~`` expanded (``litscale.user_paths``), for the run dirs Hydra
  makes under ``paths.root_dir``.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from litscale.user_paths import user_path


def tokenizer_vocab_size(name: str) -> int:
    from litscale.data.tokenizer import tokenizer_vocab_size as vocab_size  # torch: only when used

    return vocab_size(name)


OmegaConf.register_new_resolver("tokenizer_vocab_size", tokenizer_vocab_size, replace=True)
OmegaConf.register_new_resolver("user_path", user_path, replace=True)
