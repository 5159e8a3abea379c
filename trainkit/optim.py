"""The optimizer and learning-rate schedule a recipe's config describes."""

from __future__ import annotations

import torch
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from trainkit.config import TrainConfig


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module,
                    adam_class: type[torch.optim.Optimizer] = torch.optim.AdamW) -> torch.optim.Optimizer:
    """AdamW (or a drop-in such as DeepSpeed's CPU Adam) with weight decay on matrices only, or plain SGD."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return adam_class([g for g in groups if g["params"]], lr=cfg.lr)


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer):
    """Linear warm-up from 0, then cosine down to lr * min_lr_ratio at max_steps."""
    return get_cosine_with_min_lr_schedule_with_warmup(optimizer, num_warmup_steps=cfg.warmup_steps,
                                                       num_training_steps=cfg.max_steps,
                                                       min_lr_rate=cfg.min_lr_ratio)
