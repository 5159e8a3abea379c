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
- Under every strategy, gradients, optimizer states and DeepSpeed's master copy exist only for the parameters that
  train: a frozen base (LoRA's, --trainable's rest) holds its weights alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from trainkit.config import TrainConfig
from trainkit.losses.chunked_loss import chunk_tokens
from trainkit.models import quantised
from trainkit.recipes import Recipe
from trainkit.strategies.expert_parallel import expert_weights
from trainkit.strategies.tp_plan import cut_plan

# Optimizer state bytes per parameter: AdamW keeps exp_avg and exp_avg_sq in fp32, bitsandbytes' AdamW8bit in 8 bits
# each (plus an fp32 scale per block of 256: 1.6% more); plain SGD keeps nothing.
OPTIMIZER_BYTES = {"adamw": 8, "adamw_8bit": 2, "sgd": 0}


@dataclass(frozen=True, slots=True)
class DecoderShape:
    """What the activation estimate reads of a transformers decoder's config."""

    hidden: int
    ffn: int  # the MLP's inner width
    heads: int
    vocab: int
    gated: bool  # a gated MLP (Llama, Qwen2, Mistral: gate, up, down) rather than GPT's (up, down)
    attention: str  # config._attn_implementation: eager, sdpa, flash_attention_2, ...
    dropout: float  # attention dropout (eager keeps its mask and output too)
    head_trains: bool = True  # the output head's weight has a gradient (not under LoRA, whose base is frozen)
    kv_width: int = 0  # the keys (as the values) one layer caches per token: kv heads x head size; 0: hidden


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the estimate needs to know about a model: parameter sizes and its hidden size."""

    numels: tuple[int, ...]
    hidden: int
    layers: int
    names: tuple[str, ...] = ()  # the parameters' names, in the order of numels (what a model split assigns)
    # The tensor-parallel plan the model declares (model._tp_plan: module name pattern -> style), as pairs
    tp_plan: tuple[tuple[str, str], ...] = ()
    decoder: DecoderShape | None = None  # a transformers decoder's sizes; None for any other model
    frozen: tuple[bool, ...] = ()  # per parameter, in the order of numels: frozen (no gradient, no optimizer state)
    # bytes per element of the frozen weights, on average: what a pretrained base loads as (--model_dtype), a 4-bit
    # base's packed weights at half a byte
    frozen_bytes: float = 4
    experts: tuple[bool, ...] = ()  # per parameter: a mixture of experts' expert weight (expert parallelism splits)
    constant_bytes: int = 0  # what every rank holds whole beside its weights: a quantised base's constants
    # per parameter, for a weight held quantised (bitsandbytes' 4 or 8 bits), which no strategy casts: its packed bytes
    # and the elements it is stored as (a 4-bit weight's bytes in its compute dtype's elements); (0, 0) for the others
    quantised: tuple[tuple[int, int], ...] = ()

    @property
    def num_params(self) -> int:
        return sum(self.numels)

    def weight_bytes(self, held: int, trained: int, low: int = 4) -> int:
        """Bytes of `held` weight elements of which `trained` train: those at `low` bytes (4: fp32; DeepSpeed casts
        to 16 bits), the frozen rest at their own size where it is smaller; and the constants every rank holds."""
        return round(low * trained + min(low, self.frozen_bytes) * (held - trained)) + self.constant_bytes

    def expert_numel(self) -> int:
        """The elements of the experts' weights (0 where none are marked)."""
        return sum(k for k, expert in zip(self.numels, self.experts or (False,) * len(self.numels), strict=True)
                   if expert)

    def trained(self) -> ModelShape:
        """The parameters that train (LoRA's adapters, --trainable's): the ones with gradients and optimizer states."""
        keep = [i for i in range(len(self.numels)) if not (self.frozen and self.frozen[i])]
        return dataclasses.replace(self, numels=tuple(self.numels[i] for i in keep),
                                   names=tuple(self.names[i] for i in keep) if self.names else (), frozen=(),
                                   constant_bytes=0, quantised=(),
                                   experts=tuple(self.experts[i] for i in keep) if self.experts else ())


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
    packed = quantised.weights_of(model)
    frozen = [(p.numel(), packed[id(p)] / 8 if id(p) in packed else p.element_size())
              for p in params if not p.requires_grad and p.is_floating_point()]
    experts = expert_weights(model)
    return ModelShape(tuple(p.numel() for p in params), hidden_size(model), layers, tuple(names),
                      tuple(cut_plan(model).items()), decoder_shape(model),
                      tuple(not p.requires_grad for p in params),
                      sum(n * b for n, b in frozen) / sum(n for n, _ in frozen) if frozen else 4,
                      tuple(id(p) in experts for p in params),
                      sum(quantised.constant_bytes(p.shape, packed[id(p)]) for p in params if id(p) in packed),
                      tuple(_stored(p, packed.get(id(p), 0)) for p in params))


