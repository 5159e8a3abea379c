"""Reward functions for the chat walk-through's GRPO step (docs/recipes.md): pass them as
`--reward_funcs rewards.chat.arithmetic,rewards.chat.one_line`. Each has TRL's signature: the prompts, the completions
(for chat prompts a list holding the assistant's message), their token ids, and every other field of the prompts'
records by name (here `answer`); it returns one number per completion. Copy this file beside your data and edit it.
"""

from __future__ import annotations

import re


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[0]["content"]


def arithmetic(prompts, completions, completion_ids, answer, **columns) -> list[float]:
    """1 where the completion's last number is the record's `answer` ("7 times 6 is 42." for 42), else 0."""
    found = [re.findall(r"-?\d+", _text(c)) for c in completions]
    return [float(bool(numbers) and numbers[-1] == str(a)) for numbers, a in zip(found, answer, strict=True)]


def one_line(prompts, completions, completion_ids, **columns) -> list[float]:
    """0.5 for an answer of one short line that ends with a full stop (the format the SFT data taught), else 0."""
    return [0.5 * bool(re.fullmatch(r"[^\n]{1,60}\.", _text(c).strip())) for c in completions]
