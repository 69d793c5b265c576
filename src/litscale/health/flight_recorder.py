"""PyTorch's Flight Recorder, on for every multi-rank run, and its dumps in the run dir.

Flight Recorder keeps, in each process, a ring buffer of the last collectives it issued
(process group, sequence number, op, shapes, dtypes, state, and the Python stack of the
call); torch 2.13 records it on every c10d backend, gloo included. It reads
``TORCH_FR_BUFFER_SIZE`` when a process group is created, so litscale sets it before then (a
user's own value wins; ``0`` turns it off). A rank writes its buffer to
``<run dir>/flight_recorder/rank<N>`` when the hang watchdog stops the job and when the rank
fails; ``python -m litscale.doctor <run dir>`` matches the dumps across ranks. The file
format is torch's own (a pickle), so torch's analyzer
(``python -m torch.distributed.flight_recorder.fr_trace``) reads it too, with an entry
litscale adds: the rank's main-thread stack at the time of the dump (where a rank that never
entered a collective is instead).
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import traceback

BUFFER_SIZE_ENV = "TORCH_FR_BUFFER_SIZE"
# NOTE: entries, not bytes. A step of DDP issues one all-reduce per bucket, FSDP two
# collectives per unit, so 2,000 keep many steps; each entry holds its stack (~2 KB pickled).
DEFAULT_ENTRIES = 2000
DUMP_DIR = "flight_recorder"
STACK_KEY = "litscale_stack"  # the main thread's frames when dumped, innermost first
REASON_KEY = "litscale_reason"


# The buffer is one per process and outlives its process groups: a process that trains twice
# (an in-process restart, a test worker serving many runs) would dump the earlier run's
# collectives under the same group names and sequence numbers. Dumps keep entries after this.
_first_record_id = 0


def enable(entries: int = DEFAULT_ENTRIES) -> None:
    """Record the last ``entries`` collectives of every process group created from now on,
    and dump only those."""
    os.environ.setdefault(BUFFER_SIZE_ENV, str(entries))
    start_new_run()


def start_new_run() -> None:
    """Leave out of later dumps every collective recorded so far in this process."""
    global _first_record_id
    from torch._C._distributed_c10d import _dump_fr_trace

    entries = pickle.loads(_dump_fr_trace(includeStackTraces=False)).get("entries") or []
    _first_record_id = max((entry["record_id"] + 1 for entry in entries), default=_first_record_id)


def dump_path(run_dir: str, rank: int) -> str:
    # NOTE: `<prefix><rank>` with no suffix: the names torch's fr_trace infers ranks from.
    return os.path.join(run_dir, DUMP_DIR, f"rank{rank}")


def dump(run_dir: str, rank: int, reason: str) -> str | None:
    """Write this rank's Flight Recorder buffer to the run dir; its path, or None where
    nothing was recorded (a single process, or Flight Recorder off)."""
    if os.environ.get(BUFFER_SIZE_ENV) == "0":
        return None
    from torch._C._distributed_c10d import _dump_fr_trace

    record = pickle.loads(_dump_fr_trace())
    record["entries"] = [entry for entry in record.get("entries") or []
                         if entry["record_id"] >= _first_record_id]
    if not record["entries"]:
        return None
    record[STACK_KEY] = main_thread_frames()
    record[REASON_KEY] = reason
    path = dump_path(run_dir, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "wb") as handle:
        pickle.dump(record, handle)
    os.replace(path + ".tmp", path)  # a reader never sees half a dump
    return path


def main_thread_frames() -> list[dict]:
    """The main thread's stack in Flight Recorder's form (innermost first): called from the
    watchdog's thread, it shows where a stuck training thread is."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return []
    return [
        {"name": f.name, "filename": f.filename, "line": f.lineno}
        for f in reversed(traceback.extract_stack(frame))
    ]
