"""A DeepSpeed ZeRO checkpoint (stages 1-3) read whole, as the checkpoint a litscale file strategy saves
(``litscale.checkpoint.moves`` then carries it onto any layout): the fp32 master weights, the
optimizer's moments and step by parameter, and Lightning's own state (loops, schedulers,
callbacks, the data position), which DeepSpeed keeps as its "client state".

Read by hand, as no library does it in memory: DeepSpeed's ``zero_to_fp32`` recovers the
weights only, and its universal checkpoint writes a second copy of everything to disk. Each
rank's optimizer file holds its flat partition of every parameter group (weights and each
moment alike) and, per parameter, where its fragment lies in that partition
(``param_slice_mappings``); a parameter split over two partitions is its fragments in rank
order. ZeRO-3 cuts each parameter into a padded piece per rank (``_Partitions``).

The other way, another strategy's checkpoint goes into a built ZeRO engine through
DeepSpeed's own fragment setters (``load_into_zero``); so does a DeepSpeed checkpoint that
DeepSpeed's own loader cannot read (another world size, or ZeRO-3 against ZeRO-1/2:
``reads_as_saved``), read whole first.

Every file is read without running code (``weights_only``), with the few DeepSpeed classes its
files hold allowed for those reads only (``deepspeed_classes``); before any rank starts, every
file of the checkpoint is checked so (``is_readable_deepspeed_checkpoint``), since DeepSpeed's
own loader unpickles them whole.
"""

from __future__ import annotations

from typing import Any

import torch

from litscale.checkpoint.moves import OPTIMIZER_PARAM_NAMES
from litscale.checkpoint.reading import (
    deepspeed_files,
    is_deepspeed_checkpoint,
    read_deepspeed_file,
)

# The per-parameter state of the optimizers whose moments move (torch's Adam and AdamW).
MOVABLE_STATE = {"step", "exp_avg", "exp_avg_sq"}


def saved_layout(path: str) -> tuple[int, int]:
    """(ZeRO stage, data-parallel ranks) the DeepSpeed checkpoint at ``path`` was saved with."""
    model_file, ranks = deepspeed_files(path)
    saved = read_deepspeed_file(model_file)
    return int(saved["ds_config"]["zero_optimization"]["stage"]), int(saved.get("dp_world_size") or len(ranks))


def reads_as_saved(path: str, stage: int, world_size: int) -> bool:
    """DeepSpeed's own loader reads the checkpoint at ``path`` into a ZeRO-``stage`` engine of
    ``world_size`` ranks: the same ranks, and the same partition format (ZeRO-1 and 2 share
    theirs, DeepSpeed's ``stage_1_and_2``; ZeRO-3 keeps its own). Any other engine gets the
    checkpoint read whole and written in through the setters (``load_into_zero``): DeepSpeed's
    own loader asserts on a stage it did not save, and reads partitions by rank."""
    saved_stage, saved_ranks = saved_layout(path)
    return saved_ranks == world_size and (saved_stage == 3) == (stage == 3)


