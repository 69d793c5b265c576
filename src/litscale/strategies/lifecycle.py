"""Ending distributed runs cleanly.

A 2-process CPU DDP run that leaves its process group alive at interpreter exit aborts about
one run in six (``terminate called without an active exception``): gloo's threads are still
running when C++ static destructors fire. Destroying the group first removes the race.
"""

from __future__ import annotations

import atexit

import torch.distributed as dist


def destroy_process_group() -> None:
    """Destroy the default process group if one exists; safe to call more than once."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


_registered = False


def destroy_process_group_at_exit() -> None:
    """Make sure the group is destroyed at exit, also in plain Lightning scripts."""
    global _registered
    if not _registered:
        atexit.register(destroy_process_group)
        _registered = True
