"""The tensor-parallel plan: which Linear layers of a model tensor parallelism cuts, and what it cannot cut.

A `colwise` layer holds a slice of the output features (torch's ColwiseParallel), a `rowwise` one the matching slice
of its input features, and its partial outputs are summed across the group (RowwiseParallel: an all-reduce).
Everything else (embeddings, norms, the output head) stays whole on every rank of the group. The plan is the model's
`_tp_plan`, which transformers models fill from `config.base_model_tp_plan`, or what a recipe's build_model sets.

A transformers mixture of experts keeps each layer's experts fused in 3-D weights ([experts, 2 x intermediate,
hidden] for gate and up together, [experts, hidden, intermediate] down), which its plan cuts with transformers' own
styles: `moe_tp_experts` on the experts module (its forward on this rank's slices, the partial outputs summed, the
gradients of its inputs summed in backward), `packed_colwise` on gate_up_proj (each rank the same slice of the gate's
and of the up projection's features: a strided shard) and `rowwise` on down_proj. Those entries (EXPERTS) are applied
by transformers' own apply_tensor_parallelism (strategies/parallelize.py): every rank routes every token alike and
computes its slice of every expert, dropless as without tensor parallelism.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from trainkit.errors import Problem
from trainkit.launch.launcher import PARALLELISM_KEY

# The plan's styles this runner cuts (torch's ColwiseParallel / RowwiseParallel on nn.Linear), and those it keeps whole
# by choice: transformers marks the input embeddings and the output head for vocabulary-parallel styles, but a tied
# input/output matrix (the tiny transformer's default) is one parameter that cannot be cut both ways, and a cut head
# would need a loss that knows it. Whole, they cost the vocabulary x hidden matrix on every rank of the group, whatever
# style the plan gives them. The gathered styles cut a layer whose neighbours need its whole output or give it a whole
# input (Phi-3's fused query-key-value and gate-up projections, whose columns do not fall on head boundaries):
# colwise with the output gathered, rowwise with the input split first.
SPLIT_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input")
WHOLE_STYLES = ("embedding_rowwise", "embedding_colwise", "colwise_rep", "replicate")
EXPERTS = "moe_tp_experts"  # transformers' style of a fused experts module; its weights' entries name their own
# A module kept whole whose gradient is partial over the tp ranks (Qwen3's per-head q_norm and k_norm, which see only
# this rank's heads): its weights' gradients are summed over the tp group (strategies/parallelize.py)
SUMMED = "replicated_with_grad_allreduce"
NO_PLAN_FIX = ("declare one in build_model: model._tp_plan = {'layers.*.fc1': 'colwise', 'layers.*.fc2': 'rowwise'} "
               "(recipes/README.md); transformers models whose config has a base_model_tp_plan (Llama, Mistral, "
               "Qwen2, ...) bring their own; or train under fsdp.yaml or hsdp.yaml, which cut no layer")


def _pattern(entry: str) -> re.Pattern:
    """A plan entry ('model.layers.*.mlp.up_proj') as a regular expression over module names; '*' is one name part."""
    return re.compile(re.escape(entry).replace(r"\*", r"[^.]+"))


def experts_entries(plan: dict[str, str]) -> dict[str, str]:
    """The plan's entries of fused experts: each moe_tp_experts module and the entries of its weights."""
    holders = [entry for entry, style in plan.items() if style == EXPERTS]
    return {entry: style for entry, style in plan.items()
            if entry in holders or any(entry.startswith(f"{holder}.") for holder in holders)}


def cut_plan(model: torch.nn.Module) -> dict[str, str]:
    """The entries of the model's plan that this runner cuts by: those of SPLIT_STYLES, less the input embeddings and
    the output head (kept whole), and those of fused experts (experts_entries)."""
    plan = dict(getattr(model, "_tp_plan", None) or {})
    whole = {name for name, module in model.named_modules() if module is not None and any(
        module is getter() for getter in (getattr(model, "get_input_embeddings", lambda: None),
                                          getattr(model, "get_output_embeddings", lambda: None)))}
    experts = experts_entries(plan)
    return {entry: style for entry, style in plan.items() if entry in experts or style == SUMMED or
            style in SPLIT_STYLES and not any(_pattern(entry).fullmatch(name) for name in whole)}


def tp_layers(model: torch.nn.Module) -> dict[str, str]:
    """What the model's plan cuts: module name -> one of SPLIT_STYLES for its Linear layers (or SUMMED for a module
    kept whole whose gradients are summed), and for fused experts the experts module's name -> EXPERTS and each
    weight's name -> its entry's style (transformers' own)."""
    plan = cut_plan(model)
    experts = experts_entries(plan)
    patterns = [(_pattern(entry), style, entry in experts) for entry, style in plan.items()]
    named = [*((name, False) for name, _ in model.named_modules()), *((name, True) for name, _ in
                                                                       model.named_parameters())]
    return {name: style for name, is_weight in named for pattern, style, fused in patterns
            if pattern.fullmatch(name) and (fused or not is_weight)}


