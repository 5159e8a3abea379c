"""Test-only recipe: a small language model whose mixture of experts keeps one module per expert, written from the
recipe protocol alone (the layout of older MoE code and of many users' own; transformers' models fuse their experts
into one module).

What it carries: an `experts` ModuleList of which only the experts that some token picked run (top-1 routing), each
expert's weights larger than ZeRO-3's persistence threshold (10 x the hidden size), so that ZeRO-3 partitions them
and gathers an expert only when it runs. Ranks whose tokens pick different experts then ask for different gathers:
the collectives no longer match (measured here: DeepSpeed's RuntimeError "rank1: [0, 1, 2, 3, 8, ...]" at the first
step, its record of the modules run differing between ranks), unless the MoE block is a DeepSpeed leaf module
(gathered whole; the runner marks it, trainkit/strategies/deepspeed.py). With `apart`, each rank's tokens go only to
its own experts (rank r to experts r, r + ranks, ...): the routing forced apart at every step (not one process's
curve, by design).
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
    vocab: int = 48
    width: int = 16
    experts: int = 4
    seq_len: int = 12
    samples: int = 512
    batch_size: int = 8
    lr: float = 1e-2
    warmup_steps: int = 2
    weight_decay: float = 0.01
    max_steps: int = 6
    eval_every: int = 0
    eval_batches: int = 2
    find_unused_parameters: bool = True  # an expert may get no token in a step
    apart: bool = False  # route each rank's tokens to its own experts only


class Expert(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class MoEBlock(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.router = nn.Linear(cfg.width, cfg.experts)
        self.experts = nn.ModuleList(Expert(cfg.width) for _ in range(cfg.experts))
        self.apart = cfg.apart

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router(flat)
        if self.apart:  # only this rank's experts may win
            rank, ranks = (torch.distributed.get_rank(), torch.distributed.get_world_size()) \
                if torch.distributed.is_initialized() else (0, 1)
            mine = torch.arange(len(self.experts), device=x.device) % ranks == rank
            logits = logits.masked_fill(~mine, float("-inf"))
        weight, choice = torch.softmax(logits, dim=-1).max(dim=-1)
        out = torch.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            picked = choice == i
            if picked.any():  # an expert no token picked does not run
                out[picked] = weight[picked, None] * expert(flat[picked])
        return x + out.view_as(x)


class ExpertListLM(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.width)
        self.block = MoEBlock(cfg)
        self.out = nn.Linear(cfg.width, cfg.vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.embed(input_ids)))


class Sequences(Dataset):
    """Counting sequences modulo the vocabulary from random starts: the next token is learnable."""

    def __init__(self, starts: torch.Tensor, cfg: Config) -> None:
        self.ids = (starts[:, None] + torch.arange(cfg.seq_len)) % cfg.vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i]}


def build_model(cfg: Config) -> nn.Module:
    return ExpertListLM(cfg)


def build_datasets(cfg: Config, cache_dir: Path):
    starts = torch.randint(0, cfg.vocab, (cfg.samples,), generator=torch.Generator().manual_seed(5))
    split = cfg.samples * 3 // 4
    return Sequences(starts[:split], cfg), Sequences(starts[split:], cfg)


def loss(model: nn.Module, batch: dict) -> torch.Tensor:
    ids = batch["input_ids"]
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
