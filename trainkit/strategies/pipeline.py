"""Pipeline parallelism: the model's layers cut into stages, one stage per process, micro-batches flowing through.

The sources' model parallelism, with `torch.distributed.pipelining`: stage k holds layers [a_k, b_k) (the first also
the embeddings, the last the head), activations go forward to the next stage and gradients come back. With one
micro-batch per step (`--grad_accum 1 --pipeline_schedule gpipe`) only one stage works at a time: naive model
parallelism, whose idle time is the "bubble"; more micro-batches fill it. Schedules: GPipe (all forwards, then all
backwards), 1F1B (a backward as soon as possible: fewer activations held) and interleaved 1F1B (two stages per
process, half the bubble). Each step's `grad_accum` micro-batches are the pipeline's micro-batches, so the global
batch and the data order stay those of one process.

Processes = stages x data-parallel replicas: with 4 processes and `--pipeline_stages 2`, ranks 0-1 and 2-3 are two
pipelines that each compute half of every global batch, and every stage all-reduces its gradients with the same
stage of the other pipeline (one collective per step). A parameter that two stages hold (tied input and output
embeddings) is updated from the sum of both stages' gradients, as Megatron-LM does, so the copies stay equal.

Selected by `--pipeline_stages N` with a data-parallel launch (ddp.yaml, multinode.yaml, a hostfile), not by a YAML:
Accelerate's YAML refuses unknown keys, has no pipeline degree in `parallelism_config`, and hands its processes only
the settings of the features it knows (docs/strategies.md explains the choice). The recipe says where the model can
be cut (`pipeline_layers`, `pipeline_stage`, `pipeline_loss`: recipes/README.md).
"""

from __future__ import annotations

import functools
import math
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from trainkit.config import TrainConfig
from trainkit.errors import ConfigError, Problem
from trainkit.estimate import OPTIMIZER_BYTES, Estimate, ModelShape
from trainkit.guards import FiniteCheck
from trainkit.launch import Launch
from trainkit.metrics import state_bytes
from trainkit.recipes import no_generations
from trainkit.strategies.base import LossFn, MetricsFn, StepResult, Strategy, restore_trained, trained_state

# Stages per process under each schedule (interleaved: stage i lives on process i mod p).
STAGES_PER_PROCESS = {"gpipe": 1, "1f1b": 1, "interleaved": 2}


