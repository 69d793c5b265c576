"""What a run resumes, checked before any rank starts (``validation`` calls each): the checkpoint
``ckpt_path`` names holds the network the run configures, moves to the run's layout, and its
sample position shares out over the run's data-parallel ranks. Read with the checkpoint
package's readers (``litscale.checkpoint.reading``, ``.resume``, ``.moves``, ``.deepspeed``),
without running code; every refusal one ``ConfigError`` line.

The position is the data module's state in the checkpoint (the data epoch and the samples all
ranks had drawn of it); a run shares it out over its own data-parallel ranks, which works only
at a position they draw together (``litscale.data.resume.shared_position``). A run on a count
that cannot share it out is refused here, in one line. An elastic job (``elastic=true``, which
the Ray and Kubernetes launchers set where the rank count changes on its own) is not: its
ranks skip ahead to the next position they can share out, and say how many samples that
skipped (``litscale.data.base.ShardedDataModule``).
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from litscale.app.checks.safety import locate_target
from litscale.checkpoint.deepspeed import reads_as_saved, saved_layout
from litscale.checkpoint.reading import LIGHTNING_META, is_deepspeed_checkpoint, read_plain
from litscale.checkpoint.resume import network_shapes
from litscale.data.resume import shared_position, unshared_position
from litscale.errors import ConfigError
from litscale.parallel.contract import contract_value
from litscale.parallel.layout import RunLayout

# The data module's state keys that place a resume (``ShardedDataModule.state_dict``).
POSITION_KEYS = ("epoch", "samples_drawn", "dataset_samples")


def check_checkpoint_network(cfg: DictConfig, ckpt_path: str | None, net: Any,
                             choices: dict[str, str]) -> None:
    """A run resumes only a checkpoint of the network it configures: the same tensors, of the
    same shapes (what loading it demands). NOTE: checked here, on the meta network, because a
    mismatch otherwise shows only once every rank has started, as the first line of PyTorch's
    list of missing and unexpected keys."""
    saved = network_shapes(ckpt_path) if ckpt_path else {}
    if not saved:
        return  # no checkpoint, or a sharded one (its strategy checks it as it loads)
    wanted = {f"net.{name}": tuple(tensor.shape) for name, tensor in net.state_dict().items()
              if hasattr(tensor, "shape")}
    if saved == wanted:
        return
    missing, extra = sorted(wanted.keys() - saved.keys()), sorted(saved.keys() - wanted.keys())
    if extra or missing:
        difference = f"{extra[0]} is not in the run's network" if extra else f"it lacks {missing[0]}"
    else:
        name = next(n for n in sorted(saved) if saved[n] != wanted[n])
        difference = f"{name} is {list(saved[name])} there, {list(wanted[name])} here"
    shown = repr(ckpt_path) if cfg.ckpt_path == ckpt_path else f"{cfg.ckpt_path} ({ckpt_path})"
    ours = _model_named(choices.get("model"), OmegaConf.select(cfg, "model.net.preset", default=None))
    raise ConfigError(
        f"ckpt_path={shown}: the checkpoint holds {_checkpoint_model(ckpt_path)}, the run configures "
        f"{ours}: {difference}; resume with the model it was trained with, or start fresh with "
        "ckpt_path=null")


def _checkpoint_model(path: str) -> str:
    """The model a checkpoint's run configured, from the ``.hydra/`` beside its ``checkpoints/``."""
    hydra_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))), ".hydra")
    try:
        choice = OmegaConf.select(OmegaConf.load(os.path.join(hydra_dir, "hydra.yaml")),
                                  "hydra.runtime.choices.model", default=None)
        preset = OmegaConf.select(OmegaConf.load(os.path.join(hydra_dir, "config.yaml")),
                                  "model.net.preset", default=None, throw_on_resolution_failure=False)
    except Exception:  # noqa: BLE001 - no run dir around it (a copied file), or not Hydra's
        return "another network"
    return _model_named(choice, preset)