class _Partitions:
    """Where each rank's flat partitions hold a parameter, and those partitions (of the fp32
    weights, of each moment) in one rank's optimizer file.

    ZeRO-1/2 flatten each group and cut it into one piece per rank; each parameter's fragments
    are recorded (``param_slice_mappings``). ZeRO-3 cuts each parameter into one padded piece per
    rank, each rank's pieces one after the other through all its (sub-)group partitions, which
    are read as one (as DeepSpeed's ``zero_to_fp32`` reads them back)."""

    def __init__(self, ranks: list[dict[str, Any]], shapes: list[dict[str, Any]]) -> None:
        self.ranks, self.stage3 = ranks, "param_slice_mappings" not in ranks[0]
        self.optimizer = ranks[0]["optimizer_state_dict" if self.stage3 else "base_optimizer_state"]
        self.pieces: dict[str, list[tuple[int, int, int, int]]] = {}  # name -> (rank, group, start, count)
        self._joined: dict[tuple[int, str], torch.Tensor] = {}
        offset = 0
        for group, group_shapes in enumerate(shapes):
            for name, shape in group_shapes.items():
                if self.stage3:  # group 0 stands for the partitions read as one
                    share = -(-torch.Size(shape).numel() // len(ranks))
                    self.pieces[name] = [(rank, 0, offset, share) for rank in range(len(ranks))]
                    offset += share
                else:
                    self.pieces[name] = [(rank, group, fragment.start, fragment.numel) for rank, saved in enumerate(ranks)
                                         if (fragment := saved["param_slice_mappings"][group].get(name)) is not None]

    def _flat(self, rank: int, group: int, kind: str) -> torch.Tensor:
        """One of a rank's partitions: of the fp32 weights (``kind`` "weights") or of a moment."""
        saved = self.ranks[rank]
        if not self.stage3:
            return (saved["single_partition_of_fp32_groups"][group] if kind == "weights"
                    else saved["base_optimizer_state"]["state"][group][kind])
        if (rank, kind) not in self._joined:  # once per rank and kind: the partitions read as one
            states = saved["optimizer_state_dict"]["state"]
            self._joined[rank, kind] = torch.cat(list(saved["fp32_flat_groups"]) if kind == "weights" else
                                                 [states[index][kind] for index in sorted(states)])
        return self._joined[rank, kind]

    def whole(self, name: str, shape: Any, kind: str) -> torch.Tensor:
        parts = [self._flat(rank, group, kind)[start:start + count] for rank, group, start, count in self.pieces[name]]
        return torch.cat(parts)[:torch.Size(shape).numel()].view(shape)

    def step(self) -> torch.Tensor:
        return next(iter(self.optimizer["state"].values()))["step"].clone()


def saved_state_kinds(path: str) -> set[str] | None:
    """The kinds of per-parameter state (``exp_avg``, ``momentum_buffer``, ...) the optimizer of
    the DeepSpeed checkpoint at ``path`` keeps (rank 0's partition, memory-mapped: no tensor is
    read); None: it holds no ZeRO optimizer partitions."""
    _, ranks = deepspeed_files(path)
    if not ranks:
        return None
    saved = read_deepspeed_file(ranks[0])["optimizer_state_dict"]
    optimizer = saved.get("base_optimizer_state") or saved.get("optimizer_state_dict") or {}
    return {key for state in optimizer.get("state", {}).values() for key in state}


def why_not_movable(path: str) -> str | None:
    """Why the DeepSpeed checkpoint at ``path`` cannot move to another strategy; None: it can."""
    kinds = saved_state_kinds(path)
    if kinds is None:
        return "it holds no ZeRO optimizer partitions"
    keeps = not_adams_state(kinds)
    return None if keeps is None else f"its optimizer {keeps}, which litscale moves only for Adam and AdamW"


def not_adams_state(kinds: set[str]) -> str | None:
    """How an optimizer's kinds of per-parameter state differ from Adam's (``MOVABLE_STATE``,
    all that a move reads and writes), as "keeps ..." or "keeps no ..."; None: they are Adam's."""
    if kinds - MOVABLE_STATE:
        return f"keeps {', '.join(sorted(kinds - MOVABLE_STATE))}"
    if MOVABLE_STATE - kinds:  # none at all: SGD without momentum, or saved before a step
        return f"keeps no {', '.join(sorted(MOVABLE_STATE - kinds))}"
    return None


def deepspeed_as_file_checkpoint(path: str) -> dict[str, Any]:
    """The DeepSpeed ZeRO checkpoint at ``path`` as a file strategy's checkpoint: the client
    state, ``state_dict`` (fp32 master weights, and the module's buffers), one
    ``optimizer_states`` entry keyed by position in the saved groups, and the groups' parameter
    names (``OPTIMIZER_PARAM_NAMES``)."""
    model_file, rank_files = deepspeed_files(path)
    model = read_deepspeed_file(model_file, mmap=False)
    partitions = _Partitions([read_deepspeed_file(name, mmap=False)["optimizer_state_dict"] for name in rank_files],
                             model["param_shapes"])
    names = [list(group) for group in model["param_shapes"]]
    weights, state = {}, {}
    for group_shapes in model["param_shapes"]:
        for name, shape in group_shapes.items():
            weights[name] = partitions.whole(name, shape, "weights")
            state[len(state)] = {"exp_avg": partitions.whole(name, shape, "exp_avg"),
                                 "exp_avg_sq": partitions.whole(name, shape, "exp_avg_sq"), "step": partitions.step()}
    groups, start = [], 0
    for group, group_names in zip(partitions.optimizer["param_groups"], names, strict=True):
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(range(start, start + len(group_names)))})
        start += len(group_names)
    buffers = {name: value for name, value in model["module"].items() if name not in weights}
    client = {k: v for k, v in model.items() if k not in DEEPSPEED_OWN}
    return {**client, "state_dict": {**buffers, **weights}, "optimizer_states": [{"state": state, "param_groups": groups}],
            OPTIMIZER_PARAM_NAMES: [names]}


