"""Values computed once per sample from the model as it starts, before the first step (a recipe's precompute hook:
recipes/dpo.py's --precompute_ref_logps, the reference model's log-probabilities, so that no reference is kept).

The pass runs every sample of both splits once, on the prepared model (sharded as it trains: every rank a share of
the micro-batches, in eval mode, under no_grad), and one reduction gives every rank the whole table. The values then
travel with their samples: each split is read through WithColumns, which adds a sample's values to it by index, so
they follow the global batch order on any process count. Every checkpoint holds the tables (FILE), and a resumed run
reads them back there: by then the model has trained, and the start it would need is gone.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from trainkit.data.batches import BatchLayout, EvalLayout, eval_batches
from trainkit.errors import ConfigError, Problem

PrecomputeFn = Callable[[torch.nn.Module, Any], dict[str, torch.Tensor]]  # (model, micro-batch) -> one value per sample
FILE = "precomputed.safetensors"  # in each checkpoint: "<split>/<column>" -> a value per sample of the split
SPLITS = ("train", "eval")


class WithColumns(Dataset):
    """A split whose samples (dicts) also carry their precomputed values, by index."""

    def __init__(self, dataset: Any, columns: dict[str, torch.Tensor]) -> None:
        self.dataset, self.columns = dataset, columns

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.dataset[index], **{name: values[index] for name, values in self.columns.items()}}

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:  # a Hugging Face dataset's batched read
        read = getattr(self.dataset, "__getitems__", None)
        samples = read(indices) if read is not None else [self.dataset[i] for i in indices]
        return [{**sample, **{name: values[i] for name, values in self.columns.items()}}
                for sample, i in zip(samples, indices, strict=True)]


def attach(engine: Any, fn: PrecomputeFn, train_set: Any, eval_set: Any, layout: BatchLayout,
           resumed: Path | None) -> tuple[WithColumns, WithColumns, dict[str, torch.Tensor]]:
    """(train, eval) with their values, and the tables a checkpoint keeps: computed now on a fresh start, read from
    the checkpoint `resumed` from."""
    if not hasattr(train_set, "__len__"):
        raise ConfigError([Problem("values precomputed per sample need the whole training split before the first "
                                   "step, and a streamed one is read as it trains", "--streaming",
                                   "pass --streaming false (the split prepared first), or drop the precomputation")])
    tables = _read(resumed) if resumed is not None else {
        f"{split}/{name}": values for split, dataset in zip(SPLITS, (train_set, eval_set), strict=True)
        for name, values in _pass(engine, fn, dataset, layout).items()}
    train, held_out = ({name.split("/", 1)[1]: values for name, values in tables.items()
                        if name.startswith(f"{split}/")} for split in SPLITS)
    return WithColumns(train_set, train), WithColumns(eval_set, held_out), tables


def _pass(engine: Any, fn: PrecomputeFn, dataset: Any, layout: BatchLayout) -> dict[str, torch.Tensor]:
    """fn over every sample once, each rank a share (EvalLayout's dealing: every rank runs as many forwards, a
    collective under ZeRO-3 and FSDP2), then summed across ranks into one table per column, on the CPU."""
    held = EvalLayout.of(layout, len(dataset), 0)
    tables: dict[str, torch.Tensor] = {}
    model = engine.model
    model.eval()
    with torch.no_grad():
        for (indices, real), (batch, _) in zip(held.micro_batches(), eval_batches(dataset, held), strict=True):
            for name, value in fn(model, engine.cast_batch(batch)).items():
                table = tables.setdefault(name, torch.zeros(len(dataset), device=engine.accelerator.device))
                if real:  # not a copy that only keeps the ranks' forwards in step
                    table[indices] = value.detach().float().reshape(-1)
    model.train()
    return {name: engine.accelerator.reduce(table, "sum").cpu() for name, table in tables.items()}


def save(folder: Path, tables: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({name: values.contiguous() for name, values in tables.items()}, str(folder / FILE))


def _read(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not (checkpoint / FILE).is_file():
        raise ConfigError([Problem(f"checkpoint {checkpoint} holds no {FILE}: the values this run precomputes from "
                                   "the model as it started, which a resumed model cannot give again", "--resume",
                                   "resume a checkpoint written by this recipe with the same settings, or start "
                                   "afresh in a new --output_dir")])
    return load_file(str(checkpoint / FILE))
