"""Test-only recipe: a small CNN with a mixture-of-experts head, written from the recipe protocol alone.

What it carries that the shipped recipes do not: convolutions with odd-sized parameters (7 channels, 3x3 kernels),
GroupNorm, a residual block, a registered buffer (the input normalisation), no `model.config`, tuple batches of a
float image and an integer label, a router with 4 experts of which only the top-1 per sample runs (so an expert can
take no part in a step: DDP's find_unused_parameters case), and every parameter smaller than a DeepSpeed bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from trainkit.config import TrainConfig


@dataclass(kw_only=True, slots=True)
class Config(TrainConfig):
    channels: int = 7
    experts: int = 4
    classes: int = 5
    image: int = 8
    samples: int = 512
    batch_size: int = 8
    lr: float = 3e-3
    warmup_steps: int = 2
    weight_decay: float = 0.01
    max_steps: int = 6
    eval_every: int = 0
    eval_batches: int = 2
    find_unused_parameters: bool = True  # an expert may get no sample in a step


class Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.GroupNorm(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.conv(x)))


class VisionMoE(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.register_buffer("mean", torch.full((1, 3, 1, 1), 0.5))
        self.stem = nn.Conv2d(3, cfg.channels, 3, padding=1)
        self.block = Residual(cfg.channels)
        self.router = nn.Linear(cfg.channels, cfg.experts)
        self.experts = nn.ModuleList(nn.Linear(cfg.channels, cfg.classes) for _ in range(cfg.experts))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.block(torch.relu(self.stem(images - self.mean))).mean(dim=(2, 3))
        gates = torch.softmax(self.router(features), dim=-1)
        weight, choice = gates.max(dim=-1)
        logits = features.new_zeros(len(features), self.experts[0].out_features)
        for i, expert in enumerate(self.experts):
            picked = choice == i
            if picked.any():  # an expert no sample picked takes no part in this step
                logits[picked] = weight[picked, None] * expert(features[picked])
        return logits


def build_model(cfg: Config) -> nn.Module:
    return VisionMoE(cfg)


def build_datasets(cfg: Config, cache_dir: Path):
    g = torch.Generator().manual_seed(7)
    labels = torch.randint(0, cfg.classes, (cfg.samples,), generator=g)
    images = torch.rand(cfg.samples, 3, cfg.image, cfg.image, generator=g)
    images[:, labels % 3, : cfg.image // 2] += 0.5  # a pattern the label decides
    split = cfg.samples * 3 // 4
    return TensorDataset(images[:split], labels[:split]), TensorDataset(images[split:], labels[split:])


def loss(model: nn.Module, batch) -> torch.Tensor:
    images, labels = batch
    return nn.functional.cross_entropy(model(images), labels)
