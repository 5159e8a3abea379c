"""One optimizer step, as train.py's loop runs it under every strategy.

Read top to bottom, the step of every engine that torch.distributed drives (one process, DDP, the FSDP2 / tensor-
parallel mesh, the pipeline); the four points where engines differ are the strategy's calls:

1. every trainable parameter holds a gradient (zeros before its first use: the same optimizer state everywhere);
2. each micro-batch's weight: its share of the global batch (1 each, unless the recipe weighs them by their
   learned tokens: loss_weight);
3. forward and backward over this rank's micro-batches, gradients communicated once, on the last
   (strategy.forward_backward: Accelerate's accumulate under DDP, FSDP2's set_requires_gradient_sync, the pipeline's
   schedule and its tied weights' sum);
4. the gradient norm over the whole model, every shard, slice and stage, and the clip to max_grad_norm
   (strategy.clip_grad_norm);
5. one collective: the loss over the whole global batch, whether any rank was asked to stop, the engine's own
   numbers (a pipeline's idle time);
6. the finite checks: a non-finite loss or gradient norm stops the run before the optimizer step (guards.py);
7. the optimizer and schedule step, and whether fp16's loss scaler skipped it (strategy.optimizer_step); then the
   engine's own metrics (strategy.step_metrics).

DeepSpeed's engine owns its step (it clips and steps inside the last micro-batch's backward): its strategy says so
(owns_step), and the step is its own (DeepSpeed.engine_step in strategies/deepspeed.py).
"""

from __future__ import annotations

from typing import Any

from trainkit.guards import FiniteCheck
from trainkit.strategies import StepResult, Strategy

__all__ = ["train_step"]


def train_step(strategy: Strategy, step: int, micro_batches: list, loss_fn: Any, finite: FiniteCheck,
               stop_requested: bool) -> StepResult:
    if strategy.owns_step:
        return strategy.engine_step(step, micro_batches, loss_fn, finite, stop_requested)
    strategy.hold_gradients()
    weights = strategy.loss_weights(micro_batches)
    loss, extra = strategy.forward_backward(step, micro_batches, weights, loss_fn)
    norm = strategy.clip_grad_norm()
    loss_value, stop, grad_norm, extra_sums = strategy.agree(loss, stop_requested, norm, extra)
    finite.loss(step, loss_value)
    finite.grad_norm(step, grad_norm)
    result = strategy.optimizer_step(loss_value, grad_norm, stop)
    result.extra.update(strategy.step_metrics(step, extra_sums))
    return result
