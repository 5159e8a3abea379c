"""What stops a run between two steps: a signal (preemption, Ctrl-C) and a loss or gradient norm that is not finite."""

from __future__ import annotations

import math
import signal

from trainkit.errors import TrainingError


class StopSignal:
    """SIGTERM/SIGINT (preemption, Ctrl-C) asks for a stop. The strategy's step reduces `requested` over the ranks
    together with the loss (one collective), so every rank stops at the same step boundary."""

    def __init__(self) -> None:
        self.name: str | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.name is not None


class FiniteCheck:
    """A non-finite loss or gradient norm stops the run before the optimizer step.

    Under fp16 the loss scaler skips such steps itself (counted in skipped_steps) and a skipped step leaves the
    weights as they were, so only a loss that stays non-finite for `fp16_patience` steps in a row, on different
    batches, stops the run: then the weights or the data are broken, and no loss scale mends that.
    """

    def __init__(self, fp16: bool, fp16_patience: int = 3) -> None:
        self.fp16, self.fp16_patience, self.losses_in_a_row = fp16, fp16_patience, 0

    def loss(self, step: int, value: float) -> None:
        self.losses_in_a_row = 0 if math.isfinite(value) else self.losses_in_a_row + 1
        if self.losses_in_a_row and (not self.fp16 or self.losses_in_a_row >= self.fp16_patience):
            during = f" ({self.losses_in_a_row} steps in a row under fp16)" if self.fp16 else ""
            raise TrainingError(f"non-finite loss at step {step} ({value}){during}; the optimizer step was not taken",
                                "lower --lr, raise warmup_steps, or check the data")

    def grad_norm(self, step: int, value: float | None, step_taken: bool = False) -> None:
        """`step_taken`: the strategy's optimizer step comes before the norm can be read (DeepSpeed steps inside the
        last backward), so the message must not claim that the step was held back."""
        if value is not None and not math.isfinite(value) and not self.fp16:
            held = ("DeepSpeed's engine had already taken the optimizer step; the last checkpoint is intact"
                    if step_taken else "the optimizer step was not taken")
            raise TrainingError(f"non-finite gradient norm at step {step} ({value}); {held}",
                                "lower --lr, raise warmup_steps, or turn clipping on (--max_grad_norm 1)")
