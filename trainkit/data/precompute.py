"""Values computed once per sample before the first step (a recipe's precompute hook): recipes/dpo.py's
--precompute_ref_logps, the reference model's log-probabilities from the model as it starts, so that no reference is
kept; recipes/distill.py's --precompute_teacher_topk, the teacher's top K per position, so that no teacher is kept.

The pass runs every sample of both splits once, in eval mode under no_grad, every rank a share of the micro-batches,
and one reduction gives every rank the whole table. It runs the prepared model (sharded as it trains), or a model of
the recipe's own (OwnModel: whole on every rank, before the trained model is built, so that the two are never held
together). The values then travel with their samples: each split is read through WithColumns, which adds a sample's
values to it by index, so they follow the global batch order on any process count. Every checkpoint holds the tables
(FILE), and a resumed run reads them back there: by then the model has trained, and the start it would need is gone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from trainkit.data.batches import BatchLayout, EvalLayout, eval_batches
from trainkit.errors import ConfigError, Problem

# (model, micro-batch) -> {column: a value per sample, [samples, ...]}
PrecomputeFn = Callable[[torch.nn.Module, Any], dict[str, torch.Tensor]]
FILE = "precomputed.safetensors"  # in each checkpoint: "<split>/<column>" -> a value per sample of the split
SPLITS = ("train", "eval")


@dataclass(frozen=True, slots=True)
class OwnModel:
    """A pass over a model of the recipe's own (`build()`), not over the one it trains (recipes/distill.py's
    teacher): run before that one is built (attach with no engine model yet), and freed after."""

    build: Callable[[], torch.nn.Module]
    fn: PrecomputeFn


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


def attach(engine: Any, precompute: PrecomputeFn | OwnModel, train_set: Any, eval_set: Any, layout: BatchLayout,
           resumed: Path | None) -> tuple[WithColumns, WithColumns, dict[str, torch.Tensor]]:
    """(train, eval) with their values, and the tables a checkpoint keeps: computed now on a fresh start, read from
    the checkpoint `resumed` from."""
    if not hasattr(train_set, "__len__"):
        raise ConfigError([Problem("values precomputed per sample need the whole training split before the first "
                                   "step, and a streamed one is read as it trains", "--streaming",
                                   "pass --streaming false (the split prepared first), or drop the precomputation")])
    if resumed is not None:
        tables = _read(resumed)
    else:
        own = isinstance(precompute, OwnModel)
        if own:
            with engine.building_alone():  # whole on this rank, never partitioned as it is built (ZeRO-3's zero.Init)
                model = precompute.build().to(engine.accelerator.device)
        else:
            model = engine.model
        fn = precompute.fn if own else precompute
        tables = {f"{split}/{name}": values for split, dataset in zip(SPLITS, (train_set, eval_set), strict=True)
                  for name, values in _pass(engine, model, fn, dataset, layout).items()}
        del model  # an own model's last reference: freed before the trained model is built
    train, held_out = ({name.split("/", 1)[1]: values for name, values in tables.items()
                        if name.startswith(f"{split}/")} for split in SPLITS)
    return WithColumns(train_set, train), WithColumns(eval_set, held_out), tables


def _pass(engine: Any, model: torch.nn.Module, fn: PrecomputeFn, dataset: Any,
          layout: BatchLayout) -> dict[str, torch.Tensor]:
    """fn over every sample once, each rank a share (EvalLayout's dealing: every rank runs as many forwards, a
    collective under ZeRO-3 and FSDP2), then summed across ranks into one table per column. The tables stay in CPU
    memory (a teacher's top K per position can outgrow a device) and pass through the device a slice at a time."""
    held = EvalLayout.of(layout, len(dataset), 0)
    tables: dict[str, torch.Tensor] = {}
    model.eval()
    with torch.no_grad(), engine.accelerator.autocast():
        for (indices, real), (batch, _) in zip(held.micro_batches(), eval_batches(dataset, held), strict=True):
            for name, value in fn(model, engine.cast_batch(batch)).items():
                kept = torch.float32 if value.is_floating_point() else value.dtype  # ids stay integers
                table = tables.setdefault(name, torch.zeros(len(dataset), *value.shape[1:], dtype=kept))
                if real:  # not a copy that only keeps the ranks' forwards in step
                    table[indices] = value.detach().to("cpu", kept)
    model.train()
    return {name: _summed(engine, table) for name, table in tables.items()}


SLICE_BYTES = 64 << 20  # of a table on the device at a time while it is summed across ranks


def _summed(engine: Any, table: torch.Tensor) -> torch.Tensor:
    """The table summed across ranks (every rank holds zeros but for its own samples), slice by slice of samples."""
    per_sample = max(1, table[:1].numel() * table.element_size())
    for part in table.split(max(1, SLICE_BYTES // per_sample)):
        part.copy_(engine.accelerator.reduce(part.to(engine.accelerator.device), "sum").cpu())
    return table


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
