"""Test-only recipe: recipes/mlp.py with a loss that overflows fp16 on chosen training samples.

The loss of each sample is multiplied by its factor: 1 for every sample but those listed in `overflow_samples`
(indices into the training set), whose `boost` no fp16 loss scale survives. The test that picks the indices of one
global batch (trainkit/data/batches.py's epoch_order) so knows the step at which the loss scaler must skip; a boost of
inf makes the loss itself non-finite, which the run must stop on when it stays so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from trainkit.recipes import load_recipe

MLP = load_recipe("mlp")


@dataclass(kw_only=True, slots=True)
class Config(MLP.Config):
    overflow_samples: str = ""  # comma-separated training-set indices whose loss is multiplied by boost
    boost: float = 1e6  # x 2**16 (the scaler's first scale): far past fp16's largest number, 65504
    max_steps: int = 12
    eval_every: int = 0


def build_model(cfg: Config) -> torch.nn.Module:
    return MLP.build_model(cfg)


def build_datasets(cfg: Config, cache_dir: Path):
    train, held_out = MLP.build_datasets(cfg, cache_dir)
    chosen = {int(i) for i in cfg.overflow_samples.split(",") if i}
    factor = torch.tensor([[cfg.boost if i in chosen else 1.0] for i in range(len(train))])
    return TensorDataset(*train.tensors, factor), TensorDataset(*held_out.tensors, torch.ones(len(held_out), 1))


def loss(model: torch.nn.Module, batch: list) -> torch.Tensor:
    x, y, factor = batch
    return (factor * (model(x).float() - y) ** 2).mean()
