"""Expert parallelism: the experts of each mixture-of-experts layer split between ep ranks, every token sent to its
experts' rank and back, with transformers' own plan and dispatch.

transformers declares an expert-parallel plan for each mixture-of-experts family it builds (the config's
`base_model_ep_plan`: the experts module `ep_dispatch_experts`, its fused weights `grouped_gemm`, cut on the expert
dimension), and `transformers.distributed.expert_parallel.apply_expert_parallelism` applies it: each rank keeps
experts / ep of them, and the experts module's forward becomes an all-to-all of the routed (token, expert) pairs to
the experts' ranks, the experts' grouped matmul on what arrived, and an all-to-all back, weighed by the router there
(AllToAllEP). No capacity: every token reaches its top-k experts (dropless), so routing and losses are one process's.

The runner's part (an FSDP2 YAML with parallelism_config_ep_size, accelerate_configs/fsdp_ep.yaml): ep borrowed from
the data-parallel shards, as torchtitan does, so every rank still trains on its own samples. The experts live on a
mesh of their own over the same ranks, (dp_replicate, efsdp, ep) with ep innermost: neighbouring ranks split the
experts, each expert's efsdp = dp_shard / ep copies are sharded between them by FSDP2 (parallelize.shard_experts), and
HSDP's replicas copy it all; everything else is sharded over dp_shard as fsdp.yaml (or hsdp.yaml) does. The plan is
applied to each transformers model inside the recipe's (under peft's wrapper, beside a frozen reference or teacher),
before FSDP2.

Gradients: an expert's gradient sums what every rank of its ep group sent it (the all-to-all's backward); FSDP2 then
sums it over the efsdp copies and divides by the data-parallel size, as every other gradient is averaged
(transformers' own FSDP2 + EP does the same in transformers/distributed/fsdp.py).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from trainkit.errors import Problem
from trainkit.launch.launcher import PARALLELISM_KEY
from trainkit.strategies.parallel_dims import ParallelDims

EP_KEY = PARALLELISM_KEY.format("ep")


def expert_mesh(dims: ParallelDims, device_type: str) -> Any:
    """The experts' DeviceMesh over every process: (dp_replicate, efsdp, ep), ep neighbouring ranks of a replica
    splitting the experts, the efsdp ranks that hold the same experts sharding them, replicas copying it all."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (dims.dp_replicate, dims.dp_shard // dims.ep, dims.ep),
                            mesh_dim_names=("dp_replicate", "efsdp", "ep"))


def data_mesh(experts_mesh: Any) -> Any:
    """The sub-mesh FSDP2 shards the experts over: efsdp, and its replicas where there are (HSDP, as the rest)."""
    return experts_mesh["dp_replicate", "efsdp"] if experts_mesh["dp_replicate"].size() > 1 else \
        experts_mesh["efsdp"]


def launch_problems(dims: ParallelDims, where: str, compile: bool) -> list[Problem]:
    """What the runner refuses of an ep size before any model exists: ep must divide dp_shard (the ranks it regroups),
    and it runs with FSDP2's dp_shard and HSDP's replicas only (other products are not tested)."""
    if dims.ep == 1:
        return []
    problems = []
    if dims.dp_shard % dims.ep:
        problems.append(Problem(f"{EP_KEY} {dims.ep} does not divide parallelism_config_dp_shard_size "
                                f"{dims.dp_shard}: expert parallelism regroups the data-parallel shards", where,
                                f"set {EP_KEY} to a divisor of the dp_shard size (accelerate_configs/fsdp_ep.yaml: "
                                f"2 of 2)"))
    if others := [name for name in ("pp", "cp", "tp") if getattr(dims, name) > 1]:
        problems.append(Problem(f"expert parallelism with {' and '.join(others)}: the runner splits experts only "
                                f"together with FSDP2's dp_shard and HSDP's replicas (other products are not tested)",
                                where, f"keep dp_replicate, dp_shard and ep only (accelerate_configs/fsdp_ep.yaml), or "
                                f"set {EP_KEY}: 1"))
    if compile:
        problems.append(Problem("--compile with expert parallelism: not tested with the experts' all-to-all", where,
                                f"drop --compile, or set {EP_KEY}: 1"))
    return problems


