"""``docs/compatibility.md``, written from the strategy contract (``litscale.parallel.contract``).

    python -m litscale.app.compatibility > docs/compatibility.md

Each strategy option of ``conf/strategy/`` is built as a run builds it (DeepSpeed once per
ZeRO stage) and asked, for each option of the contract, whether it takes it and, if not, why:
the same answer validation gives a user, in the same words. ``tests/test_compatibility.py``
checks the page is current.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from litscale.parallel.contract import ALTERNATIVES, Option, contract_value, why_not

CONF_STRATEGIES = Path(__file__).resolve().parents[3] / "conf" / "strategy"
# Arguments a run passes at build time (runtime objects), not written in the option files.
RUNTIME_ARGUMENTS = ("precision_dtypes", "compression")
# The columns: the contract's options as a user reads them.
HEADINGS = {
    Option.FP16_MIXED: "fp16_mixed", Option.COMPRESSION: "compression", Option.LAYOUT_INVARIANT: "layout_invariant",
    Option.MIXTURE_OF_EXPERTS: "model=moe", Option.EXPERT_PARALLEL: "EP", Option.CONTEXT_PARALLEL: "CP",
    Option.TENSOR_PARALLEL: "TP", Option.PIPELINE_PARALLEL: "PP", Option.ASYNC_SAVE: "async save",
    Option.MATRIX_OPTIMIZER: "muon", Option.LAYERWISE_OPTIMIZER: "lars, lamb", Option.WIDTH_SCALING: "µP", Option.REPLICA_GROUPS: "replica groups",
    Option.TOKEN_BATCHES: "SFT, packed",
}


def strategy_nodes() -> list[tuple[str, Any]]:
    """``(name, config node)`` for each option file, DeepSpeed once per ZeRO stage: the rows,
    read without building anything."""
    from omegaconf import OmegaConf

    rows = []
    for path in sorted(CONF_STRATEGIES.glob("*.yaml")):
        node = OmegaConf.load(path)
        for key in RUNTIME_ARGUMENTS:
            node.pop(key, None)
        for key in [k for k in node if OmegaConf.is_interpolation(node, k)]:
            del node[key]  # the run's own values (federated's ${seed}); their defaults here
        for stage in (1, 2, 3) if "stage" in node else (None,):
            variant = node.copy()
            if stage is not None:
                variant.stage = stage
            rows.append((path.stem + (f" stage={stage}" if stage is not None else ""), variant))
    if not rows:  # a page of no strategies would pass for a current one
        raise FileNotFoundError(f"no strategy option files under {CONF_STRATEGIES}")
    return rows


def strategy_rows() -> list[tuple[str, Any]]:
    """``(name, strategy)`` for each row, built as a run builds it."""
    from hydra.utils import instantiate

    return [(name, instantiate(node)) for name, node in strategy_nodes()]


def render() -> str:
    rows, reasons = strategy_rows(), {}
    lines = ["# Compatibility", "",
             "Which option each strategy takes (`yes`) or refuses before any rank starts (`no`, with the",
             "one-line reason a run prints). Written by `python -m litscale.app.compatibility > docs/compatibility.md`",
             "from what each strategy states (`litscale.parallel.contract`); the tests check it is current, and a",
             "generated test (`tests/test_combinations.py`) checks that validation refuses exactly these and",
             "that what it accepts trains.", "",
             "| strategy | " + " | ".join(HEADINGS.values()) + " | collective check | needs |",
             "|---" * (len(HEADINGS) + 3) + "|"]
    for name, strategy in rows:
        cells = []
        for option in HEADINGS:
            reason = why_not(strategy, option)
            condition = contract_value(strategy, "conditions").get(option)
            if reason is None and condition is None:
                cells.append("yes")
            elif reason is None:
                cells.append(f"yes [{reasons.setdefault((None, condition), len(reasons) + 1)}]")
            else:
                number = reasons.setdefault((option, reason), len(reasons) + 1)
                cells.append(f"no [{number}]")
        untraced = contract_value(strategy, "untraced")
        traced = "traced" if untraced is None else f"no [{reasons.setdefault((None, untraced), len(reasons) + 1)}]"
        needs = ", ".join(f"`{r.module}` (`litscale[{r.extra}]`)" for r in contract_value(strategy, "requires"))
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {traced} | {needs or '-'} |")
    lines += ["", "## Why not, and what a yes needs", ""]
    for (option, reason), number in reasons.items():
        instead = f" Instead: {ALTERNATIVES[option]}." if option is not None else ""
        lines.append(f"{number}. {reason}.{instead}")
    lines += ["", "Rules that hold whatever the strategy (each one line, before any rank starts): precision",
              "`fp16_mixed` and `fp8` need a GPU; `determinism=layout_invariant` takes no compression and needs",
              "`determinism.chunks` to split the global batch evenly; a strategy whose package is missing is",
              "refused with the `pip install` line; expert parallel beside context parallel",
              "(`strategy.expert_parallel_size` and `strategy.context_parallel_size` both above 1) is refused:",
              "its groups would be borrowed from data x context, which no parity test checks yet. The mode's own rules: [reliability.md](reliability.md#bit-identical-layouts-determinismlayout_invariant).",
              "Packed rows (`data.pack=true`, `data.document_mask=true`) need a network that keeps attention",
              "inside each document: `model=llama`, `moe` or `hf` ([fine-tuning.md](fine-tuning.md)).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render())