def _model_named(choice: str | None, preset: Any) -> str:
    return (f"model={choice}" if choice else "a network") + (
        f" (preset {preset})" if isinstance(preset, str) else "")


def check_checkpoint_moves(cfg: DictConfig, ckpt_path: str | None, strategy: Any, world_size: int,
                           choices: dict[str, str]) -> None:
    """A checkpoint resumes on a layout that can read it: files and sharded directories move
    between every strategy (``litscale.checkpoint.moves``); a DeepSpeed checkpoint of Adam or
    AdamW moves to any of them, read whole (``litscale.checkpoint.deepspeed``), as it does into
    DeepSpeed at another world size or between ZeRO-3 and ZeRO-1/2; into DeepSpeed they move
    only from Adam or AdamW into Adam or AdamW (``into_zero_refusal``)."""
    if not ckpt_path:
        return
    saved_by_deepspeed = is_deepspeed_checkpoint(ckpt_path)
    to_deepspeed = not contract_value(strategy, "shares_checkpoint_formats")
    shown = repr(ckpt_path) if cfg.ckpt_path == ckpt_path else f"{cfg.ckpt_path} ({ckpt_path})"
    ours = f"strategy={choices.get('strategy', type(strategy).__name__)}"
    # DeepSpeed's own loader takes it (as many ranks, the same partition format); else it moves
    native = saved_by_deepspeed and to_deepspeed and reads_as_saved(ckpt_path, strategy.stage, world_size)
    if saved_by_deepspeed and not native:
        from litscale.checkpoint.deepspeed import why_not_movable

        reason = why_not_movable(ckpt_path)
        if reason is not None:
            stage, ranks = saved_layout(ckpt_path)
            stages = "strategy.stage=3" if stage == 3 else "strategy.stage=1 or 2"
            raise ConfigError(
                f"ckpt_path={shown}: this DeepSpeed checkpoint (ZeRO-{stage} on {_ranks(ranks)}) is read only by "
                f"DeepSpeed's own loader, not by {ours} on {_ranks(world_size)}: {reason}; allowed: "
                f"strategy=deepspeed_zero {stages} on {_ranks(ranks)} (trainer.devices x trainer.num_nodes), or start "
                "from its weights (DeepSpeed's zero_to_fp32.py) with ckpt_path=null")
    if to_deepspeed and not native:
        kind = ("a DeepSpeed checkpoint of another layout" if saved_by_deepspeed else
                "a sharded directory" if os.path.isdir(ckpt_path) else "a file")
        reason = into_zero_refusal(cfg, ckpt_path)
        if reason is not None:
            raise ConfigError(
                f"ckpt_path={shown}: {ours} resumes {kind} of another strategy only with Adam or AdamW, not "
                f"{reason}; allowed: resume it with any other strategy, or start fresh with ckpt_path=null")


def _ranks(count: int) -> str:
    return f"{count} rank" + ("s" if count != 1 else "")


def into_zero_refusal(cfg: DictConfig, ckpt_path: str) -> str | None:
    """What keeps the checkpoint at ``ckpt_path`` (not DeepSpeed's own loader's) out of this
    DeepSpeed run; None: nothing. The move writes Adam's state (``MOVABLE_STATE``: the step and
    both moments) into ZeRO's partitions (``deepspeed_moves.load_into_zero``): the run's
    optimizer must keep just that (torch's Adam or AdamW, without amsgrad), and the checkpoint's
    must hold just that (read without running code)."""
    import torch

    from litscale.checkpoint.deepspeed import not_adams_state
    from litscale.checkpoint.moves import saved_state_kinds

    optimizer = locate_target(cfg.optimizer._target_, "optimizer")
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Adam)):
        return f"optimizer={cfg.optimizer._target_.rsplit('.', 1)[-1]}"
    if OmegaConf.select(cfg, "optimizer.amsgrad", default=False):
        return "optimizer.amsgrad=true (its max_exp_avg_sq)"
    if is_deepspeed_checkpoint(ckpt_path):
        return None  # its state is Adam's: ``why_not_movable`` refused it otherwise
    keeps = not_adams_state(saved_state_kinds(ckpt_path))
    return None if keeps is None else f"a checkpoint whose optimizer {keeps}"


