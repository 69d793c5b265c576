"""A resume continues its checkpoint's sample position on the run's data-parallel ranks: checked
before any rank starts. Part of ``litscale.app.validation``.

The position is the data module's state in the checkpoint (the data epoch and the samples all
ranks had drawn of it); a run shares it out over its own data-parallel ranks, which works only
at a position they draw together (``litscale.data.resume.shared_position``). A run on a count
that cannot share it out is refused here, in one line. An elastic job (``elastic=true``, which
the Ray and Kubernetes launchers set where the rank count changes on its own) is not: its
ranks skip ahead to the next position they can share out, and say how many samples that
skipped (``litscale.data.base.ShardedDataModule``). A data module whose saved state says more
(a mixture's sources and weights) says here what a resume cannot continue
(``saved_state_mismatch``).
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from litscale.app.safety import locate_target
from litscale.checkpoint.reading import LIGHTNING_META, is_deepspeed_checkpoint, read_plain
from litscale.data.resume import shared_position, unshared_position
from litscale.errors import ConfigError
from litscale.parallel.layout import RunLayout

# The data module's state keys that place a resume (``ShardedDataModule.state_dict``).
POSITION_KEYS = ("epoch", "samples_drawn", "dataset_samples")


def check_resume_position(cfg: DictConfig, layout: RunLayout) -> None:
    """Refuse a resume whose saved position this run's data-parallel ranks cannot share out,
    unless the job is elastic (its ranks then skip ahead)."""
    if not layout.ckpt_path or cfg.get("elastic"):
        return
    data_class = locate_target(cfg.data._target_, "data")
    saved = saved_data_state(layout.ckpt_path, getattr(data_class, "__qualname__", ""))
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
