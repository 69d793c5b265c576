"""The collective doctor: matches the ranks' Flight Recorder dumps and names the first
collective the ranks disagree on (one never entered it, or entered it with another op,
shape or dtype), with where each rank is.

NOTE: written here rather than calling torch's analyzer (``torch.distributed.flight_recorder
.fr_trace``): on gloo the dumps' ``pg_config`` does not list the groups their entries name
(the analyzer fails on a KeyError), the analyzer reports through log lines rather than
returning the first difference, and it has no notion of where a rank that never entered a
collective is instead. The matching is small: per process group, the ranks' entries side by
side in sequence-number order.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from litscale.health.flight_recorder import DUMP_DIR, STACK_KEY

Entry = dict  # one collective in a Flight Recorder dump (torch's format)
DEFAULT_GROUP = "0"  # the name torch gives the default process group


@dataclass(frozen=True)
class Diagnosis:
    """The doctor's verdict: its one line, and each rank's stack at the call it names (or,
    for a rank that never entered it, where that rank was when it was dumped)."""

    line: str
    stacks: dict[int, list[dict]] = field(default_factory=dict)
    mismatch: bool = False

    def report(self, depth: int = 12) -> str:
        """The line, then each rank's stack (innermost first, ``depth`` frames of it)."""
        lines = [self.line]
        for rank, frames in sorted(self.stacks.items()):
            lines.append(f"  rank {rank}:")
            lines += [f"    {_where(frame)}" for frame in frames[:depth]]
        return "\n".join(lines)


def load_dumps(run_dir: str | os.PathLike) -> dict[int, dict]:
    """Rank -> its dump, from ``<run dir>/flight_recorder/rank<N>`` (or a directory of them).
    Raises ``UnsafeDumpError`` for a file that holds anything but plain data."""
    directory = Path(run_dir)
    if (directory / DUMP_DIR).is_dir():
        directory = directory / DUMP_DIR
    dumps = {}
    for path in directory.glob("rank*"):
        if path.name[4:].isdigit():
            dumps[int(path.name[4:])] = load_plain_pickle(path)
    return dumps


# What a Flight Recorder dump is made of. NOTE: a pickle names any importable callable and
# calls it while loading (``os.system`` included), and a run dir may come from someone else's
# job: the doctor reads plain data only.
PLAIN_TYPES = ("dict", "list", "tuple", "str", "int", "float", "bool", "bytes", "set")  # and None: no class


class UnsafeDumpError(ValueError):
    """A dump that names a class or function other than plain data; nothing of it was run."""


class _PlainDataUnpickler(pickle.Unpickler):
    def __init__(self, handle, path: Path) -> None:
        super().__init__(handle)
        self.path = path

    def find_class(self, module: str, name: str) -> type:
        if module == "builtins" and name in PLAIN_TYPES:
            return super().find_class(module, name)
        raise UnsafeDumpError(
            f"{self.path} refers to {module}.{name}, which a Flight Recorder dump never holds; "
            f"allowed: plain data ({', '.join(PLAIN_TYPES)}, None); nothing of the file was run")


def load_plain_pickle(path: str | os.PathLike) -> object:
    """The pickle at ``path``, refusing (``UnsafeDumpError``) any class but plain data."""
    with open(path, "rb") as handle:
        return _PlainDataUnpickler(handle, Path(path)).load()


def diagnose(dumps: dict[int, dict], world_size: int | None = None) -> Diagnosis:
    """The first collective the ranks disagree on; a line saying there is none otherwise."""
    if not dumps:
        return Diagnosis("no Flight Recorder dumps to compare")
    world = range(world_size) if world_size else sorted(dumps)
    absent = [rank for rank in world if rank not in dumps]
    findings = [
        f for group in _groups(dumps) if (f := _first_difference(group, dumps, absent)) is not None
    ]
    if findings:
        return min(findings, key=lambda finding: finding[0])[1]
    count = max((len(_collectives(d)) for d in dumps.values()), default=0)
    text = f"no collective mismatch: ranks {_ranks(sorted(dumps))} agree on their last {count} collectives"
    if absent:
        text += f" (no dump from {_rank_list(absent)})"
    return Diagnosis(text)


def _collectives(dump: dict) -> list[Entry]:
    """The dump's collectives (not point-to-point), each group's from its latest creation.

    NOTE: the buffer is the process's, not a group's: a group destroyed and created again
    under the same name (a process that runs several jobs) starts its sequence numbers anew."""
    kept: list[Entry] = []
    last_seq: dict[str, int] = {}
    for entry in sorted(dump.get("entries", []), key=lambda e: e["record_id"]):
        if entry.get("is_p2p"):
            continue
        group, seq = entry["process_group"][0], entry["collective_seq_id"]
        if seq < last_seq.get(group, 0):  # equal: one more part of a coalesced collective
            kept = [e for e in kept if e["process_group"][0] != group]
        last_seq[group] = seq
        kept.append(entry)
    return kept


def _groups(dumps: dict[int, dict]) -> Iterable[str]:
    return sorted({e["process_group"][0] for d in dumps.values() for e in _collectives(d)})


