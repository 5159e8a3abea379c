"""Writes data/prompts.jsonl and data/prompts_eval.jsonl: calculator questions for the GRPO walk-through
(docs/recipes.md), made here so that nothing downloads. Each is one of data/make_chat.py's questions (its system prompt
and question) in TRL's conversational prompt layout, with the `answer` that recipes/rewards/chat.py's arithmetic reward
checks: {"prompt": [messages], "answer": 42}. Every question there is, split in two: the 100 of prompts_eval.jsonl are
never trained on.

    python data/make_prompts.py    # rewrites both files (the same files every time)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from make_chat import OPERATIONS
from make_pairs import SYSTEM

HELD_OUT = 100


def main() -> None:
    questions = [(a, name, b, op(a, b)) for name, op in OPERATIONS for a in range(13) for b in range(13)
                 if name != "minus" or a >= b]
    random.Random(2).shuffle(questions)
    records = [json.dumps({"prompt": [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": f"What is {a} {name} {b}?"}],
                           "answer": result}) + "\n" for a, name, b, result in questions]
    folder = Path(__file__).parent
    (folder / "prompts_eval.jsonl").write_text("".join(records[:HELD_OUT]))
    (folder / "prompts.jsonl").write_text("".join(records[HELD_OUT:]))


if __name__ == "__main__":
    main()
