"""Applying the mesh to a model (the whole model, or one pipeline stage): one fixed order, as torchtitan's
parallelize_llama does.

    1. tensor parallelism   the Linear layers of the model's plan cut over the mesh's tp dimension (tp_plan.py)
    2. expert parallelism   each layer's experts split over ep ranks, their tokens sent to them (expert_parallel.py)
    3. activation checkpointing   each block recomputes its forward in backward (fsdp_activation_checkpointing)
    4. torch.compile        each block's forward (--compile), so FSDP2's hooks stay outside the graphs
    5. FSDP2                fully_shard each experts module over the experts' mesh, each block, then the root, over
                            the data-parallel dimensions

Cut before sharding: fully_shard then shards each tensor-parallel slice over dp_shard (2-D DTensors). With dp_shard 1
a rank's shard is the whole parameter; FSDP2 still manages it, so mixed precision, accumulation and checkpoints work
alike in every shape. The FSDP settings come from the YAML's fsdp_config (FSDPSettings); Accelerate applies FSDP only
on GPU-type devices, so the runner applies it itself on every device (one code path, tested on CPU).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from trainkit.config import TrainConfig
from trainkit.errors import ConfigError, Problem
from trainkit.launch.launcher import Launch, is_true
from trainkit.strategies import expert_parallel, tp_plan
from trainkit.strategies.parallel_dims import ParallelDims, data_mesh

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, slots=True)
class FSDPSettings:
    """The fsdp_config keys the runner applies (FSDPSettings.problems refuses the others)."""

    offload: bool = False  # fsdp_offload_params: shards, gradients and optimizer states in CPU memory
    reshard_after_forward: bool = True  # free gathered parameters after forward (ZeRO-3's memory)
    activation_checkpointing: bool = False
    whole_model: bool = False  # fsdp_auto_wrap_policy NO_WRAP: one group, the root
    block_classes: tuple[str, ...] = ()  # fsdp_transformer_layer_cls_to_wrap; empty: the model's _no_split_modules

    @classmethod
    def of(cls, launch: Launch) -> FSDPSettings:
        settings = launch.settings
        named = settings.get("fsdp_transformer_layer_cls_to_wrap") or []
        named = named.split(",") if isinstance(named, str) else named  # the environment's text, or a YAML list
        return cls(offload=is_true(settings.get("fsdp_offload_params", False)),
                   reshard_after_forward=is_true(settings.get("fsdp_reshard_after_forward", True)),
                   activation_checkpointing=is_true(settings.get("fsdp_activation_checkpointing", False)),
                   whole_model=settings.get("fsdp_auto_wrap_policy") == "NO_WRAP",
                   block_classes=tuple(str(c).strip() for c in named if str(c).strip()))

    @staticmethod
    def problems(launch: Launch, cfg: TrainConfig) -> list[Problem]:
        """The fsdp_config settings the runner does not apply are refused, never ignored. Those of FSDP1 that FSDP2
        makes moot pass: fsdp_use_orig_params (FSDP2 always keeps them), fsdp_forward/backward_prefetch (FSDP2
        prefetches on its own), fsdp_sync_module_states and fsdp_cpu_ram_efficient_loading (every rank builds the
        same weights from the seed), fsdp_state_dict_type (checkpoints are always sharded, final/ always whole)."""
        settings, where, problems = launch.settings, f"fsdp_config in {launch.source}", []
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
        checkpointing = is_true(settings.get("fsdp_activation_checkpointing", False))
        if checkpointing and cfg.compile:
            # inductor's recompute of a checkpointed block fails its own stride assertion (torch 2.13)
            problems.append(Problem("fsdp_activation_checkpointing with --compile: torch.compile's code fails in the "
                                    "recomputation", where, "drop --compile, or fsdp_activation_checkpointing"))
        if checkpointing and getattr(cfg, "gradient_checkpointing", False):
            problems.append(Problem("fsdp_activation_checkpointing and the recipe's gradient_checkpointing both "
                                    "recompute the blocks", where,
                                    "keep one: drop --gradient_checkpointing, or fsdp_activation_checkpointing"))
        return problems


def block_classes(model: torch.nn.Module, settings: FSDPSettings) -> set[str]:
    """The class names of the model's blocks: those the YAML names, else those the model declares."""
    return set(settings.block_classes) or set(getattr(model, "_no_split_modules", None) or [])