def _stored(param: torch.Tensor, bits: int) -> tuple[int, int]:
    """A quantised weight's packed bytes and the elements it is stored as: 8 bits as int8, 4 bits packed into its
    compute dtype's elements (the storage ZeRO-3 and FSDP2 shard: trainkit/models/quantised.py); (0, 0) for a weight
    that is not quantised."""
    if not bits:
        return 0, 0
    packed = param.numel() * bits // 8
    return packed, packed if bits == 8 else packed // param.element_size()


def decoder_shape(model: torch.nn.Module) -> DecoderShape | None:
    """The sizes of a transformers decoder (a config with hidden_size, num_attention_heads and vocab_size), else
    None."""
    config = getattr(model, "config", None)
    hidden, heads, vocab = (getattr(config, name, None) for name in ("hidden_size", "num_attention_heads",
                                                                     "vocab_size"))
    if not (hidden and heads and vocab):
        return None
    ffn = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    gated = any(hasattr(m, "gate_proj") for m in model.modules())
    dropout = getattr(config, "attention_dropout", None) or getattr(config, "attn_pdrop", None) or 0.0
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    trains = head is None or getattr(head, "weight", None) is None or head.weight.requires_grad
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    kv = kv_heads * (getattr(config, "head_dim", None) or hidden // heads)
    return DecoderShape(hidden, ffn, heads, vocab, gated, getattr(config, "_attn_implementation", None) or "eager",
                        float(dropout), trains, kv)


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


# Activations a decoder layer keeps for backward, in elements per token, fitted to what autograd really saves
# (tests/test_estimate.py counts them with saved-tensor hooks; BENCHMARKS.md's memory section): a gated MLP (Llama,
# Qwen2, Mistral) keeps 10 x hidden + 4 x ffn, GPT-2's 8 x hidden + 2 x ffn. Korthikanti et al. (2022) count GPT's
# 34 bytes x hidden in 16-bit with dropout masks, the same 16 elements at ffn = 4 x hidden. Eager attention adds
# its scores: heads x seq_len per token (and with dropout, the mask and the dropped copy); sdpa and flash attention
# recompute them in backward and keep none. The head keeps the logits (vocab per token) and a few hidden-sized norms,
# and the loss's backward makes two more logit-sized tensors (the softmax and the logits' gradient) while every
# layer's activations are still held: that is the step's peak (measured with torch.profiler's memory timeline). The
# logit-sized ones are fp32 in every precision (loss_bytes).
PER_TOKEN = {True: (10, 4), False: (8, 2)}  # gated: (per hidden, per ffn)


def activation_bytes(shape: ModelShape, micro_batch: int, seq_len: int | None, precision: str,
                     checkpointing: bool, loss_chunk: int = 0, tiled_mlp: bool = False) -> int:
    """The peak of activation memory in a training step, per rank, for one micro-batch of a decoder
    (ModelShape.decoder) of seq_len tokens: what the forward keeps for backward, and the loss's backward on top; with
    gradient checkpointing each layer's input, plus one layer's own while backward recomputes it; with the loss in
    chunks of `loss_chunk` positions, one chunk's logits; with the MLP in chunks (trainkit/models/tiled_mlp.py), none of
    its intermediates (measured: 4 x ffn elements a token less in a Llama layer). Other models: every Linear output
    twice (pre- and post-activation) at the model's hidden width."""
    # Bytes per element: autocast computes the matrix products in 16 bits but keeps the residual stream, the norms
    # and their inputs in fp32; measured on a Llama block, 2.9 bytes per element counted here (BENCHMARKS.md)
    size = 3 if precision in ("bf16", "fp16") else 4
    d = shape.decoder
    if d is None or not seq_len:
        return int(size * 2 * micro_batch * shape.hidden * shape.layers)
    per_hidden, per_ffn = PER_TOKEN[d.gated]
    per_ffn = 0 if tiled_mlp else per_ffn
    layer = per_hidden * d.hidden + per_ffn * d.ffn
    if d.attention == "eager":
        layer += d.heads * seq_len * (2 + 1 / size if d.dropout else 1)
    tokens = micro_batch * seq_len
    held = size * tokens * ((d.hidden if checkpointing else layer) * shape.layers + 3 * d.hidden)
    if not loss_chunk or loss_chunk >= tokens:
        loss = loss_bytes(d.vocab, tokens)
    else:  # autograd sums the chunks' gradients of the head's weight in a buffer of its size (fp32)
        loss = loss_bytes(d.vocab, loss_chunk) + (4 * d.vocab * d.hidden if d.head_trains else 0)
    # The loss's backward comes first, while everything held is; with checkpointing, each layer's recomputation
    # comes after it, one layer at a time: the peak is the larger of the two (measured: BENCHMARKS.md's long
    # sequences), without it the layers' own are held under the loss
    return int(held + (max(loss, size * tokens * layer) if checkpointing else loss))


def loss_bytes(vocab: int, tokens: int) -> int:
    """The logit-sized tensors of a step's peak, for the tokens whose logits exist at once (all of the micro-batch's,
    or one chunk's: trainkit/losses/chunked_loss.py): the logits, and the loss's softmax and the logits' gradient in its
    backward, each in fp32 whatever the precision: the loss upcasts the logits first (measured in bf16 at
    vocabularies of 32,000 and 128,256: the same peak as fp32, BENCHMARKS.md's memory section)."""
    return 3 * 4 * vocab * tokens


def measured_activations(model: torch.nn.Module, step: Callable[[], torch.Tensor]) -> tuple[int, int]:
    """What a training step really holds beyond the model's weights, measured on this machine: (the bytes autograd
    saves for backward while `step()` computes the loss, each storage counted once, the weights left out; the peak
    of live tensor bytes over the loss and its backward, from torch.profiler's memory timeline, less what was live
    before). What activation_bytes is checked against (tests/test_estimate.py, bench/activations.py)."""
    import json
    import tempfile
    import warnings

    from torch.profiler import ProfilerActivity, profile

    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = step()
        loss.backward()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = sum(n for ptr, n in storages.items() if ptr not in weights)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # its successor records CUDA memory only
        prof.export_memory_timeline(f"{tmp}/timeline.json", device="cpu")
        _, sizes = json.loads(open(f"{tmp}/timeline.json").read())
    live = [sum(categories) for categories in sizes]
    return saved, max(live) - live[0]


def attention_note(shape: ModelShape) -> str:
    """How the estimate counted attention, for the report."""
    d = shape.decoder
    if d is None:
        return "not a transformers decoder: every Linear output twice"
    return f"attention {d.attention} ({'keeps' if d.attention == 'eager' else 'does not keep'} the scores)"


PRECISION_NAMES = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}
# What a strategy may plan for of a device's memory: 90% of it (the allocator's fragmentation and caching, and the
# communication buffers, grow with it), less a fixed 1 GiB that no row counts either (a CUDA context with its kernels
# takes 0.5-1 GiB before the first tensor).
HEADROOM, CONTEXT_BYTES = 0.9, 1 << 30


