"""Whether ``plan=auto`` may choose a sweep job's layout: only for a model group whose predicted
step times ranked its plans as measured (Spearman >= ``SPEARMAN_BAR``) on configurations that
no calibrated term was fitted on, predicted in one pass of the accuracy study and measured in
another. The figures are ``accuracy.json`` beside this file, written by
``experiments/planner/study.py``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SPEARMAN_BAR = 0.9
ACCURACY_FILE = Path(__file__).with_name("accuracy.json")


@dataclass(frozen=True)
class Trust:
    picks: bool  # the planner's pick is used; otherwise the job keeps its given layout
    line: str  # what plan=auto says about it, one line


def load_accuracy(path: Path = ACCURACY_FILE) -> dict:
    return json.loads(path.read_text())


def trust_for(net: dict, accuracy: dict | None = None) -> Trust:
    """May the planner pick the layout for the network ``net`` (``model.net`` as composed: its
    ``_target_`` and ``preset`` name the group)?"""
    accuracy = load_accuracy() if accuracy is None else accuracy
    groups = accuracy["groups"]
    wanted = {"_target_": net.get("_target_"), "preset": net.get("preset")}
    group = next((name for name, g in groups.items() if g["net"] == wanted), None)
    where = f"(experiments/planner/study.py, {accuracy['date']})"
    if group is None:
        model = wanted["_target_"] + (f" preset {wanted['preset']}" if wanted["preset"] else "")
        return Trust(
            False,
            f"plan=auto: {model} is in no measured model group ({', '.join(groups)}) {where}: "
            "this job keeps its given layout",
        )
    spearman = groups[group]["spearman"]
    ranked = f"model group {group}'s held-out Spearman is {spearman:.3f}"
    if spearman >= SPEARMAN_BAR:
        return Trust(
            True,
            f"plan=auto: {ranked}, at least {SPEARMAN_BAR} {where}: the planner picks this job's layout",
        )
    return Trust(
        False, f"plan=auto: {ranked}, below {SPEARMAN_BAR} {where}: this job keeps its given layout"
    )