def blocks(model: torch.nn.Module, settings: FSDPSettings, classes: set[str] | None = None) -> list[torch.nn.Module]:
    """The units sharded (and gathered) one at a time, innermost first; the root holds the rest.

    The blocks are the classes the YAML names (Accelerate's fsdp_transformer_layer_cls_to_wrap), else those the model
    declares in `_no_split_modules` (transformers' models do; a recipe's build_model can set it), else every Linear
    layer; none under fsdp_auto_wrap_policy NO_WRAP. A block whose parameters are shared with a module outside it
    (tied input and output embeddings) stays in the root's group: FSDP2 refuses a parameter managed by two groups.
    `classes` names them for a part of a model (a pipeline stage, which declares none of its own).
    """
    if settings.whole_model:
        return []
    classes = block_classes(model, settings) if classes is None else classes
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


def parallelize(model: torch.nn.Module, dims: ParallelDims, mesh: Any, settings: FSDPSettings, *,
                mixed_precision: str, compile: bool, tp_layers: dict[str, str], classes: set[str],
                experts_mesh: Any = None) -> list[str]:
    """Apply tensor parallelism, expert parallelism, activation checkpointing, compile and FSDP2 to `model`, in that
    order; returns what was done, for the run's notes. `tp_layers` names what the plan cuts (tp_plan.py's tp_layers:
    Linear layers and fused experts; empty where tp is 1), `classes` the block class names (block_classes of the
    whole model), `experts_mesh` the experts' (dp_replicate, efsdp, ep) mesh where dims.ep > 1
    (strategies/expert_parallel.py)."""
    notes, experts = [], []
    if tp_layers:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,  # tp_plan.py's SPLIT_STYLES
                  "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
                  "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate())}
        weights = dict(model.named_parameters())
        fused = {name: style for name, style in tp_layers.items() if name in weights or style == tp_plan.EXPERTS}
        parallelize_module(model, mesh["tp"], {name: styles[style]() for name, style in tp_layers.items()
                                               if name not in fused and style != tp_plan.SUMMED})
        for name, style in tp_layers.items():
            if style == tp_plan.SUMMED:
                sum_gradients(model.get_submodule(name), mesh["tp"].get_group())
        if fused:  # transformers' own styles, as its tp_plan="auto" applies them (strategies/tp_plan.py)
            from transformers.distributed.tensor_parallel import apply_tensor_parallelism

            apply_tensor_parallelism(model, mesh["tp"], fused)
            notes.append(f"tensor parallelism: the fused experts of {sum(s == tp_plan.EXPERTS for s in fused.values())}"
                         f" layers cut over {dims.tp} ranks (transformers' moe_tp_experts, packed_colwise, rowwise)")
    if dims.ep > 1:
        experts = expert_parallel.apply(model, experts_mesh, mesh["tp"])
    units = blocks(model, settings, classes)
    if settings.activation_checkpointing:
        notes.append(checkpoint_activations(model, units))
    if compile:  # a model that declares no blocks is compiled whole
        notes.append(compile_forward(model, units if classes else []))
    if experts:
        shard_experts(experts, experts_mesh, settings, mixed_precision, dims.data_parallel)
        held, total = (sum(f(p) for m in experts for p in m.parameters()) for f in (lambda p: local(p).numel(),
                                                                                     torch.Tensor.numel))
        notes.append(f"expert parallelism: the experts of {len(experts)} layers split over {dims.ep} ranks "
                     f"(transformers' plan, all-to-all dispatch), each expert sharded over "
                     f"{dims.dp_shard // dims.ep}: this rank holds {held:,} of the {total:,} expert parameters")
    shard(model, units, data_mesh(mesh, dims), settings, mixed_precision, experts_mesh)
    return notes


