"""The processes of one fault scenario (``faults.py``): each command in a process group of its own,
every line it prints stamped with the wall-clock time it arrived, an action taken on the job from
outside while it runs, what outlived it; and the verdict a user reads in those lines.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests"))
from helpers.cli import EXIT_GRACE_S, cli_env, live_processes  # noqa: E402  (runs as the tests run them)

# The lines that tell a user something: litscale's own (some come through a logger's prefix),
# the failing rank's, the doctor's.
TOLD = re.compile(r"^(error|doctor): |litscale: ")


@dataclass
class Run:
    """One command's outcome: exit code (None when it was still running at its timeout), its
    lines in the order they arrived, its seconds, the processes that outlived it (orphaned
    ranks, or everything at a timeout), and when the action from outside struck (None: there
    was none, or the job ended first)."""

    exit: int | None
    lines: list[tuple[float, str]]
    started: float
    seconds: float
    stray: list[str] = field(default_factory=list)
    acted_at: float | None = None

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


# Terminal colours (Ray colours the prefix of a line from its actors even into a pipe).
COLOURS = re.compile(r"\x1b\[[0-9;]*m")


def _read(stream, lines: list[tuple[float, str]]) -> None:
    for line in stream:
        lines.append((time.time(), COLOURS.sub("", line.rstrip("\n"))))


def launch(command: list[str], *, outputs: Path, timeout: float, env: dict | None = None,
           act: Callable[[subprocess.Popen], float | None] | None = None) -> Run:
    """Run ``command`` from the repo in a process group of its own, reading its lines as they
    come; ``act(process)`` runs beside it and returns when it struck. Whatever is left of the
    group at the end (a rank orphaned, a hang at ``timeout``) is listed, then killed."""
    started = time.time()
    process = subprocess.Popen(command, cwd=REPO, env=cli_env(outputs, env), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[tuple[float, str]] = []
    readers = [threading.Thread(target=_read, args=(stream, lines), daemon=True)
               for stream in (process.stdout, process.stderr)]
    acted: dict[str, float | None] = {}
    helpers = [threading.Thread(target=lambda: acted.update(at=act(process)), daemon=True)] if act else []
    for thread in (*readers, *helpers):
        thread.start()
    deadline = time.monotonic() + timeout
    for reader in readers:  # until every process holding its output has ended
        reader.join(max(0.0, deadline - time.monotonic()))
    try:
        process.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    if process.poll() is None or any(reader.is_alive() for reader in readers):
        lines.append((time.time(), f"hang: killed after {timeout:g} s"))
    seconds = time.time() - started
    exit_code = process.poll()
    stray = _outlived(process.pid)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
    for helper in helpers:
        helper.join(5)
    return Run(exit=exit_code, lines=sorted(lines), started=started,
               seconds=seconds, stray=stray, acted_at=acted.get("at"))


def _outlived(group: int) -> list[str]:
    """The group's processes still running once a process still exiting has had its grace."""
    stray = live_processes(group)
    deadline = time.monotonic() + EXIT_GRACE_S
    while stray and time.monotonic() < deadline:
        time.sleep(0.1)
        stray = live_processes(group)
    return stray


def fault_record(path: Path) -> dict | None:
    """The first line ``InjectFault(record=path)`` wrote as the fault acted (None: it never did)."""
    if not path.exists():
        return None
    lines = path.read_text().splitlines()
    return json.loads(lines[0]) if lines else None


def when_recorded(path: Path, then: Callable[[subprocess.Popen], None], poll_s: float = 0.05):
    """An ``act`` for ``launch``: once the fault record at ``path`` appears (the job reached its
    step), ``then(process)``; returns when it struck (None: the job ended first)."""
    def act(process: subprocess.Popen) -> float | None:
        while fault_record(path) is None:
            if process.poll() is not None:
                return None
            time.sleep(poll_s)
        then(process)
        return time.time()
    return act


@dataclass
class Verdict:
    """What the user is told after a fault: the first line of the scenario's kind that came
    after it (else the first ``error:`` line after it, else the first line litscale printed,
    which then do not count as detected)."""

    line: str
    detected: bool
    seconds: float | None


def verdict(lines: list[tuple[float, str]], fault_at: float, told: re.Pattern) -> Verdict:
    after = [(at, line) for at, line in lines if at >= fault_at and TOLD.search(line)]
    for at, line in after:
        if told.search(line):
            return Verdict(line, True, round(at - fault_at, 1))
    # not what names the fault: the first error, else the first line at all (a misleading one)
    errors = [(at, line) for at, line in after if line.startswith("error:")] or after
    if errors:
        return Verdict(errors[0][1], False, round(errors[0][0] - fault_at, 1))
    return Verdict("(nothing)", False, None)


class SmallDisk:
    """A tmpfs of ``size_bytes`` mounted on ``path`` (root only): a disk that fills up. Its
    files are copied aside before it goes, and put back in its place (the user freed space)."""

    def __init__(self, path: Path, size_bytes: int) -> None:
        self.path, self.size_bytes = path, size_bytes

    def __enter__(self) -> SmallDisk:
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_bytes}", "tmpfs", str(self.path)],
                       check=True, capture_output=True, text=True)
        return self

    def __exit__(self, *exc_info) -> None:
        aside = self.path.with_name(self.path.name + ".aside")
        subprocess.run(["cp", "-a", str(self.path), str(aside)], check=True)
        subprocess.run(["umount", str(self.path)], check=True)
        self.path.rmdir()
        aside.rename(self.path)
