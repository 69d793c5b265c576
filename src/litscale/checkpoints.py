"""Finding the checkpoint a run resumes from (``ckpt_path``).

A checkpoint is a file (single device, DDP) or a directory: a ``torch.distributed.checkpoint``
directory of shards with Lightning's ``meta.pt`` (FSDP), or a DeepSpeed checkpoint directory
(its ``latest`` tag file and per-rank partitions).
"""

from __future__ import annotations

import glob
import os

from litscale.errors import ConfigError

RESUME_WORDS = ("last", "auto")


SHARDED_CHECKPOINT_MARKERS = ("meta.pt", ".metadata", "latest")


def is_checkpoint(path: str) -> bool:
    """A checkpoint file, or a directory holding a sharded (DCP or DeepSpeed) checkpoint."""
    if os.path.isfile(path):
        return True
    return os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, marker)) for marker in SHARDED_CHECKPOINT_MARKERS)


def _written_at(path: str) -> float:
    """When a checkpoint was last written; a directory's own mtime does not change when a
    save overwrites the files inside it, so its newest file counts."""
    if os.path.isfile(path):
        return os.path.getmtime(path)
    times = [os.path.getmtime(os.path.join(root, name))
             for root, _, names in os.walk(path) for name in names]
    return max(times, default=os.path.getmtime(path))


def newest_last_checkpoint(search_dir: str) -> str | None:
    """The most recently written ``checkpoints/last.ckpt`` (file or sharded directory) of any
    run under ``search_dir``."""
    pattern = os.path.join(glob.escape(search_dir), "**", "checkpoints", "last.ckpt")
    candidates = [path for path in glob.glob(pattern, recursive=True) if is_checkpoint(path)]
    return max(candidates, key=_written_at) if candidates else None


def resolve_ckpt_path(ckpt_path: str | None, *, search_dir: str) -> str | None:
    """``null`` -> None; a path -> itself (it must exist); ``last`` -> the newest last.ckpt of
    this run name (it must exist); ``auto`` -> the same, or None to start fresh."""
    if ckpt_path is None:
        return None
    if ckpt_path in RESUME_WORDS:
        found = newest_last_checkpoint(search_dir)
        if found is None and ckpt_path == "last":
            raise ConfigError(
                f"ckpt_path=last but no checkpoints/last.ckpt exists under {search_dir}; "
                "train once first, or use ckpt_path=auto to start fresh when there is none"
            )
        return found
    path = os.path.expanduser(ckpt_path)
    if os.path.isdir(path) and not is_checkpoint(path):
        raise ConfigError(
            f"ckpt_path={ckpt_path!r} is a directory but not a sharded checkpoint (it has none of "
            f"{', '.join(SHARDED_CHECKPOINT_MARKERS)}); give a checkpoint path, last, auto or null"
        )
    if not is_checkpoint(path):
        raise ConfigError(
            f"ckpt_path={ckpt_path!r} is not a file; give a checkpoint path, last, auto or null"
        )
    return os.path.expanduser(ckpt_path)
