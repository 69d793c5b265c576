"""Finding the checkpoint a run resumes from (``ckpt_path``)."""

from __future__ import annotations

import glob
import os

from litscale.errors import ConfigError

RESUME_WORDS = ("last", "auto")


def newest_last_checkpoint(search_dir: str) -> str | None:
    """The most recently written ``checkpoints/last.ckpt`` of any run under ``search_dir``."""
    pattern = os.path.join(glob.escape(search_dir), "**", "checkpoints", "last.ckpt")
    candidates = glob.glob(pattern, recursive=True)
    return max(candidates, key=os.path.getmtime) if candidates else None


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
    if not os.path.isfile(os.path.expanduser(ckpt_path)):
        raise ConfigError(
            f"ckpt_path={ckpt_path!r} is not a file; give a checkpoint path, last, auto or null"
        )
    return os.path.expanduser(ckpt_path)
