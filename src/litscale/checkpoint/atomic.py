"""A checkpoint is complete or invisible: every save is written beside the old one and made
visible by one atomic rename.

Lightning's strategies write ``last.ckpt`` in place: a file opened for writing over the old
one, a ``torch.distributed.checkpoint`` or DeepSpeed directory whose shards are rewritten one
by one. A save cut short (a killed rank, a preemption that outran its grace period) then
leaves neither the old checkpoint nor the new one. Here each save goes to a hidden staging
path in the same directory (``.<name>.saving``, which no resume looks at); once every rank has
written its part, rank 0 flushes its files to disk (``fsync``: a rename that outlives a power
cut must not name bytes that did not) and swaps it in:

- a file replaces the old file with ``os.replace``, atomic on POSIX;
- a directory is exchanged with the old one by Linux's ``renameat2(RENAME_EXCHANGE)``, one
  atomic step, and the old one (now at the staging path) is deleted. ``os.replace`` cannot
  replace a non-empty directory, and no library does this: written here. Where the call is
  missing (not Linux), the old directory is first renamed aside (``.<name>.old``): a crash
  between the two renames leaves the old checkpoint there and no ``<name>``, and the resume
  search (``litscale.checkpoint.resume``) looks at it.

On an object-store mount (gcsfuse, s3fs, goofys, rclone, mountpoint-s3, blobfuse: SkyPilot's
MOUNT-mode buckets) a directory's rename is a copy of its files one by one and then a delete,
or fails: a preemption part way leaves a half-copied ``last.ckpt/``. There a sharded save is
published by a pointer instead (``checkpoint.publish=pointer``): it is written under a new
hidden name (``.<name>.<id>.saved``) and stays there, and ``<name>`` becomes a small file that
names it, replaced by ``os.replace`` (one small object on those mounts, created whole or not
at all). Once a pointer moves, the saves no pointer names are deleted. A file checkpoint is
published by ``os.replace`` in both modes: on those mounts one object, copied whole. ``auto``
(the default) points where the checkpoint's directory is on a FUSE mount (``/proc/mounts``):
whatever its daemon does for a rename, a pointer is atomic on any file system.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import secrets
import shutil

STAGING_SUFFIX = ".saving"
ASIDE_SUFFIX = ".old"
SAVED_SUFFIX = ".saved"  # a save published by a pointer, under its own name for good
PUBLISH_MODES = ("auto", "rename", "pointer")
# The first line of a pointer file; the second is the name of the save it points to.
POINTER_HEADER = "litscale checkpoint pointer: this checkpoint is the directory named on the next line"
_POINTER_MAX_BYTES = 4096
MOUNTS = "/proc/mounts"  # where the kernel lists the mounts, with their file-system types
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def staging_path(path: str) -> str:
    """Where a save of ``path`` is written before it is published."""
    head, name = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{name}{STAGING_SUFFIX}")


def aside_path(path: str) -> str:
    """Where the old checkpoint waits while a directory is swapped without ``renameat2``."""
    head, name = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{name}{ASIDE_SUFFIX}")


def remove(path: str) -> None:
    """Delete a file or directory tree if it exists."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _exchange(first: str, second: str) -> bool:
    """Swap two existing paths in one atomic step; False where the system cannot."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    renameat2 = getattr(ctypes.CDLL(libc_name, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # the file system cannot exchange
        return False
    raise OSError(error, os.strerror(error), first)


def saving_path(path: str, *, by_pointer: bool) -> str:
    """Where a save of ``path`` is written: the staging path, or with ``by_pointer`` a new name
    of its own, which a sharded save keeps once published (``path`` points to it)."""
    if not by_pointer:
        return staging_path(path)
    head, name = os.path.split(os.path.abspath(path))
    return os.path.join(head, f".{name}.{secrets.token_hex(6)}{SAVED_SUFFIX}")


def publish(staging: str, path: str, *, by_pointer: bool = False) -> None:
    """Make the save written at ``staging`` visible as ``path`` in one atomic step, once its
    bytes are on disk; with ``by_pointer`` a directory by pointing ``path`` to it, and the saves
    no pointer names are then deleted."""
    sync_files(staging)
    if by_pointer:
        if os.path.isdir(staging):
            _point(path, staging)
        else:
            _rename(staging, path)
        _remove_unnamed_saves(os.path.dirname(os.path.abspath(path)))
        return
    _rename(staging, path)


def _rename(staging: str, path: str) -> None:
    if not os.path.lexists(path):
        os.rename(staging, path)
    elif os.path.isfile(staging) and os.path.isfile(path):
        os.replace(staging, path)
    elif _exchange(staging, path):
        remove(staging)  # now the old checkpoint
    else:
        aside = aside_path(path)
        remove(aside)
        os.rename(path, aside)
        os.rename(staging, path)
        remove(aside)
    _sync_directory(os.path.dirname(os.path.abspath(path)))


def sync_files(path: str) -> None:
    """Flush the file at ``path``, or every file and folder under it, to disk: a rename that
    survives a loss of power must not name bytes still in memory (``torch.save`` and DeepSpeed
    do not sync what they write; DCP syncs its shards, so theirs costs nothing here). On a
    file system shared by several hosts, what another host wrote is flushed by that host (DCP's
    sync, a network file system's close)."""
    if not os.path.isdir(path):
        _sync(path)
        return
    for root, _, names in os.walk(path):
        for name in names:
            _sync(os.path.join(root, name))
        _sync_directory(root)


def _sync(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    except OSError as error:
        if error.errno != errno.EINVAL:  # EINVAL: a file system that cannot sync; a failed write raises
            raise
    finally:
        os.close(descriptor)


def _sync_directory(directory: str) -> None:
    """Flush the rename itself to disk, so a machine that loses power keeps it."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass  # some file systems do not sync a directory; the rename is still atomic
    finally:
        os.close(descriptor)


def _point(path: str, save: str) -> None:
    """Point ``path`` to the directory ``save`` (a sibling): the pointer is written beside it
    and replaces ``path`` by one rename of a small file."""
    if os.path.isdir(path) and not os.path.islink(path):
        # NOTE: a directory published by a rename before (the run dir saved with
        # checkpoint.publish=rename): deleted first, as nothing can replace it in one step.
        remove(path)
    temporary = staging_path(path)
    with open(temporary, "w") as pointer:
        pointer.write(f"{POINTER_HEADER}\n{os.path.basename(save)}\n")
        pointer.flush()
        os.fsync(pointer.fileno())
    os.replace(temporary, path)
    _sync_directory(os.path.dirname(os.path.abspath(path)))


def pointer_target(path: str) -> str | None:
    """The save a pointer file at ``path`` names (a sibling directory), else None."""
    try:
        if not os.path.isfile(path) or os.path.getsize(path) > _POINTER_MAX_BYTES:
            return None
        with open(path, "rb") as file:
            header, _, rest = file.read().decode("utf-8", "replace").partition("\n")
    except OSError:
        return None
    name = rest.strip()
    # Only a hidden save's name in the same directory: a pointer never leads elsewhere.
    if header != POINTER_HEADER or os.path.basename(name) != name or not name.endswith(SAVED_SUFFIX) \
            or not name.startswith("."):
        return None
    return os.path.join(os.path.dirname(os.path.abspath(path)), name)


def followed(path: str) -> str:
    """The checkpoint ``path`` names: the save it points to, or ``path`` itself."""
    return pointer_target(path) or path


def remove_published(path: str) -> None:
    """Delete a checkpoint: a file or directory, or a pointer and the save that no pointer
    names any more."""
    if pointer_target(path) is None:
        remove(path)
        return
    os.unlink(path)
    _remove_unnamed_saves(os.path.dirname(os.path.abspath(path)))


def _remove_unnamed_saves(directory: str) -> None:
    """Delete the saves of ``directory`` no pointer names: replaced ones, and any a preemption
    cut short (invisible, as no pointer was written to them). Saves run one at a time, so
    none is being written now."""
    entries = [os.path.join(directory, name) for name in os.listdir(directory)]
    named = {pointer_target(entry) for entry in entries}
    for entry in entries:
        name = os.path.basename(entry)
        if name.startswith(".") and name.endswith(SAVED_SUFFIX) and entry not in named:
            remove(entry)


def link_or_copy(source: str, destination: str) -> None:
    """``destination`` holds the bytes of the file or directory tree ``source``: hard links
    where the file system has them (no second write), else copies (object-store mounts)."""
    if os.path.isdir(source):
        os.makedirs(destination, exist_ok=True)
        for name in os.listdir(source):
            link_or_copy(os.path.join(source, name), os.path.join(destination, name))
        return
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)  # keeps the modification time the completeness checks compare


def publishes_by_pointer(path: str, mode: str) -> bool:
    """Whether a save of ``path`` is published by a pointer under ``checkpoint.publish=mode``."""
    if mode not in PUBLISH_MODES:
        raise ValueError(f"checkpoint.publish={mode!r}; allowed: {', '.join(PUBLISH_MODES)}")
    if mode == "auto":
        return is_fuse(mount_type(os.path.dirname(os.path.abspath(path))))
    return mode == "pointer"


def is_fuse(file_system: str) -> bool:
    """A FUSE file system (``fuse``, ``fuse.gcsfuse``, ``fuse.s3fs``, ...): its daemon decides
    what a rename does, and the object-store ones copy a directory file by file."""
    return file_system == "fuse" or file_system.startswith("fuse.")


def mount_type(path: str) -> str:
    """The file-system type of the mount that holds ``path`` ("" where unknown)."""
    try:
        with open(MOUNTS) as file:
            lines = file.read().splitlines()
    except OSError:
        return ""
    real, best, kind = os.path.realpath(path), "", ""
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        # /proc/mounts writes a space in a mount point as \040 (and tab, newline, backslash in octal)
        point = re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), fields[1])
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind
