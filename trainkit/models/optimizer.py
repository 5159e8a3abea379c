"""The optimizer and learning-rate schedule a recipe's config describes."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from trainkit.config import TrainConfig
from trainkit.errors import Problem
from trainkit.models import expert_bias


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module,
                    adam_class: type[torch.optim.Optimizer] = torch.optim.AdamW) -> torch.optim.Optimizer:
    """AdamW (or a drop-in such as DeepSpeed's CPU Adam) with weight decay on matrices only, or plain SGD; and a
    mixture of experts' routing biases moved before each step where --router_bias_update_rate asks (expert_bias.py).

    torch's AdamW runs its fused kernel (what the Hugging Face Trainer's default, adamw_torch_fused, selects): on a
    CPU torch's default is the one-tensor-at-a-time loop, measured 4.8x slower per step on the tiny transformer's 38
    tensors (3.1 vs 0.65 ms) and 4.0x on the cpu preset's (72 vs 18 ms). It rounds a little differently (3.6e-7
    after 23 steps); every strategy and the one-process reference use it alike, so the parity bounds hold.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "sgd":
        optimizer = torch.optim.SGD(params, lr=cfg.lr)
    else:
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        if cfg.optimizer == "adamw_8bit":
            from bitsandbytes.optim import AdamW8bit

            adam_class = AdamW8bit
        fused = {"fused": True} if adam_class is torch.optim.AdamW else {}
        optimizer = adam_class([g for g in groups if g["params"]], lr=cfg.lr, **fused)
    expert_bias.install(model, optimizer, getattr(cfg, "router_bias_update_rate", 0.0))  # before each step
    return optimizer


def strategy_problems(cfg: TrainConfig, strategy: Any) -> list[Problem]:
    """--optimizer adamw_8bit where its parameters are plain tensors: one process, DDP, DeepSpeed's ZeRO-1/2/3
    (DeepSpeed's CPU offload runs its own Adam: deepspeed_config.py refuses it there). bitsandbytes' 8-bit update is
    an operator DTensor has no rule for: FSDP2 and tensor parallelism stop at the first step with "got mixed
    torch.Tensor and DTensor"; refused when the run is planned instead."""
    if cfg.optimizer != "adamw_8bit" or strategy.name in ("single", "ddp", "deepspeed"):
        return []
    return [Problem(f"--optimizer adamw_8bit under {strategy.label}: bitsandbytes' 8-bit AdamW updates plain tensors, "
                    "and this strategy holds its parameters as DTensors", "config field optimizer",
                    "use ddp.yaml or a DeepSpeed ZeRO config without offload, or --set optimizer=adamw")]


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up from 0, then cosine down to lr * min_lr_ratio at max_steps: transformers'
    get_cosine_with_min_lr_schedule_with_warmup, the same formula written here because importing
    transformers.optimization imports peft and the Trainer's utilities, 2.7 s in every process of every launch
    (python -X importtime); tests/test_config.py holds the two equal at every step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        cosine_with_warmup, warmup=cfg.warmup_steps, total=cfg.max_steps, floor=cfg.min_lr_ratio))


def cosine_with_warmup(step: int, *, warmup: int, total: int, floor: float) -> float:
    """The factor on the learning rate at `step` (transformers' _get_cosine_schedule_with_warmup_lr_lambda, one
    half cycle)."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    progress = float(step - warmup) / float(max(1, total - warmup))
    factor = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))
    return max(0, factor * (1 - floor) + floor)
