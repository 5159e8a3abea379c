"""Datasets to per-rank micro-batches, keeping the project's data-order invariant.

The invariant: the sequence of global batches depends only on the seed and the global batch size. Epoch `e` is a
permutation of the training set drawn from a generator seeded with (seed, e); global batch `g` of that epoch is
the slice [g*G, (g+1)*G) of it (the last partial global batch is dropped). Every rank cuts its own contiguous part
out of each global batch and splits that into `grad_accum` micro-batches, so world size, micro-batch size and
accumulation only decide who computes which samples, never which samples form a step. Accelerate's dataloader
sharding is not used for this reason: it shards an already-batched loader, which ties the order to world size.
"""

from __future__ import annotations

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


def epoch_order(num_samples: int, seed: int, epoch: int, group: int = 1) -> torch.Tensor:
    """The training set's order in one epoch: a fresh permutation every epoch, the same on every rank. With `group`
    > 1, a permutation of whole groups (samples g*group ... g*group + group - 1 stay side by side, in order: the
    completions of one prompt, trainkit/data/prompts.py); group 1 is the plain permutation."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    groups = torch.randperm(num_samples // group, generator=generator)
    return (groups[:, None] * group + torch.arange(group)).reshape(-1)


def private_generator() -> torch.Generator:
    """Every new DataLoader iterator draws a base seed; from this generator, not the global RNG that dropout uses
    (otherwise a resumed run, which makes its iterator at another moment, sees different dropout masks)."""
    return torch.Generator().manual_seed(0)


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches (lists of dataset indices) for one epoch, global batch by global batch.

    `set_epoch(e)` selects the epoch's permutation; `start_batch` skips global batches already trained on in that
    epoch (resume). With `shuffle=False` the order is the dataset's (evaluation). `group`: samples kept together in
    the permutation (epoch_order); `repeats`: each global batch given that many times in a row (an online-RL
    recipe's --num_iterations, which trains on one batch of completions for several steps).
    """

    def __init__(self, num_samples: int, layout: BatchLayout, seed: int, shuffle: bool = True, group: int = 1,
                 repeats: int = 1):
        if num_samples < layout.global_batch:
            raise ValueError(f"the dataset has {num_samples} samples, fewer than one global batch "
                             f"({layout.global_batch})")
        self.num_samples = num_samples
        self.layout = layout
        self.seed = seed
        self.shuffle = shuffle
        self.group, self.repeats = group, repeats
        self.epoch = 0
        self.start_batch = 0

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // self.layout.global_batch * self.repeats

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch = epoch
        self.start_batch = start_batch

    def __len__(self) -> int:
        return (self.batches_per_epoch - self.start_batch) * self.layout.grad_accum

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            order = epoch_order(self.num_samples, self.seed, self.epoch, self.group)
        else:
            order = torch.arange(self.num_samples)
        size = self.layout.global_batch
        for g in range(self.start_batch, self.batches_per_epoch):
            batch = order[g // self.repeats * size:(g // self.repeats + 1) * size]
            for part in self.layout.micro_slices():
                yield batch[part].tolist()


class TrainStream:
    """An endless stream of this rank's micro-batches that moves to the next epoch by itself.

    `position` (epoch, global batches done in it) is all that is needed to continue exactly where it stopped: no
    state of its own for the checkpoint (rank_state) and no metrics, unlike a streamed one (trainkit/data/stream.py).
    """

    def __init__(self, dataset: Dataset, layout: BatchLayout, seed: int):
        self.sampler = GlobalBatchSampler(len(dataset), layout, seed,  # type: ignore[arg-type]
                                          group=getattr(dataset, "group_size", 1),
                                          repeats=getattr(dataset, "repeats", 1))
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


@dataclass(frozen=True, slots=True)
class EvalLayout:
    """How the held-out split is evaluated: every one of its first `samples` samples exactly once, on any number of
    processes. They are cut into micro-batches of one size, the largest that divides `samples` and is at most the
    training micro-batch, so that no sample is left over and no micro-batch mixes real samples with padding; those
    micro-batches are dealt to the data-parallel ranks round by round, grad_accum each (a pipeline's schedule runs
    them as one group), and a rank left without a real one in the last round evaluates a copy of the first that
    weighs nothing: every rank runs the same forwards (a collective under ZeRO-3 and FSDP2). So the eval loss, the
    mean over every sample (or every learned unit: a recipe's loss_weight) evaluated, is the same whatever the
    process count and the split of the global batch."""

    samples: int  # held-out samples evaluated
    micro_batch: int
    layout: BatchLayout  # the training layout: this rank's place, grad_accum, the data-parallel size

    @classmethod
    def of(cls, layout: BatchLayout, held_out: int, global_batches: int) -> EvalLayout:
        """The first `global_batches` global batches' worth of the split (0: all of it)."""
        samples = min(held_out, global_batches * layout.global_batch) if global_batches else held_out
        micro_batch = max(d for d in range(1, min(layout.micro_batch, samples) + 1) if samples % d == 0)
        return cls(samples, micro_batch, layout)

    @property
    def rounds(self) -> int:
        """Rounds of grad_accum micro-batches per data-parallel rank."""
        per_round = self.layout.grad_accum * self.layout.world_size
        return -(-self.samples // self.micro_batch // per_round)

    def micro_batches(self) -> Iterator[tuple[list[int], bool]]:
        """This rank's micro-batches in order: (the samples' indices, whether they are real rather than a copy that
        weighs nothing)."""
        a, n, real = self.layout.grad_accum, self.micro_batch, self.samples // self.micro_batch
        for r in range(self.rounds):
            first = (r * self.layout.world_size + self.layout.rank) * a  # micro-batch j holds samples j*n ... j*n+n-1
            for j in range(first, first + a):
                yield (list(range(j * n, (j + 1) * n)), True) if j < real else (list(range(n)), False)

    def note(self, held_out: int) -> str | None:
        """Said before training where the micro-batch is not the training's, or the split is not evaluated whole."""
        parts = [f"the first {self.samples} of the {held_out} held-out samples evaluated (--eval_batches)"
                 if self.samples < held_out else ""]
        if self.micro_batch != self.layout.micro_batch:
            parts.append(f"in micro-batches of {self.micro_batch}, the largest that divides the {self.samples} "
                         f"samples evaluated, so that each is evaluated once on any number of processes")
        return "; ".join(p for p in parts if p) or None


def split_layouts(layout: BatchLayout, train_set: Dataset, eval_set: Dataset,
                  global_batches: int) -> tuple[EvalLayout, str | None]:
    """The held-out split's EvalLayout and a note about it; a training split without one global batch (one that has
    a length: a streamed one has none), or an empty held-out one, is refused."""
    where = "batch_size x grad_accum x data-parallel size"
    if hasattr(train_set, "__len__") and len(train_set) < layout.global_batch:
        raise ConfigError([Problem(f"the training split has {len(train_set)} samples, fewer than "
                                   f"{layout.global_batch}: one global batch", where,
                                   "use a smaller --batch_size or --grad_accum, or more data")])
    if len(eval_set) == 0:  # type: ignore[arg-type]
        raise ConfigError([Problem("the held-out split is empty", "--eval_fraction / --eval_data",
                                   "hold out more data (a larger --eval_fraction, or a larger --eval_data file)")])
    held = EvalLayout.of(layout, len(eval_set), global_batches)  # type: ignore[arg-type]
    return held, held.note(len(eval_set))  # type: ignore[arg-type]


def eval_batches(dataset: Dataset, held: EvalLayout) -> Iterator[tuple[Any, bool]]:
    """This rank's held-out micro-batches, collated, each with whether it is real (EvalLayout.micro_batches)."""
    dealt = list(held.micro_batches())
    loader = DataLoader(dataset, batch_sampler=[indices for indices, _ in dealt], generator=private_generator())
    for batch, (_, real) in zip(loader, dealt, strict=True):
        yield batch, real
