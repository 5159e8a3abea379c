"""The reward both sides of bench/grpo_peer.py train on: programmatic, dense, learnable by a model that knows nothing
yet (a tiny transformer after one step), so that the two reward curves show learning, not noise."""

from __future__ import annotations

LOW = 100  # about a tenth of the tiny transformer's 1,024-token vocabulary


def share_of_low_ids(prompts, completions, completion_ids, **columns) -> list[float]:
    """The share of the completion's tokens whose id is below LOW (chance about 0.1)."""
    return [sum(1 for i in ids if i < LOW) / max(1, len(ids)) for ids in completion_ids]
