"""DeepSpeed ZeRO stages 1-3, with or without CPU offload, through Accelerate's DeepSpeed integration.

The config (a JSON, or the YAML's own deepspeed_config keys) is resolved in deepspeed_config.py: every value the run
already knows comes from the run, and an explicit value that disagrees is refused before anything is built. The
engine owns accumulation and
clipping and takes the optimizer step inside the last micro-batch's backward, so the loss is checked before that
backward. Checkpoints are DeepSpeed's own (sharded per rank); a ZeRO checkpoint moves to another world size (and a
ZeRO-1/2 one to the other of the two stages) through DeepSpeed's universal checkpoint.

Sequence parallelism (a YAML's parallelism_config_sp_size; deepspeed_zero3_sp.yaml): Accelerate's ParallelismConfig
makes DeepSpeed's Ulysses groups and attention; the engine deals one micro-batch to each group, cuts it per rank
(trainkit/strategies/sequence_parallel.py), weighs each shard by its learned tokens, and corrects ZeRO-3's gradient
average. Checkpoints are deepspeed_format.py's.

CPU-only machines: without a backend DeepSpeed forms a world of N while Accelerate sees one process (the data would
not be sharded), and with `cpu=True` Accelerate would silently train plain DDP instead: this strategy passes
`backend="gloo"` (only with a real world: a one-process gloo group breaks Accelerate's reduce and gather).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from trainkit.config import TrainConfig
from trainkit.errors import Problem
from trainkit.estimate import OPTIMIZER_BYTES, Estimate, ModelShape
from trainkit.launch.launcher import PARALLELISM_KEY, Launch, is_true
from trainkit.losses import router
from trainkit.recipes import Recipe
from trainkit.run.stopping import FiniteCheck
from trainkit.step import StepResult, agree, loss_weights, optimizer_step
from trainkit.strategies import deepspeed_ep, sequence_parallel
from trainkit.strategies.base import Strategy
from trainkit.strategies.deepspeed_config import fill_bucket_sizes, persistence_threshold, resolve
from trainkit.strategies.deepspeed_format import DeepSpeedFormat
from trainkit.strategies.engine import Engine, LossFn


class ZeroEngine(Engine):
    """DeepSpeed's engine (Accelerate's DeepSpeedPlugin around the resolved JSON), which owns the step."""

    format = DeepSpeedFormat
    expert_layout: deepspeed_ep.Layout | None = None  # under AutoEP: the model's layout before it (final/'s)

    def build_accelerator(self, output_dir, report_to):
        # Accelerate refuses DeepSpeed settings from its YAML (mixed_precision, zero_stage, ...) next to a config it is
        # handed, because its plugin would ignore them. Here they are that config's one source: the YAML's keys were
        # translated into it and its "auto" values filled from the YAML's precision (deepspeed_config.py), so
        # nothing is left for Accelerate to ignore.
        os.environ["ACCELERATE_CONFIG_DS_FIELDS"] = ""
        accelerator = super().build_accelerator(output_dir, report_to)
        if self.strategy.stage == 3 and not self.strategy.builds_partitioned:
            # zero3_init_flag false: Accelerate's plugin registers its ZeRO-3 config with transformers whatever the
            # flag says (an HfDeepSpeedConfig made for any config it is handed), and transformers then builds inside
            # zero.Init anyway. Withdrawn, so that false means what the YAML says: the model built whole.
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
        elif self.strategy.builds_partitioned and self.sequence_parallel_size > 1:
            # zero.Init reads the config without DeepSpeed's sequence-parallel groups, so it checks train_batch_size
            # against every process ("8 != 8 * 1 * 2"): it gets the config without it (the engine gets it whole).
            from transformers.integrations import HfDeepSpeedConfig
            from transformers.integrations.deepspeed import set_hf_deepspeed_config

            plugin = accelerator.state.deepspeed_plugin
            plugin.dschf = HfDeepSpeedConfig({k: v for k, v in plugin.deepspeed_config.items()
                                              if k != "train_batch_size"})
            set_hf_deepspeed_config(plugin.dschf)
        return accelerator

    def accelerator_kwargs(self) -> dict[str, Any]:
        from accelerate.utils import DeepSpeedPlugin

        # Given explicitly so that nothing from the environment overrides the resolved JSON. Never cpu=True: under
        # it Accelerate silently trains plain DDP.
        plugin = {"deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=self.strategy.config,
                                                      gradient_accumulation_steps=self.cfg.grad_accum,
                                                      gradient_clipping=float(self.cfg.max_grad_norm))}
        if self.sequence_parallel_size == 1:
            return plugin
        from accelerate.utils import ParallelismConfig
        from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

        # Accelerate's own sequence parallelism: its prepare() makes DeepSpeed's groups (sp neighbouring ranks) and
        # registers Ulysses in place of the model's attention implementation (named in apply, once the model exists),
        # stepping aside in eval mode. Rows of any length: the runner cuts each micro-batch itself.
        handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
        # dp_replicate: the groups, which Accelerate multiplies into DeepSpeed's train_batch_size
        return {**plugin, "parallelism_config": ParallelismConfig(
            sp_size=self.sequence_parallel_size, sp_backend="deepspeed", sp_handler=handler,
            dp_replicate_size=self.data_parallel_size)}

    def process_group_kwargs(self) -> dict[str, Any]:
        kwargs = super().process_group_kwargs()
        if not torch.cuda.is_available() and self.launch.world_size > 1:
            kwargs["backend"] = "gloo"
        return kwargs

    def expected_distributed_type(self) -> str:
        return "DEEPSPEED"

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        fill_bucket_sizes(self.accelerator.state.deepspeed_plugin.deepspeed_config, model)
        built = [hasattr(p, "ds_id") for p in model.parameters()]
        if self.strategy.stage == 3 and any(built):
            # transformers builds inside zero.Init once Accelerate has selected a ZeRO-3 config with zero3_init_flag;
            # what is added to it later (peft's adapters) the engine partitions
            later = f" ({built.count(False)} parameter(s) added after it, such as LoRA's adapters, partitioned by " \
                f"the engine)" if not all(built) else ""
            self.notes.append(f"ZeRO-3: the model was built partitioned across {self.launch.world_size} process(es) "
                              f"(zero.Init): no rank held it whole{later}")
        if self.strategy.ep > 1:
            deepspeed_ep.mend_output_capture_registry()
            self.expert_layout = deepspeed_ep.layout(model, self.strategy.config)
        plugin = self.accelerator.state.deepspeed_plugin
        named = plugin.transformer_moe_cls_names or os.environ.get("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES")
        if self.strategy.stage == 3 and not named and (blocks := expert_blocks(model)):  # else Accelerate marks them
            from deepspeed.utils import set_z3_leaf_modules

            set_z3_leaf_modules(model, blocks)
            self.notes.append(f"ZeRO-3: each {', '.join(sorted({b.__name__ for b in blocks}))} is gathered whole (a "
                              "DeepSpeed leaf module): its experts run only where a token picks them, and ranks that "
                              "gathered different ones would no longer meet in the same collectives")
        if self.sequence_parallel_size > 1:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            # What Ulysses will call once it has gathered the whole sequence: the model's attention, with the mask of
            # packed rows made from the whole row's positions (trainkit/strategies/sequence_parallel.py)
            config = getattr(model, "get_base_model", lambda: model)().config
            attention, text = config._attn_implementation, config.get_text_config()
            if getattr(text, "num_key_value_heads", None) is None:  # GPT-2, GPT-NeoX: DeepSpeed reads it regardless
                text.num_key_value_heads = text.num_attention_heads
            if getattr(text, "head_dim", None) is None:  # Mixtral, OLMoE: the value their attention takes; DeepSpeed
                text.head_dim = text.hidden_size // text.num_attention_heads  # reads head_dim (a TypeError on None)
            ALL_ATTENTION_FUNCTIONS[attention] = sequence_parallel.packed_attention(ALL_ATTENTION_FUNCTIONS[attention])
            self.accelerator.parallelism_config.sp_handler.sp_attn_implementation = attention
            self.notes.append(f"sequence parallelism: each sequence cut in {self.sequence_parallel_size} (DeepSpeed's "
                              f"Ulysses, {attention} attention), {self.data_parallel_size} data-parallel group(s)")
        return super().apply(model)

    def prepare(self, model: torch.nn.Module, build_optimizer: Callable[..., torch.optim.Optimizer],
                build_scheduler: Callable[[TrainConfig, torch.optim.Optimizer], Any]) -> None:
        super().prepare(model, build_optimizer, build_scheduler)
        if self.strategy.ep > 1:
            held, total = deepspeed_ep.experts_held(self.unwrapped_model, self.expert_layout)
            self.notes.append(f"DeepSpeed's AutoEP: the experts of {len(self.expert_layout.specs)} "
                              f"mixture-of-experts block(s) split between {self.strategy.ep} ranks, tokens sent to "
                              f"their experts' rank and back: this rank holds {held:,} of the {total:,} expert "
                              f"parameters")
        if self.sequence_parallel_size > 1:  # Ulysses registered itself in place of the attention: keep its heads apart
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            attention = self.accelerator.parallelism_config.sp_handler.sp_attn_implementation
            ALL_ATTENTION_FUNCTIONS[attention] = sequence_parallel.heads_kept(ALL_ATTENTION_FUNCTIONS[attention])

    def make_optimizer(self, model: torch.nn.Module,
                       build_optimizer: Callable[..., torch.optim.Optimizer]) -> torch.optim.Optimizer:
        if not self.strategy.offloads_optimizer:
            optimizer = build_optimizer(self.cfg, model)
        else:
            if self.accelerator.is_main_process:
                print("note: ZeRO-Offload runs Adam in DeepSpeed's cpu_adam op; its first use compiles it (about a "
                      "minute), later runs reuse ~/.cache/torch_extensions", flush=True)
            optimizer = build_optimizer(self.cfg, model, adam_class=_resumable_cpu_adam())
        if self.strategy.ep > 1:
            deepspeed_ep.expert_groups(optimizer, model, self.expert_layout, self.strategy.ep)
        return optimizer

    @property
    def deepspeed_engine(self):
        return self.accelerator.deepspeed_engine_wrapped.engine

    # --- sequence parallelism: the ranks of a group share a micro-batch, 1/sp of its positions each -----------------

    @property
    def data_parallel_rank(self) -> int:
        return self.accelerator.process_index // self.sequence_parallel_size  # DeepSpeed's groups: neighbours

    @property
    def gradient_correction(self) -> float:
        """What the backward's loss is multiplied by for the reduced gradient to be the global batch's. Under
        sequence parallelism DeepSpeed divides the summed gradients by the data-parallel size (num_processes / sp) in
        ZeRO-1/2 and in ZeRO-3's all-reduce path, but by num_processes in ZeRO-3's reduce-scatter (its default,
        stage3.py's __avg_scatter_grads, which has no sp term): measured, a gradient norm 1/sp of one process's."""
        zero = self.strategy.zero
        return float(self.sequence_parallel_size) if zero.get("stage") == 3 and zero.get("reduce_scatter", True) \
            else 1.0

    def split_sequences(self, micro_batches: list) -> list:
        """This rank's positions of every row (trainkit/strategies/sequence_parallel.py's shard)."""
        if self.sequence_parallel_size == 1:
            return micro_batches
        rank = self.accelerator.process_index % self.sequence_parallel_size  # DeepSpeed's groups: neighbours
        return [sequence_parallel.shard(batch, rank, self.sequence_parallel_size) for batch in micro_batches]

    def sequence_context(self, batch: Any) -> contextlib.AbstractContextManager:
        """Around a shard's forward and backward under sequence parallelism: the ranks that hold the other parts of
        its rows (DeepSpeed's sequence-parallel group, which Accelerate made), for what needs whole sequences (a
        mixture of experts' balance: trainkit/losses/router.py)."""
        if self.sequence_parallel_size == 1:
            return contextlib.nullcontext()
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        return router.split_over(parallel_state_sp.get_sequence_parallel_group())

    # --- one optimizer step -----------------------------------------------------------------------------------------

    owns_step = True

    def engine_step(self, step: int, micro_batches: list, loss_fn: LossFn, finite: FiniteCheck,
                    stop_requested: bool) -> StepResult:
        """The engine clips and steps inside the last micro-batch's backward: the loss is agreed on and checked
        before it, the gradient norm (computed by the engine) only after.

        Accumulation costs ZeRO-2/3 communication on every micro-batch, by design of their gradient partitioning:
        a rank keeps only its own partition of the gradients, so each micro-batch's gradients are reduce-scattered
        (in buckets, during backward) into the partitions' owners and added there, instead of being held whole
        until the last micro-batch as DDP and FSDP2 do (strategies/fsdp.py). ZeRO-3 also gathers every layer's
        parameters again in each micro-batch's forward and backward."""
        accelerator, model = self.accelerator, self.model
        micro_batches = self.split_sequences(micro_batches)
        loss_sum = torch.zeros(1, device=accelerator.device)
        weights = loss_weights(self, micro_batches)
        for i, batch in enumerate(micro_batches):
            with accelerator.accumulate(model), self.sequence_context(batch):
                loss = loss_fn(model, self.cast_batch(batch)) * weights[i]
                loss_sum += loss.detach().float()
                if i == len(micro_batches) - 1:
                    loss_value, stop, _, _ = agree(self, loss_sum / len(micro_batches), stop_requested)
                    finite.loss(step, loss_value)
                accelerator.backward(loss * self.gradient_correction)
        # None when the JSON turns the norm's computation off (compute_grad_norm: false, allowed without clipping).
        norm = self.deepspeed_engine.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else None
        finite.grad_norm(step, grad_norm, step_taken=True)
        return optimizer_step(self, loss_value, grad_norm, stop)

    def step_was_skipped(self) -> bool:
        return bool(getattr(self.deepspeed_engine.optimizer, "overflow", False))

    def cast_batch(self, batch: Any) -> Any:
        """Under bf16/fp16 DeepSpeed turns the weights themselves to low precision: float inputs must follow
        ("mat1 and mat2 must have the same dtype" otherwise)."""
        batch = super().cast_batch(batch)
        if self.launch.mixed_precision == "no":
            return batch
        dtype = torch.bfloat16 if self.launch.mixed_precision == "bf16" else torch.float16
        if isinstance(batch, dict):
            return {k: v.to(dtype) if torch.is_floating_point(v) else v for k, v in batch.items()}
        return [t.to(dtype) if torch.is_floating_point(t) else t for t in batch]

    def state_tensors(self) -> Iterator[torch.Tensor]:
        """Also a ZeRO-3 parameter's partition and the ZeRO optimizer's own buffers (flat parameter groups, the fp32
        master partition, gradient partitions), which hold the same state under other names."""
        yield from super().state_tensors()
        for p in self.model.parameters():
            if getattr(p, "ds_tensor", None) is not None:
                yield p.ds_tensor
        zero_optimizer = self.deepspeed_engine.optimizer
        for value in vars(zero_optimizer).values():
            for item in value if isinstance(value, (list, tuple)) else [value]:
                for t in item if isinstance(item, (list, tuple)) else [item]:
                    if torch.is_tensor(t):
                        yield t

    @property
    def unwrapped_model(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model)  # the engine's module

    def in_eval_mode(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Under ZeRO-3 with --gather_for_generation (the default), the parameters gathered once for the whole call
        and the engine's hooks set aside meanwhile (DeepSpeed's unwrap_model_for_generation): a generation's every
        token would otherwise gather every layer again, two collectives per module per token. The same weights:
        the same tokens and log-probs, on any number of ranks."""
        if self.strategy.stage != 3 or not self.cfg.gather_for_generation:
            return super().in_eval_mode(fn, *args)
        from deepspeed.runtime.zero import unwrap_model_for_generation

        with unwrap_model_for_generation(self.deepspeed_engine):
            return super().in_eval_mode(fn, *args)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """ZeRO-3 gathers the partitions (zero3_save_16bit_model / stage3_gather_16bit_weights_on_model_save); AutoEP's
        experts are gathered from their ranks into the model's own layout."""
        state_dict = self.accelerator.get_state_dict(self.model)
        if self.strategy.ep == 1:
            return state_dict
        return deepspeed_ep.transformers_layout(self.unwrapped_model, state_dict, self.expert_layout)

    @contextlib.contextmanager
    def building_alone(self) -> Iterator[None]:
        """Without ZeRO-3's zero.Init, which transformers enters for every model it builds while Accelerate's DeepSpeed
        config is registered with it: it partitions each parameter as it is made, a collective that would wait for
        ranks that are not building. (Accelerate's zero3_init_context_manager(enable=False) registers it again.)"""
        from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        try:
            yield
        finally:
            if self.strategy.builds_partitioned:
                set_hf_deepspeed_config(self.accelerator.state.deepspeed_plugin.dschf)


class DeepSpeed(Strategy):
    """DeepSpeed's engine with the ZeRO stage, offload and precision of the resolved JSON."""

    name = "deepspeed"
    engine = ZeroEngine

    def __init__(self, launch: Launch, cfg: TrainConfig, sources: Mapping[str, str],
                 recipe: Recipe | None = None) -> None:
        super().__init__(launch, cfg, sources, recipe)
        # Ulysses sequence parallelism (parallelism_config_sp_size): groups of sp neighbouring ranks share each
        # micro-batch, 1/sp of its positions each (trainkit/strategies/sequence_parallel.py); ZeRO partitions over every
        # rank
        self.sp = launch.parallelism_size("sp")
        self.resolved = resolve(launch, cfg, sources, self.data_parallel_size)
        self.config = self.resolved.config  # the filled JSON that the engine gets
        self.ep = deepspeed_ep.ep_size(self.config)  # DeepSpeed's AutoEP (strategies/deepspeed_ep.py), 1 without
        self.notes = tuple(self.resolved.notes)

    @classmethod
    def selects(cls, launch: Launch, cfg: TrainConfig) -> bool:
        return launch.distributed_type == "DEEPSPEED"

    @property
    def zero(self) -> dict[str, Any]:
        return self.config.get("zero_optimization", {})

    @property
    def stage(self) -> int | None:
        return self.zero.get("stage")

    @property
    def builds_partitioned(self) -> bool:
        """ZeRO-3 with zero3_init_flag (Accelerate's default: true): a transformers model is built inside zero.Init,
        each parameter partitioned as it is made."""
        return self.stage == 3 and is_true(self.launch.settings.get("zero3_init_flag", True))

    @property
    def offloads_optimizer(self) -> bool:
        return self.zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None)

    @property
    def offloads_params(self) -> bool:
        return self.zero.get("offload_param", {}).get("device", "none") not in ("none", None)

    @property
    def label(self) -> str:
        return f"deepspeed_zero{self.stage}" + ("_offload" if self.offloads_optimizer else "") + \
            ("_sp" if self.sp > 1 else "") + ("_ep" if self.ep > 1 else "")

    @property
    def needs_experts(self) -> bool:
        return self.ep > 1

    @property
    def data_parallel_size(self) -> int:
        return max(1, self.launch.world_size // self.sp)

    @property
    def splits_model(self) -> bool:  # sequence parallelism cuts each sample: the recipe must read the shards
        return self.sp > 1

    @property
    def sequence_parallel_size(self) -> int:
        return self.sp

    def resolved_fields(self) -> dict[str, Any]:
        """Also the whole DeepSpeed config as the engine gets it (bucket sizes still "auto": they are filled from
        the model when it is built), the sequence-parallel size and AutoEP's (1 without it)."""
        return {"strategy": self.name, "zero_stage": self.stage, "sp": self.sp, "ep": self.ep,
                "deepspeed_config": self.config}

    @property
    def speed_rank(self) -> int:
        if self.offloads_optimizer:
            return 7 if self.stage == 3 else 5
        return {0: 1, 1: 1, 2: 2, 3: 4}.get(self.stage, 4)

    def check(self, this_machine: bool = True) -> list[Problem]:
        problems = super().check(this_machine) + self.resolved.problems + self.sequence_problems()
        if self.resolved.problems:  # the section is read from a config that passed its own checks
            return problems
        return problems + deepspeed_ep.launch_problems(self.config, self.launch.world_size, self.stage, self.sp,
                                                       self.offloads_optimizer or self.offloads_params,
                                                       self.cfg.compile, self.resolved.where)

    def sequence_problems(self) -> list[Problem]:
        """A YAML's parallelism_config under DeepSpeed: only its sp size applies, dividing the processes, for a recipe
        whose loss reads the shards."""
        where = f"parallelism_config in {self.launch.source}"
        problems = [Problem(f"{PARALLELISM_KEY.format(name)} is {size}: under DeepSpeed only the sequence-parallel "
                            f"size applies (ZeRO partitions over every rank)", where,
                            f"set {PARALLELISM_KEY.format(name)}: 1, or use an FSDP YAML for it (tp.yaml, hsdp.yaml)")
                    for name, size in self.launch.parallelism.items() if name != "sp" and size != 1]
        if self.sp < 1 or self.launch.world_size % self.sp:
            problems.append(Problem(f"parallelism_config_sp_size {self.sp} does not divide the "
                                    f"{self.launch.world_size} process(es)", where,
                                    "launch a multiple of it (--num_processes), or change parallelism_config_sp_size"))
        elif self.sp > 1 and getattr(self.cfg, "pipeline_stages", 1) > 1:
            problems.append(Problem("sequence parallelism and --pipeline_stages together", where,
                                    "drop --pipeline_stages, or set parallelism_config_sp_size: 1"))
        elif self.sp > 1:
            problems += sequence_parallel.recipe_problems(self.recipe, where, "deepspeed_zero3.yaml or fsdp.yaml")
        return problems

    def check_model(self, model: torch.nn.Module) -> list[Problem]:
        if self.ep > 1:
            return deepspeed_ep.model_problems(model, self.config, self.resolved.where)
        if self.sp == 1:
            return []
        return sequence_parallel.problems(model, self.sp, f"parallelism_config in {self.launch.source}",
                                          self.recipe.tokens_per_sample(self.cfg) if self.recipe else None)

    def cpu_fp16_refusal(self) -> str | None:
        return "DeepSpeed's own fp16 engine needs a GPU (it fails with \"Type fp16 is not supported on your device\")"

    def compile_refusal(self) -> str | None:
        if self.stage != 3:
            return None
        # Measured (torch 2.13, deepspeed 0.19.8): every rank warns "torch._dynamo hit config.recompile_limit (8)"
        # in the first step and the loss curve is bit for bit the eager one, because the compiled code is never used.
        return ("ZeRO-3 frees each layer's gathered parameters after its forward, so torch.compile recompiles at every "
                "call until its recompile limit, then runs the model eagerly: the compilation buys nothing")

    def estimate(self, shape: ModelShape, world_size: int, activations: int) -> Estimate:
        """ZeRO-1/2: full weights in the training dtype, plus an fp32 master copy of this rank's partition (even in
        fp32 training: the ZeRO paper counts none there) and the partition's optimizer states; gradients live in
        reduce buckets during backward (ZeRO-1: whole) and are freed after the step. ZeRO-3: everything
        partitioned, except parameters below stage3_param_persistence_threshold, kept whole on every rank. Offload
        moves master copy and optimizer states (ZeRO-3 offload: the weights too) to the host; ZeRO-2 offload adds
        host copies of the partition (low precision) and of its fp32 gradients, and two staging buffers the size of
        the largest parameter (measured: BENCHMARKS.md)."""
        n, w, trained = shape.num_params, world_size, shape.trained()
        t = trained.num_params  # what has gradients, a master copy and optimizer states
        low = 2 if self.launch.mixed_precision in ("bf16", "fp16") else 4  # DeepSpeed casts the model itself
        optimizer = (4 + OPTIMIZER_BYTES[self.cfg.optimizer]) * math.ceil(t / w)  # fp32 master + optimizer states
        if self.stage != 3:
            # AutoEP: 1/ep of the experts' weights on each rank, their optimizer state partitioned over the w/ep ranks
            # that hold the same experts (1/w of it, as the rest's)
            experts, trained_experts = shape.expert_numel(), trained.expert_numel()
            held = n - experts + math.ceil(experts / self.ep)
            held_trained = t - trained_experts + math.ceil(trained_experts / self.ep)
            if not self.offloads_optimizer:
                transient = low * held_trained if self.stage in (0, 1) else 0  # ZeRO-2 reduce-scatters in buckets
                return Estimate(self.label, shape.weight_bytes(held, held_trained, low), 0, optimizer, 0, activations,
                                transient)
            staging = low * max(trained.numels, default=0)
            grads = 4 * math.ceil(t / w) + 2 * staging
            optimizer += low * math.ceil(t / w)
            return Estimate(self.label, shape.weight_bytes(held, held_trained, low), grads, optimizer,
                            optimizer + grads - staging, activations)
        # ZeRO-3 partitions every weight in its training dtype, a frozen base too (measured: a LoRA run's bf16 base
        # is held in fp32 under fp32 ZeRO-3 and trains as the fp32 base does; ZeRO-1/2 leave frozen weights alone),
        # but for a quantised base's packed bytes, which it partitions as they are, beside their whole constants. A
        # parameter stored in fewer elements than the persistence threshold is held whole beside its partition
        # (measured tensor by tensor on a QLoRA run)
        threshold, params = persistence_threshold(shape.hidden), shape.constant_bytes
        for numel, (packed, stored) in zip(shape.numels, shape.quantised or ((0, 0),) * len(shape.numels),
                                           strict=True):
            size = packed or low * numel
            params += math.ceil(size / w) + (size if (stored or numel) < threshold else 0)
        host = (params if self.offloads_params else 0) + (optimizer if self.offloads_optimizer else 0)
        return Estimate(self.label, params, low * math.ceil(t / w), optimizer, host, activations)


def expert_blocks(model: torch.nn.Module) -> list[type[torch.nn.Module]]:
    """The classes of the modules below the model's root that hold one module per expert (an `experts` ModuleList),
    which ZeRO-3 must gather whole. A transformers mixture of experts keeps its experts fused in one module, whose
    parameters are gathered together whatever the routing: none there. The root is never one (a leaf root would leave
    nothing partitioned: DeepSpeed failed on tests/zoo/vision_moe.py so). A YAML's deepspeed_moe_layer_cls_names names
    them instead (Accelerate marks those)."""
    return list({type(module) for name, module in model.named_modules()
                 if name and isinstance(getattr(module, "experts", None), torch.nn.ModuleList)})


@functools.cache
def _resumable_cpu_adam() -> type[torch.optim.Optimizer]:
    """DeepSpeed's CPU Adam, with the bias correction computed the same way in a resumed run as in the original.

    cpu_adam's C++ state keeps beta^t as a running float product (beta^t = beta^(t-1) * beta, deepspeed/ops/csrc/
    includes/cpu_adam.h, IncrementStep), but a fresh process, such as a resumed run, starts it with pow(beta, t):
    a few ulps apart, so the resumed curve left the uninterrupted one by ~1e-7 within two steps. Starting the C++
    state afresh before every step makes every step take the pow path (step 1's product is beta itself), in both.
    """
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    class ResumableCPUAdam(DeepSpeedCPUAdam):
        def _fresh_state(self) -> None:
            beta1, beta2 = self.defaults["betas"]
            self.ds_opt_adam.create_adam(self.opt_id, self.defaults["lr"], beta1, beta2, self.defaults["eps"],
                                         self.defaults["weight_decay"], self.adam_w_mode, False)

        def step(self, closure=None):
            self._fresh_state()
            return super().step(closure)

        def step_subgroup(self, subgroup_id: int, closure=None):
            self._fresh_state()
            return super().step_subgroup(subgroup_id, closure)

    return ResumableCPUAdam
