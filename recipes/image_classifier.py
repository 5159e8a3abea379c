"""A small convolutional image classifier on generated pictures of shapes, with held-out accuracy.

Trains: a CNN (two convolution blocks with GroupNorm, then a linear head) to tell four kinds of 16 x 16 grey
pictures apart: a filled square, a ring, a cross and a diagonal stroke, each at a random place and size, under
noise. Data: generated from `data_seed` by `build_datasets`, nothing to download. Reports `eval_accuracy` next to
the loss (the `eval_metrics` hook). Output: `final/model.safetensors` and `final/config.json`, reloaded with
    recipe = trainkit.recipes.load_recipe("image_classifier")
    model = recipe.build_model(recipe.Config(**json.load(open("final/config.json"))))
    safetensors.torch.load_model(model, "final/model.safetensors")

To classify your own images, copy this file (`python -m trainkit.tools.catalog cp image_classifier my_images.py`) and
change `build_datasets` to return your (image, label) pairs (any map-style dataset of equal-shaped tensors), `Config`
(classes, image size) and, if you like, `build_model`. GroupNorm rather than BatchNorm: its statistics are each
sample's own, so every strategy computes the same thing (BatchNorm normalises with each rank's micro-batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from trainkit.config import TrainConfig
from trainkit.errors import Problem

SHAPES = ("square", "ring", "cross", "stroke")


@dataclass(kw_only=True, slots=True)
class Config(TrainConfig):
    # Model
    channels: int = 16  # of the first convolution block; the second has twice as many
    # Data
    image: int = 16  # pixels per side
    noise: float = 0.3  # standard deviation of the Gaussian noise added to every pixel
    train_samples: int = 4096
    eval_samples: int = 512
    data_seed: int = 99  # the pictures are the same whatever the training seed
    # Training (overrides of TrainConfig's defaults)
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.01
    max_steps: int = 200
    eval_every: int = 50

    def check(self) -> list[Problem]:
        problems = []
        if self.image < 8 or self.image % 4:
            problems.append(Problem(f"image must be a multiple of 4 from 8 on, got {self.image}", "config field image",
                                    "use --image 16"))
        for name in ("channels", "train_samples", "eval_samples"):
            if getattr(self, name) < 1:
                problems.append(Problem(f"{name} must be >= 1, got {getattr(self, name)}", f"config field {name}",
                                        f"use --{name} 1 or more"))
        return problems


def build_model(cfg: Config) -> nn.Module:
    c = cfg.channels

    def block(inputs: int, outputs: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(inputs, outputs, 3, padding=1), nn.GroupNorm(4, outputs), nn.ReLU(),
                             nn.MaxPool2d(2))

    return nn.Sequential(block(1, c), block(c, 2 * c), nn.Flatten(),
                         nn.Linear(2 * c * (cfg.image // 4) ** 2, len(SHAPES)))


def draw(labels: torch.Tensor, size: int, generator: torch.Generator) -> torch.Tensor:
    """One picture per label: the shape, somewhere, of some size, drawn with 1.0 on 0.0."""
    n = len(labels)
    ys, xs = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    radius = size * (0.15 + 0.15 * torch.rand(n, 1, 1, generator=generator))
    margin = radius + 1
    cy = margin + (size - 2 * margin) * torch.rand(n, 1, 1, generator=generator)
    cx = margin + (size - 2 * margin) * torch.rand(n, 1, 1, generator=generator)
    dy, dx = ys - cy, xs - cx
    distance = torch.sqrt(dy ** 2 + dx ** 2)
    pictures = torch.stack([
        (dy.abs() <= radius) & (dx.abs() <= radius),  # square
        (distance <= radius) & (distance >= radius - 1.5),  # ring
        ((dy.abs() <= 1) & (dx.abs() <= radius)) | ((dx.abs() <= 1) & (dy.abs() <= radius)),  # cross
        ((dy - dx).abs() <= 1) & (distance <= radius * math.sqrt(2)),  # stroke
    ])
    return pictures[labels, torch.arange(n)].float()


def build_datasets(cfg: Config, cache_dir: Path):
    generator = torch.Generator().manual_seed(cfg.data_seed)
    total = cfg.train_samples + cfg.eval_samples
    labels = torch.randint(0, len(SHAPES), (total,), generator=generator)
    images = draw(labels, cfg.image, generator) + cfg.noise * torch.randn(total, cfg.image, cfg.image,
                                                                         generator=generator)
    images = images[:, None]  # one channel
    split = cfg.train_samples
    return TensorDataset(images[:split], labels[:split]), TensorDataset(images[split:], labels[split:])


def loss(model: nn.Module, batch) -> torch.Tensor:
    images, labels = batch
    return nn.functional.cross_entropy(model(images), labels)


def eval_metrics(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    images, labels = batch
    return {"accuracy": (model(images).argmax(dim=-1) == labels).sum()}
