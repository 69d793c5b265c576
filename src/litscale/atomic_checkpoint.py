"""A checkpoint is complete or invisible: every save is written beside the old one and made
visible by one atomic rename.

Lightning's strategies write ``last.ckpt`` in place: a file opened for writing over the old
one, a ``torch.distributed.checkpoint`` or DeepSpeed directory whose shards are rewritten one
by one. A save cut short (a killed rank, a preemption that outran its grace period) then
leaves neither the old checkpoint nor the new one. Here each save goes to a hidden staging
path in the same directory (``.<name>.saving``, which no resume looks at); once every rank has
written its part, rank 0 swaps it in:

- a file replaces the old file with ``os.replace``, atomic on POSIX;
- a directory is exchanged with the old one by Linux's ``renameat2(RENAME_EXCHANGE)``, one
  atomic step, and the old one (now at the staging path) is deleted. ``os.replace`` cannot
  replace a non-empty directory, and no library does this: written here. Where the call is
  missing (not Linux), the old directory is first renamed aside (``.<name>.old``): a crash
  between the two renames leaves the old checkpoint there and no ``<name>``, and the resume
  search (``litscale.checkpoints``) looks at it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil

STAGING_SUFFIX = ".saving"
ASIDE_SUFFIX = ".old"
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


def publish(staging: str, path: str) -> None:
    """Make the save written at ``staging`` visible as ``path`` in one atomic step."""
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
