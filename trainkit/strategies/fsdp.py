"""FSDP2: PyTorch's `fully_shard`, every parameter a DTensor sharded across the processes.

Accelerate applies FSDP only on GPU-type devices, so this strategy applies `fully_shard` itself on every device (one
code path, tested on CPU) and tells Accelerate not to wrap the model again; Accelerate still prepares the optimizer
and schedule. Accumulation: `set_requires_gradient_sync(False)` on all but the last micro-batch, so gradients are
reduce-scattered once per step (`accelerator.accumulate` cannot do that for a model it did not wrap).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trainkit.config import TrainConfig
from trainkit.errors import ConfigError, Problem
from trainkit.estimate import OPTIMIZER_BYTES, Estimate, ModelShape
from trainkit.launch import PARALLELISM_KEY, Launch, is_true
from trainkit.strategies.base import Strategy


class FSDP2(Strategy):
    """PyTorch FSDP2 over NCCL or gloo; optionally with the shards in CPU memory (CPUOffloadPolicy)."""

    name = "fsdp"

    @classmethod
    def selects(cls, launch: Launch, cfg: TrainConfig) -> bool:
        return launch.distributed_type == "FSDP"

    @property
    def offload(self) -> bool:
        return is_true(self.launch.settings.get("fsdp_offload_params", False))

    @property
    def reshard_after_forward(self) -> bool:
        return is_true(self.launch.settings.get("fsdp_reshard_after_forward", True))

    @property
    def activation_checkpointing(self) -> bool:
        return is_true(self.launch.settings.get("fsdp_activation_checkpointing", False))

    def check(self) -> list[Problem]:
        """The fsdp_config settings the runner does not apply are refused, never ignored. Those of FSDP1 that FSDP2
        makes moot pass: fsdp_use_orig_params (FSDP2 always keeps them), fsdp_forward/backward_prefetch (FSDP2
        prefetches on its own), fsdp_sync_module_states and fsdp_cpu_ram_efficient_loading (every rank builds the
        same weights from the seed), fsdp_state_dict_type (checkpoints are always sharded, final/ always whole)."""
        problems = super().check() + parallelism_problems(self.launch)
        settings, where = self.launch.settings, f"fsdp_config in {self.launch.source}"
        version = str(settings.get("fsdp_version", 2))
        if version != "2":
            problems.append(Problem(f"fsdp_version {version}: this runner shards with FSDP2 only", where,
                                    "set fsdp_version: 2"))
        policy = str(settings.get("fsdp_auto_wrap_policy") or "TRANSFORMER_BASED_WRAP")
        if policy not in ("TRANSFORMER_BASED_WRAP", "NO_WRAP"):
            problems.append(Problem(f"fsdp_auto_wrap_policy {policy}: the runner shards the model's blocks "
                                    f"(TRANSFORMER_BASED_WRAP) or the whole model at once (NO_WRAP)", where,
                                    "set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP and name the block classes in "
                                    "fsdp_transformer_layer_cls_to_wrap (or in the model's _no_split_modules)"))
        if settings.get("fsdp_ignored_modules"):
            problems.append(Problem("fsdp_ignored_modules: the runner shards every module", where,
                                    "remove fsdp_ignored_modules"))
        if is_true(settings.get("fsdp_activation_checkpointing_offload", False)):
            problems.append(Problem("fsdp_activation_checkpointing_offload: the runner recomputes activations, it "
                                    "does not move them to the CPU", where,
                                    "remove it (fsdp_activation_checkpointing alone saves the memory by recomputing)"))
        if self.activation_checkpointing and self.cfg.compile:
            # inductor's recompute of a checkpointed block fails its own stride assertion (torch 2.13)
            problems.append(Problem("fsdp_activation_checkpointing with --compile: torch.compile's code fails in the "
                                    "recomputation", where, "drop --compile, or fsdp_activation_checkpointing"))
        if self.activation_checkpointing and getattr(self.cfg, "gradient_checkpointing", False):
            problems.append(Problem("fsdp_activation_checkpointing and the recipe's gradient_checkpointing both "
                                    "recompute the blocks", where,
                                    "keep one: drop --gradient_checkpointing, or fsdp_activation_checkpointing"))
        return problems

    @property
    def label(self) -> str:
        return "fsdp_offload" if self.offload else "fsdp"

    @property
    def speed_rank(self) -> int:
        return 6 if self.offload else 3

    def estimate(self, shape: ModelShape, world_size: int, activations: int) -> Estimate:
        """What DDP holds per parameter, for the part of each parameter one rank holds."""
        shard, trained = self.held_numel(shape, world_size), self.held_numel(shape.trained(), world_size)
        opt = OPTIMIZER_BYTES[self.cfg.optimizer]
        host = 4 * shard + (4 + opt) * trained if self.offload else 0
        return Estimate(self.label, 4 * shard, 4 * trained, opt * trained, host, activations)

    def held_numel(self, shape: ModelShape, world_size: int) -> int:
        """Parameter elements one rank holds: 1/world_size of each, as FSDP2 pads each parameter's dim-0 shards."""
        return sum(math.ceil(k / world_size) for k in shape.numels)

    def build_accelerator(self, output_dir, report_to):
        # Accelerate must see a plain MULTI_GPU/MULTI_CPU run: it would otherwise wrap the sharded model again, and
        # it refuses a parallelism_config on CPU ("ParallelismConfig is only compatible DistributedType.FSDP (version
        # 2) or ... but got DistributedType.MULTI_CPU"); the runner builds the device mesh itself (strategies/mesh.py).
        os.environ["ACCELERATE_USE_FSDP"] = "false"
        os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = "false"
        return super().build_accelerator(output_dir, report_to)

    def prepare(self, model: torch.nn.Module, build_optimizer: Callable[..., torch.optim.Optimizer],
                build_scheduler: Callable[[TrainConfig, torch.optim.Optimizer], Any]) -> None:
        # Compiled before sharding, block by block as torchtitan does (its parallelize step: tensor parallelism,
        # then compile, then fully_shard): each block's graph holds its own computation, and FSDP2's gathers and
        # reduce-scatters run in its hooks around the graph. A model that declares no blocks is compiled whole.
        blocks = self.blocks(model) if self.block_classes(model) else []
        self.compile_model(model, blocks)
        self.model = self._fully_shard(model)
        optimizer = build_optimizer(self.cfg, self.model)
        self.optimizer, self.scheduler = self.accelerator.prepare(optimizer, build_scheduler(self.cfg, optimizer))

    def blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The units sharded (and gathered) one at a time, innermost first; the root holds the rest.

        The blocks are the classes the YAML names (Accelerate's fsdp_transformer_layer_cls_to_wrap), else those the
        model declares in `_no_split_modules` (transformers' models do; a recipe's build_model can set it), else every
        Linear layer; none under fsdp_auto_wrap_policy NO_WRAP. A block whose parameters are shared with a module
        outside it (tied input and output embeddings) stays in the root's group: FSDP2 refuses a parameter managed by
        two groups.
        """
        if self.launch.settings.get("fsdp_auto_wrap_policy") == "NO_WRAP":
            return []
        classes = self.block_classes(model)
        owners: dict[int, list[torch.nn.Module]] = {}
        for module in model.modules():
            for param in module.parameters(recurse=False):
                owners.setdefault(id(param), []).append(module)

        def shares_outside(block: torch.nn.Module) -> bool:
            inside = {id(m) for m in block.modules()}
            return any(id(owner) not in inside for p in block.parameters() for owner in owners[id(p)])

        candidates = [m for m in reversed(list(model.modules())) if m is not model and
                      (type(m).__name__ in classes if classes else isinstance(m, torch.nn.Linear))]
        return [m for m in candidates if any(True for _ in m.parameters()) and not shares_outside(m)]

    def block_classes(self, model: torch.nn.Module) -> set[str]:
        """The class names of the model's blocks: those the YAML names, else those the model declares."""
        named = self.launch.settings.get("fsdp_transformer_layer_cls_to_wrap") or []
        named = named.split(",") if isinstance(named, str) else named  # the environment's text, or a YAML list
        return {str(c).strip() for c in named if str(c).strip()} or set(getattr(model, "_no_split_modules",
                                                                                None) or [])

    def _fully_shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """Shard each block, then the root (which takes every parameter no block holds)."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        # No model.to(device) first: each fully_shard call moves only its own unit to the device, then shards it, so a
        # GPU never holds the whole unsharded model (the model FSDP exists for may not fit there).
        dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
        policy = dict(
            # Mixed precision FSDP's way: compute in low precision, reduce gradients and keep the shards in fp32.
            mp_policy=MixedPrecisionPolicy(param_dtype=dtypes.get(self.launch.mixed_precision),
                                           reduce_dtype=torch.float32),
            offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.offload else OffloadPolicy(),
            reshard_after_forward=self.reshard_after_forward,
            mesh=self.fsdp_mesh(),
        )
        blocks = self.blocks(model)
        if self.activation_checkpointing:
            self.checkpoint_activations(model, blocks)
        for block in blocks:
            fully_shard(block, **policy)
        fully_shard(model, **policy)
        if callable(getattr(model, "generate", None)):  # a recipe's generate hook: the root's own parameters gathered
            from torch.distributed.fsdp import register_fsdp_forward_method  # around the whole call, not just forward

            register_fsdp_forward_method(model, "generate")
        unsharded = [name for name, p in model.named_parameters() if not self.is_sharded(p)]
        if unsharded:
            raise ConfigError([Problem(f"FSDP left parameters unsharded: {', '.join(unsharded[:5])}", "fsdp",
                                       "report this with the recipe; use deepspeed_zero3.yaml meanwhile")])
        return model

    def checkpoint_activations(self, model: torch.nn.Module, blocks: list[torch.nn.Module]) -> None:
        """fsdp_activation_checkpointing: each block (the whole model when there are none) keeps only its input from
        the forward and runs its forward again in backward (torch's composable `checkpoint`: hooks, so the parameter
        names stay, and checkpoints and final/ with them); the same numbers, less activation memory, about one more
        forward per step."""
        from torch.distributed._composable import checkpoint

        for unit in blocks or [model]:
            checkpoint(unit)
        self.notes.append(f"activation checkpointing on each {type(blocks[0]).__name__} ({len(blocks)})" if blocks
                          else "activation checkpointing on the whole model (one FSDP group)")

    def fsdp_mesh(self) -> Any:
        """The DeviceMesh fully_shard shards over; None: every process, one shard each."""
        return None

    def is_sharded(self, param: torch.Tensor) -> bool:
        """Whether fully_shard sharded this parameter as fsdp_mesh asks."""
        return _is_sharded(param, self.launch.world_size)

    @contextlib.contextmanager
    def gradient_sync(self, last: bool) -> Iterator[None]:
        """One reduce-scatter and the all-gathers of one micro-batch per step, not per micro-batch: on all but the
        last micro-batch FSDP2 keeps each block's unsharded gradient and adds the next one to it
        (`set_requires_gradient_sync(False)`), and keeps the gathered parameters after forward and after backward
        (`set_reshard_after_forward(False)` on the blocks, `set_reshard_after_backward(False)`), so that the next
        micro-batch gathers nothing. The last micro-batch reshards as without accumulation (HSDP: its all-reduce
        too). The cost, during accumulation only: the blocks' gathered parameters and unsharded gradients stay in
        memory until the last micro-batch, as DDP holds them. Tests: the accumulation parity and exact resume of
        tests/test_strategies.py."""
        self.model.set_requires_gradient_sync(last)
        self.model.set_reshard_after_backward(last)
        if self.cfg.grad_accum > 1:
            from torch.distributed.fsdp import FSDPModule

            for block in self.model.modules():  # not the root, whose own setting (False) FSDP2 chose
                if isinstance(block, FSDPModule) and block is not self.model:
                    block.set_reshard_after_forward(last and self.reshard_after_forward, recurse=False)
        yield

    def clip_grad_norm(self) -> torch.Tensor:
        norm = super().clip_grad_norm()
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def parallelism_problems(launch: Launch) -> list[Problem]:
    """What the runner refuses in a YAML's parallelism_config: sizes that do not multiply to the processes launched,
    and the dimensions it does not apply (context and sequence parallelism)."""
    if not launch.parallelism:
        return []
    where = f"parallelism_config in {launch.source}"
    sizes = {name: launch.parallelism_size(name) for name in ("dp_replicate", "dp_shard", "tp")}
    keys = " x ".join(PARALLELISM_KEY.format(name) for name in sizes)
    problems = [Problem(f"{PARALLELISM_KEY.format(name)} is {size}: every size must be a positive integer", where,
                        f"set {PARALLELISM_KEY.format(name)}: 1 or more")
                for name, size in launch.parallelism.items() if size < 1]
    product = math.prod(sizes.values())
    if product != launch.world_size:
        problems.append(Problem(
            f"the parallelism sizes multiply to {product} ({' x '.join(f'{n} {s}' for n, s in sizes.items())}) but "
            f"{launch.world_size} process(es) were launched", where,
            f"make {keys} equal num_processes (accelerate launch --num_processes must match it too)"))
    for name, what in (("cp", "context"), ("sp", "sequence")):
        if launch.parallelism_size(name) > 1:
            problems.append(Problem(f"{PARALLELISM_KEY.format(name)} is {launch.parallelism_size(name)}: {what} "
                                    f"parallelism is not supported by this runner", where,
                                    f"set {PARALLELISM_KEY.format(name)}: 1"))
    if sizes["dp_replicate"] > 1 and sizes["dp_shard"] == 1:
        # Accelerate's own rule: replicas without sharding are DDP (with tp as well, it asks for dp_shard instead)
        problems.append(Problem(f"dp_replicate {sizes['dp_replicate']} with dp_shard 1: replicas without sharding "
                                f"are data parallelism", where,
                                "use accelerate_configs/ddp.yaml for replicas only, or move the replicas to "
                                "parallelism_config_dp_shard_size (FSDP), or shard within them (hsdp.yaml)"))
    return problems


def _is_sharded(param: torch.Tensor, world_size: int) -> bool:
    from torch.distributed.tensor import DTensor, Shard

    return (isinstance(param, DTensor) and param.device_mesh.size() == world_size
            and all(isinstance(p, Shard) for p in param.placements))