def _members(group: str, dumps: dict[int, dict]) -> list[int]:
    """The ranks of ``group``: every rank for the default group; otherwise those whose dump has
    an entry in it or lists it among its groups."""
    if group == DEFAULT_GROUP:
        return sorted(dumps)
    return sorted(
        rank
        for rank, d in dumps.items()
        if group in d.get("pg_config", {})
        or any(e["process_group"][0] == group for e in _collectives(d))
    )


def _signature(entry: Entry) -> tuple:
    return (_op(entry), str(entry.get("input_sizes")), str(entry.get("input_dtypes")))


def _first_difference(
    group: str, dumps: dict[int, dict], absent: list[int]
) -> tuple[int, Diagnosis] | None:
    """(when it was issued, the diagnosis) for the first sequence number of ``group`` at which
    its ranks differ; None if they agree on all of it."""
    by_rank: dict[int, dict[int, Entry]] = {rank: {} for rank in _members(group, dumps)}
    for rank, seqs in by_rank.items():
        for entry in _collectives(dumps[rank]):
            # the first part of a coalesced collective stands for it (the same on every rank)
            if entry["process_group"][0] == group:
                seqs.setdefault(entry["collective_seq_id"], entry)
    recorded = [seqs for seqs in by_rank.values() if seqs]
    # NOTE: a ring buffer that wrapped drops a rank's oldest entries: compare from the first
    # sequence number every rank still holds.
    start = max(min(seqs) for seqs in recorded)
    end = max(max(seqs) for seqs in recorded)
    for seq in range(start, end + 1):
        at = {rank: seqs.get(seq) for rank, seqs in by_rank.items()}
        if len({_signature(e) if e else None for e in at.values()}) > 1:
            issued = min(e["time_created_ns"] for e in at.values() if e)
            return issued, _describe(group, seq, at, dumps, absent)
    return None


def _describe(
    group: str, seq: int, at: dict[int, Entry | None], dumps: dict[int, dict], absent: list[int]
) -> Diagnosis:
    name = _group_name(next(e for e in at.values() if e))
    parts, stacks = [], {}
    variants: dict[tuple, list[int]] = {}
    for rank, entry in sorted(at.items()):
        variants.setdefault(_signature(entry) if entry else (), []).append(rank)
    for signature, ranks in variants.items():
        frames = at[ranks[0]]["frames"] if signature else dumps[ranks[0]].get(STACK_KEY, [])
        for rank in ranks:
            stacks[rank] = at[rank]["frames"] if signature else dumps[rank].get(STACK_KEY, [])
        where = f" (at {_where(_call_site(frames))})" if frames else ""
        if signature:
            parts.append(f"{_rank_list(ranks)} in {_call(at[ranks[0]])}{where}")
        else:
            parts.append(f"{_rank_list(ranks)} never entered it{where.replace('(at', '(now at')}")
    if absent:
        parts.append(f"no dump from {_rank_list(absent)}")
    op = next(_op(e) for e in at.values() if e)
    return Diagnosis(
        f"collective mismatch at {op} #{seq} of {name}: " + "; ".join(parts), stacks, mismatch=True
    )


def _group_name(entry: Entry) -> str:
    name, desc = entry["process_group"]
    return desc if desc and desc != "undefined" else f"group {name}"


def _op(entry: Entry) -> str:
    return entry["profiling_name"].split(":")[-1]  # "gloo:all_reduce", "nccl:all_reduce"


# Flight Recorder's dtype names (c10's ScalarType) as torch spells them.
DTYPES = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Long": "int64",
    "Int": "int32",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
}


def _call(entry: Entry) -> str:
    dtypes = ",".join(DTYPES.get(d, d) for d in entry.get("input_dtypes", []))
    sizes = ",".join(str(list(s)) for s in entry.get("input_sizes", []))
    return f"{_op(entry)} {dtypes}{sizes}"


def _call_site(frames: list[dict]) -> dict:
    """The innermost frame outside torch: the line of the user's, Lightning's or litscale's
    code that issued the collective (or where a rank waits)."""
    return next((f for f in frames if not _in_torch(f["filename"])), frames[0])


def _in_torch(filename: str) -> bool:
    parts = Path(filename).parts
    return any(
        part == "torch" and index and parts[index - 1] in ("site-packages", "dist-packages")
        for index, part in enumerate(parts)
    ) or filename.startswith(_TORCH_DIR)


def _where(frame: dict) -> str:
    return f"{_short(frame['filename'])}:{frame['line']} in {frame['name']}"


def _short(filename: str) -> str:
    """A path as a reader finds it: below site-packages, or below the working directory."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in filename:
            return filename.rsplit(marker, 1)[1]
    try:
        relative = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if relative.startswith("..") else relative


def _rank_list(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranks(ranks)}"


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))


def _torch_dir() -> str:
    spec = importlib.util.find_spec("torch")  # where torch is, without importing it
    return (
        os.path.dirname(spec.origin) + os.sep
        if spec and spec.origin
        else os.sep + "nowhere" + os.sep
    )


_TORCH_DIR = _torch_dir()
