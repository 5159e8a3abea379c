"""DeepSpeed's AutoEP: expert parallelism selected by the JSON's `expert_parallel` section (ds_configs/zero2_ep.json).

When DeepSpeed builds its engine, AutoEP finds each mixture-of-experts block of a transformers model by its family's
preset (deepspeed/module_inject/auto_ep_presets/: Mixtral, Qwen3-MoE, DeepSeek-V2/V3...) and replaces it with an
AutoEPMoELayer: the router copied, this rank's experts / ep experts repacked as grouped gate, up and down weights, the
tokens sent to their experts' rank and back by all-to-all. Dropless: every token reaches its top-k experts, so
routing and losses are one process's. ZeRO partitions the experts' optimizer state over the ranks that hold the same
experts (DeepSpeed's expert-data-parallel groups), the rest over every rank.

What the runner adds around it:
- a refusal where AutoEP would silently do nothing (a dense model, a model inside a recipe's wrapper whose names the
  presets do not match, a family without a preset), with DeepSpeed's own checks of the section and of the layers it
  found run at plan and build time (`launch_problems`, `model_problems`);
- the optimizer's expert parameter group: DeepSpeed's ZeRO needs the experts in groups of their own marked `moe`
  (`expert_groups`), before the engine moves each replacement into its source's group;
- final/ in the transformers layout (`transformers_layout`): the experts gathered from every rank of the ep group and
  packed back as the model's fused tensors, the router under its own name, so that from_pretrained loads it;
- transformers 5.23 and DeepSpeed 0.19.8 disagree on `_CAN_RECORD_REGISTRY.get` (`mend_output_capture_registry`).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch

from trainkit.errors import Problem

FIX = "train it under accelerate_configs/deepspeed_zero2.yaml (the same without the expert_parallel section), or " \
      "split a transformers mixture of experts under accelerate_configs/fsdp_ep.yaml (transformers' own expert " \
      "parallelism)"


def section(config: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON's expert_parallel section where it is enabled, else None."""
    found = config.get("expert_parallel") or {}
    return found if found.get("enabled") else None


def ep_size(config: dict[str, Any]) -> int:
    """The section's autoep_size (1 without the section; 0 for a value that is not a whole number: refused)."""
    size = (section(config) or {}).get("autoep_size", 1)
    return size if isinstance(size, int) and not isinstance(size, bool) else 0


def run_ep_size(resolved: dict[str, Any]) -> int:
    """The AutoEP size a run's resolved_config.json records (1: none, or not a DeepSpeed run)."""
    return ep_size(resolved.get("deepspeed_config") or {})


def _parsed(found: dict[str, Any]) -> Any:
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config

    return parse_autoep_config(found)


def launch_problems(config: dict[str, Any], world_size: int, stage: int | None, sp: int, offloads: bool,
                    compile: bool, where: str) -> list[Problem]:
    """What the runner refuses of the section before any model exists: ZeRO-3 (no final/), sequence parallelism and
    --compile (not tested), an ep size that does not divide the processes, and what DeepSpeed's own validation
    (validate_autoep_config) rejects."""
    if (found := section(config)) is None:
        return []
    problems = []
    if compile:
        problems.append(Problem("--compile with DeepSpeed's AutoEP: not tested (AutoEP replaces the blocks after the "
                                "runner compiles the model)", "--compile",
                                "drop --compile, or train without the expert_parallel section"))
    size = ep_size(config)
    if stage not in (1, 2):  # measured under ZeRO-3: the curve is one process's, but DeepSpeed will not write final/
        problems.append(Problem(f"expert_parallel with ZeRO-{stage}: DeepSpeed 0.19 cannot consolidate AutoEP's "
                                f"experts under ZeRO-3 for final/ (\"_zero3_consolidated_16bit_state_dict is not "
                                f"supported for AutoEP with ZeRO Stage 3\")", where,
                                f"set zero_optimization.stage to 1 or 2 (ds_configs/zero2_ep.json), or {FIX}"))
    if sp > 1:
        problems.append(Problem("expert_parallel with sequence parallelism: not tested", where,
                                f"set parallelism_config_sp_size: 1, or {FIX}"))
    if size < 2 or world_size % size:
        problems.append(Problem(f"expert_parallel.autoep_size {found.get('autoep_size')!r} does not divide the "
                                f"{world_size} process(es) "
                                f"into groups of at least 2 that split the experts", where,
                                "set autoep_size to a divisor of the process count above 1 (ds_configs/zero2_ep.json: "
                                "2), or launch a multiple of it"))
        return problems
    from deepspeed.module_inject.auto_ep_config import validate_autoep_config

    try:
        validate_autoep_config(_parsed(found), world_size, 1, 1, sp, zero_stage=stage or 0,
                               zero_offload_optimizer=offloads)
    except ValueError as error:
        problems.append(Problem(f"DeepSpeed rejects the expert_parallel section: {error}", where,
                                "correct the section (deepspeed/module_inject/auto_ep_config.py lists its keys)"))
    return problems


