"""FSDP2, HSDP, tensor parallelism, FSDP2 + TP and context parallelism: one strategy, the sizes of the mesh
(strategies/parallel_dims.py).

An FSDP launch (`distributed_type: FSDP`, `fsdp_version: 2`) trains on the (dp_replicate, dp_shard, cp, tp) part of
the mesh: fsdp.yaml shards every parameter over every process (dp_shard = N), hsdp.yaml shards within groups that
replicate each other, tp.yaml cuts the planned layers over tp, fsdp_tp.yaml does both, fsdp_cp.yaml splits each
sequence over cp (GPUs only). strategies/parallelize.py applies them in one order (tensor parallelism, activation
checkpointing, compile, fully_shard).

Accelerate applies FSDP and a parallelism_config only on GPU-type devices; on a CPU machine it refuses the config
("ParallelismConfig is only compatible DistributedType.FSDP (version 2) or ... but got DistributedType.MULTI_CPU").
So the runner builds the mesh itself (`init_device_mesh`, once the Accelerator has made the process group) and tells
Accelerate not to wrap the model; Accelerate still prepares the optimizer and schedule. Accumulation:
`set_requires_gradient_sync(False)` on all but the last micro-batch, so gradients are reduce-scattered once per
step (`accelerator.accumulate` cannot do that for a model it did not wrap).

The ranks of one tensor-parallel group compute one model on the same samples: the data-parallel size is
dp_replicate x dp_shard, and the data-parallel rank is the (dp_replicate, dp_shard) coordinate on the mesh.

Context parallelism (parallelism_config_cp_size; torch's `context_parallel`, as Accelerate's `cp_backend: torch`):
the ranks of a cp group share each micro-batch; inside the context torch cuts its rows (input_ids, the next-token
targets made whole first, positions: trainkit/strategies/sequence_parallel.py's rows) into 2 x cp chunks, two per rank
(head_tail: causal attention's work balanced), and its ring attention replaces `F.scaled_dot_product_attention`,
passing keys and values around the group. The runner's part: the model's sdpa attention called as one causal
F.scaled_dot_product_attention (sequence_parallel.causal_sdpa), each rank's loss weighed by its part's learned tokens,
FSDP2 sharding over dp_shard x cp (whose average over cp the backward undoes: gradient_correction). The ring's
kernels are CUDA's (flash, memory-efficient, cuDNN): on a CPU the plan refuses it (context_parallel_refusal).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from trainkit.config import TrainConfig
from trainkit.errors import Problem
from trainkit.estimate import OPTIMIZER_BYTES, Estimate, ModelShape
from trainkit.launch.launcher import Launch
from trainkit.losses import router
from trainkit.recipes import Recipe
from trainkit.strategies import expert_parallel, sequence_parallel
from trainkit.strategies.base import Strategy
from trainkit.strategies.engine import Engine
from trainkit.strategies.parallel_dims import ParallelDims, data_parallel_rank, parallelism_problems
from trainkit.strategies.parallelize import FSDPSettings, block_classes, clip_to, grad_norm, parallelize
from trainkit.strategies.tp_plan import plan_problems, split_parameters, tp_layers


class OnMesh(Engine):
    """An engine on the one device mesh (strategies/parallel_dims.py), which it builds once the process group exists,
    and
    that parallelises the model itself: this module's, and the pipeline's (strategies/pipeline.py)."""

    accelerate_wraps_model = False

    def __init__(self, strategy: Any) -> None:  # an FSDP, or strategies/pipeline.py's Pipeline: dims and settings
        super().__init__(strategy)
        self.dims, self.settings = strategy.dims, strategy.settings
        self.sharded = strategy.launch.distributed_type == "FSDP"  # FSDP2 (and TP) on the mesh: Accelerate's FSDP off
        self.mesh: Any = None  # the DeviceMesh, once built
        self.experts_mesh: Any = None  # the experts' (dp_replicate, efsdp, ep) mesh, once built, where ep > 1

    @property
    def data_parallel_rank(self) -> int:
        return data_parallel_rank(self.mesh, self.dims)

    def build_accelerator(self, output_dir, report_to):
        if self.sharded:
            without_accelerate_fsdp()
        accelerator = super().build_accelerator(output_dir, report_to)  # verified: world size, type, precision
        self.mesh = self.dims.build(accelerator.device.type)
        if self.dims.ep > 1:
            self.experts_mesh = expert_parallel.expert_mesh(self.dims, accelerator.device.type)
        return accelerator


class FSDPEngine(OnMesh):
    """The model parallelized on the mesh, FSDP2's gradient sync per step."""

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.dims.cp > 1:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            # the model's sdpa as one F.scaled_dot_product_attention call, which the ring takes over in training
            ALL_ATTENTION_FUNCTIONS["sdpa"] = sequence_parallel.causal_sdpa(ALL_ATTENTION_FUNCTIONS["sdpa"])
            self.notes.append(f"context parallelism: each sequence cut in {2 * self.dims.cp} chunks over "
                              f"{self.dims.cp} ranks (torch's ring attention), FSDP2 over dp_shard x cp")
        self.notes += parallelize(model, self.dims, self.mesh, self.settings,
                                  mixed_precision=self.launch.mixed_precision, compile=self.cfg.compile,
                                  tp_layers=tp_layers(model) if self.dims.tp > 1 else {},
                                  classes=block_classes(model, self.settings), experts_mesh=self.experts_mesh)
        return model

    # --- one optimizer step -------------------------------------------------------------------------------------

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

            for block in self.model.modules():  # not the root, which keeps its parameters (parallelize.shard)
                if isinstance(block, FSDPModule) and block is not self.model:
                    block.set_reshard_after_forward(last and self.settings.reshard_after_forward, recurse=False)
        yield

    # --- context parallelism: the ranks of a cp group share a micro-batch, 2 of its 2 x cp chunks each ------------

    def split_sequences(self, micro_batches: list) -> list:
        """Whole rows with their targets, padded to 2 x cp chunks: torch cuts them in sequence_context."""
        if self.dims.cp == 1:
            return micro_batches
        # copies: torch resizes the buffers it cuts in place
        return [{name: part.clone() for name, part in sequence_parallel.rows(batch, 2 * self.dims.cp).items()}
                for batch in micro_batches]

    def sequence_context(self, batch: Any) -> contextlib.AbstractContextManager:
        """torch's cut of the rows and its ring; the cp group named for what needs whole sequences (a mixture of
        experts' balance: trainkit/losses/router.py, which gathers the router logits in the order torch cut them,
        the balance mask cut with them)."""
        if self.dims.cp == 1:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(router.split_over(self.mesh.get_group("cp")))
        stack.enter_context(ring_context(self.mesh["cp"], list(batch.values())))
        return stack

    def learned_tokens(self, batch: Any) -> float:
        return sequence_parallel.learned_tokens(
            sequence_parallel.head_tail(batch, self.mesh.get_local_rank("cp"), self.dims.cp))

    @property
    def gradient_correction(self) -> float:
        """FSDP2 averages the gradients over dp_shard x cp, but the cp ranks of a group computed parts of one loss
        (weighed to sum to it): their sum is the gradient, so the backward multiplies by cp."""
        return float(self.dims.cp)

    def clip_grad_norm(self) -> torch.Tensor:
        """The total gradient norm before clipping (over slices and shards, made whole), and the clip."""
        self.accelerator.unscale_gradients()  # fp16's loss scale, as Accelerate's clip_grad_norm_ does
        params = list(self.model.parameters())
        total = grad_norm(params)
        clip_to(params, self.cfg.max_grad_norm, total)
        return total

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class FSDP(Strategy):
    """FSDP2 over the data-parallel dimensions of the mesh, tensor parallelism over its tp dimension."""

    name = "fsdp"
    engine = FSDPEngine

    def __init__(self, launch: Launch, cfg: TrainConfig, sources: Mapping[str, str],
                 recipe: Recipe | None = None) -> None:
        super().__init__(launch, cfg, sources, recipe)
        self.dims = ParallelDims.of(launch)
        self.settings = FSDPSettings.of(launch)
        self.name = ("tp" if self.dims.tp > 1 else "hsdp" if self.dims.dp_replicate > 1 else
                     "fsdp_ep" if self.dims.ep > 1 else "fsdp")

    @classmethod
    def selects(cls, launch: Launch, cfg: TrainConfig) -> bool:
        return launch.distributed_type == "FSDP"

    @property
    def splits_model(self) -> bool:  # tensor parallelism cuts the planned layers, context parallelism each sample
        return self.dims.tp > 1 or self.dims.cp > 1

    @property
    def sequence_parallel_size(self) -> int:
        return self.dims.cp

    @property
    def needs_experts(self) -> bool:  # expert parallelism: strategies/expert_parallel.py
        return self.dims.ep > 1

    @property
    def needs_gpu(self) -> bool:  # torch's ring attention: context_parallel_refusal
        return self.dims.cp > 1

    @property
    def offload(self) -> bool:
        return self.settings.offload

    def check(self, this_machine: bool = True) -> list[Problem]:
        return (super().check(this_machine) + parallelism_problems(self.launch) + self.dims.problems(self.launch)
                + FSDPSettings.problems(self.launch, self.cfg) + self.context_problems(this_machine)
                + expert_parallel.launch_problems(self.dims, f"parallelism_config in {self.launch.source}",
                                                  self.cfg.compile))

    def context_problems(self, this_machine: bool) -> list[Problem]:
        """Context parallelism: on GPUs, with FSDP2's data parallelism only (strategies/pipeline.py refuses it with
        stages), for a recipe whose loss reads the parts of its rows, not packed (torch's ring attention takes no mask
        to keep packed examples apart)."""
        if self.dims.cp == 1:
            return []
        where, fix = f"parallelism_config in {self.launch.source}", "set parallelism_config_cp_size: 1"
        problems = []
        if this_machine and (refusal := context_parallel_refusal()) is not None:
            problems.append(Problem(f"parallelism_config_cp_size {self.dims.cp}: {refusal}", where,
                                    f"run it on GPUs, or split sequences on this machine with DeepSpeed's sequence "
                                    f"parallelism (accelerate_configs/deepspeed_zero3_sp.yaml), or {fix}"))
        if others := [name for name in ("dp_replicate", "tp") if getattr(self.dims, name) > 1]:
            problems.append(Problem(f"context parallelism with {' and '.join(others)}: the runner splits sequences "
                                    f"only together with FSDP2's dp_shard (other products are not tested)", where,
                                    f"keep cp and dp_shard only (accelerate_configs/fsdp_cp.yaml), or {fix}"))
        problems += sequence_parallel.recipe_problems(self.recipe, where, "fsdp.yaml")
        if getattr(self.cfg, "packing", False):
            problems.append(Problem("--packing with context parallelism: torch's ring attention runs causal attention "
                                    "without a mask, so packed examples would attend to each other", "--packing",
                                    "drop --packing (rows padded on the right are exact), or split packed rows with "
                                    "accelerate_configs/deepspeed_zero3_sp.yaml (its attention keeps them apart)"))
        return problems

    def check_model(self, model: torch.nn.Module) -> list[Problem]:
        problems = []
        if self.dims.ep > 1:
            problems += expert_parallel.model_problems(model, self.dims.ep,
                                                       f"parallelism_config in {self.launch.source}")
        if self.dims.cp > 1:
            problems += sequence_parallel.problems(model, self.dims.cp, f"parallelism_config in {self.launch.source}",
                                                   self.recipe.tokens_per_sample(self.cfg) if self.recipe else None,
                                                   key="cp")
        if self.dims.tp == 1:
            return problems
        where = f"model._tp_plan of {self.recipe.path.name}'s build_model" if self.recipe else "model._tp_plan"
        return problems + plan_problems(model, self.dims.tp, where, f"parallelism_config in {self.launch.source}")

    @property
    def label(self) -> str:
        """fsdp, hsdp, tp, fsdp_tp, hsdp_tp or fsdp_ep, and _offload."""
        return self.dims.fsdp_label(self.offload)

    def resolved_fields(self) -> dict[str, Any]:
        return {**super().resolved_fields(), **{name: size for name, size in self.dims.sizes().items() if name != "pp"},
                "ep": self.dims.ep}

    @property
    def speed_rank(self) -> int:
        # Tensor parallelism's activations cross the group twice per layer in forward and in backward: worth it only
        # where the matrices are too large for the others' gathers, and on fast links.
        return (4 if self.dims.tp > 1 else 3) + (3 if self.offload else 0)

    def cpu_fp16_refusal(self) -> str | None:
        if not self.launch.parallelism:
            return None
        # Whether every rank of a replicated-and-sharded or tensor-parallel mesh agrees on an overflow is not tested.
        return ("fp16 on a CPU exists to test the loss scaler's logic, which tests/test_fp16.py runs under one "
                "process, DDP and FSDP2, not under this mesh")

    def estimate(self, shape: ModelShape, world_size: int, activations: int) -> Estimate:
        """What DDP holds per parameter, for the part of each parameter one rank holds."""
        shard, trained = held_numel(shape, self.dims.resized(world_size)), \
            held_numel(shape.trained(), self.dims.resized(world_size))
        opt = OPTIMIZER_BYTES[self.cfg.optimizer]
        weights = shape.weight_bytes(shard, trained)
        host = weights + (4 + opt) * trained if self.offload else 0
        return Estimate(self.label, weights, 4 * trained, opt * trained, host, activations)

    @property
    def data_parallel_size(self) -> int:
        return self.dims.data_parallel


