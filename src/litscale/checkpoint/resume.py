"""Finding the checkpoint a run resumes from (``ckpt_path``), and telling complete ones apart.

A checkpoint is a file (single device, DDP) or a directory: a ``torch.distributed.checkpoint``
directory of shards with Lightning's ``meta.pt`` (FSDP, tensor/pipeline parallel), or a
DeepSpeed checkpoint directory (its ``latest`` tag file and per-rank partitions).

``ckpt_path=auto``/``last`` resume from the newest *complete* checkpoint in the ``checkpoints/``
dirs of the runs named ``name``; ``here`` from the run's own ``checkpoints/`` only. litscale's strategies publish every save atomically
(``litscale.checkpoint.atomic``), so a save cut short is never visible; the completeness checks
here are for checkpoints written otherwise (a strategy of the user's own, an older run, a copy):
a truncated file, or a directory half rewritten in place, is skipped for the one before it.
Every ``*.ckpt`` in a ``checkpoints/`` dir counts except ``nonfinite-*.ckpt`` (the NaN guard's,
saved to be inspected, never resumed from).

Nothing here runs what a checkpoint holds: whatever ``ckpt_path`` resolves to (a path, or what
a resume word chose) is read before any rank starts without running code (``read_plain``), and
refused in one line where it does not read so.
"""

from __future__ import annotations

import glob
import os
import re
import zipfile

from litscale.checkpoint.atomic import ASIDE_SUFFIX, followed
from litscale.checkpoint.reading import (
    DCP_METADATA,
    DEEPSPEED_LATEST,
    LIGHTNING_META,
    files_under,
    is_readable_checkpoint,
    read_plain,
)
from litscale.errors import ConfigError
from litscale.user_paths import user_path

# ``here``: ``auto`` within the run's own dir: what a cluster job restarted in the same run dir
# resumes from (Kubernetes, SkyPilot's managed jobs), never another job of the same name.
RESUME_WORDS = ("last", "auto", "here")

SHARDED_CHECKPOINT_MARKERS = ("meta.pt", ".metadata", "latest")
NOT_RESUMABLE_PREFIXES = ("nonfinite-",)


def is_checkpoint(path: str) -> bool:
    """A checkpoint file, or a directory holding a sharded (DCP or DeepSpeed) checkpoint."""
    if os.path.isfile(path):
        return True
    return os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, marker)) for marker in SHARDED_CHECKPOINT_MARKERS)