def check_resume_position(cfg: DictConfig, layout: RunLayout) -> None:
    """Refuse a resume whose saved position this run's data-parallel ranks cannot share out,
    unless the job is elastic (its ranks then skip ahead)."""
    if not layout.ckpt_path or cfg.get("elastic"):
        return
    data_class = locate_target(cfg.data._target_, "data")
    saved = saved_data_state(layout.ckpt_path, getattr(data_class, "__qualname__", ""))
    # A data module whose saved state says more (a mixture's sources and weights) says what a
    # resume cannot continue.
    mismatch = getattr(data_class, "saved_state_mismatch", None)
    if saved is not None and mismatch is not None:
        message = mismatch(saved, OmegaConf.to_container(cfg.data, resolve=True))
        if message:
            raise ConfigError(message)
    if saved is None or not all(isinstance(saved.get(key), int) for key in POSITION_KEYS):
        return  # no position saved (another data module), or a format not read before launch
    ranks = layout.batch_ranks
    # determinism=layout_invariant: each rank takes one block of micro batch x accumulation samples
    block = layout.micro_batch * layout.accumulation if "_target_" in (cfg.get("determinism") or {}) else None
    epoch, samples = saved["epoch"], saved["samples_drawn"]
    point = shared_position(epoch, samples, dataset_samples=saved["dataset_samples"], ranks=ranks, block=block)
    if not point.skipped:
        return
    raise ConfigError(
        f"{_rank_count_keys(cfg, layout)}: {unshared_position(epoch, samples, ranks=ranks, block=block)}; "
        f"allowed: {_counts_that_share(samples, ranks, block)}, elastic=true to skip ahead to sample "
        f"{samples + point.skipped} ({point.skipped} sample{'s' if point.skipped != 1 else ''} not trained in "
        "that epoch), or start fresh with ckpt_path=null")


def saved_data_state(path: str, name: str) -> dict[str, Any] | None:
    """The state of the data module class ``name`` (Lightning keeps it under the class's name)
    in the checkpoint at ``path``: a file, a sharded directory's ``meta.pt``, or a DeepSpeed
    directory's model states (its client state). Read without running code and memory-mapped
    (no tensor is read); None where there is none, or it cannot be read so."""
    try:
        if is_deepspeed_checkpoint(path):
            from litscale.checkpoint.reading import deepspeed_files, read_deepspeed_file

            checkpoint = read_deepspeed_file(deepspeed_files(path)[0])
        else:
            checkpoint = read_plain(os.path.join(path, LIGHTNING_META) if os.path.isdir(path) else path)
    except Exception:  # noqa: BLE001 - unpickling errors have many types; the ranks' own load reports them
        return None
    state = checkpoint.get(name) if isinstance(checkpoint, dict) else None
    return state if isinstance(state, dict) else None


def _rank_count_keys(cfg: DictConfig, layout: RunLayout) -> str:
    """The keys that set the data-parallel count, as the user typed them."""
    keys = [f"trainer.devices={cfg.trainer.get('devices')}"]
    if layout.num_nodes > 1:
        keys.append(f"trainer.num_nodes={layout.num_nodes}")
    if layout.replica_groups > 1:
        keys.append(f"fault_tolerance.groups={layout.replica_groups}")
    return " x ".join(keys)


def _counts_that_share(samples: int, ranks: int, block: int | None) -> str:
    """The data-parallel counts (near this one) that share ``samples`` out."""
    unit, bound = block or 1, max(2 * ranks, 8)
    counts = [str(count) for count in range(1, bound + 1) if samples % (unit * count) == 0]
    if samples % unit == 0 and samples // unit > bound:
        counts.append("...")
    shown = ", ".join(counts) or "none at this micro batch and accumulation"
    if block:
        return f"a data-parallel count whose global batch ({block} x the count) divides {samples} ({shown})"
    return f"a data-parallel count that divides {samples} ({shown})"
