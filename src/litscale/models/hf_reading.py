"""Reading a local Hugging Face checkpoint directory for litscale's own decoders
(``model.net.from_hf``): its transformers config and its weights by litscale's names. It
imports none of the decoders (they import it, when asked for a directory); transformers is
imported only when a directory is read."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from litscale.extras import TRANSFORMERS
from litscale.models.hf import checkpoint_fields, with_vocab_size
from litscale.user_paths import user_path

BASE_PREFIX = "model."  # transformers' base model, which litscale's decoders are without the head


def refuse_architecture_with_checkpoint(given: dict) -> None:
    """``model.net.from_hf`` brings the architecture: a number set beside it is an error, not
    silently ignored."""
    name, value = next(((n, v) for n, v in given.items() if v is not None), (None, None))
    if name is not None:
        raise ValueError(f"model.net.{name}={value} with model.net.from_hf: the checkpoint fixes the "
                         f"architecture; allowed: leave model.net.{name} unset")


def hf_config_of_directory(directory: str, key: str = "model.net.from_hf") -> Any:
    """The transformers config of a local checkpoint directory with safetensors weights."""
    directory = user_path(directory)
    checkpoint_fields(directory, key)  # a local directory, its config.json, safetensors: or one line
    if TRANSFORMERS.missing():  # after the path, as model=hf: a bad path is named as such
        raise ValueError(TRANSFORMERS.refusal(f"{key}={directory!r}"))
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(directory, local_files_only=True)


def hf_weights(directory: str) -> dict[str, torch.Tensor]:
    """A local transformers checkpoint's weights by litscale's names (safetensors only: a
    pickled .bin can run code when it is loaded)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(user_path(directory), local_files_only=True, use_safetensors=True,
                                                 dtype=torch.float32)
    return {name.removeprefix(BASE_PREFIX): tensor for name, tensor in model.state_dict().items()}


def reading_shapes_only() -> bool:
    """Built under ``torch.device("meta")``: the app's checks before any rank starts want the
    shapes, not gigabytes of weights."""
    return torch.get_default_device().type == "meta"


def fitted_to_data(config: Any, vocab_size: int | None, block_size: int | None, source: str):
    """A checkpoint's config trained on the data's sequences: its vocabulary must be the data's
    (``with_vocab_size``); ``block_size`` (data.seq_len) within its positions replaces them."""
    with_vocab_size({"vocab_size": config.vocab_size}, vocab_size, source, from_checkpoint=True)
    if block_size is None:
        return config
    if block_size > config.block_size:
        raise ValueError(f"model.net.block_size={block_size} (data.seq_len) is longer than {source}'s "
                         f"max_position_embeddings={config.block_size}; allowed: at most {config.block_size}")
    return replace(config, block_size=block_size)


def checkpoint_config(directory: str, of_hf: Any, vocab_size: int | None, block_size: int | None,
                      key: str = "model.net.from_hf") -> Any:
    """A local checkpoint's config as a litscale decoder's (``of_hf``: the decoder's mapping of
    a transformers config, which names what it lacks in one line), fitted to the data."""
    source = f"{key}={directory!r}"
    return fitted_to_data(of_hf(hf_config_of_directory(directory, key), source), vocab_size, block_size, source)
