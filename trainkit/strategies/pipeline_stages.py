"""The pieces of a pipeline that are not the strategy: where the layers are cut, which names a stage's tensors have in
the whole model, releasing what a process does not hold, a timed PipelineStage, and a micro-batch's input, target and
weight as the schedule carries them (strategies/pipeline.py uses them).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from trainkit.errors import ConfigError, Problem


@functools.cache
def timed_stage() -> type:
    """torch's PipelineStage, adding the seconds its forward and backward computations take to `busy`: the rest of a
    step is waiting for the neighbours (the bubble) or sending. Made on first use: torch.distributed.pipelining takes
    over a second to import, which only pipeline runs should pay."""
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        def __init__(self, *args: Any, busy: list[float], **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.busy = busy

        def _timed(self, compute: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return compute(*args, **kwargs)
            finally:
                self.busy[0] += time.perf_counter() - started

        def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed(super().forward_one_chunk, *args, **kwargs)

        def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed(super().backward_one_chunk, *args, **kwargs)

    return TimedStage


def pipeline_io(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The first stage's input and the loss's target from a collated micro-batch (recipes/README.md): a dict's
    input_ids and labels, where it has none the input_ids with -100 on the padding (attention_mask 0), as
    transformers' language-modelling collator makes them."""
    if torch.is_tensor(batch):
        return batch, batch
    if isinstance(batch, dict):
        ids = batch["input_ids"]
        if "labels" in batch:
            return ids, batch["labels"]
        return ids, ids.masked_fill(batch["attention_mask"] == 0, -100) if "attention_mask" in batch else ids
    return batch[0], batch[1]


class Weighed:
    """A recipe's pipeline_loss times each micro-batch's factor (trainkit/step.py's loss_weights: its share of the
    global batch's learned units), which _cut appends to the target as a last column of float64 (which holds token
    ids exactly): the schedule passes a loss function only the output and the target."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.loss_fn = loss_fn

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target[:, :-1].long()) * target[0, -1].float()


def cut_points(recipe: Any, model: torch.nn.Module, stages: int, split: str) -> list[int]:
    """Where each stage's layers start (and the end), from --pipeline_split or balanced by parameter count (the
    first stage also holds the embeddings, the last the head: what the recipe's stages hold outside the layers)."""
    layers = list(recipe.pipeline_layers(model))
    n = len(layers)
    if n < stages:
        raise ConfigError([Problem(f"the model has {n} layers, too few for {stages} pipeline stages",
                                   "--pipeline_stages / --pipeline_schedule",
                                   f"use at most {n} stages (interleaved holds two per process)")])
    if split:
        starts = [int(x) for x in split.replace(" ", "").split(",")]
        if len(starts) != stages - 1 or starts != sorted(set(starts)) or not 0 < starts[0] <= starts[-1] < n:
            raise ConfigError([Problem(f"--pipeline_split {split} does not cut {n} layers into {stages} stages",
                                       "--pipeline_split", f"give {stages - 1} increasing layer indices between 1 "
                                       f"and {n - 1}, or leave it out to balance by parameter count")])
        return [0, *starts, n]
    inside = {id(p) for layer in layers for p in layer.parameters()}

    def outside(stage: torch.nn.Module) -> int:
        return sum(p.numel() for p in stage.parameters() if id(p) not in inside)

    first, last = (outside(recipe.pipeline_stage(model, range(0), first, not first)) for first in (True, False))
    return balanced_cuts([sum(p.numel() for p in layer.parameters()) for layer in layers], stages, first, last)


def shared_groups(every: list[torch.nn.Module], mine: torch.nn.Module, ranks: torch.Tensor,
                  pp_rank: int) -> list[tuple[str, Any, bool]]:
    """Parameters that stages on several processes hold (tied embeddings), by their name in this process's stages
    (`mine`; by name: sharding replaces the parameters), with the process group of those processes at this rank's
    place in the rest of the mesh (`ranks`: the mesh as [pp, the rest]) and whether this process is the first of
    them (the one whose copy the gradient norm counts). Every process creates every group, in one order (torch
    requires it)."""
    import torch.distributed as dist

    stages = ranks.shape[0]
    holders: dict[int, set[int]] = {}
    for i, stage in enumerate(every):
        for p in stage.parameters():
            holders.setdefault(id(p), set()).add(i % stages)
    place = (ranks[pp_rank] == dist.get_rank()).nonzero().item()
    names = {id(p): name for name, p in mine.named_parameters(remove_duplicate=False)}
    shared = []
    for key, processes in holders.items():
        if len(processes) < 2:
            continue
        for column in range(ranks.shape[1]):
            group = dist.new_group(sorted(ranks[r, column].item() for r in processes))
            if column == place and key in names:
                shared.append((names[key], group, min(processes) == pp_rank))
    return shared


def balanced_cuts(layer_sizes: list[int], stages: int, first_extra: int, last_extra: int) -> list[int]:
    """Layer indices where each stage starts (and the end): contiguous stages whose largest parameter count (the
    first stage also holds `first_extra`, the last `last_extra`) is as small as possible."""
    n = len(layer_sizes)
    prefix = [0]
    for size in layer_sizes:
        prefix.append(prefix[-1] + size)

    def cost(stage: int, a: int, b: int) -> int:
        return prefix[b] - prefix[a] + (first_extra if stage == 0 else 0) + (last_extra if stage == stages - 1 else 0)

    # best[s][i]: (the smallest largest stage, cuts) for layers [0, i) in s stages
    best: dict[tuple[int, int], tuple[int, list[int]]] = {(0, 0): (0, [0])}
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            options = [(max(best[(s - 1, j)][0], cost(s - 1, j, i)), best[(s - 1, j)][1] + [i])
                       for j in range(s - 1, i) if (s - 1, j) in best]
            best[(s, i)] = min(options)
    return best[(stages, n)][1]


def full_names(model: torch.nn.Module, stages: torch.nn.Module) -> dict[str, list[str]]:
    """Each name in the stages' state dict -> every name the same tensor has in the whole model."""
    names: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), []).append(name)
    return {name: names[id(tensor)] for name, tensor in
            [*stages.named_parameters(remove_duplicate=False), *stages.named_buffers(remove_duplicate=False)]}


def release_others(model: torch.nn.Module, mine: torch.nn.Module) -> None:
    """Drop the storage of every weight no stage of this process holds (the model keeps its structure)."""
    kept = {id(t) for t in [*mine.parameters(), *mine.buffers()]}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in kept:
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