def split_parameters(names: Iterable[str], plan: Iterable[tuple[str, str]]) -> set[str]:
    """The parameters a plan cuts, by name: a colwise layer's weight and bias, a rowwise layer's weight (its bias is
    added once to the summed output, whole), a fused experts weight that its entry names."""
    plan = dict(plan)
    experts = experts_entries(plan)
    patterns = [(_pattern(entry), style) for entry, style in plan.items() if style in SPLIT_STYLES
                and entry not in experts]
    weights = [_pattern(entry) for entry, style in experts.items() if style != EXPERTS]
    cut = set()
    for name in names:
        module, _, leaf = name.rpartition(".")
        if any(pattern.fullmatch(module) and (style.startswith("colwise") or leaf == "weight")
               for pattern, style in patterns) or any(pattern.fullmatch(name) for pattern in weights):
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
    if not cut_plan(model):
        return [Problem(f"{kind} declares no tensor-parallel plan (which Linear layers to cut)", where, NO_PLAN_FIX)]
    modules, weights = dict(model.named_modules()), dict(model.named_parameters())
    # transformers' plan of a family names the layers of every config it builds (the dense MLPs of a mixture of
    # experts whose layers here are all sparse): an entry that matches nothing is a mistake only in a plan of one's own
    declared = bool(getattr(getattr(model, "config", None), "base_model_tp_plan", None))
    experts = experts_entries(plan)
    problems = experts_problems(experts, modules, weights, tp, where, sizes_where, declared)
    for entry, style in plan.items():
        if entry in experts:
            continue
        if style not in (*SPLIT_STYLES, *WHOLE_STYLES, SUMMED):
            problems.append(Problem(f"plan entry {entry!r} asks for {style!r}, which this runner does not apply",
                                    where, "use colwise or rowwise on nn.Linear layers, or train under fsdp.yaml"))
        elif style in SPLIT_STYLES and not declared and not any(_pattern(entry).fullmatch(name) for name in modules):
            problems.append(Problem(f"plan entry {entry!r} matches no module of {kind}", where,
                                    "name modules as model.named_modules() does, with * for a layer number"))
    layers = {name: style for name, style in tp_layers(model).items()
              if name in modules and style not in (EXPERTS, SUMMED)}
    others = [f"{name} ({type(modules[name]).__name__})" for name in layers
              if not isinstance(modules[name], torch.nn.Linear)]
    if others:
        problems.append(Problem(f"the plan cuts {', '.join(others[:3])}: only nn.Linear layers can be cut", where,
                                "cut Linear layers only (a fused projection such as GPT-2's Conv1D c_attn cannot be "
                                "cut by columns), or train under fsdp.yaml"))
    uneven = [f"{name} ({features} {side} features)" for name, style in layers.items()
              if isinstance(modules[name], torch.nn.Linear)
              for side, features in [("output", modules[name].out_features) if style.startswith("colwise") else
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


# The weights' styles of a fused experts module (transformers' own), and the dimension each cuts: packed_colwise the
# output features of gate and up (each half cut alike), rowwise the input features
EXPERT_WEIGHT_STYLES = {"packed_colwise": -2, "rowwise": -1}


def experts_problems(experts: dict[str, str], modules: dict[str, torch.nn.Module], weights: dict[str, torch.Tensor],
                     tp: int, where: str, sizes_where: str, declared: bool) -> list[Problem]:
    """What keeps the plan's fused experts entries from cutting them: a style transformers has not for them, an entry
    that names nothing (in a plan of one's own: `declared` is transformers'), features the tp size does not divide."""
    problems = []
    for entry, style in experts.items():
        pattern = _pattern(entry)
        found = [name for name in (modules if style == EXPERTS else weights) if pattern.fullmatch(name)]
        if style != EXPERTS and style not in EXPERT_WEIGHT_STYLES:
            problems.append(Problem(f"plan entry {entry!r} asks for {style!r} on a fused experts weight, which this "
                                    "runner does not apply", where,
                                    f"use {' or '.join(EXPERT_WEIGHT_STYLES)} (transformers' styles), or train it "
                                    "under fsdp.yaml or accelerate_configs/fsdp_ep.yaml"))
        elif not found and not declared:
            problems.append(Problem(f"plan entry {entry!r} matches no {'module' if style == EXPERTS else 'weight'}",
                                    where, "name modules and weights as model.named_modules() and "
                                           "model.named_parameters() do, with * for a layer number"))
        elif found and style != EXPERTS:
            features = weights[found[0]].shape[EXPERT_WEIGHT_STYLES[style]] // (2 if style == "packed_colwise" else 1)
            if features % tp:
                problems.append(Problem(f"{PARALLELISM_KEY.format('tp')} {tp} does not divide the {features} "
                                        f"features of each expert's {found[0].rpartition('.')[2]}", sizes_where,
                                        "choose a tensor-parallel size that divides the experts' intermediate size"))
    return problems
