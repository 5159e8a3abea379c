"""A small MLP on a synthetic regression task: the classic data-parallel demonstration.

Trains: an MLP (optionally with BatchNorm, which becomes SyncBatchNorm in multi-process GPU runs) to predict
y = X w + noise, with X ~ N(0, 1) and a fixed random w. Data is generated from `data_seed`: nothing to download.
Output: `final/model.safetensors` and `final/config.json` (the run's config). Load it with
    recipe = trainkit.recipes.load_recipe("mlp")
    model = recipe.build_model(recipe.Config(**json.load(open("final/config.json"))))
    safetensors.torch.load_model(model, "final/model.safetensors")

To add your own model, copy this file: change `Config` (your sizes, your data settings), `build_model`,
`build_datasets` (any map-style datasets whose samples collate into tensors) and `loss`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from trainkit.config import TrainConfig
from trainkit.errors import Problem


@dataclass(kw_only=True, slots=True)
class Config(TrainConfig):
    # Model
    features: int = 32
    hidden: int = 64
    layers: int = 2  # hidden layers
    batchnorm: bool = False
    # Data
    train_samples: int = 8192
    eval_samples: int = 1024
    noise: float = 0.1
    data_seed: int = 1234  # the data is the same whatever the training seed
    # Training (overrides of TrainConfig's defaults)
    batch_size: int = 32
    lr: float = 1e-2
    max_steps: int = 200

    def check(self) -> list[Problem]:
        problems = []
        for name in ("features", "hidden", "layers", "train_samples", "eval_samples"):
            if getattr(self, name) < 1:
                problems.append(Problem(f"{name} must be >= 1, got {getattr(self, name)}", f"config field {name}",
                                        f"use --{name} 1 or more"))
        if self.noise < 0:
            problems.append(Problem(f"noise must be >= 0, got {self.noise}", "config field noise", "use --noise 0.1"))
        return problems


def build_model(cfg: Config) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    width = cfg.features
    for _ in range(cfg.layers):
        layers.append(torch.nn.Linear(width, cfg.hidden))
        if cfg.batchnorm:
            layers.append(torch.nn.BatchNorm1d(cfg.hidden))
        layers.append(torch.nn.ReLU())
        width = cfg.hidden
    layers.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*layers)


def build_datasets(cfg: Config, cache_dir: Path):
    generator = torch.Generator().manual_seed(cfg.data_seed)
    w = torch.randn(cfg.features, 1, generator=generator)
    x = torch.randn(cfg.train_samples + cfg.eval_samples, cfg.features, generator=generator)
    y = x @ w + cfg.noise * torch.randn(len(x), 1, generator=generator)
    split = cfg.train_samples
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])


def loss(model: torch.nn.Module, batch: list) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)
