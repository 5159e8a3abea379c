"""Memory per rank under each strategy, estimated before anything is built and checked against measurements.

The model is built on the meta device (no memory, no init) to read its parameter sizes. Model states are what the
libraries really hold, measured on this project's machines (tests/test_estimate.py, BENCHMARKS.md), not only the
ZeRO paper's idealised 2 + 2 + 12 bytes per parameter:

- DDP / one process: fp32 weights, fp32 gradients (kept between steps) and the optimizer's fp32 states, all
  replicated. Accelerate's bf16 is autocast: the weights stay fp32, so bf16 saves no state memory.
- FSDP2: the same per parameter, divided by the world size (shards padded to equal size).
- DeepSpeed ZeRO-1/2: full weights in the training dtype, plus an fp32 master copy of this rank's partition, even
  in fp32 training (the paper counts no master copy there), plus the optimizer states of the partition. Gradients
  live in reduce buckets during backward and are freed after the step.
- DeepSpeed ZeRO-3: weights, gradients, master copy and optimizer states all partitioned; parameters smaller than
  stage3_param_persistence_threshold stay whole on every rank.
- Offload moves the master copy and optimizer states (ZeRO-3 offload: the weights too) to CPU memory: the same bytes
  on the host instead of the device. ZeRO-2 offload adds host copies of the partition (low precision) and of its
  fp32 gradients, and two staging buffers the size of the largest parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainkit.config import TrainConfig
from trainkit.recipes import Recipe

# Optimizer state bytes per parameter in fp32: AdamW keeps exp_avg and exp_avg_sq; plain SGD keeps nothing.
OPTIMIZER_BYTES = {"adamw": 8, "sgd": 0}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the estimate needs to know about a model: parameter sizes and its hidden size."""

    numels: tuple[int, ...]
    hidden: int
    layers: int
    names: tuple[str, ...] = ()  # the parameters' names, in the order of numels (what a model split assigns)
    # The tensor-parallel plan the model declares (model._tp_plan: module name pattern -> style), as pairs
    tp_plan: tuple[tuple[str, str], ...] = ()

    @property
    def num_params(self) -> int:
        return sum(self.numels)


def hidden_size(model: torch.nn.Module) -> int:
    """The model's hidden size: `model.config.hidden_size` where it has one; otherwise the square root of the largest
    parameter (the width of a square weight matrix)."""
    return getattr(getattr(model, "config", None), "hidden_size", None) or \
        int(math.sqrt(max(p.numel() for p in model.parameters())))


def meta_model(recipe: Recipe, cfg: TrainConfig) -> torch.nn.Module:
    """The recipe's model built on the meta device: its structure and sizes, no memory, no initialisation."""
    with torch.device("meta"):
        return recipe.make_model(cfg)


def model_shape(recipe: Recipe, cfg: TrainConfig, model: torch.nn.Module | None = None) -> ModelShape:
    """Parameter sizes of the recipe's model (`model`: its meta-device build, if already made)."""
    model = model if model is not None else meta_model(recipe, cfg)
    names, params = zip(*model.named_parameters(), strict=True)
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", None) or \
        sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    return ModelShape(tuple(p.numel() for p in params), hidden_size(model), layers, tuple(names),
                      tuple((getattr(model, "_tp_plan", None) or {}).items()))


@dataclass(frozen=True, slots=True)
class Estimate:
    strategy: str
    params: int  # bytes of weights this rank holds (device, or host under ZeRO-3 offload)
    grads: int
    optimizer: int  # optimizer states + DeepSpeed's fp32 master copy
    host: int  # of the above, what lives in CPU memory under offload
    activations: int
    transient: int = 0  # gradients that exist only during backward (ZeRO-1 accumulates them whole)

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def device(self) -> int:
        """Peak device bytes: states not offloaded, transient gradients and activations."""
        return self.state - self.host + self.transient + self.activations


