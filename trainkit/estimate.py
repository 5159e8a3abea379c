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
from types import ModuleType

import torch

from trainkit.config import TrainConfig
from trainkit.strategy import hidden_size, persistence_threshold

# Optimizer state bytes per parameter in fp32: AdamW keeps exp_avg and exp_avg_sq; plain SGD keeps nothing.
OPTIMIZER_BYTES = {"adamw": 8, "sgd": 0}
# From the cheapest to run (least communication, no host traffic) to the most frugal with device memory.
STRATEGIES = ("ddp", "deepspeed_zero1", "deepspeed_zero2", "fsdp", "deepspeed_zero3", "deepspeed_zero2_offload",
              "fsdp_offload", "deepspeed_zero3_offload")


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the estimate needs to know about a model: parameter sizes and its hidden size."""

    numels: tuple[int, ...]
    hidden: int
    layers: int

    @property
    def num_params(self) -> int:
        return sum(self.numels)


def model_shape(recipe: ModuleType, cfg: TrainConfig) -> ModelShape:
    with torch.device("meta"):
        model = recipe.build_model(cfg)
    numels = tuple(p.numel() for p in model.parameters())
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", None) or \
        sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    return ModelShape(numels, hidden_size(model), layers)


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


def estimate(shape: ModelShape, strategy: str, world_size: int, precision: str, optimizer: str,
             activations: int = 0) -> Estimate:
    """Model-state bytes per rank under `strategy` (a name from STRATEGIES, or single)."""
    n, w = shape.num_params, world_size
    opt = OPTIMIZER_BYTES[optimizer]
    if strategy in ("single", "ddp"):
        return Estimate(strategy, 4 * n, 4 * n, opt * n, 0, activations)
    if strategy.startswith("fsdp"):
        shard = sum(math.ceil(k / w) for k in shape.numels)  # FSDP2 pads each parameter's dim-0 shards
        host = (8 + opt) * shard if strategy == "fsdp_offload" else 0
        return Estimate(strategy, 4 * shard, 4 * shard, opt * shard, host, activations)
    low = 2 if precision in ("bf16", "fp16") else 4  # DeepSpeed turns the model itself to bf16/fp16
    optimizer_bytes = (4 + opt) * math.ceil(n / w)  # fp32 master partition + optimizer states
    if strategy in ("deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero2_offload"):
        transient = low * n if strategy == "deepspeed_zero1" else 0  # ZeRO-2 reduce-scatters in buckets
        if not strategy.endswith("offload"):
            return Estimate(strategy, low * n, 0, optimizer_bytes, 0, activations, transient)
        # ZeRO-Offload also keeps, per rank, a low-precision copy of its partition and the partition's fp32
        # gradients on the host, and two staging buffers of the largest parameter's size (measured: BENCHMARKS.md).
        staging = low * max(shape.numels)
        grads = 4 * math.ceil(n / w) + 2 * staging
        optimizer_bytes += low * math.ceil(n / w)
        return Estimate(strategy, low * n, grads, optimizer_bytes, optimizer_bytes + grads - staging, activations)
    persistent = sum(k for k in shape.numels if k < persistence_threshold(shape.hidden))
    params = low * (math.ceil((n - persistent) / w) + persistent)
    grads = low * math.ceil(n / w)
    host = params + optimizer_bytes if strategy == "deepspeed_zero3_offload" else 0
    return Estimate(strategy, params, grads, optimizer_bytes, host, activations)


def strategy_name(kind: str, zero_stage: int | None, offload: bool) -> str:
    """The STRATEGIES name of a launch (kind from trainkit.strategy.Launch)."""
    if kind == "deepspeed":
        return f"deepspeed_zero{zero_stage}" + ("_offload" if offload else "")
    if kind == "fsdp":
        return "fsdp_offload" if offload else "fsdp"
    return kind


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


def table(shape: ModelShape, world_size: int, precision: str, optimizer: str, activations: int,
          device_memory: int | None) -> str:
    """Every strategy's bytes per rank, and which is the cheapest that fits `device_memory`."""
    rows = [estimate(shape, s, world_size, precision, optimizer, activations) for s in STRATEGIES]
    gib = 1024 ** 3

    def fmt(b: int) -> str:
        return f"{b / gib:.3f} GiB" if b >= gib / 10 else f"{b / 1024 ** 2:.2f} MiB"

    lines = [f"{shape.num_params:,} parameters, {world_size} process(es), precision {precision}, optimizer "
             f"{optimizer}; bytes per rank (device = states not offloaded + activations {fmt(activations)})",
             f"{'strategy':<26}{'params':>12}{'grads':>12}{'optim+master':>14}{'host (CPU)':>12}"
             f"{'device peak':>13}"]
    for r in rows:
        lines.append(f"{r.strategy:<26}{fmt(r.params):>12}{fmt(r.grads):>12}{fmt(r.optimizer):>14}"
                     f"{fmt(r.host):>12}{fmt(r.device):>13}")
    lines.append("params/grads/optim are held between steps (what metrics.jsonl's state_bytes measures); device peak "
                 "adds gradients that exist only in backward (ZeRO-1 holds them whole) and activations. The ZeRO "
                 "paper's 2+2+12 bytes/param assumes fp16 training; DeepSpeed also keeps an fp32 master partition "
                 "in fp32 training.")
    if device_memory:
        fitting = [r for r in rows if r.device <= 0.9 * device_memory]  # 10% for the framework and fragmentation
        lines.append(f"cheapest strategy that fits {fmt(device_memory)} per device (with 10% headroom): "
                     f"{fitting[0].strategy}" if fitting else
                     f"nothing fits {fmt(device_memory)} per device: add processes or shrink the model or batch")
    return "\n".join(lines)


def for_run(shape: ModelShape, cfg: TrainConfig, strategy: str, world_size: int, precision: str) -> Estimate:
    """The estimate for this run; recipes with seq_len/heads fields get the transformer activation formula."""
    activations = activation_bytes(shape, cfg.batch_size, getattr(cfg, "seq_len", None), getattr(cfg, "heads", None),
                                   precision, getattr(cfg, "gradient_checkpointing", False))
    return estimate(shape, strategy, world_size, precision, cfg.optimizer, activations)