def usable_bytes(device_memory: int) -> int:
    """What the rows' device peaks are held against (HEADROOM, CONTEXT_BYTES)."""
    return max(0, int(HEADROOM * device_memory) - CONTEXT_BYTES)


def load_host_bytes(shape: ModelShape, processes_per_machine: int, partitioned_over: int = 1) -> int:
    """Host memory one machine needs while the model is built and loaded, before any strategy shards it: each
    process builds the whole model (its weights at their load dtype: the trained ones fp32, a frozen base at
    --model_dtype), or, built inside ZeRO-3's zero.Init, 1/partitioned_over of it."""
    whole = shape.weight_bytes(shape.num_params, shape.trained().num_params)
    return processes_per_machine * -(-whole // partitioned_over)


def report(shape: ModelShape, rows: list[Estimate], mine: Estimate | None, world_size: int, precision: str,
           optimizer: str, device_memory: int | None, assumed: str, refused: Mapping[str, str],
           load_host: Mapping[str, int]) -> str:
    """--estimate: every strategy's bytes per rank (`rows`, fastest first), the fastest that fits `device_memory`
    among those the plan accepts (`refused`: the label of each it refuses -> why, as --dry_run says), and whether
    this launch's strategy (`mine`; None when no launch was chosen) fits. `assumed`: the micro-batch, sequence length
    and attention that the activations were counted for; `load_host`: each label's host memory per machine while the
    model loads. One unit throughout."""
    gib = 1024 ** 3
    shown = [*rows, mine] if mine else rows
    # The largest unit in which no figure but 0 reads as 0.000 (a tiny model's in MiB or KiB)
    smallest = min((b for r in shown for b in (r.params, r.grads, r.optimizer, r.activations) if b), default=gib)
    unit, size = next(((name, bytes_) for name, bytes_ in (("GiB", gib), ("MiB", 1024 ** 2))
                       if smallest >= bytes_ / 1000), ("KiB", 1024))

    def fmt(b: float) -> str:
        return f"{b / size:,.3f}"

    # A row that cuts each sequence between ranks (sequence or context parallelism) counts a rank's share
    share = f", {fmt(mine.activations)} {unit} for this launch's rank" if mine and \
        mine.activations != rows[0].activations else ""
    lines = [f"{shape.num_params:,} parameters, {world_size} process(es), {PRECISION_NAMES[precision]}, optimizer "
             f"{optimizer}; {unit} per rank",
             f"assumed per rank: {assumed}: activations {fmt(rows[0].activations)} {unit} for whole sequences"
             f"{share}; the rows that cut each sequence (_sp, _cp) count a rank's share (device peak = states not "
             f"offloaded + activations)",
             f"{'strategy':<26}{'params':>12}{'grads':>12}{'optim+master':>14}{'host (CPU)':>12}{'device peak':>13}"
             f"{'load host/machine':>19}"]
    for r in rows:
        lines.append(f"{r.strategy:<26}{fmt(r.params):>12}{fmt(r.grads):>12}{fmt(r.optimizer):>14}"
                     f"{fmt(r.host):>12}{fmt(r.device):>13}{fmt(load_host[r.strategy]):>19}"
                     + (" refused" if r.strategy in refused else ""))
    lines.append("params/grads/optim are held between steps (what metrics.jsonl's state_bytes measures); device peak "
                 "adds gradients that exist only in backward (ZeRO-1 holds them whole) and activations. The ZeRO "
                 "paper's 2+2+12 bytes/param assumes fp16 training; DeepSpeed also keeps an fp32 master partition "
                 "in fp32 training. Load host/machine: the host memory one machine needs while the model is built "
                 "and loaded, before it is sharded (ZeRO-3 with zero3_init_flag builds it partitioned).")
    lines += [f"refused by the plan at {world_size} process(es) (as --dry_run would be): {label}: {why}"
              for label, why in refused.items()]
    verdict = ""
    if device_memory:
        usable = usable_bytes(device_memory)
        lines.append(f"--device_memory {fmt(device_memory)} {unit}: a strategy fits when its device peak is at most "
                     f"{fmt(usable)} {unit} ({HEADROOM:.0%} less {CONTEXT_BYTES / gib:.0f} GiB: the rest goes to "
                     f"the CUDA context, communication buffers and fragmentation, which no row counts)")
        fitting = [r for r in rows if r.device <= usable and r.strategy not in refused]
        lines.append(f"cheapest strategy that fits: {fitting[0].strategy} (device peak {fmt(fitting[0].device)} "
                     f"{unit})" if fitting else
                     "nothing fits: add processes, or shrink the model, the micro-batch or the sequence length "
                     "(--gradient_checkpointing cuts activations)")
        if mine:
            verdict = (f"; fits, {fmt(usable - mine.device)} {unit} to spare" if mine.device <= usable else
                       f"; does not fit: {fmt(mine.device - usable)} {unit} over")
    if mine and mine.strategy in refused:
        verdict += f"; refused by the plan: {refused[mine.strategy]}"
    lines.append(f"this launch ({mine.strategy}, {world_size} process(es)): {fmt(mine.state)} {unit} of model state "
                 f"per rank, device peak {fmt(mine.device)} {unit}{verdict}" if mine else
                 "no launch chosen: with --accelerate_config FILE (or under accelerate launch) the last line is that "
                 "config's")
    return "\n".join(lines)


def _loss_chunk(shape: ModelShape, cfg: TrainConfig) -> int:
    """The positions whose logits the run's loss computes at once (--loss_chunk_mib); 0: all of them."""
    return chunk_tokens(getattr(cfg, "loss_chunk_mib", 0), shape.decoder.vocab) if shape.decoder else 0


def loss_note(shape: ModelShape, cfg: TrainConfig, seq_len: int | None) -> str:
    """How --estimate counts the loss's logits: whole, or a chunk of positions at a time (--loss_chunk_mib)."""
    if shape.decoder is None or not seq_len or not hasattr(cfg, "loss_chunk_mib"):
        return ""
    chunk = _loss_chunk(shape, cfg)
    if chunk and chunk < cfg.batch_size * seq_len:
        return f", the loss's logits {chunk:,} positions at a time (--loss_chunk_mib {cfg.loss_chunk_mib:g})"
    return ", the loss's logits whole"


def run_activations(shape: ModelShape, cfg: TrainConfig, seq_len: int | None, precision: str) -> int:
    """Activation bytes for this run (seq_len: the recipe's tokens per sample; the loss in chunks where the recipe
    has loss_chunk_mib), or a sampling recipe's KV cache where that is the larger."""
    training = activation_bytes(shape, cfg.batch_size, seq_len, precision,
                                getattr(cfg, "gradient_checkpointing", False), _loss_chunk(shape, cfg),
                                getattr(cfg, "tiled_mlp", False))
    return max(training, sampling_bytes(shape, cfg, seq_len, precision))


def sampling_bytes(shape: ModelShape, cfg: TrainConfig, seq_len: int | None, precision: str) -> int:
    """What an online-RL recipe's sampling holds (recipes/grpo.py, trainkit/rl/sampling.py), outside the step: the
    KV cache of every completion slot of the rank at once (batch_size x grad_accum rows of seq_len tokens: keys and
    values of every layer, in the compute dtype) and the last position's fp32 logits; 0 for a recipe that samples
    nothing."""
    d = shape.decoder
    if not getattr(cfg, "num_generations", 0) or d is None or not seq_len:
        return 0
    size = 2 if precision in ("bf16", "fp16") else 4
    rows = cfg.batch_size * cfg.grad_accum
    return int(size * rows * seq_len * shape.layers * 2 * (d.kv_width or d.hidden) + 4 * rows * d.vocab)
