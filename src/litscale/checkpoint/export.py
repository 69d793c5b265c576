"""A consolidated export: one ``model.pt`` that the plain zoo network loads, from any strategy.

Sharded checkpoints (FSDP's DCP directories, DeepSpeed's per-rank partitions) resume
training but cannot be opened by ``net.load_state_dict``: users hit this wall with Lightning
(#16815, #20065) and torchtitan (#811). This module gathers the full weights of the
LightningModule's ``net`` with the strategy's own gathering API and writes them once:

    net = build_gpt(preset="nano"); net.load_state_dict(torch.load("model.pt"))
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from litscale.health.beats import after_fit

EXPORT_FILENAME = "model.pt"
HF_DIRNAME = "hf"


def _has_dtensor(module: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def _deepspeed_engine(trainer: Trainer):
    engine = getattr(trainer.strategy, "model", None)
    return engine if type(engine).__name__ == "DeepSpeedEngine" else None


def _strip_prefix(state_dict: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}


def consolidated_state_dict(trainer: Trainer, module: LightningModule) -> dict[str, torch.Tensor]:
    """The full, unsharded ``state_dict`` of ``module.net`` (or of ``module`` if it has no
    ``net``) on CPU. A collective: every rank must call it; rank 0's result is complete."""
    from litscale.parallel.contract import contract_value

    splits_layers = contract_value(trainer.strategy, "splits_layers_over_ranks")
    state = _rank_state_dict(trainer, module, every_rank=splits_layers)
    if not splits_layers or not torch.distributed.is_initialized():
        return state
    # A pipeline rank holds only its stages' layers: every rank's part, gathered and merged
    # (ranks of the same stage send the same tensors; an object gather, as export is once a run).
    parts: list[dict | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, state)
    return {name: tensor for part in parts for name, tensor in (part or {}).items()}


def _rank_state_dict(trainer: Trainer, module: LightningModule, *, every_rank: bool = False) -> dict[str, torch.Tensor]:
    """What this rank holds of the net's state, whole tensors on CPU: on global rank 0 at least,
    on every rank with ``every_rank`` (a pipeline's other stages are not on rank 0)."""
    net = getattr(module, "net", module)
    engine = _deepspeed_engine(trainer)
    if engine is not None and getattr(engine, "zero_optimization_partition_weights", lambda: False)():
        # ZeRO-3: DeepSpeed gathers each partitioned parameter (rank 0 receives the tensors).
        full = engine._zero3_consolidated_16bit_state_dict()
        prefix = "net." if net is not module else ""
        return {k: v.cpu() for k, v in _strip_prefix(full or {}, prefix).items()}
    if _has_dtensor(net):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # cpu_offload keeps the gathered tensors on global rank 0 only: a stage that rank 0 does
        # not hold (pipeline x FSDP) would export nothing, so there every rank keeps its own.
        options = StateDictOptions(full_state_dict=True, cpu_offload=not every_rank)
        return {k: v.detach().cpu() for k, v in get_model_state_dict(net, options=options).items()}
    # DDP, single device, ZeRO-1/2: every rank holds the full parameters.
    return {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}


def export_model(trainer: Trainer, module: LightningModule, output_dir: str, *,
                 hugging_face: bool = False, save_tokenizer: Callable[[str], object] | None = None) -> str:
    """Write ``<output_dir>/model.pt`` (rank 0) and return its path (on every rank); with
    ``hugging_face``, from the same gathered weights, also ``<output_dir>/hf/``, a
    transformers directory (``litscale.models.hf_writing``: model=llama and model=hf), and in it the
    run's tokenizer (``save_tokenizer(directory)``: the data module's, with its chat template)."""
    state_dict = consolidated_state_dict(trainer, module)
    path = os.path.abspath(os.path.join(output_dir, EXPORT_FILENAME))
    if trainer.is_global_zero:
        os.makedirs(output_dir, exist_ok=True)
        torch.save(state_dict, path + ".tmp")
        os.replace(path + ".tmp", path)
        if hugging_face:
            from litscale.models.hf_writing import (
                save_hf_directory,  # transformers: an optional extra
            )

            save_hf_directory(getattr(module, "net", module), state_dict, os.path.join(output_dir, HF_DIRNAME))
            if save_tokenizer is not None:
                save_tokenizer(os.path.join(output_dir, HF_DIRNAME))
    after_fit(trainer, "export", "barrier")  # where a rank waits for rank 0's save
    trainer.strategy.barrier("export")
    return path
