"""The run's own lines (``litscale: ...``, ``error: ...``) in its ``train.log`` as well as on
the console.

Hydra's job logging writes ``<run dir>/train.log`` through the ``logging`` module, while
litscale prints its lines (start, layout, memory, done, throughput, ...) so that the console
shows them bare, without a logging prefix. ``log_printed_lines`` leaves the console as it is
and hands each such line to the log file too: to Hydra's own file handler in the process
Hydra runs in, or, in a rank that litscale's launcher started (a fresh interpreter, with no
handler), to the same ``train.log``, appended.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

PREFIXES = ("litscale: ", "error: ")
# Hydra's default job_logging file format, for a rank that writes train.log by itself.
HYDRA_FILE_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


class _LineTee:
    """A text stream that writes through to ``stream`` and hands each complete line starting
    with one of ``PREFIXES`` to ``emit``; everything else (progress bars) only goes through."""

    def __init__(self, stream, emit: Callable[[str], None]) -> None:
        self._stream, self._emit, self._pending = stream, emit, ""
        self._lock = threading.Lock()  # the watchdog prints from its own thread

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        with self._lock:
            *lines, pending = (self._pending + text).split("\n")
            # A progress bar redraws its line after "\r": only its last state can precede a line.
            self._pending = pending[pending.rfind("\r") + 1:]
        for line in lines:
            self._take(line)
        return written

    def _take(self, line: str) -> None:
        line = line[line.rfind("\r") + 1:]
        # NOTE: a print during an epoch follows tqdm's bar on the same line ("...it/s]litscale: ...").
        start = 0 if line.startswith(PREFIXES) else line.find(PREFIXES[0])
        if start >= 0:
            self._emit(line[start:])

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str):  # isatty, fileno, encoding, buffer, ...: the stream's
        return getattr(self._stream, name)


@contextmanager
def log_printed_lines(log_file: str | None = None) -> Iterator[None]:
    """While inside, copy the lines litscale prints to the run's log: the root logger's file
    handlers (Hydra's ``train.log``), else ``log_file`` if it exists (a rank litscale started;
    Hydra made the file in the launching process). Nothing happens without either, or when an
    outer call already copies (a one-process run: the job and its rank are one process)."""
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    own = None
    if not handlers and log_file and os.path.isfile(log_file):
        own = logging.FileHandler(log_file, mode="a", delay=True)
        own.setFormatter(logging.Formatter(HYDRA_FILE_FORMAT))
        handlers = [own]
    if not handlers or isinstance(sys.stdout, _LineTee):
        yield
        return

    def emit(line: str) -> None:
        level = logging.ERROR if line.startswith("error: ") else logging.INFO
        record = logging.LogRecord("litscale", level, __file__, 0, line, None, None)
        for handler in handlers:
            if level >= handler.level:
                handler.handle(record)

    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _LineTee(stdout, emit), _LineTee(stderr, emit)
    moved = _move_stream_handlers({stdout: sys.stdout, stderr: sys.stderr})
    try:
        yield
    finally:
        sys.stdout, sys.stderr = stdout, stderr
        _move_stream_handlers({tee: stream for stream, tee in moved})
        if own is not None:
            own.close()


def _move_stream_handlers(streams: dict) -> list[tuple]:
    """Point the console handlers of loggers that do not reach the root logger at other streams.

    NOTE: Lightning, imported before Hydra set up logging (train.py checks the command line
    first), gives its logger a console handler of its own, holding the ``sys.stderr`` of that
    moment, and stops propagation: its ``rank_zero_info("litscale: ...")`` lines would pass by
    the tee. Returns the ``(old, new)`` streams moved."""
    moved = []
    for logger in list(logging.Logger.manager.loggerDict.values()):
        if not isinstance(logger, logging.Logger) or logger.propagate:
            continue
        for handler in logger.handlers:
            if type(handler) is logging.StreamHandler and handler.stream in streams:
                old = handler.setStream(streams[handler.stream])
                moved.append((old, handler.stream))
    return moved
