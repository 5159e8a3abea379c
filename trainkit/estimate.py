"""Model-state memory per rank, estimated before anything is built (checked against `state_bytes` in tests)."""

from __future__ import annotations

from types import ModuleType

import torch

from trainkit.config import TrainConfig
from trainkit.strategy import Launch

# Optimizer state bytes per parameter in fp32: AdamW keeps exp_avg and exp_avg_sq; plain SGD keeps nothing.
OPTIMIZER_BYTES = {"adamw": 8, "sgd": 0}


def count_parameters(recipe: ModuleType, cfg: TrainConfig) -> int:
    """The recipe's parameter count, from a model built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        model = recipe.build_model(cfg)
    return sum(p.numel() for p in model.parameters())


def estimate_state_bytes(num_params: int, launch: Launch, cfg: TrainConfig) -> int:
    """Bytes of parameters + gradients + optimizer states one rank holds.

    Single process and DDP replicate everything: fp32 parameters and gradients (Accelerate's bf16 is autocast,
    the weights stay fp32) and the optimizer's fp32 states.
    """
    return num_params * (4 + 4 + OPTIMIZER_BYTES[cfg.optimizer])