def sum_gradients(module: torch.nn.Module, group: Any) -> None:
    """A module whose weights are whole on every rank of `group` and whose gradients are partial there (a norm over
    this rank's attention heads): each forward uses its weights through transformers' _AllReduceBackward, so that the
    gradient of each micro-batch reaches them summed over the group. (transformers' own replicated_with_grad_allreduce
    sums the accumulated gradient after each micro-batch instead: with accumulation it adds the earlier micro-batches'
    sums again; measured on Qwen3-MoE under tp.yaml with --grad_accum 2, a gradient norm 5.6e-6 off.)"""
    from transformers.distributed.parallel_utils import _AllReduceBackward

    weights: dict[str, torch.nn.Parameter] = {}

    def summed(module: torch.nn.Module, args: Any) -> None:
        for name, weight in module._parameters.items():
            if weight is not None and weight.requires_grad:
                weights[name] = weight
                module._parameters[name] = _AllReduceBackward.apply(weight, group)

    def restored(module: torch.nn.Module, args: Any, output: Any) -> None:
        module._parameters.update(weights)
        weights.clear()

    module.register_forward_pre_hook(summed)
    module.register_forward_hook(restored)


def checkpoint_activations(model: torch.nn.Module, units: list[torch.nn.Module]) -> str:
    """fsdp_activation_checkpointing: each block (the whole model when there are none) keeps only its input from the
    forward and runs its forward again in backward (torch's composable `checkpoint`: hooks, so the parameter names
    stay, and checkpoints and final/ with them); the same numbers, less activation memory, about one more forward per
    step."""
    from torch.distributed._composable import checkpoint

    for unit in units or [model]:
        checkpoint(unit)
    return (f"activation checkpointing on each {type(units[0]).__name__} ({len(units)})" if units
            else "activation checkpointing on the whole model (one FSDP group)")


def compile_forward(model: torch.nn.Module, units: list[torch.nn.Module]) -> str:
    """--compile: torch.compile (inductor) on the `forward` of each of `units` (the whole model when there are none),
    before any wrapper or engine sees the model.

    The module itself stays as it is: its class, its parameter names (checkpoints and final/ hold the same names
    compiled or not, so a run resumes across the flag; `torch.compile(model)` would return a wrapper that prefixes
    every name with `_orig_mod.`), and its hooks, which run eagerly around the compiled forward: FSDP2's gathers and
    DeepSpeed's ZeRO-3 fetches stay out of the graph. (`Module.compile()` compiles the hooks as well, and compiles
    nothing where the forward is torch's own: dynamo skips torch.nn's files, so an nn.Sequential ran eagerly under
    it.) Under DDP the compiled module runs inside DDP's forward, where dynamo's DDPOptimizer cuts the graph at DDP's
    gradient buckets so that their all-reduce can start during backward. The first step pays the compilation (about
    a minute on 2 CPU cores for the tiny transformer)."""
    for unit in units or [model]:
        unit.forward = torch.compile(unit.forward)
    what = f"each {type(units[0]).__name__} ({len(units)})" if units else "the whole model"
    return f"torch.compile (inductor) on {what}: the first step compiles"