def held_numel(shape: ModelShape, dims: ParallelDims) -> int:
    """Parameter elements one rank holds: per parameter its tensor-parallel slice (1/tp of what the plan cuts), or all
    of it, of which one rank holds 1/(dp_shard x cp) (FSDP2 pads dim-0 shards); dp_replicate adds copies, not
    savings."""
    cut = split_parameters(shape.names, shape.tp_plan) if dims.tp > 1 else set()
    names = shape.names or ("",) * len(shape.numels)
    return sum(math.ceil((math.ceil(k / dims.tp) if name in cut else k) / (dims.dp_shard * dims.cp))
               for name, k in zip(names, shape.numels, strict=True))


def context_parallel_refusal() -> str | None:
    """Why torch's context parallelism cannot run here, or None on GPUs: its ring attention has kernels for CUDA's
    flash, memory-efficient and cuDNN attention only (measured on a CPU over gloo, torch 2.13: "Operator
    aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered")."""
    if torch.cuda.is_available():
        return None
    return ("torch's context parallelism runs its ring attention on CUDA's attention kernels only (on a CPU it fails: "
            "aten._scaled_dot_product_flash_attention_for_cpu has no sharding strategy)")


def ring_context(mesh: Any, parts: list[torch.Tensor]) -> contextlib.AbstractContextManager:
    """torch's context parallelism over the cp sub-mesh for one micro-batch: each of `parts` (rows, sequence in
    dimension 1) cut in place to this rank's chunks, F.scaled_dot_product_attention replaced by the ring attention."""
    from torch.distributed.tensor.experimental import context_parallel

    return context_parallel(mesh, buffers=parts, buffer_seq_dims=[1] * len(parts), no_restore_buffers=set(parts))


def without_accelerate_fsdp() -> None:
    """Make Accelerate see a plain MULTI_GPU/MULTI_CPU run: it would otherwise wrap the sharded model again, and it
    refuses a parallelism_config on CPU; the runner builds the device mesh itself."""
    os.environ["ACCELERATE_USE_FSDP"] = "false"
    os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = "false"