# What DeepSpeed adds to the model states file beside Lightning's checkpoint (its client state).
DEEPSPEED_OWN = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                 "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps",
                 "global_steps", "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions",
                 "ds_config", "ds_version"}


def moved_into_zero(path: str, strategy: Any) -> dict[str, Any] | None:
    """A checkpoint that DeepSpeed's own loader cannot read, read whole and written into the
    built ZeRO engine of ``strategy`` (``load_into_zero``): another strategy's file or sharded
    directory, a DeepSpeed checkpoint of another world size, or of ZeRO-3 against 1/2. None
    where DeepSpeed's own loader reads it (``reads_as_saved``)."""
    from litscale.checkpoint.moves import read_as_file

    if not is_deepspeed_checkpoint(path):
        return load_into_zero(read_as_file(path), strategy.lightning_module, strategy.deepspeed_engine)
    if reads_as_saved(path, strategy.stage, strategy.world_size):
        return None
    return load_into_zero(deepspeed_as_file_checkpoint(path), strategy.lightning_module, strategy.deepspeed_engine)


def load_into_zero(checkpoint: dict[str, Any], module: torch.nn.Module, engine: Any) -> dict[str, Any]:
    """Load a file strategy's checkpoint (as read: ``checkpoint_moves.read_as_file``) into a
    built ZeRO engine through DeepSpeed's own fragment setters: each rank writes its part of
    every parameter's fp32 master copy and moments; the module's weights follow (whole on every
    rank at ZeRO-1/2, the rank's partitions at ZeRO-3, copied from the master as its step
    does); returns the rest for Lightning to restore."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    from litscale.checkpoint.moves import named_optimizer_state

    weights, (state,) = checkpoint.pop("state_dict"), named_optimizer_state(checkpoint)
    steps = {float(saved["step"]) for saved in state.values()}
    if len(steps) != 1:
        raise ValueError(f"ckpt_path: the checkpoint's parameters were stepped {sorted(steps)} times; DeepSpeed "
                         "keeps one count per group")
    # NOTE: torch's Adam makes its state at its first step, and ZeRO-1/2 link each parameter's
    # fragment of it after that step: before one there is none to set. The state is made here
    # (the count, and moments the setters then fill) and linked as DeepSpeed links it then.
    zero, (step,) = engine.optimizer, steps
    stage3 = hasattr(zero, "fp32_partitioned_groups_flat")
    # ZeRO-3 hands its optimizer each sub-group's partition only for the step: the state is keyed
    # by the partitions themselves.
    flats = zero.fp32_partitioned_groups_flat if stage3 else [p for g in zero.optimizer.param_groups for p in g["params"]]
    for flat in flats:
        zero.optimizer.state[flat] = {"step": torch.tensor(step), "exp_avg": torch.zeros_like(flat),
                                      "exp_avg_sq": torch.zeros_like(flat)}
    if not stage3:
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()
    # Each group's hyperparameters as saved (the learning rate the schedule had reached).
    for group, saved in zip(zero.optimizer.param_groups, checkpoint["optimizer_states"][0]["param_groups"], strict=True):
        group.update({key: value for key, value in saved.items() if key != "params"})
    with torch.no_grad():
        for name, param in module.named_parameters():
            if not stage3:
                param.copy_(weights[name])
            safe_set_full_fp32_param(param, weights[name].float())
            for key in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(param, state[name][key].float(), key)
        if stage3:  # each rank's partitions of the module's weights, from the master copy
            for low, master in zip(zero.fp16_partitioned_groups_flat, zero.fp32_partitioned_groups_flat, strict=True):
                low.copy_(master)
    return checkpoint
