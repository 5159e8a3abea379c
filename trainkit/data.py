"""Datasets to per-rank micro-batches, keeping the project's data-order invariant.

The invariant: the sequence of global batches depends only on the seed and the global batch size. Epoch `e` is a
permutation of the training set drawn from a generator seeded with (seed, e); global batch `g` of that epoch is
the slice [g*G, (g+1)*G) of it (the last partial global batch is dropped). Every rank cuts its own contiguous part
out of each global batch and splits that into `grad_accum` micro-batches, so world size, micro-batch size and
accumulation only decide who computes which samples, never which samples form a step. Accelerate's dataloader
sharding is not used for this reason: it shards an already-batched loader, which ties the order to world size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from trainkit.errors import ConfigError, Problem


def global_batch_size(micro_batch: int, grad_accum: int, world_size: int) -> int:
    """Samples per optimizer step over all ranks: what the data order, the schedule and the curves are defined by."""
    return micro_batch * grad_accum * world_size


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """Who computes which part of a global batch."""

    micro_batch: int  # per-process micro-batch
    grad_accum: int
    rank: int
    world_size: int

    @property
    def global_batch(self) -> int:
        return global_batch_size(self.micro_batch, self.grad_accum, self.world_size)

    def micro_slices(self) -> list[slice]:
        """Positions inside a global batch that this rank computes, one slice per micro-batch, in order."""
        start = self.rank * self.micro_batch * self.grad_accum
        return [slice(start + a * self.micro_batch, start + (a + 1) * self.micro_batch)
                for a in range(self.grad_accum)]


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The training set's order in one epoch: a fresh permutation every epoch, the same on every rank."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


def private_generator() -> torch.Generator:
    """Every new DataLoader iterator draws a base seed; from this generator, not the global RNG that dropout uses
    (otherwise a resumed run, which makes its iterator at another moment, sees different dropout masks)."""
    return torch.Generator().manual_seed(0)


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches (lists of dataset indices) for one epoch, global batch by global batch.

    `set_epoch(e)` selects the epoch's permutation; `start_batch` skips global batches already trained on in that
    epoch (resume). With `shuffle=False` the order is the dataset's (evaluation).
    """

    def __init__(self, num_samples: int, layout: BatchLayout, seed: int, shuffle: bool = True):
        if num_samples < layout.global_batch:
            raise ValueError(f"the dataset has {num_samples} samples, fewer than one global batch "
                             f"({layout.global_batch})")
        self.num_samples = num_samples
        self.layout = layout
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.start_batch = 0

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // self.layout.global_batch

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch = epoch
        self.start_batch = start_batch

    def __len__(self) -> int:
        return (self.batches_per_epoch - self.start_batch) * self.layout.grad_accum

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            order = epoch_order(self.num_samples, self.seed, self.epoch)
        else:
            order = torch.arange(self.num_samples)
        size = self.layout.global_batch
        for g in range(self.start_batch, self.batches_per_epoch):
            batch = order[g * size:(g + 1) * size]
            for part in self.layout.micro_slices():
                yield batch[part].tolist()


class TrainStream:
    """An endless stream of this rank's micro-batches that moves to the next epoch by itself.

    `position` (epoch, global batches done in it) is all that is needed to continue exactly where it stopped: no
    state of its own for the checkpoint (rank_state) and no metrics, unlike a streamed one (trainkit/stream.py).
    """

    def __init__(self, dataset: Dataset, layout: BatchLayout, seed: int):
        self.sampler = GlobalBatchSampler(len(dataset), layout, seed)  # type: ignore[arg-type]
        self.loader = DataLoader(dataset, batch_sampler=self.sampler, generator=private_generator())
        self.epoch = 0
        self.batch_in_epoch = 0
        self.note: str | None = None
        self._iterator: Iterator | None = None

    @property
    def position(self) -> tuple[int, int]:
        return self.epoch, self.batch_in_epoch

    def seek(self, epoch: int, batch_in_epoch: int, rank_states: list[dict] | None = None) -> None:
        self.epoch, self.batch_in_epoch = epoch, batch_in_epoch
        self._iterator = None

    def rank_state(self) -> dict | None:
        return None

    def metrics(self, accelerator: Any, copies: int) -> dict:
        return {}

    def next_global_batch(self) -> list:
        """This rank's micro-batches of the next global batch."""
        if self._iterator is None or self.batch_in_epoch == self.sampler.batches_per_epoch:
            if self.batch_in_epoch == self.sampler.batches_per_epoch:
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
            self.sampler.set_epoch(self.epoch, self.batch_in_epoch)
            self._iterator = iter(self.loader)
        micro_batches = [next(self._iterator) for _ in range(self.sampler.layout.grad_accum)]
        self.batch_in_epoch += 1
        return micro_batches


def eval_layout(layout: BatchLayout, num_samples: int) -> BatchLayout | None:
    """How the held-out split is cut: the training layout, or, for a split smaller than one global batch, the same
    layout with the largest micro-batch that fits (the whole split but its remainder evaluated at once; the same
    micro-batch count, which a pipeline's schedule needs). None: not even one sample per micro-batch."""
    if num_samples >= layout.global_batch:
        return layout
    micro_batch = num_samples // (layout.grad_accum * layout.world_size)
    return dataclasses.replace(layout, micro_batch=micro_batch) if micro_batch else None


def split_layouts(layout: BatchLayout, train_set: Dataset, eval_set: Dataset) -> tuple[BatchLayout, str | None]:
    """The held-out split's layout (eval_layout) and a note when it is smaller than the training's; a training split
    without one global batch (one that has a length: a streamed one has none), or a held-out one without a sample
    per micro-batch, is refused."""
    eval_samples = len(eval_set)  # type: ignore[arg-type]
    held_out = eval_layout(layout, eval_samples)
    where = "batch_size x grad_accum x data-parallel size"
    fix = "use a smaller --batch_size or --grad_accum, or more data"
    if hasattr(train_set, "__len__") and len(train_set) < layout.global_batch:
        raise ConfigError([Problem(f"the training split has {len(train_set)} samples, fewer than "
                                   f"{layout.global_batch}: one global batch", where, fix)])
    if held_out is None:
        raise ConfigError([Problem(f"the held-out split has {eval_samples} samples, fewer than "
                                   f"{layout.grad_accum * layout.world_size}: one per micro-batch of every "
                                   f"data-parallel rank", where, fix)])
    note = None if held_out is layout else (
        f"the held-out split ({eval_samples} samples) is smaller than one global batch ({layout.global_batch}): "
        f"evaluated as one batch of {held_out.global_batch} (micro-batch {held_out.micro_batch})")
    return held_out, note


def eval_batches(dataset: Dataset, layout: BatchLayout, num_global_batches: int) -> Iterator:
    """This rank's micro-batches of the first `num_global_batches` global batches of the held-out split, in order."""
    sampler = GlobalBatchSampler(len(dataset), layout, seed=0, shuffle=False)  # type: ignore[arg-type]
    sampler.set_epoch(0)
    limit = min(num_global_batches, sampler.batches_per_epoch) * layout.grad_accum
    for i, batch in enumerate(DataLoader(dataset, batch_sampler=sampler, generator=private_generator())):
        if i == limit:
            return
        yield batch
