"""What the TRL peers (bench/peers/trl_*.py) record of a Trainer's run: the end time of every optimizer step and the
logs of the steps, those holding `key` (the trainer's own loss, or GRPO's reward)."""

from __future__ import annotations

import time

from transformers import TrainerCallback


class Record(TrainerCallback):
    def __init__(self, key: str = "loss") -> None:
        self.key = key
        self.ends: list[float] = []
        self.logs: list[dict] = []

    @property
    def losses(self) -> list[float]:
        return [log["loss"] for log in self.logs]

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and self.key in logs:
            self.logs.append(logs)
