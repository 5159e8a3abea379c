"""The tensor-parallel plan: which Linear layers of a model tensor parallelism cuts, and what it cannot cut.

A `colwise` layer holds a slice of the output features (torch's ColwiseParallel), a `rowwise` one the matching slice
of its input features, and its partial outputs are summed across the group (RowwiseParallel: an all-reduce).
Everything else (embeddings, norms, the output head) stays whole on every rank of the group. The plan is the model's
`_tp_plan`, which transformers models fill from `config.base_model_tp_plan`, or what a recipe's build_model sets.
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
NO_PLAN_FIX = ("declare one in build_model: model._tp_plan = {'layers.*.fc1': 'colwise', 'layers.*.fc2': 'rowwise'} "
               "(recipes/README.md); transformers models whose config has a base_model_tp_plan (Llama, Mistral, "
               "Qwen2, ...) bring their own; or train under fsdp.yaml or hsdp.yaml, which cut no layer")


def _pattern(entry: str) -> re.Pattern:
    """A plan entry ('model.layers.*.mlp.up_proj') as a regular expression over module names; '*' is one name part."""
    return re.compile(re.escape(entry).replace(r"\*", r"[^.]+"))


def cut_plan(model: torch.nn.Module) -> dict[str, str]:
    """The entries of the model's plan that this runner cuts by: those of SPLIT_STYLES, less the input embeddings and
    the output head (kept whole)."""
    plan = dict(getattr(model, "_tp_plan", None) or {})
    whole = {name for name, module in model.named_modules() if module is not None and any(
        module is getter() for getter in (getattr(model, "get_input_embeddings", lambda: None),
                                          getattr(model, "get_output_embeddings", lambda: None)))}
    return {entry: style for entry, style in plan.items()
            if style in SPLIT_STYLES and not any(_pattern(entry).fullmatch(name) for name in whole)}


def tp_layers(model: torch.nn.Module) -> dict[str, str]:
    """The layers the model's plan cuts: module name -> one of SPLIT_STYLES."""
    plan = [(_pattern(entry), style) for entry, style in cut_plan(model).items()]
    return {name: style for name, _ in model.named_modules() for pattern, style in plan if pattern.fullmatch(name)}


def split_parameters(names: Iterable[str], plan: Iterable[tuple[str, str]]) -> set[str]:
    """The parameters a plan cuts, by name: a colwise layer's weight and bias, a rowwise layer's weight (its bias is
    added once to the summed output, whole)."""
    patterns = [(_pattern(entry), style) for entry, style in plan if style in SPLIT_STYLES]
    cut = set()
    for name in names:
        module, _, leaf = name.rpartition(".")
        if any(pattern.fullmatch(module) and (style.startswith("colwise") or leaf == "weight")
               for pattern, style in patterns):
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
    if "moe_tp_experts" in plan.values():
        # transformers' experts styles (packed_colwise on fused 3-D weights, an all-reduce around the experts) are its
        # own tensor parallelism, not torch's Linear styles that this runner applies
        return [Problem(f"{kind} is a mixture of experts whose plan cuts its fused experts (transformers' "
                        "moe_tp_experts and packed_colwise styles), which this runner does not apply", where,
                        "split the experts whole between ranks with accelerate_configs/fsdp_ep.yaml (expert "
                        "parallelism), or shard them with fsdp.yaml or deepspeed_zero3.yaml")]
    if not cut_plan(model):
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
