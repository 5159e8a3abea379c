"""Data parallelism (DDP): a full replica per process, gradients all-reduced; and one process, its world of one.

Accelerate wraps the model in DistributedDataParallel and `accelerator.accumulate` turns off its gradient
all-reduce (`no_sync`) on all but the last micro-batch of a step. On a machine without GPUs the base strategy asks
Accelerate for the CPU, which turns the YAML's MULTI_GPU into MULTI_CPU over gloo.
"""

from __future__ import annotations

import re

import torch

from trainkit.config import TrainConfig
from trainkit.errors import TrainingError
from trainkit.estimate import OPTIMIZER_BYTES, Estimate, ModelShape
from trainkit.launch.launcher import Launch
from trainkit.strategies.base import Strategy
from trainkit.strategies.engine import Engine, LossFn


class DDPEngine(Engine):
    """Accelerate's DistributedDataParallel around the model (no wrapper for a world of one)."""

    def wrapper_kwargs(self) -> list:
        from accelerate.utils import DistributedDataParallelKwargs

        return [DistributedDataParallelKwargs(find_unused_parameters=self.cfg.find_unused_parameters)]

    def forward_backward(self, step: int, micro_batches: list, weights: list[float],
                         loss_fn: LossFn) -> tuple[torch.Tensor, torch.Tensor | None]:
        try:
            return super().forward_backward(step, micro_batches, weights, loss_fn)
        except RuntimeError as e:  # DDP's reducer: a parameter took no part in the previous step
            if "find_unused_parameters" not in str(e):
                raise
            raise TrainingError(f"{self.unused(str(e))} took no part in step {step - 1} on rank "
                                f"{self.accelerator.process_index}, which DDP cannot reduce",
                                "pass --find_unused_parameters true (DDP then looks for such parameters every "
                                "step), or make every parameter take part in every step") from None

    def unused(self, said: str) -> str:
        """The parameters DDP's error names by index (its reducer's order: the trained parameters in module order),
        by name: "parameter model.layers.0.mlp.gate...", or "a parameter of the model" where it names none."""
        found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", said)
        if not found:
            return "a parameter of the model"
        trained = [name for name, p in self.unwrapped_model.named_parameters() if p.requires_grad]
        names = [trained[int(i)] for i in found.group(1).split() if int(i) < len(trained)]
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        return f"parameter{'s' if len(names) > 1 else ''} {', '.join(names[:3])}{more}" if names else \
            "a parameter of the model"


class SingleEngine(DDPEngine):
    def expected_distributed_type(self) -> str:
        # A data-parallel YAML launched with --num_processes 1 still goes through torchrun, and Accelerate then makes
        # a process group of one (DDP around the model, the same numbers); only a launch without one is NO.
        return super().expected_distributed_type() if self.launch.distributed_type != "NO" else "NO"


class DDP(Strategy):
    """PyTorch DistributedDataParallel over NCCL (GPUs) or gloo (CPUs)."""

    name = "ddp"
    engine = DDPEngine

    @classmethod
    def selects(cls, launch: Launch, cfg: TrainConfig) -> bool:
        return launch.distributed_type in ("MULTI_GPU", "MULTI_CPU") and launch.world_size > 1

    def estimate(self, shape: ModelShape, world_size: int, activations: int) -> Estimate:
        """Everything replicated: fp32 weights (a frozen base: as loaded, --model_dtype), fp32 gradients (kept
        between steps), the optimizer's fp32 states. Accelerate's bf16 is autocast: the weights stay fp32, so bf16
        saves no state memory."""
        n, trained = shape.num_params, shape.trained().num_params
        return Estimate(self.label, shape.weight_bytes(n, trained), 4 * trained,
                        OPTIMIZER_BYTES[self.cfg.optimizer] * trained, 0, activations)


class Single(DDP):
    """One process on one device: no process group, no wrapper. The reference every other strategy reproduces."""

    name = "single"
    engine = SingleEngine

    @classmethod
    def selects(cls, launch: Launch, cfg: TrainConfig) -> bool:
        return launch.distributed_type == "NO" or (launch.distributed_type in ("MULTI_GPU", "MULTI_CPU")
                                                   and launch.world_size == 1)