def is_complete_torch_file(path: str) -> bool:
    """A ``torch.save`` file whose write finished: torch saves a zip archive, and a zip's
    central directory is written last, so a truncated file has none."""
    try:
        with zipfile.ZipFile(path) as archive:
            return bool(archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def _is_complete_dcp_directory(path: str) -> bool:
    """Lightning's sharded layout: shards, then ``.metadata`` (renamed into place), then
    ``meta.pt``. An in-place overwrite that stopped part way leaves shards newer than
    ``.metadata``, or a ``meta.pt`` older than it (or truncated)."""
    metadata, meta = os.path.join(path, DCP_METADATA), os.path.join(path, LIGHTNING_META)
    if not (os.path.isfile(metadata) and is_complete_torch_file(meta)):
        return False
    written = os.path.getmtime(metadata)
    shards = [f for f in files_under(path) if f.endswith(".distcp")]
    return os.path.getmtime(meta) >= written and all(os.path.getmtime(f) <= written for f in shards)


def _is_complete_deepspeed_directory(path: str) -> bool:
    """DeepSpeed's layout: ``<tag>/`` with ``torch.save`` files, then ``latest`` naming the tag,
    written by rank 0 after its own files (the model states). Other ranks' partitions may land
    after ``latest``, so for them only a finished write is checked."""
    latest = os.path.join(path, DEEPSPEED_LATEST)
    try:
        with open(latest) as file:
            tag_dir = os.path.join(path, file.read().strip())
    except OSError:
        return False
    files = [f for f in files_under(tag_dir) if f.endswith(".pt")]
    if not any(f.endswith("_model_states.pt") for f in files):
        return False
    if not all(is_complete_torch_file(f) for f in files):
        return False
    # Rank 0's files: the model states (``mp_rank_00_...``, or ``zero_pp_rank_0_...`` at stage 3)
    # and its optimizer partition (``[bf16_]zero_pp_rank_0_...``).
    by_rank_zero = [f for f in files if re.match(r"(mp_rank_00_|(bf16_)?zero_pp_rank_0_)",
                                                  os.path.basename(f))]
    return all(os.path.getmtime(f) <= os.path.getmtime(latest) for f in by_rank_zero)


def is_complete_checkpoint(path: str) -> bool:
    """True when the save that wrote ``path`` finished (see the module docstring); for a
    pointer (``checkpoint.publish=pointer``), the save it names."""
    path = followed(path)
    if os.path.isfile(path):
        return is_complete_torch_file(path)
    if os.path.isfile(os.path.join(path, DEEPSPEED_LATEST)):
        return _is_complete_deepspeed_directory(path)
    return _is_complete_dcp_directory(path)


def _written_at(path: str) -> float:
    """When a checkpoint was last written; a directory's own mtime does not change when a
    save overwrites the files inside it, so its newest file counts."""
    if os.path.isfile(path):
        return os.path.getmtime(path)
    return max(map(os.path.getmtime, files_under(path)), default=os.path.getmtime(path))


def resumable_checkpoints(search_dir: str) -> list[str]:
    """Every checkpoint in a ``checkpoints/`` dir under ``search_dir`` that a run may resume
    from (complete or not; ``nonfinite-*.ckpt`` excluded)."""
    pattern = os.path.join(glob.escape(search_dir), "**", "checkpoints", "*.ckpt")
    # A directory set aside while a save was swapped in where the system has no atomic
    # exchange (``litscale.checkpoint.atomic``): the old checkpoint, if the swap was cut short.
    aside = os.path.join(glob.escape(search_dir), "**", "checkpoints", f".*.ckpt{ASIDE_SUFFIX}")
    found = glob.glob(pattern, recursive=True) + glob.glob(aside, recursive=True)
    # A pointer (``checkpoint.publish=pointer``) stands for the save it names, which several may name.
    named = dict.fromkeys(followed(path) for path in found
                          if not os.path.basename(path).startswith(NOT_RESUMABLE_PREFIXES))
    return [path for path in named if is_checkpoint(path)]


def newest_last_checkpoint(search_dir: str) -> str | None:
    """The most recently written complete checkpoint of any run under ``search_dir``: its
    ``last.ckpt``, or, when a crash cut that save short, the newest complete one before it.
    On equal write times ``last.ckpt`` wins (ModelCheckpoint writes it after ``step*.ckpt``)."""
    candidates = [path for path in resumable_checkpoints(search_dir) if is_complete_checkpoint(path)]
    if not candidates:
        return None
    return max(candidates, key=lambda path: (
        _written_at(path), os.path.basename(path).startswith("last")))


def skipped_line(ckpt_path: str, search_dir: str, chosen: str | None) -> str | None:
    """The line that says which checkpoints a resume word passed over because their save did not
    finish (newer than the one it chose); None when it passed over none."""
    chosen_at = _written_at(chosen) if chosen else float("-inf")
    skipped = sorted(path for path in resumable_checkpoints(search_dir)
                     if not is_complete_checkpoint(path) and _written_at(path) >= chosen_at)
    if not skipped:
        return None
    then = f"resuming from {chosen}" if chosen else "starting afresh"
    return (f"litscale: ckpt_path={ckpt_path} skipped {', '.join(skipped)}: incomplete (a save cut short, or "
            f"a copy truncated); {then}")


def resolve_ckpt_path(ckpt_path: str | None, *, search_dir: str) -> str | None:
    """``null`` -> None; a path -> itself (it must exist); ``last`` -> the newest complete
    checkpoint under ``search_dir`` (one must exist); ``auto`` and ``here`` -> the same, or None to start
    fresh (the caller gives ``here`` the run's own dir, the others the run name's). Whatever it
    resolves to must read without running code (``is_readable_checkpoint``)."""
    if ckpt_path is None:
        return None
    if ckpt_path in RESUME_WORDS:
        found = newest_last_checkpoint(search_dir)
        if found is None and ckpt_path == "last":
            raise ConfigError(
                f"ckpt_path=last but no complete checkpoints/*.ckpt exists under {search_dir}; "
                "train once first, or use ckpt_path=auto to start fresh when there is none"
            )
        if found is not None:
            _check_readable(found, shown=f"{ckpt_path} ({found})")
        return found
    path = followed(user_path(ckpt_path))  # a pointer file (checkpoint.publish=pointer): the save it names
    if os.path.isdir(path) and not is_checkpoint(path):
        raise ConfigError(
            f"ckpt_path={ckpt_path!r} is a directory but not a sharded checkpoint (it has none of "
            f"{', '.join(SHARDED_CHECKPOINT_MARKERS)}); give a checkpoint path, last, auto, here or null"
        )
    if not is_checkpoint(path):
        raise ConfigError(
            f"ckpt_path={ckpt_path!r} is not a file; give a checkpoint path, last, auto, here or null"
        )
    _check_readable(path, shown=repr(ckpt_path))
    return path


def _check_readable(path: str, *, shown: str) -> None:
    try:
        readable = is_readable_checkpoint(path)
    except ImportError:  # a DeepSpeed checkpoint's classes, without DeepSpeed
        raise ConfigError(
            f"ckpt_path={shown} is a DeepSpeed checkpoint, read only with the deepspeed package, which is not "
            "installed; install it with: pip install 'litscale[extras]'") from None
    if not readable:
        raise ConfigError(
            f"ckpt_path={shown} is not a readable checkpoint (truncated, corrupt, not a Lightning checkpoint, or "
            "holding more than tensors and plain data, which litscale never unpickles); give a checkpoint path, "
            "last, auto, here or null"
        )


def network_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """The shape of each network tensor (``net.*`` in its ``state_dict``) of a checkpoint file,
    read without reading the tensors (memory-mapped); empty for a sharded directory, whose
    shards the strategy that wrote them reads."""
    if not os.path.isfile(path):
        return {}
    checkpoint = read_plain(path)
    return {name: tuple(tensor.shape) for name, tensor in checkpoint["state_dict"].items()
            if name.startswith("net.") and hasattr(tensor, "shape")}
