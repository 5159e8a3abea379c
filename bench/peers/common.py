"""What the peer scripts share: the same model, data and settings as `train.py --recipe tiny_transformer`, a clock
per optimizer step, and a record of what each peer really ran (bench/throughput.py compares it with what was asked).

Each peer writes one JSON file (--report): the wall-clock time at the end of every optimizer step, the seconds from
process start to the end of the first step, and `ran`: the distributed type, process count, the model's wrapper
classes, the ZeRO stage and whether the parameters are sharded DTensors. A peer that silently runs something other
than the strategy asked for (DDP for FSDP, one process for two) is then reported as such, not timed as the strategy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from trainkit.recipes import load_recipe  # noqa: E402

STARTED = psutil.Process().create_time()  # what train.py's elapsed_s counts from: the process start


def arguments(description: str) -> argparse.ArgumentParser:
    """The flags every peer takes; the defaults are the recipe's (tiny_transformer's Config)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--report", type=Path, required=True, help="JSON file written by the main process")
    parser.add_argument("--batch_size", type=int, default=16, help="per-process micro-batch")
    parser.add_argument("--grad_accum", type=int, default=1)
    parser.add_argument("--max_steps", type=int, default=24)
    parser.add_argument("--cache_dir", type=Path, default=Path(os.environ.get(
        "TRAINKIT_CACHE", Path.home() / ".cache" / "trainkit")), help="train.py's tokenised-data cache")
    return parser


def recipe_setup(args: argparse.Namespace):
    """(recipe, cfg, train_set): the tiny transformer's Config with the run's batch settings, and its training blocks
    (the same cache train.py reads)."""
    recipe = load_recipe("tiny_transformer")
    cfg = recipe.Config(batch_size=args.batch_size, grad_accum=args.grad_accum, max_steps=args.max_steps)
    train_set, _ = recipe.make_datasets(cfg, args.cache_dir)
    return recipe, cfg, train_set


def build_model(recipe, cfg) -> torch.nn.Module:
    """The recipe's model with its KV cache off, as the recipe's own loss asks (`use_cache=False`): every tool does
    the same work per step. Set on the config, since the Trainer calls the model with the batch alone."""
    model = recipe.build_model(cfg)
    model.config.use_cache = False
    return model


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only, as trainkit/models/optimizer.py (and the Trainer, for this model: no biases, 1-d
    norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


class StepClock:
    """perf_counter at the end of each optimizer step; seconds since the process started at the first."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.first_step_s: float | None = None

    def tick(self) -> None:
        self.times.append(time.perf_counter())
        if self.first_step_s is None:
            self.first_step_s = time.time() - STARTED


def what_ran(model: torch.nn.Module, accelerator=None) -> dict[str, Any]:
    """The facts bench/throughput.py checks against the strategy asked for."""
    from torch.distributed.tensor import DTensor

    wrappers, inner = [], model
    while inner is not None:
        wrappers.append(type(inner).__name__)
        inner = getattr(inner, "module", None)
    engine = model if hasattr(model, "zero_optimization_stage") else None
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return {"distributed_type": accelerator.distributed_type.value if accelerator is not None else "NO",
            "num_processes": accelerator.num_processes if accelerator is not None else 1,
            "world_size": world,
            "wrappers": wrappers,
            "zero_stage": engine.zero_optimization_stage() if engine is not None else None,
            "sharded": any(isinstance(p, DTensor) for p in model.parameters()),
            "threads": torch.get_num_threads()}


def write_report(path: Path, clock: StepClock, ran: dict[str, Any], is_main: bool = True) -> None:
    if is_main:
        path.write_text(json.dumps({"step_end_s": clock.times, "first_step_s": clock.first_step_s, "ran": ran}))
