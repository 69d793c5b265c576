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
# A network's keys that follow the data (its sequence and vocabulary), not its architecture.
DATA_SHAPE_KEYS = ("vocab_size", "block_size")


@dataclass(frozen=True)
class Trust:
    picks: bool  # the planner's pick is used; otherwise the job keeps its given layout
    reason: str  # the group and its figure, or that the model is in none

    def line(self, *, given_fits: bool = True) -> str:
        """What plan=auto says, one line; a given layout that does not fit is replaced all the same."""
        if self.picks:
            return f"plan=auto: {self.reason}: the planner picks this job's layout"
        if not given_fits:
            return f"plan=auto: {self.reason}, but the given layout does not fit: the planner picks this job's layout"
        return f"plan=auto: {self.reason}: this job keeps its given layout"


def load_accuracy(path: Path = ACCURACY_FILE) -> dict:
    return json.loads(path.read_text())


def architecture(net: dict) -> dict:
    """``model.net`` as composed, without the keys that follow the data: what names a group."""
    return {key: value for key, value in net.items() if key not in DATA_SHAPE_KEYS}


def trust_for(net: dict, accuracy: dict | None = None, *, seq_len: int | None = None) -> Trust:
    """May the planner pick the layout for the network ``net`` (``model.net`` as composed) at
    ``seq_len`` tokens?"""
    accuracy = load_accuracy() if accuracy is None else accuracy
    groups = accuracy["groups"]
    # A network measured in several groups (Llama-tiny at 128 and at 512 tokens) is trusted as
    # far as its worst ranking at the job's sequence length where a group was measured at it,
    # else at any: the groups differ by the data's shape, which the architecture does not name.
    measured = [name for name, g in groups.items() if g["net"] == architecture(net)]
    at_length = [name for name in measured if seq_len is not None and groups[name].get("seq_len") == seq_len]
    group = min(at_length or measured, key=lambda name: groups[name]["spearman"], default=None)
    where = f"(experiments/planner/study.py, {accuracy['date']})"
    if group is None:
        model = str(net.get("_target_")) + (f" preset {net['preset']}" if net.get("preset") else "")
        return Trust(
            False,
            f"{model} as configured is in no measured model group ({', '.join(groups)}) {where}",
        )
    spearman = groups[group]["spearman"]
    ranked = f"model group {group}'s held-out Spearman is {spearman:.3f}"
    if spearman >= SPEARMAN_BAR:
        return Trust(True, f"{ranked}, at least {SPEARMAN_BAR} {where}")
    return Trust(False, f"{ranked}, below {SPEARMAN_BAR} {where}")
