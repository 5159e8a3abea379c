"""Pipeline parallelism: the model's layers cut into stages, one stage per process, micro-batches flowing through.

The sources' model parallelism, with `torch.distributed.pipelining`: stage k holds layers [a_k, b_k) (the first also
the embeddings, the last the head), activations go forward to the next stage and gradients come back. With one
micro-batch per step (`--grad_accum 1 --pipeline_schedule gpipe`) only one stage works at a time: naive model
parallelism, whose idle time is the "bubble"; more micro-batches fill it. Schedules: GPipe (all forwards, then all
backwards), 1F1B (a backward as soon as possible: fewer activations held) and interleaved 1F1B (two stages per
process, half the bubble). Each step's `grad_accum` micro-batches are the pipeline's micro-batches, so the global
batch and the data order stay those of one process.

The pipeline is the outermost dimension of the one mesh (strategies/parallel_dims.py): processes = stages x the launch's
own mesh. On a data-parallel launch (ddp.yaml, multinode.yaml, a hostfile) with 4 processes and `--pipeline_stages
2`, ranks 0-1 hold stage 0 and ranks 2-3 stage 1: two pipelines that each compute half of every global batch, and
every stage all-reduces its gradients with the same stage of the other pipeline (one collective per step). On an
FSDP launch each stage is parallelised as the YAML asks, within its own part of the mesh (strategies/parallelize.py:
fsdp.yaml shards it over the stage's data-parallel ranks, tp.yaml cuts its layers, fsdp_tp.yaml and hsdp.yaml as
they say), and torch's schedule runs FSDP2's reduce-scatter after the last micro-batch. A parameter that two stages
hold (tied input and output embeddings) is updated from the sum of both stages' gradients, as Megatron-LM does, so
the copies stay equal.

Selected by `--pipeline_stages N` on a YAML, not by a YAML alone: Accelerate's YAML refuses unknown keys, has no
pipeline degree in `parallelism_config`, and hands its processes only the settings of the features it knows
(docs/model-parallelism.md explains the choice). The recipe says where the model can be cut (`pipeline_layers`,
`pipeline_stage`, `pipeline_loss`: recipes/README.md).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from trainkit.config import TrainConfig
from trainkit.errors import ConfigError, Problem
from trainkit.estimate import OPTIMIZER_BYTES, Estimate, ModelShape
from trainkit.launch.launcher import Launch
from trainkit.losses import router
from trainkit.recipes import Recipe, no_generations
from trainkit.run.metrics import means_of, state_bytes
from trainkit.strategies import expert_parallel, pipeline_decoder
from trainkit.strategies.base import Strategy
from trainkit.strategies.engine import LossFn, MetricsFn, batch_samples
from trainkit.strategies.fsdp import OnMesh, held_numel
from trainkit.strategies.parallel_dims import ParallelDims, parallelism_problems
from trainkit.strategies.parallelize import FSDPSettings, block_classes, clip_to, grad_norm, local, parallelize, whole
from trainkit.strategies.pipeline_stages import (
    Weighed,
    cut_points,
    full_names,
    pipeline_io,
    release_others,
    shared_groups,
    timed_stage,
)
from trainkit.strategies.tp_plan import plan_problems, tp_layers

# Stages per process under each schedule (interleaved: stage i lives on process i mod p).
STAGES_PER_PROCESS = {"gpipe": 1, "1f1b": 1, "interleaved": 2}


class PipelineEngine(OnMesh):
    """This process's stages on the mesh, torch's schedule over them, the tied weights' sum between stages."""

    def __init__(self, strategy: Pipeline) -> None:
        super().__init__(strategy)
        self.stages, self.total_stages, self.label = strategy.stages, strategy.total_stages, strategy.label
        # made by prepare: the pp group, torch's schedule; this rank's place
        self.pp_group = self.schedule = None
        self.pp_rank = self.tp_rank = 0
        self.first = self.last = False  # whether this process runs the first / the last stage
        self.names: dict[str, list[str]] = {}  # each name in the stages' state dict -> its names in the whole model
        self.full_model: torch.nn.Module | None = None  # the recipe's model; only the stages here hold weights
        self._shared: list[tuple[torch.nn.Parameter, Any, bool]] = []  # tied weights across stages
        self.busy, self.stage_bytes = [0.0], None  # seconds computed in the current step; each stage's bytes held
        # a mixture of experts' balance (pipeline_decoder.Balanced): what it reports (these names) at each call
        self.balance_names: list[str] = []
        self.balance_reported: list[dict[str, torch.Tensor]] = []
        self.idle_sums, self.steps_timed = [0.0] * self.stages, 0

    def batch_norm_group(self) -> Any:
        """The ranks that hold this rank's stages: the same layers, other samples (every rank holds other layers)."""
        groups = [dist.new_group(ranks.tolist()) for ranks in self.mesh.mesh.reshape(self.stages, -1)]
        return groups[self.mesh.get_local_rank("pp")]

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """This rank's stages of the model, parallelised as the rest of the mesh asks, and torch's schedule over
        them."""
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        recipe, device = self.recipe, self.accelerator.device
        self.pp_group, self.pp_rank = self.mesh.get_group("pp"), self.mesh.get_local_rank("pp")
        self.tp_rank = self.mesh.get_local_rank("tp")
        cuts = cut_points(recipe, model, self.total_stages, self.cfg.pipeline_split)
        every = [recipe.pipeline_stage(model, range(cuts[i], cuts[i + 1]), i == 0, i == self.total_stages - 1)
                 for i in range(self.total_stages)]
        mine = list(range(self.pp_rank, self.total_stages, self.stages))  # stage i runs on process i mod p
        self.model = torch.nn.ModuleList(every[i] for i in mine)
        self.first, self.last = 0 in mine, self.total_stages - 1 in mine
        self.notes.append(f"pipeline: {self.total_stages} stages over {self.stages} processes x a mesh of "
                          f"{self.dims.world // self.stages} ({self.label}), layers cut at {cuts}, "
                          f"{self.cfg.pipeline_schedule} with {self.cfg.grad_accum} micro-batch(es) per step; this "
                          f"process runs stage(s) {', '.join(map(str, mine))}")
        shared = shared_groups(every, self.model, self.mesh.mesh.reshape(self.stages, -1), self.pp_rank)
        self.names = full_names(model, self.model)
        self.full_model = model
        release_others(model, self.model)  # this process holds only its stages' weights from here on
        self._parallelize_stages(model)
        params = dict(self.model.named_parameters(remove_duplicate=False))
        self._shared = [(params[name], group, owner) for name, group, owner in shared]
        stages = [timed_stage()(every[i], i, self.total_stages, device, group=self.pp_group, busy=self.busy)
                  for i in mine]
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}[
            self.cfg.pipeline_schedule]
        loss_fn = recipe.pipeline_loss
        if isinstance(every[-1], pipeline_decoder.DecoderStage) and every[-1].routes:
            loss_fn = pipeline_decoder.Balanced(loss_fn, model, self.balance_reported)
            self.balance_names = router.reported_names(loss_fn.layers)
        loss_fn = loss_fn if self.loss_weigher is None else Weighed(loss_fn)
        self.schedule = kind(stages if kind is ScheduleInterleaved1F1B else stages[0], self.cfg.grad_accum,
                             loss_fn=loss_fn)
        return self.model

    def _parallelize_stages(self, model: torch.nn.Module) -> None:
        """Each of this process's stages as the rest of the mesh asks (an FSDP launch: strategies/parallelize.py,
        the layers the whole model's plan cuts found by identity), or on the device and compiled whole."""
        if not self.sharded:
            self.model.to(self.accelerator.device)
            self.compile_model(self.model, list(self.model))  # each of its stages, before PipelineStage holds it
            return
        weights = dict(model.named_parameters())
        planned = {id(weights[name] if name in weights else model.get_submodule(name)): style
                   for name, style in tp_layers(model).items()} if self.dims.tp > 1 else {}
        classes = block_classes(model, self.settings)
        for stage in self.model:
            cut = {name: planned[id(m)] for name, m in [*stage.named_modules(), *stage.named_parameters()]
                   if id(m) in planned}
            self.notes += parallelize(stage, self.dims, self.mesh, self.settings,
                                      mixed_precision=self.launch.mixed_precision, compile=self.cfg.compile,
                                      tp_layers=cut, classes=classes)

    @property
    def unwrapped_model(self) -> torch.nn.Module:
        """The recipe's whole model (its export needs the full structure); only this process's stages hold weights."""
        return self.full_model

    # --- one optimizer step -----------------------------------------------------------------------------------

    def forward_backward(self, step: int, micro_batches: list, weights: list[float],
                         loss_fn: LossFn) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The schedule's forwards and backwards over the step's micro-batches (the pipeline's micro-batches), then
        the tied weights' sum and, on a data-parallel launch, the replicas' mean. The loss is the last stage's, once
        per tensor-parallel group; the engine's own number is this process's idle share of the step."""
        factors = weights if self.loss_weigher is not None else None
        inputs, targets = self._cut([self.cast_batch(b) for b in micro_batches], factors)
        losses: list[torch.Tensor] = []
        self.busy[0], started = 0.0, time.perf_counter()
        with self.accelerator.autocast():
            self.schedule.step(*([inputs] if self.first else []), target=targets if self.last else None,
                               losses=losses)
        elapsed = time.perf_counter() - started
        self._reduce_gradients()
        counts = self.last and self.tp_rank == 0
        loss = torch.stack(losses).float().mean().reshape(1) if counts else torch.zeros(1, device=inputs.device)
        idle = torch.zeros(self.stages, device=inputs.device)
        idle[self.pp_rank] = max(0.0, 1.0 - self.busy[0] / elapsed) if elapsed > 0 else 0.0
        # what the balance reported on the step's micro-batches (the schedule's first step calls the loss once more
        # before them, to learn the gradients' shapes), summed by the step's one collective (the last stage of each
        # replica holds it)
        calls = self.balance_reported[-len(micro_batches):] if counts else []
        sums = torch.stack([torch.stack([call[name] for call in calls]).sum().to(inputs.device)
                            for name in self.balance_names]) if calls else idle.new_zeros(len(self.balance_names))
        self.balance_reported.clear()
        return loss, torch.cat([idle, sums])

    def step_metrics(self, step: int, extra_sums: list[float]) -> dict[str, Any]:
        """Each stage's idle share of the step (the mean over its ranks) next to the theory's, and what each stage
        holds (gathered once, after the first step made the optimizer states)."""
        balance = dict(zip(self.balance_names, extra_sums[self.stages:], strict=True))
        idle_per_stage = [x * self.stages / self.dims.world for x in extra_sums[:self.stages]]
        if self.stage_bytes is None:
            self.stage_bytes = [None] * self.stages
            dist.all_gather_object(self.stage_bytes, state_bytes(self.state_tensors()), group=self.pp_group)
        if self.steps_timed or step > 1 or self.cfg.max_steps == 1:  # step 1 also measures the stages' shapes
            self.idle_sums = [a + b for a, b in zip(self.idle_sums, idle_per_stage, strict=True)]
            self.steps_timed += 1
        return {"pipeline_idle": [round(x, 4) for x in idle_per_stage],
                "pipeline_bubble_theory": round(self.bubble_theory, 4), "stage_state_bytes": self.stage_bytes,
                **means_of(balance, 0.0)}

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

    def _cut(self, batches: list, factors: list[float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The first stage's input and the last stage's target for this rank's micro-batches, concatenated (the
        schedule cuts them again into the same micro-batches); a balancing mixture of experts' target has each row's
        attention mask beside its labels (pipeline_decoder.Balanced); with `factors` (a recipe's loss_weight) each
        micro-batch's factor rides as one more column of its target (Weighed)."""
        pairs = [pipeline_io(b) for b in batches]
        targets = [y for _, y in pairs]
        if self.balance_names:
            targets = [torch.cat([y, b["attention_mask"] if "attention_mask" in b else torch.ones_like(y)], dim=1)
                       for y, b in zip(targets, batches, strict=True)]
        if factors is not None:
            targets = [torch.cat([y.reshape(len(y), -1).double(), torch.full((len(y), 1), f, dtype=torch.float64,
                                                                              device=y.device)], dim=1)
                       for y, f in zip(targets, factors, strict=True)]
        return torch.cat([x for x, _ in pairs]), torch.cat(targets)

    def _reduce_gradients(self) -> None:
        """Shared parameters: the sum over the stages that hold them (their local shards, laid out alike); then, on a
        data-parallel launch, the mean over the replicas of this stage (under FSDP2 the schedule has reduced them).
        Each is one collective over a flat buffer."""
        for p, group, _ in self._shared:
            dist.all_reduce(local(p.grad), group=group)
        if self.data_parallel_size > 1 and not self.sharded:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.mesh.get_group("dp_replicate"))
            flat /= self.data_parallel_size
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def clip_grad_norm(self) -> torch.Tensor:
        """The norm over the whole model: each stage's (whole over its shards and slices; a shared parameter counted
        once) squared and summed over the pipeline; every stage then scales by the same factor."""
        counted = {id(p) for p, _, owner in self._shared if not owner}
        params = [p for p in self.model.parameters() if p.grad is not None]
        squares = grad_norm([p for p in params if id(p) not in counted]).to(self.accelerator.device).pow(2).reshape(1)
        dist.all_reduce(squares, group=self.pp_group)
        norm = squares.sqrt()[0]
        clip_to(params, self.cfg.max_grad_norm, norm)
        return norm

    @property
    def loss_holders(self) -> int:
        return self.data_parallel_size  # the last stage of each replica; the others agree with a loss of 0

    def evaluate(self, batches: Iterator[tuple[Any, bool]], loss_fn: LossFn,
                 metrics_fn: MetricsFn) -> dict[str, float]:
        """eval_loss through the pipeline, forward only, grad_accum micro-batches at a time, each weighing its
        samples or its units (the recipe's loss_weight), a copy that is not real nothing (trainkit/data/batches.py's
        EvalLayout); the recipe's other eval metrics need the whole model's output, which no stage has: not computed
        under a pipeline."""
        self.model.eval()
        weigh, counts = self.loss_weigher, self.last and self.tp_rank == 0  # once per tensor-parallel group
        group: list = []
        sums = torch.zeros(2, device=self.accelerator.device)  # the losses (weighed), and what they weigh
        for batch, real in batches:
            group.append((self.cast_batch(batch), real))
            if len(group) < self.cfg.grad_accum:
                continue
            micro = [b for b, _ in group]
            weights = [(float(weigh(self.cfg, b)) if weigh is not None else batch_samples(b)) * real
                       for b, real in group]
            # Weighed multiplies each loss by its factor inside the schedule; without it, the factor is applied here
            inputs, targets = self._cut(micro, weights if weigh is not None else None)
            losses: list[torch.Tensor] = []
            with torch.no_grad(), self.accelerator.autocast():
                self.schedule.eval(*([inputs] if self.first else []), target=targets if self.last else None,
                                   losses=losses)
            if counts:
                weighed = [loss.float() * (1.0 if weigh is not None else w) for loss, w in
                           zip(losses, weights, strict=True)]
                sums += torch.stack([torch.stack(weighed).sum(), torch.tensor(sum(weights))])
            group = []
        self.balance_reported.clear()  # what the balance reported on held-out rows: not written under a pipeline
        self.model.train()
        dist.all_reduce(sums)
        return {"eval_loss": (sums[0] / sums[1]).item()}

    def generate(self, generate_fn: Callable[..., list[dict[str, str]]], eval_set: Any) -> list[dict[str, str]]:
        """None: generating needs the whole model in one process (the plan said so in a note)."""
        return []

    def checkpointed(self) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, list[str]]]:
        return self.model, self.optimizer.optimizer, self.names

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's weights gathered on the main process, under the whole model's names."""
        local = {}
        for name, value in self.model.state_dict().items():  # sharded or cut: made whole (a collective per tensor)
            tensor = whole(value).detach().cpu()
            local.update({alias: tensor for alias in self.names[name]})
        gathered: list[dict | None] = [None] * self.stages
        sends = self.data_parallel_rank == 0 and self.tp_rank == 0  # one copy of each stage
        dist.all_gather_object(gathered, local if sends else {}, group=self.pp_group)
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            merged.update(part or {})
        return merged


class Pipeline(Strategy):
    """Stages over point-to-point sends (NCCL or gloo), each replicated, sharded or cut by the rest of the mesh."""

    name = "pipeline"
    engine = PipelineEngine
    splits_model = True

    def __init__(self, launch: Launch, cfg: TrainConfig, sources: Mapping[str, str],
                 recipe: Recipe | None = None) -> None:
        super().__init__(launch, cfg, sources, recipe)
        self.dims = ParallelDims.of(launch, cfg.pipeline_stages)
        self.sharded = launch.distributed_type == "FSDP"  # each stage under FSDP2 (and tensor parallelism)
        self.settings = FSDPSettings.of(launch)
        if recipe is not None and recipe.generate is not no_generations:
            self.notes = (f"pipeline: recipe {recipe.path.name}'s answers at each evaluation (generate) are not "
                          "written: each stage holds part of the model; final/ holds all of it (python -m "
                          "trainkit.tools.ask FOLDER QUESTION)",)

    @classmethod
    def selects(cls, launch: Launch, cfg: TrainConfig) -> bool:
        return cfg.pipeline_stages > 1

    @property
    def stages(self) -> int:
        """Processes per pipeline."""
        return self.dims.pp

    @property
    def total_stages(self) -> int:
        """Stages per pipeline (interleaved: two on each process)."""
        return self.stages * STAGES_PER_PROCESS[self.cfg.pipeline_schedule]

    @property
    def data_parallel_size(self) -> int:
        return self.dims.data_parallel

    @property
    def label(self) -> str:
        mesh = self.dims.fsdp_label(self.settings.offload) if self.sharded else ""
        return "_".join(part for part in ("pipeline", self.cfg.pipeline_schedule, mesh) if part)

    def resolved_fields(self) -> dict[str, Any]:
        return {**super().resolved_fields(), **self.dims.sizes()}

    def check(self, this_machine: bool = True) -> list[Problem]:
        cfg, launch, where = self.cfg, self.launch, "--pipeline_stages"
        problems = super().check(this_machine) if launch.mixed_precision != "fp16" else [
            # Measured on a CPU, and so on a GPU: torch's schedule runs each stage's backward itself, on the
            # unscaled loss, and the scaler's step then fails ("Attempted step but _scale is None").
            Problem("fp16 does not work with pipeline stages: the pipeline schedule runs each stage's backward "
                    "itself, without the loss scaler", f"{where} with mixed_precision from {launch.source}",
                    "train the pipeline in bf16 (--mixed_precision bf16) or fp32")]
        if launch.distributed_type not in ("MULTI_GPU", "MULTI_CPU", "NO", "FSDP"):
            problems.append(Problem(f"pipeline stages compose with the launches of one mesh (DDP, FSDP2, HSDP, tensor "
                                    f"parallelism), not with {launch.distributed_type}",
                                    f"{where} with {launch.source}",
                                    "launch with accelerate_configs/ddp.yaml, fsdp.yaml, tp.yaml or fsdp_tp.yaml, or "
                                    "drop --pipeline_stages"))
        elif self.sharded:
            problems += (parallelism_problems(launch) + FSDPSettings.problems(launch, cfg) +
                         expert_parallel.launch_problems(self.dims, f"{where} with parallelism_config in "
                                                         f"{launch.source}", cfg.compile))
        problems += self.dims.problems(launch)
        if self.dims.cp > 1:
            problems.append(Problem("context parallelism with --pipeline_stages: the stages' schedule runs their "
                                    "forwards outside the context that cuts the sequences",
                                    f"{where} with parallelism_config in {launch.source}",
                                    "drop --pipeline_stages, or set parallelism_config_cp_size: 1"))
        if cfg.activation_offload:
            problems.append(Problem("--activation_offload does not reach the pipeline's stages, whose forwards the "
                                    "schedule runs", where, "drop --activation_offload, or train without "
                                    "--pipeline_stages (fsdp.yaml or deepspeed_zero3.yaml shard a model that does "
                                    "not fit)"))
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
        if recipe.precompute(self.cfg) is not None:
            return [Problem("the recipe precomputes values per sample from the whole model before the first step, "
                            "and each pipeline stage holds only its own layers", f"--recipe {recipe.path}",
                            "train it with another strategy (fsdp.yaml, deepspeed_zero3.yaml shard a model that does "
                            "not fit), or turn the precomputation off")]
        problems = plan_problems(model, self.dims.tp, f"model._tp_plan of {recipe.path.name}'s build_model",
                                 f"parallelism_config in {self.launch.source}") if self.dims.tp > 1 else []
        if router.balances(model) and recipe.pipeline_stage is not pipeline_decoder.stage:
            problems.append(Problem(
                f"{type(model).__name__} computes its router's balancing loss from every layer's router logits, which "
                f"the stages of {recipe.path.name}'s pipeline_stage do not pass on to the last stage",
                f"--recipe {recipe.path}", "cut it with recipes/causal_lm.py's pipeline_stage and pipeline_loss "
                "(trainkit.strategies.pipeline_decoder's stage and loss), which pass them on, or train it without "
                "--pipeline_stages"))
        try:
            cut_points(recipe, model, self.total_stages, self.cfg.pipeline_split)
        except ConfigError as e:
            problems += e.problems
        return problems

    def estimate(self, shape: ModelShape, world_size: int, activations: int) -> Estimate:
        """DDP's bytes per parameter for one process's stages: the layers (parameters named with a layer index)
        balanced across the stages, plus all the rest (embeddings and head: the first and last stage hold them), of
        which the rest of the mesh holds its share (mesh.py's held_numel: 1/tp of a cut layer, 1/dp_shard of each).
        Activations: this process's share of the layers, for the micro-batches in flight at once (GPipe: every one
        of the step; 1F1B: at most one per stage)."""
        per_process = STAGES_PER_PROCESS[self.cfg.pipeline_schedule] / self.total_stages
        dims = self.dims.resized(world_size)

        def held(part: ModelShape) -> int:
            names = part.names or ("",) * len(part.numels)
            layered = [i for i, name in enumerate(names) if re.search(r"\.\d+\.", name)]
            inside = held_numel(dataclasses.replace(part, names=tuple(names[i] for i in layered), frozen=(),
                                                    numels=tuple(part.numels[i] for i in layered)), dims)
            whole = held_numel(part, dims)
            return min(whole, math.ceil(inside * per_process) + whole - inside)

        n, trained = held(shape), held(shape.trained())
        m = self.cfg.grad_accum
        in_flight = m if self.cfg.pipeline_schedule == "gpipe" else min(m, self.stages)
        weights = shape.weight_bytes(n, trained)
        host = weights + (4 + OPTIMIZER_BYTES[self.cfg.optimizer]) * trained \
            if self.sharded and self.settings.offload else 0
        return Estimate(self.label, weights, 4 * trained, OPTIMIZER_BYTES[self.cfg.optimizer] * trained, host,
                        int(activations * per_process * in_flight / dims.tp))