def layer_specs(model: torch.nn.Module, found: dict[str, Any]) -> list[Any]:
    """The mixture-of-experts blocks AutoEP will replace in `model`, found by DeepSpeed's own detection (on a config
    parsed afresh: detection fills it from the model's; a deep copy would lose its sentinel for unset names)."""
    from deepspeed.module_inject.auto_ep import AutoEP

    return AutoEP(model, _parsed(found)).ep_parser()


def model_problems(model: torch.nn.Module, config: dict[str, Any], where: str) -> list[Problem]:
    """A model AutoEP would leave as it is (it says nothing then: the run would train every expert on every rank
    under a config that promises to split them), or whose layers DeepSpeed rejects (validate_autoep_post_detection:
    ep not dividing the experts...)."""
    if (found := section(config)) is None:
        return []
    from deepspeed.module_inject.auto_ep_config import validate_autoep_post_detection
    from deepspeed.module_inject.auto_ep_presets.registry import (
        available_preset_names,
        get_preset,
        preset_name_for_hf_model_type,
    )
    from peft import PeftModel
    from transformers import PreTrainedModel

    name = type(model).__name__
    if isinstance(model, PeftModel):
        return [Problem("LoRA with DeepSpeed's AutoEP: peft's wrapper renames the blocks (base_model.model...), which "
                        "AutoEP's presets look for by name from the model's root: it would split nothing",
                        where, "fine-tune the whole model under this config, or train adapters on the attention and "
                               "the router under accelerate_configs/fsdp_ep.yaml")]
    if not isinstance(model, PreTrainedModel) and any(isinstance(m, PreTrainedModel) for m in model.modules()):
        return [Problem(f"DeepSpeed's AutoEP finds no mixture-of-experts block to split in the recipe's {name}, which "
                        f"holds its transformers model(s) inside (a policy and its reference...): AutoEP looks for "
                        f"the blocks by name from the root of the model handed to DeepSpeed", where, FIX)]
    try:
        specs = layer_specs(model, found)
    except ValueError as error:
        return [Problem(f"DeepSpeed's AutoEP cannot split {name}: {error}", where, FIX)]
    if not specs:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        preset = found.get("preset_model") or preset_name_for_hf_model_type(model_type or "")
        if preset is None:
            what = f"model_type {model_type!r} ({name}): AutoEP has presets for " \
                   f"{', '.join(available_preset_names())} only" if model_type else f"{name}, not a transformers model"
        else:
            what = f"{name}: its preset looks for them as {get_preset(preset).moe_layer_pattern}"
        return [Problem(f"DeepSpeed's AutoEP finds no mixture-of-experts block to split in {what}, and would train "
                        f"unsplit without a word", where, FIX)]
    try:
        validate_autoep_post_detection(_parsed(found), specs)
    except ValueError as error:
        return [Problem(f"DeepSpeed's AutoEP rejects {name}'s experts: {error}", where,
                        f"set autoep_size to a divisor of the experts per layer, or {FIX}")]
    if apart := [spec.moe_module_name for spec in specs if spec.expert_storage != "fused_3d"]:
        return [Problem(f"{name} keeps one module per expert ({apart[0]}...): the runner writes final/ back from "
                        f"AutoEP's layout for the fused experts transformers builds only", where, FIX)]
    return []


def mend_output_capture_registry() -> None:
    """AutoEP reads and restores transformers' `_CAN_RECORD_REGISTRY` entries by class name with a default, as a dict
    (deepspeed/module_inject/auto_ep_presets/base.py), where transformers 5.23's `get` takes a model and no default:
    "TypeError: get() takes 2 positional arguments but 3 were given" (measured). Its `get` answers both."""
    from transformers.utils import output_capturing

    registry = type(output_capturing._CAN_RECORD_REGISTRY)
    if len(inspect.signature(registry.get).parameters) > 2:  # already takes a default
        return

    def get(self: dict, key: Any, default: Any = None) -> Any:
        if isinstance(key, str):
            return dict.get(self, key, default)
        return dict.get(self, str(key.__class__)) or {}

    registry.get = get


@dataclass(frozen=True)
class Layout:
    """What final/ must hold: every name and shape of the model's state dict before AutoEP replaced its blocks, and
    the blocks it replaces (their specs)."""

    shapes: dict[str, torch.Size]
    specs: tuple[Any, ...]


def layout(model: torch.nn.Module, config: dict[str, Any]) -> Layout:
    return Layout({name: t.shape for name, t in model.state_dict().items()}, tuple(layer_specs(model, section(config))))


