"""The data-order invariant: global batches depend only on the seed and the global batch size."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from trainkit.data import BatchLayout, GlobalBatchSampler, TrainStream

NUM_SAMPLES, GLOBAL = 100, 8


def global_batches(world_size: int, grad_accum: int, epochs: int, seed: int = 3) -> list[list[int]]:
    """The global batches as every rank together sees them: rank 0's micro-batches, then rank 1's..."""
    micro = GLOBAL // (world_size * grad_accum)
    streams = [TrainStream(TensorDataset(torch.arange(NUM_SAMPLES)), BatchLayout(micro, grad_accum, r, world_size),
                           seed) for r in range(world_size)]
    steps = epochs * (NUM_SAMPLES // GLOBAL)
    batches = []
    for _ in range(steps):
        per_rank = [[i for (mb,) in s.next_global_batch() for i in mb.tolist()] for s in streams]
        batches.append([i for part in per_rank for i in part])
    return batches


@pytest.mark.parametrize("world_size, grad_accum", [(2, 1), (1, 2), (2, 2), (4, 2), (8, 1)])
def test_same_global_batches_whatever_the_split(world_size, grad_accum):
    assert global_batches(world_size, grad_accum, epochs=3) == global_batches(1, 1, epochs=3)


def test_each_epoch_is_a_fresh_permutation():
    batches = global_batches(1, 1, epochs=3)
    per_epoch = NUM_SAMPLES // GLOBAL
    epochs = [[i for b in batches[e * per_epoch:(e + 1) * per_epoch] for i in b] for e in range(3)]
    for order in epochs:  # no sample twice in an epoch; the 4 left over (100 % 8) are dropped
        assert len(set(order)) == len(order) == per_epoch * GLOBAL
    assert epochs[0] != epochs[1] != epochs[2]  # the set_epoch lesson: not the same order every epoch


def test_the_seed_changes_the_order_and_nothing_else_does():
    assert global_batches(1, 1, 1, seed=3) != global_batches(1, 1, 1, seed=4)
    assert global_batches(2, 2, 1, seed=4) == global_batches(1, 1, 1, seed=4)


def test_ranks_compute_disjoint_parts():
    layouts = [BatchLayout(2, 2, r, 2) for r in range(2)]
    parts = [list(GlobalBatchSampler(NUM_SAMPLES, layout, seed=0)) for layout in layouts]
    first = [set(parts[r][0]) | set(parts[r][1]) for r in range(2)]
    assert not first[0] & first[1] and len(first[0] | first[1]) == GLOBAL


def test_seek_continues_mid_epoch():
    full = TrainStream(TensorDataset(torch.arange(NUM_SAMPLES)), BatchLayout(4, 1, 0, 1), seed=0)
    expected = [full.next_global_batch() for _ in range(40)][17:]
    resumed = TrainStream(TensorDataset(torch.arange(NUM_SAMPLES)), BatchLayout(4, 1, 0, 1), seed=0)
    resumed.seek(*divmod(17, NUM_SAMPLES // 4))
    got = [resumed.next_global_batch() for _ in range(23)]
    assert [[t.tolist() for (t,) in b] for b in got] == [[t.tolist() for (t,) in b] for b in expected]


def test_iterating_does_not_consume_the_global_rng():
    """Dropout after a resume must see the RNG as it was saved: making a DataLoader iterator must not draw from it."""
    torch.manual_seed(0)
    before = torch.get_rng_state()
    stream = TrainStream(TensorDataset(torch.arange(NUM_SAMPLES)), BatchLayout(4, 1, 0, 1), seed=0)
    for _ in range(30):  # crosses an epoch boundary: a new iterator
        stream.next_global_batch()
    assert torch.equal(before, torch.get_rng_state())
