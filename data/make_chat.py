"""Writes data/chat.jsonl: short chat conversations for the fine-tuning walk-through (docs/recipes.md), made here so
that nothing downloads. Each is a system prompt, a question about two small numbers and the answer, often with a
follow-up turn: the loss learns only the assistant's turns.

    python data/make_chat.py    # rewrites data/chat.jsonl (the same file every time)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OPERATIONS = [("plus", lambda a, b: a + b), ("times", lambda a, b: a * b), ("minus", lambda a, b: a - b)]
FOLLOW_UPS = [("And doubled?", lambda r: f"Doubled, it is {2 * r}."),
              ("Is that even?", lambda r: f"Yes, {r} is even." if r % 2 == 0 else f"No, {r} is odd."),
              ("And plus one?", lambda r: f"Plus one, it is {r + 1}.")]


def conversation(rng: random.Random) -> dict:
    a, b = rng.randint(0, 12), rng.randint(0, 12)
    name, op = rng.choice(OPERATIONS)
    a, b = (max(a, b), min(a, b)) if name == "minus" else (a, b)
    result = op(a, b)
    messages = [{"role": "system", "content": "You are a careful calculator. Answer in one sentence."},
                {"role": "user", "content": f"What is {a} {name} {b}?"},
                {"role": "assistant", "content": f"{a} {name} {b} is {result}."}]
    if rng.random() < 0.6:
        question, answer = rng.choice(FOLLOW_UPS)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer(result)}]
    return {"messages": messages}


def main() -> None:
    rng = random.Random(0)
    lines = [json.dumps(conversation(rng)) + "\n" for _ in range(400)]
    (Path(__file__).parent / "chat.jsonl").write_text("".join(lines))


if __name__ == "__main__":
    main()
