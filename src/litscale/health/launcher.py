"""Whether the launcher that started this rank is still there.

litscale's launcher and torchrun both start their ranks through torch's elastic agent, which
hosts the job's ``TCPStore`` (the rendezvous, heartbeats, straggler windows) in its own process,
and asks the kernel to send each rank SIGINT when that process dies (``PR_SET_PDEATHSIG``, set by
``torch.multiprocessing``'s spawn wrapper). That SIGINT is not the user's Ctrl-C: it says the
store is gone and that no launcher is left to report a rank's failure. The kernel hands an
orphan to a new parent before it signals it, so a rank tells the two apart by its parent's pid.
"""

from __future__ import annotations

import os

# The pid of the process that started this rank, noted as it started (None: not a launched rank).
_launcher_pid: int | None = None
# Whether a stop signal (SIGTERM, SIGUSR1) reached this rank: the launcher stopping its ranks.
_told_to_stop = False
# What this rank started that cannot be stopped (None: nothing): a failing rank does not wait for it.
_unstoppable: str | None = None


def note_launcher() -> None:
    """On a rank, as it starts: its parent is its launcher."""
    global _launcher_pid
    _launcher_pid = os.getppid()


def launcher_pid() -> int | None:
    return _launcher_pid


def note_told_to_stop() -> None:
    """A stop signal reached this rank (``PreemptionCheckpoint`` notes it for the step boundary)."""
    global _told_to_stop
    _told_to_stop = True


def leave_behind_on_failure(what: str) -> None:
    """``what`` (a thread a library runs, blocked on a lost peer) cannot be stopped: if this rank
    fails, it exits once its failure is recorded, without waiting for ``what`` at the
    interpreter's exit (``litscale.app.launch``)."""
    global _unstoppable
    _unstoppable = what


def left_behind_on_failure() -> str | None:
    return _unstoppable


def told_to_stop() -> bool:
    """Whether a stop signal reached this rank: once its launcher sends one, it has seen the
    failure that stops the job, and a rank that waits for a peer's report waits for nothing."""
    return _told_to_stop


def launcher_lost() -> bool:
    """Whether this rank's launcher has died: the rank has another parent now, or its launcher's
    main thread has exited.

    NOTE: the kernel sends the death signal as the thread that started the rank exits. Where the
    launcher's other threads are still exiting (a SIGKILLed process goes thread by thread), the
    rank keeps its parent a moment longer (seen: a step's time on a loaded machine), but the
    launcher's main thread already shows as a zombie."""
    if _launcher_pid is None:
        return False
    return os.getppid() != _launcher_pid or _main_thread_state(_launcher_pid) in ("Z", "X", "gone")


def _main_thread_state(pid: int) -> str | None:
    """The state letter of ``pid``'s main thread (``R``, ``S``, ``Z``...), "gone" where it has no
    entry in ``/proc``; None where there is no ``/proc`` to read (not Linux)."""
    if not os.path.isdir("/proc/self"):
        return None
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]  # after the command name, which may hold spaces
    except (OSError, IndexError):
        return "gone"
