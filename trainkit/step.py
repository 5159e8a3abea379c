"""One optimizer step, as train.py's loop runs it under every strategy.

Read top to bottom, the step of every engine that torch.distributed drives (one process, DDP, the FSDP2 / tensor-
parallel mesh, the pipeline); where engines differ, the step calls the engine (engine.<method>, strategies/engine.py):

1. every trainable parameter holds a gradient (zeros before its first use: the same optimizer state everywhere);
2. each micro-batch's weight: its share of the global batch (1 each, unless the recipe weighs them by their
   learned tokens: loss_weights; rows split between ranks weigh their part's: engine.split_sequences);
3. forward and backward over this rank's micro-batches, gradients communicated once, on the last
   (engine.forward_backward: Accelerate's accumulate under DDP, FSDP2's set_requires_gradient_sync, the pipeline's
   schedule and its tied weights' sum);
4. the gradient norm over the whole model, every shard, slice and stage, and the clip to max_grad_norm
   (engine.clip_grad_norm);
5. one collective: the loss over the whole global batch (engine.loss_holders: the ranks that compute one), whether
   any rank was asked to stop, the engine's own numbers (a pipeline's idle time): agree;
6. the finite checks: a non-finite loss or gradient norm stops the run before the optimizer step (run/stopping.py);
7. the optimizer and schedule step, and whether fp16's loss scaler skipped it (optimizer_step); then the engine's
   own metrics (engine.step_metrics).

DeepSpeed's engine owns its step (it clips and steps inside the last micro-batch's backward): it says so
(owns_step), and the step is its own (ZeroEngine.engine_step in strategies/deepspeed.py), made of the same
loss_weights, agree and optimizer_step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from trainkit.run.stopping import FiniteCheck

__all__ = ["StepEngine", "StepResult", "agree", "loss_weights", "optimizer_step", "train_step"]


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one optimizer step reports to the loop."""

    loss: float  # mean over the whole global batch: every rank and micro-batch
    grad_norm: float | None  # total norm before clipping; None when the engine computes none
    lr: float  # the rate this step used
    skipped: bool  # fp16's loss scaler skipped the step
    stop: bool  # some rank was asked to stop (a signal): every rank stops after this step
    extra: dict[str, Any] = field(default_factory=dict)  # the engine's own metrics (a pipeline's idle time)


class StepEngine(Protocol):
    """What a step asks of an engine (strategies/engine.py's Engine, which every strategy's engine extends): named
    here, so that this module imports no strategy and the engines import its StepResult, one way."""

    cfg: Any
    accelerator: Any
    optimizer: Any
    scheduler: Any
    owns_step: bool

    @property
    def data_parallel_size(self) -> int: ...

    @property
    def loss_holders(self) -> int: ...

    @property
    def sequence_parallel_size(self) -> int: ...

    @property
    def loss_weigher(self) -> Callable[[Any, Any], Any] | None: ...

    def engine_step(self, step: int, micro_batches: list, loss_fn: Any, finite: FiniteCheck,
                    stop_requested: bool) -> StepResult: ...

    def hold_gradients(self) -> None: ...

    def split_sequences(self, micro_batches: list) -> list: ...

    def forward_backward(self, step: int, micro_batches: list, weights: list[float],
                         loss_fn: Any) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def clip_grad_norm(self) -> torch.Tensor | None: ...

    def step_metrics(self, step: int, extra_sums: list[float]) -> dict[str, Any]: ...

    def step_was_skipped(self) -> bool: ...


def train_step(engine: StepEngine, step: int, micro_batches: list, loss_fn: Any, finite: FiniteCheck,
               stop_requested: bool) -> StepResult:
    if engine.owns_step:
        return engine.engine_step(step, micro_batches, loss_fn, finite, stop_requested)
    engine.hold_gradients()
    micro_batches = engine.split_sequences(micro_batches)
    weights = loss_weights(engine, micro_batches)
    loss, extra = engine.forward_backward(step, micro_batches, weights, loss_fn)
    norm = engine.clip_grad_norm()
    loss_value, stop, grad_norm, extra_sums = agree(engine, loss, stop_requested, norm, extra)
    finite.loss(step, loss_value)
    finite.grad_norm(step, grad_norm)
    result = optimizer_step(engine, loss_value, grad_norm, stop)
    result.extra.update(engine.step_metrics(step, extra_sums))
    return result


def loss_weights(engine: StepEngine, micro_batches: list) -> list[float]:
    """The factor on each micro-batch's mean loss, 1 each unless the recipe weighs them (its loss_weight: the
    learned tokens a mean is over). Then micro-batch m's factor is w_m x A x D / N, with A micro-batches per
    rank, D data-parallel ranks and N the units of the whole global batch (one all-reduce, before the first
    forward): Accelerate's backward divides by A and the gradient reduction averages over D, so the step's
    gradient and loss are the sum over every unit divided by N, whatever the split."""
    weigh = engine.loss_weigher
    if weigh is None:
        return [1.0] * len(micro_batches)
    local = [float(weigh(engine.cfg, batch)) for batch in micro_batches]
    total = engine.accelerator.reduce(torch.tensor([sum(local)], device=engine.accelerator.device), "sum").item()
    # ranks that share a batch count it once (tensor parallelism's copies), unless they split its sequence
    total *= engine.data_parallel_size * engine.sequence_parallel_size / engine.accelerator.num_processes
    return [w * len(micro_batches) * engine.data_parallel_size / total if total else 0.0 for w in local]


def agree(engine: StepEngine, loss: torch.Tensor, stop_requested: bool, grad_norm: torch.Tensor | None = None,
          extra: torch.Tensor | None = None) -> tuple[float, bool, float | None, list[float]]:
    """The mean loss over the ranks that hold one, whether any rank asked to stop, and the sum over all ranks of
    an engine's own numbers (`extra`): one collective, then one transfer to the host that also brings the
    gradient norm."""
    parts = [loss.reshape(1), torch.tensor([float(stop_requested)], device=loss.device)]
    summed = engine.accelerator.reduce(torch.cat(parts if extra is None else [*parts, extra]), "sum")
    values = torch.cat([summed, grad_norm.detach().reshape(1).float()]) if grad_norm is not None else summed
    numbers = values.tolist()
    end = len(summed)
    return (numbers[0] / engine.loss_holders, numbers[1] > 0, numbers[end] if grad_norm is not None else None,
            numbers[2:end])


def optimizer_step(engine: StepEngine, loss: float, grad_norm: float | None, stop: bool) -> StepResult:
    """The optimizer and schedule step; whether fp16's scaler skipped it: under torch's GradScaler the scale halves
    exactly when it found an overflow and skipped (engine.step_was_skipped where another library scales).
    Gradient buffers are kept (zeroed): state_bytes counts them as held."""
    lr = engine.scheduler.get_last_lr()[0]
    scaler = engine.accelerator.scaler
    scale = scaler.get_scale() if scaler is not None else None
    engine.optimizer.step()
    skipped = scaler.get_scale() < scale if scaler is not None else engine.step_was_skipped()
    engine.scheduler.step()
    engine.optimizer.zero_grad(set_to_none=False)
    return StepResult(loss, grad_norm, lr, skipped, stop)