def experts_held(model: torch.nn.Module, before: Layout) -> tuple[int, int]:
    """The expert parameters this rank holds once AutoEP replaced the blocks, and the model's, as counted."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    held = sum(p.numel() for m in model.modules() if isinstance(m, AutoEPMoELayer) for p in m.experts.parameters())
    total = sum(math.prod(shape) for name, shape in before.shapes.items()
                if any(name.startswith(f"{s.moe_module_name}.{s.experts_name}.") for s in before.specs))
    return held, total


def expert_groups(optimizer: torch.optim.Optimizer, model: torch.nn.Module, before: Layout, ep: int) -> None:
    """Move the experts' weights of the blocks AutoEP replaces into parameter groups of their own, marked as
    DeepSpeed's ZeRO wants an expert group (`moe`, and the ep group's name), settings kept: the engine then puts each
    repacked expert weight into its source's group and partitions those over the ranks that hold the same experts
    ("The model has moe layers, but None of the param groups are marked as MoE" otherwise)."""
    experts = {id(p) for spec in before.specs
               for p in model.get_submodule(f"{spec.moe_module_name}.{spec.experts_name}").parameters()}
    name = f"ep_size_{ep}"
    for group in list(optimizer.param_groups):
        moved = [p for p in group["params"] if id(p) in experts]
        if not moved:
            continue
        group["params"] = [p for p in group["params"] if id(p) not in experts]
        if not group["params"]:
            optimizer.param_groups.remove(group)
        optimizer.add_param_group({**{k: v for k, v in group.items() if k != "params"}, "params": moved,
                                   "moe": True, "name": name})


def _gathered(local: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """All of a layer's experts of one weight, in the experts' order, from the local ones of each ep rank."""
    import torch.distributed as dist
    from deepspeed.checkpoint.autoep_affine import autoep_experts_for_rank

    parts = [torch.empty_like(local) for _ in range(layer.ep_size)]
    dist.all_gather(parts, local.contiguous(), group=layer.ep_group)
    whole = torch.empty((layer.num_experts, *local.shape[1:]), dtype=local.dtype, device=local.device)
    for rank, part in enumerate(parts):
        whole[list(autoep_experts_for_rank(layer.expert_placement_descriptor, rank))] = part
    return whole


def transformers_layout(model: torch.nn.Module, state_dict: dict[str, torch.Tensor],
                        before: Layout) -> dict[str, torch.Tensor]:
    """The engine's state dict in the names and shapes of the model AutoEP was given (a collective over each ep
    group: call on every rank). Each replaced block's grouped gate (w1), up (w3) and down (w2) weights are gathered
    and packed back as the family's own tensors (a fused gate_up in either orientation, or gate and up apart), its
    router's linear under the router's own name; what AutoEP adds (its router alias and buffers) is left out. Any name
    or shape that does not come out as before is an error: final/ must load as the model it was."""
    from deepspeed.moe.fused_expert_layout import classify_fused_gate_up_layout

    out = dict(state_dict)
    for spec in before.specs:
        block, prefix = model.get_submodule(spec.moe_module_name), spec.moe_module_name
        for key in [k for k in out if k.startswith(f"{prefix}.")]:
            del out[key]
        experts = f"{prefix}.{spec.experts_name}"
        w1, w2, w3 = (_gathered(getattr(block.experts, w).detach(), block) for w in ("w1", "w2", "w3"))
        if spec.expert_w3_name is None:  # fused_3d storage: one module per expert is refused (model_problems)
            fused = classify_fused_gate_up_layout(tuple(before.shapes[f"{experts}.{spec.expert_w1_name}"]),
                                                  tuple(before.shapes[f"{experts}.{spec.expert_w2_name}"]))
            if fused.needs_transpose:  # [E, hidden, 2 x ffn] and [E, ffn, hidden]
                out[f"{experts}.{spec.expert_w1_name}"] = torch.cat([w1, w3], 1).transpose(1, 2).contiguous()
                out[f"{experts}.{spec.expert_w2_name}"] = w2.transpose(1, 2).contiguous()
            else:
                out[f"{experts}.{spec.expert_w1_name}"] = torch.cat([w1, w3], 1)
                out[f"{experts}.{spec.expert_w2_name}"] = w2
        else:
            out.update({f"{experts}.{spec.expert_w1_name}": w1, f"{experts}.{spec.expert_w2_name}": w2,
                        f"{experts}.{spec.expert_w3_name}": w3})
        for name, tensor in block.router.state_dict().items():  # gate.weight (the linear), e_score_correction_bias...
            out[f"{prefix}.{spec.router_name}.{name.removeprefix('gate.')}"] = tensor
        for attribute, source in (("shared_experts", spec.shared_experts_name),
                                  ("shared_experts_gate", spec.shared_experts_gate_name)):
            if source and (module := getattr(block, attribute, None)) is not None:
                out.update({f"{prefix}.{source}.{name}": t for name, t in module.state_dict().items()})
        for key in [k for k in out if k.startswith(f"{prefix}.") and k not in before.shapes]:
            del out[key]  # AutoEP's own buffers (tokens per expert), not the model's
    wrong = sorted(set(before.shapes) ^ set(out)) + sorted(k for k in before.shapes if k in out and
                                                          out[k].shape != before.shapes[k])
    if wrong:
        raise ValueError(f"AutoEP's weights do not map back to the model's layout: {', '.join(wrong[:4])}")
    return out
