"""Write the example conversations ``data=sft`` trains on when ``data.paths`` is null
(``src/litscale/data/assets/sft-arithmetic.jsonl``): short arithmetic chats, seeded.

    python experiments/sft_example/make_arithmetic.py           # rewrite the shipped file
    python experiments/sft_example/make_arithmetic.py --check   # exit 1 if it differs
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "src" / "litscale" / "data" / "assets" / "sft-arithmetic.jsonl"
SYSTEM = "You are a calculator. Answer with the equation and its result."


def question(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    op = rng.choice("+-*")
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    asked = rng.choice([f"What is {a} {op} {b}?", f"Compute {a} {op} {b}.", f"{a} {op} {b} = ?"])
    return asked, f"{a} {op} {b} = {result}."


def conversation(rng: random.Random) -> dict:
    messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.2 else []
    for _ in range(2 if rng.random() < 0.15 else 1):
        asked, answer = question(rng)
        messages += [{"role": "user", "content": asked}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def render(rows: int = 600, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(json.dumps(conversation(rng)) + "\n" for _ in range(rows))


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if OUT.read_text(encoding="utf-8") == text else 1)
    OUT.write_text(text, encoding="utf-8")