def activation_bytes(shape: ModelShape, micro_batch: int, seq_len: int | None, heads: int | None,
                     precision: str, checkpointing: bool) -> int:
    """Activations kept for backward, per rank, for one micro-batch.

    Transformers: Korthikanti et al. (2022), s*b*h*(34 + 5*a*s/h) bytes per layer in 16-bit, doubled in fp32;
    with gradient checkpointing only each layer's input (2*s*b*h) is kept. Other models: every Linear output twice
    (pre- and post-activation) at the model's hidden width.
    """
    scale = 1 if precision in ("bf16", "fp16") else 2
    if seq_len:
        s, b, h, a = seq_len, micro_batch, shape.hidden, heads or 1
        per_layer = 2 * s * b * h if checkpointing else s * b * h * (34 + 5 * a * s / h)
        return int(scale * per_layer * shape.layers)
    return int(scale * 2 * 2 * micro_batch * shape.hidden * shape.layers)


PRECISION_NAMES = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}
HEADROOM = 0.9  # of a device's memory a strategy may plan for: the rest is the framework's, buffers', fragmentation's


def report(shape: ModelShape, rows: list[Estimate], mine: Estimate, world_size: int, precision: str, optimizer: str,
           device_memory: int | None) -> str:
    """--estimate: every strategy's bytes per rank (`rows`, fastest first), the fastest that fits `device_memory`,
    and whether this launch's strategy (`mine`) fits. One unit throughout."""
    gib = 1024 ** 3
    unit, size = ("GiB", gib) if max(r.device for r in [*rows, mine]) >= gib / 10 else ("MiB", 1024 ** 2)

    def fmt(b: float) -> str:
        return f"{b / size:,.3f}"

    lines = [f"{shape.num_params:,} parameters, {world_size} process(es), {PRECISION_NAMES[precision]}, optimizer "
             f"{optimizer}; {unit} per rank (device peak = states not offloaded + activations "
             f"{fmt(mine.activations)} {unit})",
             f"{'strategy':<26}{'params':>12}{'grads':>12}{'optim+master':>14}{'host (CPU)':>12}{'device peak':>13}"]
    for r in rows:
        lines.append(f"{r.strategy:<26}{fmt(r.params):>12}{fmt(r.grads):>12}{fmt(r.optimizer):>14}"
                     f"{fmt(r.host):>12}{fmt(r.device):>13}")
    lines.append("params/grads/optim are held between steps (what metrics.jsonl's state_bytes measures); device peak "
                 "adds gradients that exist only in backward (ZeRO-1 holds them whole) and activations. The ZeRO "
                 "paper's 2+2+12 bytes/param assumes fp16 training; DeepSpeed also keeps an fp32 master partition "
                 "in fp32 training.")
    verdict = ""
    if device_memory:
        usable = HEADROOM * device_memory
        lines.append(f"--device_memory {fmt(device_memory)} {unit}: a strategy fits when its device peak is at most "
                     f"{fmt(usable)} {unit} ({HEADROOM:.0%}; the rest goes to the framework, communication buffers "
                     f"and fragmentation)")
        fitting = [r for r in rows if r.device <= usable]
        lines.append(f"cheapest strategy that fits: {fitting[0].strategy} (device peak {fmt(fitting[0].device)} "
                     f"{unit})" if fitting else
                     "nothing fits: add processes, or shrink the model, the micro-batch or the sequence length "
                     "(--gradient_checkpointing cuts activations)")
        verdict = (f"; fits, {fmt(usable - mine.device)} {unit} to spare" if mine.device <= usable else
                   f"; does not fit: {fmt(mine.device - usable)} {unit} over")
    lines.append(f"this launch ({mine.strategy}, {world_size} process(es)): {fmt(mine.state)} {unit} of model state "
                 f"per rank, device peak {fmt(mine.device)} {unit}{verdict}")
    return "\n".join(lines)


def run_activations(shape: ModelShape, cfg: TrainConfig, precision: str) -> int:
    """Activation bytes for this run; recipes with seq_len/heads fields get the transformer formula."""
    return activation_bytes(shape, cfg.batch_size, getattr(cfg, "seq_len", None), getattr(cfg, "heads", None),
                            precision, getattr(cfg, "gradient_checkpointing", False))
