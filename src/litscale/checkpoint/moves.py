"""Moving a checkpoint between the two kinds of litscale strategy: those that save one
``torch.save`` file (``single``, ``ddp`` and the DDP family) and those that save a
``torch.distributed.checkpoint`` directory of shards (``fsdp``, ``tensor_parallel``,
``pipeline``). DCP reshards between the directory strategies by itself; this module carries a
file into a sharded model and a directory into a replicated one.

What does not move by itself is the optimizer state's keys. A file keys it by the parameter's
position in the saving optimizer's groups, a directory by the parameter's name; Lightning's own
conversion assumes the module's parameter order, which is not the groups' order when weight
decay splits the parameters (``modules.weight_decay_groups``), and so gives a parameter another
one's moments. Every save therefore records the names of each optimizer's parameters, group by
group (``OPTIMIZER_PARAM_NAMES``), and the conversions here go by name. A DeepSpeed
checkpoint is read whole as a file (``litscale.checkpoint.deepspeed``) and moves as one; a file or a
directory moves into a ZeRO engine through DeepSpeed's own setters (``deepspeed_moves.load_into_zero``).
"""

from __future__ import annotations

import os
import re
from typing import Any

from torch import nn
from torch.optim import Optimizer

from litscale.checkpoint.reading import read_dcp_metadata, read_plain

# Checkpoint key: for each optimizer, for each of its groups, its parameters' names.
OPTIMIZER_PARAM_NAMES = "optimizer_param_names"
# Marks a checkpoint read from a directory whose optimizer states are still keyed by name.
BY_NAME = "optimizer_states_by_name"


def param_names_by_group(module: nn.Module, optimizers: list[Optimizer]) -> list[list[list[str]]] | None:
    """The names of every optimizer's parameters, group by group; None if one is not the
    module's (an optimizer of the user's own over other tensors)."""
    name_of = {id(param): name for name, param in module.named_parameters()}
    names = [[[name_of.get(id(param)) for param in group["params"]] for group in _unwrapped(optimizer).param_groups]
             for optimizer in optimizers]
    if any(name is None for optimizer in names for group in optimizer for name in group):
        return None
    return names


def _unwrapped(optimizer: Any) -> Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)


def state_by_name(saved: dict[str, Any], saved_names: list[list[str]], wanted_names: list[list[str]]) -> dict[str, Any]:
    """A file's optimizer state (keyed by position in ``saved_names``' groups) keyed by name,
    for the parameters in ``wanted_names`` (a pipeline stage holds only its own), grouped as
    there; each group keeps the saved group's hyperparameters (its learning rate included)."""
    flat = [name for group in saved_names for name in group]
    by_name = {flat[index]: state for index, state in saved["state"].items()}
    wanted = {name for group in wanted_names for name in group}
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": names}
              for group, names in zip(saved["param_groups"], wanted_names, strict=True)]
    return {"state": {name: state for name, state in by_name.items() if name in wanted}, "param_groups": groups}


def named_optimizer_state(checkpoint: dict[str, Any]) -> list[dict[str, Any]]:
    """Each optimizer's per-parameter state keyed by the parameter's name, from a file's
    checkpoint (keyed by position, with ``OPTIMIZER_PARAM_NAMES``) or a directory read as one."""
    if checkpoint.get(BY_NAME):
        return [saved["state"] for saved in checkpoint["optimizer_states"]]
    names = checkpoint.get(OPTIMIZER_PARAM_NAMES)
    if names is None:
        raise ValueError("ckpt_path: the checkpoint records no names for its optimizer's parameters (saved before "
                         "they were recorded); resume it with the strategy that saved it")
    return [state_by_name(saved, saved_names, saved_names)["state"]
            for saved, saved_names in zip(checkpoint["optimizer_states"], names, strict=True)]


def state_by_position(saved: dict[str, Any], wanted_names: list[list[str]]) -> dict[str, Any]:
    """A directory's optimizer state (keyed by name) keyed by position in ``wanted_names``'
    groups, as ``Optimizer.load_state_dict`` takes it; the hyperparameters of the saved groups
    (DCP saves them once, from rank 0, whose list of parameters may be only its own)."""
    position = {name: index for index, name in enumerate(n for group in wanted_names for n in group)}
    missing = [name for name in position if name not in saved["state"]]
    if missing and saved["state"]:
        raise ValueError(f"ckpt_path: the checkpoint holds no optimizer state for {missing[0]}; resume with the "
                         "optimizer it was trained with, or start fresh with ckpt_path=null")
    groups, start = [], 0
    for group, names in zip(saved["param_groups"], wanted_names, strict=True):
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(range(start, start + len(names)))})
        start += len(names)
    return {"state": {position[name]: state for name, state in saved["state"].items() if name in position},
            "param_groups": groups}