def moe_models(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost transformers models inside `model` (itself included) that declare an expert-parallel plan: the
    recipe's model under peft's wrapper (whose classes pass `ep_plan` on from the model inside, under other module
    names), a reference or teacher beside it. A process that has not imported transformers holds none of its models:
    no import then (about 2 s of the start of a run of a plain nn.Module, measured on 2 cores)."""
    if "transformers" not in sys.modules:
        return []
    from transformers import PreTrainedModel

    found: list[torch.nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, PreTrainedModel) or not module.ep_plan:
            continue
        found.append(module)
        inside.update(id(m) for m in module.modules())
    return found


def expanded_plan(model: torch.nn.Module) -> dict[str, str]:
    """The model's expert-parallel plan (layer numbers as `*`) for each of its parameters and modules by name, each
    module's parameters before the module, as transformers' own loading expands it."""
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    plan, expanded = model.ep_plan, {}
    for name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            full = f"{name}.{param_name}" if name else param_name
            if (style := plan.get(replace_layer_number_by_wildcard(full))) is not None:
                expanded[full] = style
        if (style := plan.get(replace_layer_number_by_wildcard(name))) is not None:
            expanded[name] = style
    return expanded


def expert_weights(model: torch.nn.Module) -> set[int]:
    """The ids of the experts' weights of every transformers mixture of experts inside `model` (their plans'
    grouped_gemm entries): what expert parallelism splits by expert, whichever library splits them."""
    return {id(moe.get_parameter(name)) for moe in moe_models(model)
            for name, style in expanded_plan(moe).items() if style == "grouped_gemm"}


def dispatched(model: torch.nn.Module, plan: dict[str, str]) -> list[torch.nn.Module]:
    """The experts modules of `model`'s expanded plan (ep_dispatch_experts): each holds one layer's experts."""
    return [model.get_submodule(name) for name, style in plan.items() if style == "ep_dispatch_experts"]


def model_problems(model: torch.nn.Module, ep: int, where: str) -> list[Problem]:
    """A model expert parallelism cannot split: no transformers model with an expert-parallel plan inside (a dense
    model, or a mixture of experts of the user's own), or experts that do not divide by ep."""
    experts_modules = [experts for m in moe_models(model) for experts in dispatched(m, expanded_plan(m))]
    fix = f"set {EP_KEY}: 1 (accelerate_configs/fsdp.yaml shards every parameter instead)"
    if not experts_modules:
        return [Problem(f"{type(model).__name__} has no expert-parallel plan: expert parallelism splits the experts "
                        f"of transformers' mixture-of-experts models (their config's base_model_ep_plan), and this "
                        f"model declares none (a dense model, or experts of its own)", where, fix)]
    from peft.tuners.tuners_utils import BaseTunerLayer

    if any(isinstance(experts, BaseTunerLayer) for experts in experts_modules):
        # peft's all-linear adapts transformers' fused experts too (its target_parameters): adapters whose weights
        # hold every expert's, which the plan does not split
        return [Problem("LoRA adapters on the experts with expert parallelism: peft adapts the fused experts with "
                        "weights for every expert, which expert parallelism does not split by expert", where,
                        "adapt the attention and the router (--lora_target_modules q_proj,k_proj,v_proj,o_proj,gate: "
                        "the experts stay frozen), or train adapters on the experts under accelerate_configs/fsdp.yaml "
                        "or deepspeed_zero3.yaml")]
    counts = {getattr(experts, "num_experts", 0) for experts in experts_modules}
    if uneven := sorted(n for n in counts if n % ep):
        return [Problem(f"{EP_KEY} {ep} does not divide the {uneven[0]} experts of each layer: every rank must hold "
                        f"the same number of them", where, f"set {EP_KEY} to a divisor of {uneven[0]}, or {fix}")]
    return []


def apply(model: torch.nn.Module, experts_mesh: Any, tp_mesh: Any) -> list[torch.nn.Module]:
    """Shard the experts of every transformers model in `model` over experts_mesh's ep dimension and install
    transformers' all-to-all dispatch (tp_mesh: the ranks that share a batch, one here); returns the experts
    modules, for FSDP2 to shard over efsdp."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    modules = []
    for moe in moe_models(model):
        plan = expanded_plan(moe)
        apply_expert_parallelism(moe, experts_mesh["ep"], tp_mesh, plan, ep_implementation="all_to_all")
        modules += dispatched(moe, plan)
    return modules
