"""Profiles timed by ``plan=show|auto``, kept per (model, data shape, cluster file) so that
what one planning run timed serves every later run of the same model on the same machine:
a second ``plan=show`` times only what is new, and an ordinary run's summary predicts its
step without timing anything (no child process after ``fit``).

One JSON file per identity under ``$LITSCALE_CACHE/profiles/``; inside it, one entry per
``profile_key`` (how one rank runs the network: plain, ``fsdp<n>``, ``tp<n>``, ...).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from litscale.planner.calibrate import calibration_path
from litscale.planner.model_facts import Profile


def cache_dir() -> Path:
    return calibration_path().parent / "profiles"  # beside the cluster file the profiles were timed against


def cache_path(identity: dict) -> Path:
    """The file for ``identity`` (plain data: the network's config, sequence length, vocabulary,
    compression, the cluster file it was timed against, torch's version)."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()
    return cache_dir() / f"{digest[:24]}.json"


def load(identity: dict) -> dict[str, Profile]:
    """The profiles cached for ``identity`` ({} when none, or the file is unreadable)."""
    try:
        entries = json.loads(cache_path(identity).read_text())["profiles"]
    except (OSError, ValueError, KeyError):
        return {}
    return {key: Profile(forward_backward_s={int(m): s for m, s in entry["forward_backward_s"].items()},
                         optimizer_step_s=entry["optimizer_step_s"], bytes_ratio=entry.get("bytes_ratio", 1.0))
            for key, entry in entries.items()}


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
        result[key] = Profile(times, profile.optimizer_step_s, profile.bytes_ratio)
    return result


def store(identity: dict, profiles: dict[str, Profile]) -> Path:
    """Write ``profiles`` for ``identity`` (whole file at once: a reader never sees half of it)."""
    path = cache_path(identity)
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = {key: {"forward_backward_s": {str(m): s for m, s in p.forward_backward_s.items()},
                     "optimizer_step_s": p.optimizer_step_s, "bytes_ratio": p.bytes_ratio}
               for key, p in profiles.items()}
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps({"identity": identity, "profiles": entries}, indent=1, default=str))
    os.replace(temporary, path)
    return path
