"""The engine: what a strategy builds and runs once the plan holds (trainkit/plan.py), one instance per run.

An engine makes the Accelerator, prepares the model, optimizer and schedule, runs the points of one optimizer step
where strategies differ (trainkit/step.py reads the step top to bottom and calls these), evaluates, and hands the
checkpoint format (strategies/dcp_format.py) and the export what they read. Everything decided before a model exists
is the strategy's (strategies/base.py), read-only here as `self.strategy`.

The defaults are those of an Accelerate-driven data-parallel run (one process, DDP); each strategy module's engine
overrides what differs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from trainkit.config import TrainConfig
from trainkit.launch.launcher import Launch
from trainkit.recipes import Recipe
from trainkit.run.metrics import means_of, model_state_tensors
from trainkit.run.stopping import FiniteCheck
from trainkit.step import StepResult
from trainkit.strategies import accelerator, dcp_format, sequence_parallel
from trainkit.strategies.parallelize import compile_forward

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
MetricsFn = Callable[[torch.nn.Module, Any], dict[str, torch.Tensor]]


class Planned(Protocol):
    """What an engine reads of its strategy's plan (strategies/base.py's Strategy, which imports this module for its
    `engine`; each strategy module's engine reads its own strategy's fields)."""

    launch: Launch
    cfg: TrainConfig
    recipe: Recipe | None

    @property
    def data_parallel_size(self) -> int: ...

    @property
    def sequence_parallel_size(self) -> int: ...


# Config fields of transformers models whose value > 0 makes training draw random numbers (jitter on the router's
# input or logits), beside dropout; and the families whose router draws whatever its config says (PhiMoE's
# sparsemixer samples its experts with rand_like and exponential_ in training).
DRAWING_FIELDS = ("router_jitter_noise", "input_jitter_noise")
DRAWING_ROUTERS = {"phimoe": "PhiMoE's sparsemixer router"}


def random_draws(model: torch.nn.Module) -> list[str]:
    """What in `model` draws random numbers in a training forward, in words: dropout modules and config fields with a
    rate above 0, jittered routers, routers that sample. Each data-parallel rank draws from its own generator, so such
    a model's curve under them is not one process's (the BatchNorm of the model is the other such case)."""
    found = []
    configs = [c for c in (getattr(model, "config", None),) if c is not None]
    configs += [sub for c in configs for sub in (getattr(c, "text_config", None),) if sub is not None]
    for config in configs:
        if config.model_type in DRAWING_ROUTERS:
            found.append(DRAWING_ROUTERS[config.model_type])
        found += [f"{name} {value:g}" for name, value in sorted(vars(config).items())
                  if isinstance(value, float) and value > 0 and not name.startswith(("lora", "summary"))
                  and (name in DRAWING_FIELDS or "dropout" in name or "pdrop" in name)]
    dropping = [m for m in model.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0]
    if dropping:
        found.append(f"{len(dropping)} dropout module{'s' if len(dropping) > 1 else ''} of p up to "
                     f"{max(m.p for m in dropping):g}")
    return list(dict.fromkeys(found))


class Engine:
    """Builds and runs one strategy's plan: the Accelerator, the prepared model, optimizer and schedule."""

    # How checkpoints hold this engine's model and optimizer (trainkit/run/checkpoint.py's Checkpointer makes one).
    format: ClassVar[type[dcp_format.CheckpointFormat]] = dcp_format.DCP

    def __init__(self, strategy: Planned) -> None:
        self.strategy = strategy
        self.launch, self.cfg, self.recipe = strategy.launch, strategy.cfg, strategy.recipe
        self.notes: list[str] = []  # what building decided on the user's behalf, printed before training
        self.accelerator: Any = None
        self.model: torch.nn.Module | None = None
        self.optimizer: Any = None
        self.scheduler: Any = None

    @property
    def data_parallel_size(self) -> int:
        return self.strategy.data_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        """Which part of each global batch this rank computes (after build): ranks that split one model between them
        share a data-parallel rank and see the same samples."""
        return self.accelerator.process_index

    @property
    def sequence_parallel_size(self) -> int:
        """The ranks that share each micro-batch, each computing a part of its positions (DeepSpeed's Ulysses, torch's
        context parallelism)."""
        return self.strategy.sequence_parallel_size

    # --- build ------------------------------------------------------------------------------------------------------

    def accelerator_kwargs(self) -> dict[str, Any]:
        """What this engine adds to Accelerator(...). A MULTI_GPU launch on a machine without GPUs becomes
        MULTI_CPU over gloo only when the script asks for the CPU; otherwise every process runs alone as
        DistributedType.NO: N unsynchronised copies."""
        return {"cpu": not torch.cuda.is_available()}

    def process_group_kwargs(self) -> dict[str, Any]:
        """InitProcessGroupKwargs for this launch (Accelerate takes one handler of each type)."""
        if self.launch.dist_timeout_s and self.launch.world_size > 1:
            # How long a collective waits for the other ranks (TRAINKIT_DIST_TIMEOUT): a machine that vanishes without
            # closing its connections then fails the run after this, not after torch's 30 min (gloo) / 10 min (NCCL).
            return {"timeout": timedelta(seconds=self.launch.dist_timeout_s)}
        return {}

    def wrapper_kwargs(self) -> list:
        """Accelerate's kwargs handlers for the model wrapper it builds (DDP's)."""
        return []

    def expected_distributed_type(self) -> str:
        """What Accelerate must report once built (verify refuses anything else)."""
        return "MULTI_GPU" if torch.cuda.is_available() else "MULTI_CPU"

    def build_accelerator(self, output_dir: Path, report_to: list[str]):
        """An Accelerator that does what the launch asked for on this machine, verified before it is returned
        (strategies/accelerator.py): the first thing build does, before any model exists."""
        self.accelerator, notes = accelerator.build(self, output_dir, report_to)
        self.notes += notes
        return self.accelerator

    # Whether Accelerate wraps the model (DDP's wrapper, DeepSpeed's engine); False where the runner parallelised it
    # itself (FSDP2, tensor parallelism, pipeline stages) and Accelerate prepares only the optimizer and schedule.
    accelerate_wraps_model: ClassVar[bool] = True

    def prepare(self, model: torch.nn.Module,
                build_optimizer: Callable[..., torch.optim.Optimizer],
                build_scheduler: Callable[[TrainConfig, torch.optim.Optimizer], Any]) -> None:
        """One fixed sequence that every engine goes through, as torchtitan applies its parallelisms in one order:
        the BatchNorm policy, the strategy's own parallelisation of the model (apply), the optimizer and schedule
        for what this rank trains, the hand-over to Accelerate. An engine changes a step, never the sequence, so
        that no step is skipped under one strategy (the BatchNorm policy was, under FSDP2, TP and the pipeline,
        when they replaced the whole of prepare)."""
        # from_pretrained returns a model in eval mode: its dropout would stay off until the first evaluation's
        # model.train() turned it on, so a run's curve changed with --eval_every
        model.train()
        if self.data_parallel_size > 1 and (drawn := random_draws(model)):
            self.notes.append(f"the model draws random numbers in training ({'; '.join(drawn)}): each of the "
                              f"{self.data_parallel_size} data-parallel ranks draws its own, so the curve follows one "
                              "process's in distribution, not to the digit; set them to 0 in the model's config for "
                              "an exact one (docs/strategies.md)")
        model = self.sync_batch_norm(model)
        trained = self.apply(model)
        optimizer = self.make_optimizer(trained, build_optimizer)
        scheduler = build_scheduler(self.cfg, optimizer)
        if self.accelerate_wraps_model:
            self.model, self.optimizer, self.scheduler = self.accelerator.prepare(trained, optimizer, scheduler)
        else:
            self.model = trained
            self.optimizer, self.scheduler = self.accelerator.prepare(optimizer, scheduler)

    def sync_batch_norm(self, model: torch.nn.Module) -> torch.nn.Module:
        """Replicas normalise BatchNorm with their own micro-batch unless it is converted to SyncBatchNorm (over
        batch_norm_group: the ranks that compute other samples of the same layers), which torch supports on GPU/XPU
        only: on a CPU, a note says so."""
        if self.data_parallel_size == 1 or not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                                                   for m in model.modules()):
            return model
        if self.accelerator.device.type == "cpu":
            self.notes.append("BatchNorm stays per-rank: torch's SyncBatchNorm supports only GPU/XPU devices, so on "
                              "CPU each rank normalises with its own micro-batch statistics (losses will differ from "
                              "one process)")
            return model
        self.notes.append("BatchNorm converted to SyncBatchNorm")
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model, self.batch_norm_group())

    def batch_norm_group(self) -> Any:
        """The process group SyncBatchNorm reduces over: every rank (None), where every rank holds the same layers
        (ranks that share samples, tensor parallelism's, add copies of them, which leave a mean and a variance as
        they are)."""
        return None

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """The strategy's own changes before the optimizer is made, returning what this rank trains: here torch.compile
        (--compile); FSDP2 and TP parallelise the model, a pipeline builds this rank's stages."""
        self.compile_model(model)
        return model

    def compile_model(self, model: torch.nn.Module, units: list[torch.nn.Module] | None = None) -> None:
        """--compile: torch.compile on the forward of each of `units` (by default the whole model), before any
        wrapper or engine sees the model (strategies/parallelize.py's compile_forward says how and why)."""
        if self.cfg.compile:
            self.notes.append(compile_forward(model, units or []))

    def make_optimizer(self, model: torch.nn.Module,
                       build_optimizer: Callable[..., torch.optim.Optimizer]) -> torch.optim.Optimizer:
        return build_optimizer(self.cfg, model)

    # --- one optimizer step (trainkit/step.py runs it; these are the points where engines differ) ----------------

    # Whether the engine runs the whole step itself (DeepSpeed's: engine_step), not trainkit/step.py.
    owns_step: ClassVar[bool] = False

    def forward_backward(self, step: int, micro_batches: list, weights: list[float],
                         loss_fn: LossFn) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward and backward over this rank's micro-batches, each loss times its weight, gradients communicated
        on the last only; returns the mean of the weighed losses (one element: gloo cannot reduce 0-d tensors) and
        the engine's own numbers for the step's one collective (None)."""
        accelerator, model = self.accelerator, self.model
        loss_sum = torch.zeros(1, device=accelerator.device)
        for i, batch in enumerate(micro_batches):
            batch = self.cast_batch(batch)
            with accelerator.accumulate(model), self.gradient_sync(last=i == len(micro_batches) - 1), \
                    self.sequence_context(batch):
                loss = loss_fn(model, batch) * weights[i]
                loss_sum += loss.detach().float()
                accelerator.backward(loss * self.gradient_correction)
        return loss_sum / len(micro_batches), None

    # --- sequences split between ranks (sequence_parallel_size > 1; trainkit/strategies/sequence_parallel.py)
    # ------------------

    def split_sequences(self, micro_batches: list) -> list:
        """The micro-batches as this rank computes them: under sequence or context parallelism the rows with their
        next-token targets made whole (shift_labels), and this rank's part of them where the engine cuts them itself."""
        return micro_batches

    def sequence_context(self, batch: Any) -> contextlib.AbstractContextManager:
        """Around one micro-batch's forward and backward: where a library cuts the rows itself (torch's context
        parallelism), or the loss needs to know which ranks hold the rest of its rows (DeepSpeed's Ulysses)."""
        return contextlib.nullcontext()

    def learned_tokens(self, batch: Any) -> float:
        """What this rank's loss on a split micro-batch is a mean over: its part's learned tokens."""
        return sequence_parallel.learned_tokens(batch)

    @property
    def gradient_correction(self) -> float:
        """What each backward's loss is multiplied by for the reduced gradient to be the global batch's: 1 unless the
        library divides the gradients of ranks that split a sequence by their number as if they were data-parallel."""
        return 1.0

    def step_metrics(self, step: int, extra_sums: list[float]) -> dict[str, Any]:
        """The engine's own entries for metrics.jsonl after a step (a pipeline's idle time), from the sums over
        every rank of what forward_backward returned."""
        return {}

    def engine_step(self, step: int, micro_batches: list, loss_fn: LossFn, finite: FiniteCheck,
                    stop_requested: bool) -> StepResult:
        """The whole step, where the engine owns it (owns_step)."""
        raise NotImplementedError

    @property
    def loss_weigher(self) -> Callable[[Any, Any], Any] | None:
        """The recipe's loss_weight, or None: its micro-batches weigh alike. A micro-batch split between ranks
        (split_sequences) weighs its part's learned tokens, so that a step's loss is the mean over every learned token,
        never a mean of the parts' means; a whole one (evaluation) as the recipe weighs it."""
        recipe = self.recipe.loss_weight if self.recipe is not None else None
        if self.sequence_parallel_size == 1:
            return recipe

        def weigh(cfg: Any, batch: Any) -> Any:
            if "shift_labels" in batch:
                return self.learned_tokens(batch)
            return recipe(cfg, batch) if recipe is not None else batch_samples(batch)

        return weigh

    def hold_gradients(self) -> None:
        """Give every trainable parameter a gradient before its first step (zeros; kept between steps).

        A parameter that takes no part in a step (an expert no sample picked) would otherwise have no gradient, which
        AdamW takes as "skip me": no decay, no optimizer state until its first use. Its state would then be missing
        from a checkpoint, and whether it is skipped would depend on what happened before a resume. With a gradient
        of zeros it is updated like under DeepSpeed (whose flat buffers hold zeros for it), in every run the same.
        """
        for param in self.model.parameters():
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)

    def gradient_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Gradient communication off on all but the last micro-batch, where Accelerate's `accumulate` cannot do it."""
        return contextlib.nullcontext()

    def clip_grad_norm(self) -> torch.Tensor | None:
        """Clip to max_grad_norm (0: no clipping) and return the total norm before clipping, on the device."""
        return self.accelerator.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm or float("inf"))

    @property
    def loss_holders(self) -> int:
        """How many ranks compute a loss each step: all of them, unless the strategy splits the model in depth, or
        its sequences (the ranks of a group compute one loss between them, a part each, weighed by its tokens)."""
        return self.accelerator.num_processes // self.sequence_parallel_size

    def step_was_skipped(self) -> bool:
        """Whether the step just taken was skipped, where no torch loss scaler ran (a library's own scaler, as
        DeepSpeed's). Under torch's GradScaler the runner reads the scale instead: it halves exactly when the scaler
        found an overflow and skipped. Accelerate's own `optimizer_step_was_skipped` misses that skip with a fused
        optimizer (which the runner uses): GradScaler hands the overflow flag to the fused kernel, which skips inside
        an optimizer.step() that Accelerate then counts as taken (measured: always False)."""
        return False

    def cast_batch(self, batch: Any) -> Any:
        from accelerate.utils import send_to_device

        return send_to_device(batch, self.accelerator.device)

    def evaluate(self, batches: Iterator[tuple[Any, bool]], loss_fn: LossFn,
                 metrics_fn: MetricsFn) -> dict[str, float]:
        """eval_loss and eval_<metric> over every rank's held-out micro-batches (trainkit/data/batches.py's EvalLayout:
        each with whether it is real or a copy that weighs nothing), with one collective.

        The loss is the mean over every sample evaluated (each micro-batch's mean weighs its samples), or with the
        recipe's loss_weight over every unit (a learned token); each recipe metric is a sum over a micro-batch's
        samples, divided here by the number of samples evaluated on all ranks (or, "<name> per <other>", by the other's
        total: trainkit/run/metrics.py's means_of).
        """
        model = self.model
        model.eval()
        weigh = self.loss_weigher
        loss_sum, weight_sum, sample_count, sums = 0.0, 0.0, 0, {}
        with torch.no_grad():
            for batch, real in batches:
                samples = batch_samples(batch)
                weight = (float(weigh(self.cfg, batch)) if weigh is not None else samples) if real else 0.0
                batch = self.cast_batch(batch)
                loss_sum = loss_sum + loss_fn(model, batch).detach().float() * weight
                for name, value in metrics_fn(model, batch).items():
                    sums[name] = sums.get(name, 0.0) + value.detach().float() * real
                weight_sum += weight
                sample_count += samples * real
        model.train()
        device = self.accelerator.device
        local = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=device).reshape(()) for v in
                             (loss_sum, weight_sum, sample_count, *sums.values())])
        loss_total, weight_total, samples, *metric_sums = self.accelerator.reduce(local, "sum").tolist()
        return {"eval_loss": loss_total / weight_total,
                **{f"eval_{name}": mean for name, mean in
                   means_of(dict(zip(sums, metric_sums, strict=True)), samples).items()}}

    def generate(self, generate_fn: Callable[[torch.nn.Module, TrainConfig, Any], list[dict[str, str]]],
                 eval_set: Any) -> list[dict[str, str]]:
        """The recipe's generate hook on this rank's model (in_eval_mode)."""
        return self.in_eval_mode(generate_fn, eval_set)

    def rollout(self, rollout_fn: Callable[[torch.nn.Module, TrainConfig, int, list], Any], step: int,
                micro_batches: list) -> Any:
        """The recipe's rollout hook (trainkit/recipes.py) on this rank's model (in_eval_mode)."""
        return self.in_eval_mode(rollout_fn, step, micro_batches)

    def in_eval_mode(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(model, cfg, *args) on the recipe's own module (its parameters gathered by the strategy's hooks where
        they are sharded), in eval mode, without gradients; the model trains again after."""
        model = self.unwrapped_model
        model.eval()
        with torch.no_grad():
            result = fn(model, self.cfg, *args)
        model.train()
        return result

    def report(self) -> str | None:
        """A line for the end of the run about the engine's own measurements (a pipeline's bubble), or None."""
        return None

    # --- what it holds --------------------------------------------------------------------------------------------

    def state_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor of model state this rank holds (metrics.py's model_state_tensors)."""
        return model_state_tensors(self.model, self.optimizer)

    @property
    def unwrapped_model(self) -> torch.nn.Module:
        """The recipe's model inside the strategy's wrapper: DDP holds it as `.module`. (Accelerate's unwrap_model
        does the same after importing DeepSpeed to check for its engine: 1.2 s in every process of every run.)"""
        from torch.nn.parallel import DistributedDataParallel

        return self.model.module if isinstance(self.model, DistributedDataParallel) else self.model

    def checkpointed(self) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, list[str]] | None]:
        """What the DCP checkpoint format writes and reads: the model, the torch optimizer inside Accelerate's
        wrapper, and for a part of the model (a pipeline's stages) each name in its state dict -> the names the
        tensor has in the whole model (None: the model is whole)."""
        return self.unwrapped_model, getattr(self.optimizer, "optimizer", self.optimizer), None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The consolidated weights on the main process (a collective: call on every rank). Here every rank holds
        them whole."""
        return self.unwrapped_model.state_dict()

    def building_alone(self) -> contextlib.AbstractContextManager:
        """Where the main process alone builds a model (a recipe's export: the LoRA merge) as plain torch modules."""
        return contextlib.nullcontext()


def batch_samples(batch: Any) -> int:
    """The number of samples in a collated batch: the length of its first tensor."""
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0] if isinstance(batch, list | tuple) \
        else batch
    return len(first)

