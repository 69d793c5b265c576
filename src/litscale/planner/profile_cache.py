"""Profiles timed by ``plan=show|auto``, kept per (model, data shape, cluster file, code,
machine) so that what one planning run timed serves every later run of the same model on the
same machine: a second ``plan=show`` times only what is new, and an ordinary run's summary
predicts its step without timing anything (no child process after ``fit``).

One JSON file per identity under ``$LITSCALE_CACHE/profiles/``; inside it, one entry per
``profile_key`` (how one rank runs the network: plain, ``fsdp<n>``, ``tp<n>``, ...), with the
load average it was timed at; and the layouts whose prediction a run's own measurement
contradicted (not predicted again, nor their profile read, until it is timed again).

The identity holds everything a profile's seconds depend on beyond the model: litscale's
version and a digest of the code a profile runs (another checkout's model timed differently),
torch's version and the machine's fingerprint (a cache directory shared by hosts, or a home
directory moved to another machine).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

from litscale.planner import machine
from litscale.planner.calibrate import calibration_path
from litscale.planner.model_facts import Profile

# What a profile runs, relative to the package: the networks, how strategies shard and split
# them, the compression hooks, and the timing itself.
TIMED_CODE = ("models", "strategies", "compression", "parallel", "precision.py", "planner/model_facts.py",
              "app/plan/profile.py")
# A run's measured step this many times off its prediction (either way) contradicts it.
CONTRADICTION_FACTOR = 2.0


def cache_dir() -> Path:
    return calibration_path().parent / "profiles"  # beside the cluster file the profiles were timed against


@functools.cache
def code_digest() -> str:
    """A digest of ``TIMED_CODE``'s sources in this installation (read once per process)."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for part in TIMED_CODE:
        for path in sorted((package / part).rglob("*.py")) if (package / part).is_dir() else [package / part]:
            digest.update(str(path.relative_to(package)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def code_identity() -> dict:
    """What a profile depends on beyond the model and the cluster file: litscale's version and
    code, torch's version, the machine."""
    import torch

    import litscale

    return {"litscale": litscale.__version__, "code": code_digest(), "torch": torch.__version__,
            "machine": machine.fingerprint()}


def cache_path(identity: dict) -> Path:
    """The file for ``identity`` (plain data: the network's config, sequence length, vocabulary,
    compression, the cluster file it was timed against, ``code_identity``)."""
    return cache_dir() / file_name(identity)


def file_name(identity: dict) -> str:
    """A cache file's name: a digest of ``identity`` (plain data)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:24] + ".json"


def _read(identity: dict) -> dict:
    try:
        content = json.loads(cache_path(identity).read_text())
        return {"profiles": dict(content["profiles"]), "contradicted": dict(content.get("contradicted", {}))}
    except (OSError, ValueError, KeyError, TypeError):
        return {"profiles": {}, "contradicted": {}}


def load(identity: dict) -> dict[str, Profile]:
    """The profiles cached for ``identity`` ({} when none, or the file is unreadable), less those
    a run's measurement contradicted."""
    content = _read(identity)
    dropped = {record.get("profile_key") for record in content["contradicted"].values()
               if record.get("compute_source") == "timed"}
    return {key: Profile(forward_backward_s={int(m): s for m, s in entry["forward_backward_s"].items()},
                         optimizer_step_s=entry["optimizer_step_s"], bytes_ratio=entry.get("bytes_ratio", 1.0),
                         load_average=entry.get("load_average"))
            for key, entry in content["profiles"].items() if key not in dropped}


def contradiction(identity: dict, layout: str) -> dict | None:
    """The record of the run that contradicted the prediction for ``layout`` (a plan's
    description) of ``identity``'s model (None: none did, or its profile was timed again since)."""
    return _read(identity)["contradicted"].get(layout)


def missing(cached: dict[str, Profile], wanted: dict[str, set[int]]) -> dict[str, set[int]]:
    """Of ``wanted`` (profile key -> micro batches), what ``cached`` has not timed."""
    left = {key: micros - set(cached[key].forward_backward_s) if key in cached else set(micros)
            for key, micros in wanted.items()}
    return {key: micros for key, micros in left.items() if micros}


def merged(cached: dict[str, Profile], timed: dict[str, Profile]) -> dict[str, Profile]:
    """``cached`` with ``timed`` added: a key's micro batches joined, its newer step time kept."""
    result = dict(cached)
    for key, profile in timed.items():
        old = cached.get(key)
        times = {**old.forward_backward_s, **profile.forward_backward_s} if old else profile.forward_backward_s
        result[key] = Profile(times, profile.optimizer_step_s, profile.bytes_ratio, profile.load_average)
    return result


def store(identity: dict, profiles: dict[str, Profile], retimed: set[str]) -> Path:
    """Write ``profiles`` for ``identity``; a contradiction whose profile key was ``retimed``
    (timed again just now) is cleared: the next prediction is a new one."""
    contradicted = {layout: record for layout, record in _read(identity)["contradicted"].items()
                    if record.get("profile_key") not in retimed}
    entries = {key: {"forward_backward_s": {str(m): s for m, s in p.forward_backward_s.items()},
                     "optimizer_step_s": p.optimizer_step_s, "bytes_ratio": p.bytes_ratio,
                     "load_average": p.load_average}
               for key, p in profiles.items()}
    return _write(identity, {"identity": identity, "profiles": entries, "contradicted": contradicted})


def contradict(identity: dict, layout: str, record: dict) -> Path:
    """Stop predicting ``layout`` (a plan's description) for ``identity``'s model: ``record``
    says which run measured what, and by which ``profile_key`` and ``compute_source`` it was
    predicted; a ``timed`` profile is no longer read. ``plan=show|auto`` times it again."""
    content = _read(identity)
    content["contradicted"][layout] = record
    return _write(identity, {"identity": identity, **content})


def _write(identity: dict, content: dict) -> Path:
    return write_atomically(cache_path(identity), content)


def write_atomically(path: Path, content: dict) -> Path:
    """The whole file at once: a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(content, indent=1, default=str))
    os.replace(temporary, path)
    return path