class Pipeline(Strategy):
    """Stages over point-to-point sends (NCCL or gloo), optionally replicated for data parallelism."""

    name = "pipeline"
    checkpoint_format = "dcp_pipeline"
    splits_model = True

    @classmethod
    def selects(cls, launch: Launch, cfg: TrainConfig) -> bool:
        return cfg.pipeline_stages > 1

    # --- plan ---------------------------------------------------------------------------------------------------

    @property
    def stages(self) -> int:
        """Processes per pipeline."""
        return self.cfg.pipeline_stages

    @property
    def total_stages(self) -> int:
        """Stages per pipeline (interleaved: two on each process)."""
        return self.stages * STAGES_PER_PROCESS[self.cfg.pipeline_schedule]

    @property
    def data_parallel_size(self) -> int:
        return max(1, self.launch.world_size // self.stages)

    @property
    def data_parallel_rank(self) -> int:
        return self.accelerator.process_index // self.stages

    @property
    def label(self) -> str:
        return f"pipeline_{self.cfg.pipeline_schedule}"

    def check(self) -> list[Problem]:
        cfg, launch, where = self.cfg, self.launch, "--pipeline_stages"
        problems = super().check() if launch.mixed_precision != "fp16" else [
            # Measured on a CPU, and so on a GPU: torch's schedule runs each stage's backward itself, on the
            # unscaled loss, and the scaler's step then fails ("Attempted step but _scale is None").
            Problem("fp16 does not work with pipeline stages: the pipeline schedule runs each stage's backward "
                    "itself, without the loss scaler", f"{where} with mixed_precision from {launch.source}",
                    "train the pipeline in bf16 (--mixed_precision bf16) or fp32")]
        if self.recipe is not None and self.recipe.generate is not no_generations:
            problems.append(Problem(f"recipe {self.recipe.path.name} generates text at each evaluation (generate), "
                                    "which needs the whole model in one process: a pipeline stage holds part of it",
                                    where, "train it without --pipeline_stages"))
        if self.loss_weigher is not None:
            problems.append(Problem(f"recipe {self.recipe.path.name} weighs its micro-batches (loss_weight), which the "
                                    "pipeline's schedule does not: each micro-batch's mean would count the same",
                                    where, "train it without --pipeline_stages"))
        if launch.distributed_type not in ("MULTI_GPU", "MULTI_CPU", "NO"):
            problems.append(Problem(f"pipeline stages compose with data parallelism only, not with "
                                    f"{launch.distributed_type}", f"{where} with {launch.source}",
                                    "launch with accelerate_configs/ddp.yaml (or multinode.yaml), or drop "
                                    "--pipeline_stages"))
        if launch.world_size % self.stages or launch.world_size < self.stages:
            problems.append(Problem(f"{launch.world_size} process(es) cannot hold {self.stages} stages per pipeline",
                                    f"{where} {self.stages} with num_processes {launch.world_size}",
                                    f"launch a multiple of {self.stages} processes (--num_processes "
                                    f"{self.stages}), or change --pipeline_stages"))
        m, p = cfg.grad_accum, self.stages
        if cfg.pipeline_schedule == "1f1b" and m < p:
            problems.append(Problem(f"1F1B needs at least as many micro-batches per step as stages: grad_accum {m} < "
                                    f"{p} stages", "--grad_accum", f"pass --grad_accum {p} or more (the "
                                    f"micro-batches fill the pipeline), or --pipeline_schedule gpipe"))
        rounds = max(1, m // p)
        if cfg.pipeline_schedule == "interleaved" and m % rounds:
            problems.append(Problem(f"interleaved 1F1B runs the micro-batches in {rounds} round(s) (grad_accum // "
                                    f"stages), so grad_accum must be a multiple of {rounds}; got {m}", "--grad_accum",
                                    f"pass --grad_accum {p * rounds} (a multiple of the {p} stages)"))
        return problems

    def check_model(self, model: torch.nn.Module) -> list[Problem]:
        recipe = self.recipe
        hooks = ("pipeline_layers", "pipeline_stage", "pipeline_loss")
        if recipe is None or any(getattr(recipe, h) is None for h in hooks):
            where = f"--recipe {recipe.path}" if recipe else "--recipe"
            return [Problem("the recipe does not say where its model can be cut into pipeline stages", where,
                            "define pipeline_layers, pipeline_stage and pipeline_loss in the recipe (recipes/README.md;"
                            " recipes/tiny_transformer.py has them), or train it with another strategy (fsdp.yaml, "
                            "deepspeed_zero3.yaml shard a model that does not fit)")]
        try:
            self.cuts(model)
        except ConfigError as e:
            return list(e.problems)
        return []

    def cuts(self, model: torch.nn.Module) -> list[int]:
        """Where each stage's layers start (and the end), from --pipeline_split or balanced by parameter count."""
        layers = list(self.recipe.pipeline_layers(model))
        n, s = len(layers), self.total_stages
        if n < s:
            raise ConfigError([Problem(f"the model has {n} layers, too few for {s} pipeline stages",
                                       "--pipeline_stages / --pipeline_schedule",
                                       f"use at most {n} stages (interleaved holds two per process)")])
        if self.cfg.pipeline_split:
            starts = [int(x) for x in self.cfg.pipeline_split.replace(" ", "").split(",")]
            if len(starts) != s - 1 or starts != sorted(set(starts)) or not 0 < starts[0] <= starts[-1] < n:
                raise ConfigError([Problem(f"--pipeline_split {self.cfg.pipeline_split} does not cut {n} layers into "
                                           f"{s} stages", "--pipeline_split",
                                           f"give {s - 1} increasing layer indices between 1 and {n - 1}, or leave "
                                           f"it out to balance by parameter count")])
            return [0, *starts, n]
        first, last = self._ends(model, layers)
        return balanced_cuts([sum(p.numel() for p in layer.parameters()) for layer in layers], s, first, last)

    def _ends(self, model: torch.nn.Module, layers: list[torch.nn.Module]) -> tuple[int, int]:
        """Parameters outside the layers: what the first stage adds (embeddings) and what the last adds (head)."""
        inside = {id(p) for layer in layers for p in layer.parameters()}
        first_stage = self.recipe.pipeline_stage(model, range(0), True, False)
        last_stage = self.recipe.pipeline_stage(model, range(0), False, True)
        count = lambda stage: sum(p.numel() for p in stage.parameters() if id(p) not in inside)  # noqa: E731
        return count(first_stage), count(last_stage)

    def estimate(self, shape: ModelShape, world_size: int, activations: int) -> Estimate:
        """DDP's bytes per parameter for one process's stages: the layers (parameters named with a layer index)
        balanced across the stages, plus all the rest (embeddings and head: the first and last stage hold them).
        Activations: this process's share of the layers, for the micro-batches in flight at once (GPipe: every one
        of the step; 1F1B: at most one per stage)."""
        per_process = STAGES_PER_PROCESS[self.cfg.pipeline_schedule] / self.total_stages

        def held(part: ModelShape) -> int:
            layered = sum(n for n, name in zip(part.numels, part.names, strict=True) if re.search(r"\.\d+\.", name))
            return min(part.num_params, math.ceil(layered * per_process) + part.num_params - layered)

        n, trained = held(shape), held(shape.trained())
        m = self.cfg.grad_accum
        in_flight = m if self.cfg.pipeline_schedule == "gpipe" else min(m, self.stages)
        return Estimate(self.label, 4 * n, 4 * trained, OPTIMIZER_BYTES[self.cfg.optimizer] * trained, 0,
                        int(activations * per_process * in_flight))

    # --- build ------------------------------------------------------------------------------------------------

    def prepare(self, model: torch.nn.Module, build_optimizer: Callable[..., torch.optim.Optimizer],
                build_scheduler: Callable[[TrainConfig, torch.optim.Optimizer], Any]) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        acc, recipe = self.accelerator, self.recipe
        device = acc.device
        mesh = init_device_mesh(device.type, (self.data_parallel_size, self.stages), mesh_dim_names=("dp", "pp"))
        self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        self.pp_rank = acc.process_index % self.stages
        cuts = self.cuts(model)
        every = [recipe.pipeline_stage(model, range(cuts[i], cuts[i + 1]), i == 0, i == self.total_stages - 1)
                 for i in range(self.total_stages)]
        mine = list(range(self.pp_rank, self.total_stages, self.stages))  # stage i runs on process i mod p
        self.model = torch.nn.ModuleList(every[i] for i in mine)
        self.first, self.last = 0 in mine, self.total_stages - 1 in mine
        self.notes.append(f"pipeline: {self.total_stages} stages over {self.stages} processes x "
                          f"{self.data_parallel_size} replica(s), layers cut at {cuts}, {self.cfg.pipeline_schedule} "
                          f"with {self.cfg.grad_accum} micro-batch(es) per step; this process runs stage(s) "
                          f"{', '.join(map(str, mine))}")
        self._shared = self._shared_groups(every)
        self._names = _full_names(model, self.model)
        self.full_model = model
        _release_others(model, self.model)  # this process holds only its stages' weights from here on
        self.model.to(device)
        self.compile_model(self.model, list(self.model))  # each of its stages, before PipelineStage holds it
        self.busy = [0.0]  # seconds this process computed during the current step
        stages = [timed_stage()(every[i], i, self.total_stages, device, group=self.pp_group, busy=self.busy)
                  for i in mine]
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}[
            self.cfg.pipeline_schedule]
        self.schedule = kind(stages if kind is ScheduleInterleaved1F1B else stages[0], self.cfg.grad_accum,
                             loss_fn=recipe.pipeline_loss)
        optimizer = build_optimizer(self.cfg, self.model)
        self.optimizer, self.scheduler = acc.prepare(optimizer, build_scheduler(self.cfg, optimizer))
        self.stage_bytes: list[int] | None = None
        self.idle_sums, self.steps_timed = [0.0] * self.stages, 0

    def _shared_groups(self, every: list[torch.nn.Module]) -> list[tuple[torch.nn.Parameter, Any, bool]]:
        """Parameters that stages on several processes hold (tied embeddings), with the process group of those
        processes in this replica and whether this process is the first of them (the one whose copy the gradient
        norm counts). Every process creates every group, in one order (torch requires it)."""
        holders: dict[int, tuple[torch.nn.Parameter, set[int]]] = {}
        for i, stage in enumerate(every):
            for p in stage.parameters():
                holders.setdefault(id(p), (p, set()))[1].add(i % self.stages)
        shared = []
        for p, processes in holders.values():
            if len(processes) < 2:
                continue
            for replica in range(self.data_parallel_size):
                group = dist.new_group(sorted(replica * self.stages + r for r in processes))
                if replica == self.data_parallel_rank and self.pp_rank in processes:
                    shared.append((p, group, min(processes) == self.pp_rank))
        return shared

    @property
    def unwrapped_model(self) -> torch.nn.Module:
        """The recipe's whole model (its export needs the full structure); only this process's stages hold weights."""
        return self.full_model

    # --- one optimizer step -----------------------------------------------------------------------------------

    def train_step(self, step: int, micro_batches: list, loss_fn: LossFn, finite: FiniteCheck,
                   stop_requested: bool) -> StepResult:
        self.hold_gradients()
        inputs, targets = self._cut([self.cast_batch(b) for b in micro_batches])
        losses: list[torch.Tensor] = []
        self.busy[0], started = 0.0, time.perf_counter()
        with self.accelerator.autocast():
            self.schedule.step(*([inputs] if self.first else []), target=targets if self.last else None,
                               losses=losses)
        elapsed = time.perf_counter() - started
        self._reduce_gradients()
        loss = torch.stack(losses).float().mean().reshape(1) if self.last else torch.zeros(1, device=inputs.device)
        idle = torch.zeros(self.stages, device=inputs.device)
        idle[self.pp_rank] = max(0.0, 1.0 - self.busy[0] / elapsed) if elapsed > 0 else 0.0
        loss_value, stop, grad_norm, idle_sums = self.agree(loss, stop_requested, self.clip_grad_norm(), idle)
        idle_per_stage = [x / self.data_parallel_size for x in idle_sums]  # the mean over the replicas
        finite.loss(step, loss_value)
        finite.grad_norm(step, grad_norm)
        result = self.optimizer_step(loss_value, grad_norm, stop)
        if self.stage_bytes is None:  # after the first step made the optimizer states: once, one collective
            held = [None] * self.stages
            dist.all_gather_object(held, state_bytes(self.state_tensors()), group=self.pp_group)
            self.stage_bytes = held
        if self.steps_timed or step > 1 or self.cfg.max_steps == 1:  # step 1 also measures the stages' shapes
            self.idle_sums = [a + b for a, b in zip(self.idle_sums, idle_per_stage, strict=True)]
            self.steps_timed += 1
        result.extra.update({"pipeline_idle": [round(x, 4) for x in idle_per_stage],
                             "pipeline_bubble_theory": round(self.bubble_theory, 4),
                             "stage_state_bytes": self.stage_bytes})
        return result

    @property
    def bubble_theory(self) -> float:
        """The idle fraction of each stage if sends were free and stages equal: (p - 1) / (m + p - 1) for GPipe and
        1F1B, (p - 1) / (v m + p - 1) with v stages per process interleaved (Narayanan et al., 2021)."""
        p, m, v = self.stages, self.cfg.grad_accum, STAGES_PER_PROCESS[self.cfg.pipeline_schedule]
        return (p - 1) / (v * m + p - 1)

    def report(self) -> str | None:
        if not self.steps_timed:
            return None
        idle = ", ".join(f"stage {i} {x / self.steps_timed:.1%}" for i, x in enumerate(self.idle_sums))
        return (f"pipeline bubble: each step's time idle per process: {idle} (mean of {self.steps_timed} steps); "
                f"theory for {self.cfg.pipeline_schedule} with p={self.stages}, m={self.cfg.grad_accum}: "
                f"{self.bubble_theory:.1%}")

    def _cut(self, batches: list) -> tuple[torch.Tensor, torch.Tensor]:
        """The first stage's input and the last stage's target for this rank's micro-batches, concatenated (the
        schedule cuts them again into the same micro-batches)."""
        pairs = [pipeline_io(b) for b in batches]
        return torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])

    def _reduce_gradients(self) -> None:
        """Shared parameters: the sum over the stages that hold them; then the mean over the replicas of this stage.
        Each is one collective over a flat buffer."""
        for p, group, _ in self._shared:
            dist.all_reduce(p.grad, group=group)
        if self.data_parallel_size > 1:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.dp_group)
            flat /= self.data_parallel_size
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def clip_grad_norm(self) -> torch.Tensor:
        """The norm over the whole model: each stage's sum of squares (a shared parameter counted once), summed over
        the pipeline; every stage then scales by the same factor."""
        counted = {id(p) for p, _, owner in self._shared if not owner}
        params = [p for p in self.model.parameters() if p.grad is not None]
        squares = sum((p.grad.float().pow(2).sum() for p in params if id(p) not in counted),
                      torch.zeros((), device=self.accelerator.device))
        dist.all_reduce(squares, group=self.pp_group)
        norm = squares.sqrt()
        if self.cfg.max_grad_norm:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.max_grad_norm, norm)
        return norm

    @property
    def loss_holders(self) -> int:
        return self.data_parallel_size  # the last stage of each replica; the others agree with a loss of 0

    def evaluate(self, batches: Iterator, loss_fn: LossFn, metrics_fn: MetricsFn) -> dict[str, float]:
        """eval_loss through the pipeline, forward only, grad_accum micro-batches at a time (the recipe's other
        eval metrics need the whole model's output, which no stage has: not computed under a pipeline)."""
        self.model.eval()
        group: list = []
        loss_sum, count = torch.zeros(1, device=self.accelerator.device), 0
        for batch in batches:
            group.append(self.cast_batch(batch))
            if len(group) < self.cfg.grad_accum:
                continue
            inputs, targets = self._cut(group)
            losses: list[torch.Tensor] = []
            with torch.no_grad(), self.accelerator.autocast():
                self.schedule.eval(*([inputs] if self.first else []), target=targets if self.last else None,
                                   losses=losses)
            if self.last:
                loss_sum += torch.stack(losses).float().sum()
            count += len(group)
            group = []
        self.model.train()
        dist.all_reduce(loss_sum)
        return {"eval_loss": loss_sum.item() / (count * self.data_parallel_size)}

    # --- checkpoints: torch.distributed.checkpoint under the whole model's parameter names ---------------------

    def _renamed(self, model_state: dict, optim_state: dict) -> dict[str, Any]:
        """This process's state under the whole model's names: every name of a weight (tied ones under both), the
        optimizer's per-parameter state under the first, and the learning rate (every group has the schedule's).
        Stages that share a weight write equal values under equal names, which torch.distributed.checkpoint writes
        once."""
        model = {alias: value for name, value in model_state.items() for alias in self._names[name]}
        optim = {self._names[name][0]: value for name, value in optim_state["state"].items()}
        return {"model": model, "optim": optim, "lr": torch.tensor(optim_state["param_groups"][0]["lr"])}

    def save_state(self, folder) -> None:
        import torch.distributed.checkpoint as dcp

        model_state, optim_state = trained_state(self.model, self.optimizer.optimizer)
        dcp.save(self._renamed(model_state, optim_state), checkpoint_id=str(folder / self.state_dir))

    def load_state(self, folder) -> None:
        import torch.distributed.checkpoint as dcp

        raw = self.optimizer.optimizer
        model_state, optim_state = trained_state(self.model, raw)
        state = self._renamed(model_state, optim_state)
        dcp.load(state, checkpoint_id=str(folder / self.state_dir))
        model_state = {name: state["model"][aliases[0]] for name, aliases in self._names.items()
                       if name in model_state}
        optim_state["state"] = {name: state["optim"][self._names[name][0]] for name in optim_state["state"]}
        for group in optim_state["param_groups"]:
            group["lr"] = state["lr"].item()
        restore_trained(self.model, raw, model_state, optim_state)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's weights gathered on the main process, under the whole model's names."""
        local = {}
        for name, value in self.model.state_dict().items():
            tensor = value.detach().cpu()
            local.update({alias: tensor for alias in self._names[name]})
        gathered: list[dict | None] = [None] * self.stages
        dist.all_gather_object(gathered, local if self.data_parallel_rank == 0 else {}, group=self.pp_group)
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            merged.update(part or {})
        return merged


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
    """The first stage's input and the loss's target from a collated micro-batch (recipes/README.md)."""
    if torch.is_tensor(batch):
        return batch, batch
    if isinstance(batch, dict):
        return batch["input_ids"], batch.get("labels", batch["input_ids"])
    return batch[0], batch[1]


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


def _full_names(model: torch.nn.Module, stages: torch.nn.Module) -> dict[str, list[str]]:
    """Each name in the stages' state dict -> every name the same tensor has in the whole model."""
    names: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), []).append(name)
    return {name: names[id(tensor)] for name, tensor in
            [*stages.named_parameters(remove_duplicate=False), *stages.named_buffers(remove_duplicate=False)]}


def _release_others(model: torch.nn.Module, mine: torch.nn.Module) -> None:
    """Drop the storage of every weight no stage of this process holds (the model keeps its structure)."""
    kept = {id(t) for t in [*mine.parameters(), *mine.buffers()]}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in kept:
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
