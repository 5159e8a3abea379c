"""Writes data/pairs.jsonl: preference pairs for the DPO walk-through (docs/recipes.md), made here so that nothing
downloads. Each is one of data/make_chat.py's calculator questions (its system prompt and question) with the right
answer chosen and a wrong one rejected, in TRL's conversational layout: {"prompt": [messages], "chosen":
[the assistant's message], "rejected": [...]}.

    python data/make_pairs.py    # rewrites data/pairs.jsonl (the same file every time)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from make_chat import OPERATIONS

SYSTEM = "You are a careful calculator. Answer in one sentence."


def pair(rng: random.Random) -> dict:
    a, b = rng.randint(0, 12), rng.randint(0, 12)
    name, op = rng.choice(OPERATIONS)
    a, b = (max(a, b), min(a, b)) if name == "minus" else (a, b)
    right = op(a, b)
    wrong = right + rng.choice([-3, -2, -1, 1, 2, 3])  # near misses: what a small model gets wrong

    def answer(result: int) -> list[dict]:
        return [{"role": "assistant", "content": f"{a} {name} {b} is {result}."}]

    return {"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} {name} {b}?"}],
            "chosen": answer(right), "rejected": answer(wrong)}


def main() -> None:
    rng = random.Random(1)
    (Path(__file__).parent / "pairs.jsonl").write_text("".join(json.dumps(pair(rng)) + "\n" for _ in range(400)))


if __name__ == "__main__":
    main()
