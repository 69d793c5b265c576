"""A model's traced facts (``model_facts``: a forward and a forward-backward traced on fake
tensors, about a second on a 2-core machine), kept per model so that the planner traces a model
once per installation: each run's summary prediction after ``fit`` and each ``plan=show`` of
the same model read it back instead (0.05 s for GPT-nano, its meta-device network rebuilt).

One JSON file per identity under ``$LITSCALE_CACHE/facts/``. The identity holds everything the
trace depends on: the network's config, the sequence length, the vocabulary, the precision,
and the code (litscale's version and a digest of the models' and the tracer's sources, torch's
and transformers' versions). The meta-device network the facts carry is not stored: the caller
builds it again (``net``). A network read from files (``model.net.path``, ``model.net.from_hf``,
a ``model.net.config`` that names a config.json) is not cached: they can change under the same
config.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import metadata
from pathlib import Path

from torch import nn

from litscale.planner.calibrate import calibration_path
from litscale.planner.model_facts import ModelFacts, MoEFacts
from litscale.planner.profile_cache import code_identity, file_name, write_atomically

NOT_STORED = ("net", "profiles")  # the network (built again), and the profiles (profile_cache's)


def identity(net_config: dict, *, seq_len: int, vocab_size: int, compute_dtype: str, param_dtype: str,
             packed_documents: bool = False) -> dict | None:
    """What a trace of ``net_config``'s network depends on; None where it cannot be cached."""
    if net_config.get("path") or net_config.get("from_hf") or isinstance(net_config.get("config"), str):
        return None
    try:
        transformers = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        transformers = None
    code = code_identity()
    return {"net": net_config, "seq_len": seq_len, "vocab_size": vocab_size, "compute_dtype": compute_dtype,
            "param_dtype": param_dtype, "packed_documents": packed_documents, "litscale": code["litscale"], "code": code["code"], "torch": code["torch"],
            "transformers": transformers}


def _path(key: dict) -> Path:
    return calibration_path().parent / "facts" / file_name(key)


def load(key: dict | None, net: nn.Module) -> ModelFacts | None:
    """The facts stored for ``key``, carrying ``net``; None when none are (or unreadable)."""
    if key is None:
        return None
    try:
        return from_plain(json.loads(_path(key).read_text())["facts"], net)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(key: dict | None, facts: ModelFacts) -> None:
    if key is None:
        return
    write_atomically(_path(key), {"identity": key, "facts": as_plain(facts)})


def as_plain(facts: ModelFacts) -> dict:
    """``facts`` as JSON's plain data, less what is not stored (the network, the profiles)."""
    stored = {field.name: getattr(facts, field.name) for field in dataclasses.fields(facts)
              if field.name not in NOT_STORED}
    if facts.moe is not None:
        stored["moe"] = {field.name: getattr(facts.moe, field.name) for field in dataclasses.fields(facts.moe)}
    return json.loads(json.dumps(stored))


def from_plain(stored: dict, net: nn.Module) -> ModelFacts:
    """``as_plain``'s data back into the facts, carrying ``net`` (built again by the caller)."""
    stored = dict(stored)
    moe = stored.pop("moe")
    return ModelFacts(**_tuples(stored), moe=MoEFacts(**_tuples(moe)) if moe else None, net=net)


def _tuples(values: dict) -> dict:
    """JSON's lists back into the tuples the dataclasses hold."""
    def tupled(value):
        if isinstance(value, dict):
            return {key: tupled(item) for key, item in value.items()}
        return tuple(tupled(item) for item in value) if isinstance(value, list) else value

    return {name: tupled(value) for name, value in values.items()}