def read_directory_whole(path: str) -> dict[str, Any]:
    """A DCP checkpoint directory read whole into one process's memory: its tensors (by
    Lightning's keys, ``state_dict`` and ``optimizer_<i>``) and ``meta.pt``'s the rest."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from litscale.lightning_private import CHECKPOINT_METADATA_FILENAME

    # NOTE: DCP's own dcp_to_torch_save writes the whole state to a second file; this is the
    # same read (its private planner and loader), kept in memory. Every rank reads it all.
    tensors: dict[str, Any] = {}
    _load_state_dict(tensors, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    # NOTE: DCP's reader unpickles ``.metadata`` whole; validation read it without running code
    # (``checkpoint_reading.is_readable_checkpoint``) before any rank started.
    rest = read_plain(f"{path}/{CHECKPOINT_METADATA_FILENAME}", mmap=False)
    return {**rest, **tensors}


def directory_as_file_checkpoint(path: str) -> dict[str, Any]:
    """A DCP directory as the checkpoint a file strategy loads: the module's full state, and
    each optimizer's state still keyed by name (``BY_NAME``): a file strategy reads the
    checkpoint before it builds its optimizers, and ``optimizer_states_by_position`` keys them
    by position once it has."""
    whole = read_directory_whole(path)
    count = sum(1 for key in whole if key.startswith("optimizer_") and key[len("optimizer_"):].isdigit())
    whole["optimizer_states"] = [whole.pop(f"optimizer_{index}") for index in range(count)]
    whole[BY_NAME] = True
    return whole


def read_as_file(path: str) -> dict[str, Any]:
    """A file checkpoint, or a sharded directory read whole as one (``directory_as_file_checkpoint``)."""
    if os.path.isdir(path):
        return directory_as_file_checkpoint(path)
    return read_plain(path, mmap=False)


def saved_state_kinds(path: str) -> set[str]:
    """The kinds of per-parameter state (``exp_avg``, ``momentum_buffer``, ...) the optimizers of
    the file or DCP directory at ``path`` keep, read without running code and without reading a
    tensor (a file memory-mapped; a directory's from the keys its ``.metadata`` lists)."""
    if os.path.isdir(path):
        keys = read_dcp_metadata(path).state_dict_metadata
        return {key.rsplit(".", 1)[1] for key in keys if re.match(r"optimizer_\d+\.state\.", key)}
    return {kind for saved in read_plain(path).get("optimizer_states", []) for state in saved["state"].values()
            for kind in state}


def optimizer_states_by_position(checkpoint: dict[str, Any], module: nn.Module,
                                 optimizers: list[Optimizer]) -> dict[str, Any]:
    """``checkpoint`` with the optimizer states of ``directory_as_file_checkpoint`` keyed by
    position in ``optimizers``' groups, as ``Optimizer.load_state_dict`` takes them."""
    if not checkpoint.get(BY_NAME):
        return checkpoint
    wanted = param_names_by_group(module, optimizers)
    if wanted is None:
        raise ValueError("ckpt_path: a sharded checkpoint resumes on a replicated layout only with optimizers over "
                         "the module's parameters")
    states = [state_by_position(state, names)
              for state, names in zip(checkpoint["optimizer_states"], wanted, strict=True)]
    return {**checkpoint, "optimizer_states": states}


def load_file_into_sharded(path: str | dict[str, Any], model: nn.Module, optimizers: list[Optimizer], *,
                           strict: bool) -> dict[str, Any]:
    """Load a file checkpoint (its path, or the checkpoint as read: a DeepSpeed directory read as
    one by ``litscale.checkpoint.deepspeed``) into a sharded (DTensor, or pipeline-stage) model and
    its optimizers; returns the checkpoint's other state for Lightning to restore."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    checkpoint = read_plain(path) if isinstance(path, str) else path
    own = model.state_dict().keys()
    weights = checkpoint.pop("state_dict")
    partial = own != weights.keys()  # a pipeline stage holds only its own layers
    set_model_state_dict(model, {k: v for k, v in weights.items() if k in own},
                         options=StateDictOptions(full_state_dict=True, strict=strict and not partial))
    saved_names = checkpoint.get(OPTIMIZER_PARAM_NAMES)
    wanted = param_names_by_group(model, optimizers)
    if saved_names is None or wanted is None:
        raise ValueError("ckpt_path: the checkpoint records no names for its optimizer's parameters (saved before "
                         "they were recorded); resume it with the strategy that saved it")
    for optimizer, state, saved, names in zip(optimizers, checkpoint["optimizer_states"], saved_names, wanted,
                                              strict=True):
        set_optimizer_state_dict(model, _unwrapped(optimizer), optim_state_dict=state_by_name(state, saved, names),
                                 options=StateDictOptions(full_state_dict=True, strict=not partial))
    return checkpoint


def load_directory_into_stages(path: str, model: nn.Module, optimizers: list[Optimizer], *,
                               weights_only: bool | None, strict: bool) -> dict[str, Any]:
    """A DCP directory into a pipeline stage's model and optimizers, each stage its own
    parameters and optimizer state; returns the checkpoint's other state for Lightning.

    Mirrors the sharded branch of Lightning's loader, which finds "the distributed model" by its
    DTensor parameters and so refuses a pure pipeline stage (plain tensors)."""
    from pathlib import Path

    import torch
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from litscale.lightning_private import CHECKPOINT_METADATA_FILENAME, distributed_checkpoint_load

    model_state = {"state_dict": get_model_state_dict(model)}
    distributed_checkpoint_load(model_state, Path(path))
    model.load_state_dict(model_state["state_dict"], strict=strict)
    for index, optimizer in enumerate(optimizers):
        # NOTE: DCP saves the non-tensor param_groups once, from rank 0, which lists only its
        # stage's parameters: each group's hyperparameters (the learning rate the scheduler
        # had set) are read from it, its parameters are this stage's own.
        key, current = f"optimizer_{index}", get_optimizer_state_dict(model, optimizer)
        hyperparameters = [{k: v for k, v in group.items() if k != "params"} for group in current["param_groups"]]
        loaded = {key: {"state": current["state"], "param_groups": hyperparameters}}
        distributed_checkpoint_load(loaded, Path(path))
        groups = [{**saved, "params": group["params"]}
                  for saved, group in zip(loaded[key]["param_groups"], current["param_groups"], strict=True)]
        set_optimizer_state_dict(model, optimizer, options=StateDictOptions(cpu_offload=True),
                                 optim_state_dict={"state": loaded[key]["state"], "param_groups": groups})
    return torch.load(os.path.join(path, CHECKPOINT_METADATA_FILENAME), weights_only=weights_only)