def fsdp_policy(settings: FSDPSettings, mixed_precision: str, mesh: Any) -> dict[str, Any]:
    """fully_shard's keywords for the YAML's settings over `mesh`."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    return dict(
        # Mixed precision FSDP's way: compute in low precision, reduce gradients and keep the shards in fp32.
        mp_policy=MixedPrecisionPolicy(param_dtype=DTYPES.get(mixed_precision), reduce_dtype=torch.float32),
        offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if settings.offload else OffloadPolicy(),
        reshard_after_forward=settings.reshard_after_forward,
        mesh=mesh,
    )


def shard_experts(experts: list[torch.nn.Module], experts_mesh: Any, settings: FSDPSettings, mixed_precision: str,
                  data_parallel: int) -> None:
    """fully_shard each experts module over the experts mesh's efsdp and replicas (before the blocks that hold them),
    its gradients divided by the data-parallel size: each is already the sum over the ep ranks' tokens, and the
    reduction over efsdp and the replicas adds the copies (strategies/expert_parallel.py)."""
    from torch.distributed.fsdp import fully_shard

    mesh = expert_parallel.data_mesh(experts_mesh)
    policy = fsdp_policy(settings, mixed_precision, mesh)
    for module in experts:
        fully_shard(module, **policy)
        module.set_gradient_divide_factor(float(data_parallel))
        if experts_mesh["efsdp"].size() > 1:
            # FSDP2 reduce-scatters with a factor other than the group's size as PREMUL_SUM, which gloo does not have:
            # sum, then divide locally. Without efsdp (one copy of an expert per replica) FSDP2 divides itself, and a
            # forced sum would divide twice (measured under HSDP; transformers/distributed/fsdp.py's same rule).
            module.set_force_sum_reduction_for_comms(True)


def shard(model: torch.nn.Module, units: list[torch.nn.Module], mesh: Any, settings: FSDPSettings,
          mixed_precision: str, experts_mesh: Any = None) -> None:
    """fully_shard each block, then the root (which takes every parameter no block holds), and check that every
    parameter is sharded as the mesh asks (an expert on experts_mesh, where shard_experts put it)."""
    from torch.distributed.fsdp import fully_shard

    # No model.to(device) first: each fully_shard call moves only its own unit to the device, then shards it, so a
    # GPU never holds the whole unsharded model (the model FSDP exists for may not fit there).
    policy = fsdp_policy(settings, mixed_precision, mesh)
    for unit in units:
        fully_shard(unit, **policy)
    # The root keeps its gathered parameters from forward to backward, as torch advises (backward needs them first)
    # and as the chunked loss needs: it calls the head again after the forward and in backward (chunked_loss.py).
    fully_shard(model, **{**policy, "reshard_after_forward": False})
    if callable(getattr(model, "generate", None)):  # a recipe's generate hook: the root's own parameters gathered
        from torch.distributed.fsdp import register_fsdp_forward_method  # around the whole call, not just forward

        register_fsdp_forward_method(model, "generate")
    unsharded = [name for name, p in model.named_parameters()
                 if not is_sharded(p, experts_mesh if on_mesh(p, experts_mesh) else mesh)]
    if unsharded:
        raise ConfigError([Problem(f"FSDP left parameters unsharded: {', '.join(unsharded[:5])}", "fsdp",
                                   "report this with the recipe; use deepspeed_zero3.yaml meanwhile")])


def is_sharded(param: torch.Tensor, mesh: Any) -> bool:
    """Whether fully_shard made `param` a DTensor sharded on mesh's last (dp_shard) dimension (a mesh of one: any)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return False
    if mesh.size(-1) == 1:
        return True
    return not param.placements[param.device_mesh.mesh_dim_names.index(mesh.mesh_dim_names[-1])].is_replicate()


def on_mesh(param: torch.Tensor, mesh: Any) -> bool:
    """Whether `param` is a DTensor on `mesh` or a sub-mesh of it (None: no mesh)."""
    names = getattr(getattr(param, "device_mesh", None), "mesh_dim_names", None)
    return mesh is not None and names is not None and set(names) <= set(mesh.mesh_dim_names)


def grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """The total 2-norm of these parameters' gradients, whole (a DTensor's norm is partial over its shards and
    slices). torch's clip_grad_norm_ stacks one norm per parameter, which fails for DTensors on different meshes (a
    cut layer lives on (dp_shard, tp), the rest on dp_shard: "All operands in aten.stack.default must have the same
    mesh"). So: one norm per group of gradients laid out alike, each made whole, then their norm."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if hasattr(p.grad, "device_mesh") else ()
            groups.setdefault(key, []).append(p.grad)
    norms = [whole(torch.nn.utils.get_total_norm(group, 2.0)) for group in groups.values()]
    return torch.linalg.vector_norm(torch.stack(norms), 2.0) if norms else torch.zeros(())


def clip_to(params: Iterable[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Scale the gradients so that their total norm `total` is at most max_norm (torch's formula; 0: no clip). The
    factor is the same on every rank, so each scales its local pieces: an elementwise product."""
    if max_norm:
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_([local(p.grad) for p in params if p.grad is not None], coefficient)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor made whole on every rank of its mesh (a collective); a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (its shard or slice); a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
