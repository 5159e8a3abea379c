"""Test-only recipe: a tiny recurrent language model with tied embeddings, written from the recipe protocol alone.

What it carries that the shipped recipes do not: input and output embeddings that are one parameter (tied), a GRU,
a frozen parameter (the position table), a registered buffer, dict batches of integer token ids (Hugging Face
style), and no `model.config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from trainkit.config import TrainConfig


@dataclass(kw_only=True, slots=True)
class Config(TrainConfig):
    vocab: int = 50
    width: int = 24
    seq_len: int = 12
    samples: int = 512
    batch_size: int = 8
    lr: float = 1e-2
    warmup_steps: int = 2
    weight_decay: float = 0.01
    max_steps: int = 6
    eval_every: int = 0
    eval_batches: int = 2


class TiedRNN(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.width)
        self.positions = nn.Parameter(torch.randn(cfg.seq_len, cfg.width) * 0.1, requires_grad=False)
        self.register_buffer("scale", torch.tensor(cfg.width ** -0.5))
        self.rnn = nn.GRU(cfg.width, cfg.width, batch_first=True)
        self.out = nn.Linear(cfg.width, cfg.vocab, bias=False)
        self.out.weight = self.embed.weight  # tied

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(input_ids) + self.positions[: input_ids.shape[1]])
        return self.out(hidden * self.scale)


class Sequences(Dataset):
    """Counting sequences modulo the vocabulary from random starts: the next token is learnable."""

    def __init__(self, starts: torch.Tensor, cfg: Config) -> None:
        self.ids = (starts[:, None] + torch.arange(cfg.seq_len)) % cfg.vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i]}


def build_model(cfg: Config) -> nn.Module:
    return TiedRNN(cfg)


def build_datasets(cfg: Config, cache_dir: Path):
    starts = torch.randint(0, cfg.vocab, (cfg.samples,), generator=torch.Generator().manual_seed(3))
    split = cfg.samples * 3 // 4
    return Sequences(starts[:split], cfg), Sequences(starts[split:], cfg)


def loss(model: nn.Module, batch: dict) -> torch.Tensor:
    ids = batch["input_ids"]
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
