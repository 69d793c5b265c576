"""Whether ``plan=auto`` may choose a sweep job's layout: only for a model group whose predicted
step times ranked, as measured, configurations the cost model was not developed on: the held-out
study's Spearman, whose 95% bootstrap interval's lower end must reach ``SPEARMAN_BAR``. A group
with no held-out study recorded keeps the given layout (its developed-on figures, beside it in
the file, say how well the model fits the configurations it was built against, not how it ranks
a user's). The figures are ``accuracy.json`` beside this file, written by
``experiments/planner/study.py`` (``--held-out``: ``experiments/planner/held_out.py``)."""

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
    group = min(at_length or measured, key=lambda name: lower_end(groups[name]), default=None)
    if group is None:
        where = f"(experiments/planner/study.py, {accuracy['date']})"
        model = str(net.get("_target_")) + (f" preset {net['preset']}" if net.get("preset") else "")
        return Trust(
            False,
            f"{model} as configured is in no measured model group ({', '.join(groups)}) {where}",
        )
    held = groups[group].get("held_out")
    if held is None:
        return Trust(False, f"model group {group} has no held-out study recorded "
                            "(python experiments/planner/study.py --held-out)")
    low, high = held["spearman_interval"]
    where = f"(experiments/planner/study.py --held-out, {held['date']})"
    ranked = (f"model group {group}'s held-out Spearman is {held['spearman']:.3f}, 95% interval {low:.3f} to "
              f"{high:.3f} over {held['configurations']} configurations it was not developed on")
    if low >= SPEARMAN_BAR:
        return Trust(True, f"{ranked}: its lower end is at least {SPEARMAN_BAR} {where}")
    return Trust(False, f"{ranked}: its lower end is below {SPEARMAN_BAR} {where}")


def lower_end(group: dict) -> float:
    """A group's held-out Spearman's lower end; a group without a held-out study the lowest."""
    held = group.get("held_out")
    return held["spearman_interval"][0] if held else float("-inf")
