"""A run resumes only a checkpoint of the network it configures: checked on the meta network
before any rank starts. Part of ``litscale.app.validation``."""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from litscale.checkpoint.deepspeed import reads_as_saved, saved_layout
from litscale.checkpoint.reading import is_deepspeed_checkpoint
from litscale.checkpoint.resume import network_shapes
from litscale.errors import ConfigError
from litscale.parallel.contract import contract_value


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

    from litscale.app.safety import locate_target
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
