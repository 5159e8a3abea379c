"""Tensor parallelism and hybrid sharding: FSDP2 on a (dp_replicate, dp_shard, tp) DeviceMesh, from the YAML's
`parallelism_config` block (accelerate_configs/tp.yaml, fsdp_tp.yaml, hsdp.yaml).

Accelerate applies a parallelism_config only on GPU-type devices; on a CPU machine it refuses ("ParallelismConfig is
only compatible DistributedType.FSDP (version 2) or ... but got DistributedType.MULTI_CPU"). So, as FSDP2 applies
fully_shard itself (strategies/fsdp.py), these strategies apply the config themselves with torch, on every device
(one code path, tested on CPU):

1. a DeviceMesh of shape (dp_replicate, dp_shard, tp) over all processes (`init_device_mesh`, once the Accelerator
   has made the process group): the ranks of one tensor-parallel group are neighbours (rank // tp is the group);
2. tensor parallelism (tp > 1): the Linear layers of the model's plan (`model._tp_plan`, which transformers models
   fill from `config.base_model_tp_plan`) cut with torch's `parallelize_module` over the mesh's tp dimension. A
   `colwise` layer holds a slice of the output features (ColwiseParallel), a `rowwise` one the matching slice of its
   input features, and its partial outputs are summed across the group (RowwiseParallel: an all-reduce). Everything
   else (embeddings, norms, the output head) stays whole on every rank of the group;
3. FSDP2's fully_shard (its blocks, mixed precision, offload) over the data-parallel dimensions: each parameter (a
   tensor-parallel slice, or a whole one) is sharded across dp_shard, and dp_replicate holds copies of those shards
   (HSDP). With dp_shard 1 a rank's shard is the whole parameter: FSDP2 still manages it, so that mixed precision,
   accumulation and checkpoints work alike in every shape.

The ranks of one tensor-parallel group compute one model on the same samples: the data-parallel size is
dp_replicate x dp_shard, and the data-parallel rank is the (dp_replicate, dp_shard) coordinate on the mesh.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import astuple, dataclass, replace
from typing import Any, ClassVar

import torch

from trainkit.config import TrainConfig
from trainkit.errors import Problem
from trainkit.estimate import ModelShape
from trainkit.launch import PARALLELISM_KEY, Launch
from trainkit.strategies.fsdp import FSDP2

DIMS = ("dp_replicate", "dp_shard", "tp")  # the mesh's dimensions, outermost first
# The plan's styles this runner cuts (torch's ColwiseParallel / RowwiseParallel on nn.Linear), and those it keeps whole
# by choice: transformers marks the input embeddings and the output head for vocabulary-parallel styles, but a tied
# input/output matrix (the tiny transformer's default) is one parameter that cannot be cut both ways, and a cut head
# would need a loss that knows it. Whole, they cost the vocabulary x hidden matrix on every rank of the group.
SPLIT_STYLES = ("colwise", "rowwise")
WHOLE_STYLES = ("embedding_rowwise", "embedding_colwise", "colwise_gather_output", "colwise_rep", "replicate")
NO_PLAN_FIX = ("declare one in build_model: model._tp_plan = {'layers.*.fc1': 'colwise', 'layers.*.fc2': 'rowwise'} "
               "(recipes/README.md); transformers models whose config has a base_model_tp_plan (Llama, Mistral, "
               "Qwen2, ...) bring their own; or train under fsdp.yaml or hsdp.yaml, which cut no layer")


@dataclass(frozen=True, slots=True)
class MeshSizes:
    """The sizes of the mesh's dimensions (DIMS)."""

    dp_replicate: int
    dp_shard: int
    tp: int

    @classmethod
    def of(cls, launch: Launch) -> MeshSizes:
        return cls(*(launch.parallelism_size(name) for name in DIMS))

    @property
    def data_parallel(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def label(self) -> str:
        """The dimensions in use: tp, fsdp_tp, hsdp or hsdp_tp."""
        data = "hsdp" if self.dp_replicate > 1 else "fsdp" if self.dp_shard > 1 else ""
        return "_".join(part for part in (data, "tp" if self.tp > 1 else "") if part)

    def resized(self, world_size: int) -> MeshSizes:
        """These sizes for another number of processes (--estimate --num_processes N): the outermost dimension in use
        takes what the others leave, as adding machines would grow it."""
        if self.dp_replicate > 1:
            return replace(self, dp_replicate=max(1, world_size // (self.dp_shard * self.tp)))
        if self.dp_shard > 1:
            return replace(self, dp_shard=max(1, world_size // self.tp))
        return replace(self, tp=world_size)


class MeshFSDP(FSDP2):
    """FSDP2 over the data-parallel dimensions of the mesh; the two strategies below are what the registry selects."""

    mesh: Any = None  # the DeviceMesh, once built

    @property
    def sizes(self) -> MeshSizes:
        return MeshSizes.of(self.launch)

    @property
    def label(self) -> str:
        return self.sizes.label + ("_offload" if self.offload else "")

    def resolved_fields(self) -> dict[str, Any]:
        return {**super().resolved_fields(), **dict(zip(DIMS, astuple(self.sizes), strict=True))}

    def cpu_fp16_refusal(self) -> str | None:
        # Whether every rank of a replicated-and-sharded or tensor-parallel mesh agrees on an overflow is not tested.
        return ("fp16 on a CPU exists to test the loss scaler's logic, which tests/test_fp16.py runs under one "
                "process, DDP and FSDP2, not under this mesh")

    @property
    def data_parallel_size(self) -> int:
        return self.sizes.data_parallel

    @property
    def data_parallel_rank(self) -> int:
        return self.mesh.get_local_rank("dp_replicate") * self.sizes.dp_shard + self.mesh.get_local_rank("dp_shard")

    def held_numel(self, shape: ModelShape, world_size: int) -> int:
        """Per parameter: its tensor-parallel slice (1/tp of what the plan cuts, split_parameters), or all of it, of
        which one rank holds 1/dp_shard (FSDP2 pads dim-0 shards); dp_replicate adds copies, not savings."""
        sizes = self.sizes.resized(world_size)
        cut = split_parameters(shape.names, shape.tp_plan) if sizes.tp > 1 else set()
        names = shape.names or ("",) * len(shape.numels)
        return sum(math.ceil((math.ceil(k / sizes.tp) if name in cut else k) / sizes.dp_shard)
                   for name, k in zip(names, shape.numels, strict=True))

    def build_accelerator(self, output_dir, report_to):
        from torch.distributed.device_mesh import init_device_mesh

        accelerator = super().build_accelerator(output_dir, report_to)  # verified: world size, type, precision
        self.mesh = init_device_mesh(accelerator.device.type, astuple(self.sizes), mesh_dim_names=DIMS)
        return accelerator

    def fsdp_mesh(self) -> Any:
        return self.mesh["dp_replicate", "dp_shard"] if self.sizes.dp_replicate > 1 else self.mesh["dp_shard"]

    def is_sharded(self, param: torch.Tensor) -> bool:
        from torch.distributed.tensor import DTensor

        if not isinstance(param, DTensor):
            return False
        on_shard_dim = param.placements[param.device_mesh.mesh_dim_names.index("dp_shard")]
        return self.sizes.dp_shard == 1 or not on_shard_dim.is_replicate()

    def clip_grad_norm(self) -> torch.Tensor:
        """The total gradient norm before clipping, and the clip. torch's clip_grad_norm_ stacks one norm per
        parameter, which fails for DTensors on different meshes (a cut layer lives on (dp_shard, tp), the rest on
        dp_shard: "All operands in aten.stack.default must have the same mesh"). So: one norm per group of gradients
        laid out alike, each made whole (full_tensor: a DTensor's norm is partial over its shards), then their norm;
        the clip scales each rank's local pieces, an elementwise product."""
        self.accelerator.unscale_gradients()  # fp16's loss scale, as Accelerate's clip_grad_norm_ does
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        groups: dict[tuple, list[torch.Tensor]] = {}
        for grad in grads:
            groups.setdefault((grad.device_mesh, grad.placements), []).append(grad)
        norms = [torch.nn.utils.get_total_norm(group, 2.0).full_tensor() for group in groups.values()]
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        if self.cfg.max_grad_norm:
            coefficient = torch.clamp(self.cfg.max_grad_norm / (total + 1e-6), max=1.0)  # torch's formula
            torch._foreach_mul_([grad.to_local() for grad in grads], coefficient)
        return total


class TensorParallel(MeshFSDP):
    """Tensor parallelism (tp > 1), alone or with FSDP2 (dp_shard) and HSDP (dp_replicate) over the rest."""

    name = "tp"
    splits_model: ClassVar[bool] = True

    @classmethod
    def selects(cls, launch: Launch, cfg: TrainConfig) -> bool:
        return launch.distributed_type == "FSDP" and launch.parallelism_size("tp") > 1

    @property
    def speed_rank(self) -> int:
        # Activations cross the group twice per layer in forward and in backward: worth it only where the matrices
        # are too large for the others' gathers, and on fast links.
        return 7 if self.offload else 4

    def check_model(self, model: torch.nn.Module) -> list[Problem]:
        where = f"model._tp_plan of {self.recipe.path.name}'s build_model" if self.recipe else "model._tp_plan"
        return plan_problems(model, self.sizes.tp, where, f"parallelism_config in {self.launch.source}")

    def prepare(self, model: torch.nn.Module, build_optimizer: Callable[..., torch.optim.Optimizer],
                build_scheduler: Callable[[TrainConfig, torch.optim.Optimizer], Any]) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        # Cut before sharding: fully_shard then shards each slice over the data-parallel dimensions (2-D DTensors).
        parallelize_module(model, self.mesh["tp"], {name: styles[style]() for name, style in tp_layers(model).items()})
        super().prepare(model, build_optimizer, build_scheduler)


class HybridShard(MeshFSDP):
    """HSDP: parameters sharded within each group of dp_shard processes, the groups replicas of each other."""

    name = "hsdp"

    @classmethod
    def selects(cls, launch: Launch, cfg: TrainConfig) -> bool:
        return (launch.distributed_type == "FSDP" and launch.parallelism_size("tp") == 1
                and launch.parallelism_size("dp_replicate") > 1)

    @property
    def speed_rank(self) -> int:
        # FSDP2's communication, its gathers within a group (within a machine) and only the gradient all-reduce
        # across groups; more memory than FSDP2 over every process.
        return 6 if self.offload else 3


# --- the tensor-parallel plan -------------------------------------------------------------------------------------

def _pattern(entry: str) -> re.Pattern:
    """A plan entry ('model.layers.*.mlp.up_proj') as a regular expression over module names; '*' is one name part."""
    return re.compile(re.escape(entry).replace(r"\*", r"[^.]+"))


def tp_layers(model: torch.nn.Module) -> dict[str, str]:
    """The layers the model's plan cuts: module name -> colwise | rowwise."""
    plan = [(_pattern(entry), style) for entry, style in (getattr(model, "_tp_plan", None) or {}).items()
            if style in SPLIT_STYLES]
    return {name: style for name, _ in model.named_modules() for pattern, style in plan if pattern.fullmatch(name)}


def split_parameters(names: Iterable[str], plan: Iterable[tuple[str, str]]) -> set[str]:
    """The parameters a plan cuts, by name: a colwise layer's weight and bias, a rowwise layer's weight (its bias is
    added once to the summed output, whole)."""
    patterns = [(_pattern(entry), style) for entry, style in plan if style in SPLIT_STYLES]
    cut = set()
    for name in names:
        module, _, leaf = name.rpartition(".")
        if any(pattern.fullmatch(module) and (style == "colwise" or leaf == "weight") for pattern, style in patterns):
            cut.add(name)
    return cut


def plan_problems(model: torch.nn.Module, tp: int, where: str, sizes_where: str) -> list[Problem]:
    """What stops the model's plan from cutting it into tp slices that compute what the whole model computes."""
    plan = dict(getattr(model, "_tp_plan", None) or {})
    kind = type(model).__name__
    if any(type(m).__module__.startswith("peft.") for m in model.modules()):
        return [Problem(f"{kind} carries peft adapters (LoRA), whose layers wrap the Linear layers that tensor "
                        "parallelism cuts and do not take cut (DTensor) weights", where,
                        "train LoRA under ddp.yaml, fsdp.yaml, hsdp.yaml or a deepspeed_*.yaml (the adapters are "
                        "small: sharding the frozen base is what saves memory)")]
    if not any(style in SPLIT_STYLES for style in plan.values()):
        return [Problem(f"{kind} declares no tensor-parallel plan (which Linear layers to cut)", where, NO_PLAN_FIX)]
    modules = dict(model.named_modules())
    problems = []
    for entry, style in plan.items():
        if style not in SPLIT_STYLES + WHOLE_STYLES:
            problems.append(Problem(f"plan entry {entry!r} asks for {style!r}, which this runner does not apply",
                                    where, "use colwise or rowwise on nn.Linear layers, or train under fsdp.yaml"))
        elif style in SPLIT_STYLES and not any(_pattern(entry).fullmatch(name) for name in modules):
            problems.append(Problem(f"plan entry {entry!r} matches no module of {kind}", where,
                                    "name modules as model.named_modules() does, with * for a layer number"))
    layers = tp_layers(model)
    others = [f"{name} ({type(modules[name]).__name__})" for name in layers
              if not isinstance(modules[name], torch.nn.Linear)]
    if others:
        problems.append(Problem(f"the plan cuts {', '.join(others[:3])}: only nn.Linear layers can be cut", where,
                                "cut Linear layers only (a fused projection such as GPT-2's Conv1D c_attn cannot be "
                                "cut by columns), or train under fsdp.yaml"))
    uneven = [f"{name} ({features} {side} features)" for name, style in layers.items()
              if isinstance(modules[name], torch.nn.Linear)
              for side, features in [("output", modules[name].out_features) if style == "colwise" else
                                     ("input", modules[name].in_features)] if features % tp]
    if uneven:
        problems.append(Problem(f"{PARALLELISM_KEY.format('tp')} {tp} does not divide {', '.join(uneven[:3])}",
                                sizes_where, "choose a tensor-parallel size that divides every cut layer's features"))
    config = getattr(model, "config", None)
    heads = {key: getattr(config, key, None) for key in ("num_attention_heads", "num_key_value_heads")}
    if uneven := {key: n for key, n in heads.items() if isinstance(n, int) and n % tp}:
        problems.append(Problem(f"{' and '.join(f'{key} {n}' for key, n in uneven.items())}: not a multiple of "
                                f"{PARALLELISM_KEY.format('tp')} {tp}, and each rank computes whole attention heads",
                                sizes_where, "choose a tensor-parallel size that divides the heads"))
    return problems
