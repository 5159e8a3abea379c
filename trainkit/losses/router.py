"""A mixture of experts' router loss, kept in the objective of a recipe that computes its own loss.

transformers' MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss, ...) compute a load-balancing loss from
their router logits when their config sets `output_router_logits` (Switch Transformer, Fedus et al. 2021, eq. 4:
experts x the sum over experts of the share of tokens routed to each times its mean router probability), return it
unscaled as the output's `aux_loss`, and add `router_aux_loss_coef` times it to their own loss only when given
`labels`. The recipes here compute the next-token loss from the hidden states in chunks
(trainkit/losses/chunked_loss.py) and pass no labels, so without this the balance is silently dropped: a coefficient
of 10 and of 0.01 trained to the same losses.

Over which tokens the balance is measured. The model's own loss measures it over its forward's batch, so its value
changes with the micro-batch: two rows balanced together are not two rows balanced alone, and a global batch split
over 1, 2 or 4 processes, or over more accumulation steps, would train another curve. Here the model's own function
(its modeling module's `load_balancing_loss_func`) is called on each sequence alone, as Megatron-Core's
`seq_aux_loss` does, and the objective adds coefficient x the mean of the sequences' values, each weighed like the
recipe's loss (its learned tokens, its completions): a sum over sequences, so the same for any split of the global
batch (tests/test_moe.py). For a micro-batch of one sequence it is the model's own loss to the digit
(tests/test_router_loss.py). A sequence-parallel rank holds part of each sequence, and the balance needs the whole:
under DeepSpeed's Ulysses and torch's context parallelism (the engine sets `split_over` around each shard's loss) the
ranks of a group gather their router logits into whole sequences (`Gathered`: each gradient goes back to the rank of
its positions), each computes the whole sequences' balance and weighs it by its own part's learned tokens, so that
the shards' weighed sum is one process's term. The balance is a mean over a sequence's tokens, blind to their order:
torch's cut (chunks from the head and the tail of each row) gathers into another order of the same positions, with
the balance mask cut and gathered alike.

metrics.jsonl's `loss` is the objective (what the optimizer sees) and `aux_loss` the unscaled term, weighed as the
objective weighs it. Beside it, `expert_load/layer_<i>`: each layer's busiest expert's share of the micro-batch's
top-k assignments (padding left out) times the number of experts, 1.0 when the router spreads the tokens evenly and
the number of experts when one expert takes them all; the mean over the step's micro-batches, weighed as the loss (a
statistic of the micro-batch, unlike the loss). transformers' MoE layers are dropless (no capacity), so no token is
dropped to count. The coefficient is the model config's router_aux_loss_coef; a recipe's --router_aux_loss_coef sets
it (trainkit/models/finetune.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from trainkit.models import pretrained
from trainkit.run.metrics import PER

UNITS = "_router_units"  # the reported total that aux_loss is a mean over (not a metric of its own)
# The process group whose ranks hold consecutive parts of the sequences being computed (sequence parallelism), or None
SPLIT: contextvars.ContextVar[Any] = contextvars.ContextVar("router_split", default=None)


@contextlib.contextmanager
def split_over(group: Any) -> Iterator[None]:
    """Around a shard's loss: its sequences' other positions are on `group`'s ranks, in rank order."""
    token = SPLIT.set(group)
    try:
        yield
    finally:
        SPLIT.reset(token)


class Gathered(torch.autograd.Function):
    """[rows, part, ...] on each rank of a group -> [rows, part x ranks, ...] on every rank; in backward each rank's
    part gets the sum over the ranks of the gradient of its positions (an all-reduce: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, part.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group), dim=1)[dist.get_rank(ctx.group)], None


def whole_sequences(router_logits: tuple[torch.Tensor, ...], mask: torch.Tensor | None, rows: int
                    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    """Under split_over: each layer's router logits ([rows x part, experts]) and the mask ([rows, part]) of the
    whole sequences, gathered from the group's ranks; as they are otherwise."""
    group = SPLIT.get()
    if group is None:
        return router_logits, mask
    gathered = tuple(Gathered.apply(logits.view(rows, -1, logits.shape[-1]), group).reshape(-1, logits.shape[-1])
                     for logits in router_logits)
    return gathered, None if mask is None else Gathered.apply(mask.float(), group).detach()


def coefficient(model: nn.Module) -> float:
    """The model's router_aux_loss_coef (its config's, as its own loss uses it); 0 where it has none."""
    from accelerate.utils import extract_model_from_parallel

    config = getattr(extract_model_from_parallel(model), "config", None)
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def _inner(model: nn.Module) -> nn.Module:
    """The transformers model inside a strategy's or peft's wrapper (`model` itself where there is none)."""
    from accelerate.utils import extract_model_from_parallel

    inner = extract_model_from_parallel(model)
    return getattr(inner, "get_base_model", lambda: inner)()


def balances(model: nn.Module) -> bool:
    """Whether `model` (or the transformers model inside a strategy's or peft's wrapper) computes its router's
    balancing loss: its config asks for the router logits."""
    text = pretrained.text_config(getattr(_inner(model), "config", None))
    return bool(getattr(text, "output_router_logits", False))


def routers(model: nn.Module, within: nn.Module) -> list[tuple[nn.Module, int]]:
    """The modules of `within` whose output holds a layer's router logits, in order, with the logits' index in it:
    those the transformers `model` (or the one inside its wrapper) declares to record its router_logits from (its
    `_can_record_outputs`: a class, an index, a name part; the instance's where a library pointed it elsewhere, as
    DeepSpeed's AutoEP does at its own routers); none where it declares none."""
    spec = (getattr(_inner(model), "_can_record_outputs", None) or {}).get("router_logits")
    spec = spec[0] if isinstance(spec, list) and len(spec) == 1 else spec
    if isinstance(spec, type):
        spec = (spec, 1, None)  # transformers' own default index for a class given alone
    elif spec is not None and isinstance(getattr(spec, "target_class", None), type):
        spec = (spec.target_class, spec.index, spec.layer_name)
    else:
        return []
    cls, index, part = spec
    return [(module, index) for name, module in within.named_modules()
            if isinstance(module, cls) and (part is None or f".{part.strip('.')}." in f".{name}.")]


@contextlib.contextmanager
def caught(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Around a forward of `model` (or the transformers model inside a strategy's or peft's wrapper): the router
    logits of each layer it runs, [tokens, experts], in order, caught from the modules that output them (`routers`),
    where the model balances its router; nothing is caught (nor looked for) otherwise. For a head that drops them
    from its output (transformers' sequence classifiers: recipes/reward.py) and a pipeline stage."""
    logits: list[torch.Tensor] = []
    hooks = [module.register_forward_hook(
        lambda _module, _args, output, i=index: logits.append(output[i] if isinstance(output, tuple) else output))
        for module, index in (routers(model, _inner(model)) if balances(model) else [])]
    try:
        yield logits
    finally:
        for hook in hooks:
            hook.remove()


def generating(model: nn.Module) -> dict[str, bool]:
    """The forward's keyword that turns the balance off while sampling with a KV cache (trainkit/rl/sampling.py): a
    step's router logits are its new tokens' alone, while the attention mask covers the whole sequence, and the
    model's own balance fails on the difference ("The size of tensor a (8) must match the size of tensor b (456)")."""
    return {"output_router_logits": False} if balances(model) else {}


def own_balance(model: nn.Module) -> tuple[Callable[..., torch.Tensor], int]:
    """The model's own load_balancing_loss_func (from the module that defines its classes: under peft or a strategy's
    wrapper, the model inside that routes; under transformers' generic sequence classifier, its decoder's) and its
    top-k (the model's num_experts_per_tok, else its config's)."""
    from accelerate.utils import extract_model_from_parallel

    config = pretrained.text_config(getattr(extract_model_from_parallel(model), "config", None))
    top_k = next((module.num_experts_per_tok for module in model.modules() if hasattr(module, "num_experts_per_tok")),
                 getattr(config, "num_experts_per_tok", None))
    for module in model.modules():
        for cls in type(module).__mro__:  # FSDP2 makes a class of its own on top of the model's
            defined = sys.modules.get(cls.__module__)
            if hasattr(defined, "load_balancing_loss_func") and top_k is not None:
                return defined.load_balancing_loss_func, int(top_k)
    raise TypeError(f"{type(model).__name__} returns an aux_loss, but no module of it defines "
                    "load_balancing_loss_func, or it has no num_experts_per_tok")


def sequence_balance(balance: Callable[..., torch.Tensor], top_k: int, router_logits: tuple[torch.Tensor, ...],
                     attention_mask: torch.Tensor | None, rows: int) -> torch.Tensor:
    """[rows]: each sequence's balancing loss, the model's own function (own_balance) on that sequence alone
    (router_logits: one [rows x length, experts] per layer, as transformers returns them; attention_mask [rows,
    length] or None)."""
    experts = router_logits[0].shape[-1]
    layers = [logits.view(rows, -1, experts) for logits in router_logits]
    return torch.stack([balance(tuple(layer[row] for layer in layers), experts, top_k,
                                None if attention_mask is None else attention_mask[row:row + 1])
                        for row in range(rows)])


def expert_load(router_logits: tuple[torch.Tensor, ...], top_k: int,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per layer (router_logits: [tokens, experts] each), the busiest expert's share of the top-k assignments of the
    tokens `attention_mask` keeps (all where None), times the number of experts."""
    loads = []
    for logits in router_logits:
        experts = logits.shape[-1]
        chosen = torch.topk(logits.detach().float(), top_k, dim=-1).indices
        kept = torch.ones(chosen.shape[0], device=chosen.device) if attention_mask is None else \
            attention_mask.reshape(-1).to(chosen.device).float()
        counts = torch.zeros(experts, device=chosen.device).scatter_add_(
            0, chosen.reshape(-1), kept.repeat_interleave(top_k))
        loads.append(counts.max() / counts.sum().clamp(min=1.0) * experts)
    return torch.stack(loads)


def with_router_loss(model: nn.Module, loss: torch.Tensor, aux_loss: torch.Tensor | None,
                     router_logits: tuple[torch.Tensor, ...] | None, attention_mask: torch.Tensor | None,
                     row_weights: torch.Tensor
                     ) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`loss` as it is where the model computed no auxiliary loss; else `balanced`."""
    if aux_loss is None:
        return loss
    return balanced(model, loss, router_logits, attention_mask, row_weights)


def balanced(model: nn.Module, loss: torch.Tensor, router_logits: tuple[torch.Tensor, ...],
             attention_mask: torch.Tensor | None, row_weights: torch.Tensor
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss + coefficient x the row_weights-weighed mean of the sequences' balancing losses, the reported sums:
    aux_loss and expert_load/layer_<i> over the rows' weights, named as `reported_names`; trainkit/recipes.py).
    row_weights: [rows], what each sequence weighs in the recipe's loss of the micro-batch (its learned tokens, 1 per
    completion, ...)."""
    balance, top_k = own_balance(model)
    weights = row_weights.detach().float().to(loss.device)
    router_logits, attention_mask = whole_sequences(router_logits, attention_mask, len(weights))
    each = sequence_balance(balance, top_k, router_logits, attention_mask, len(weights))
    weighed = (each.to(loss.device) * weights).sum()
    loads = expert_load(router_logits, top_k, attention_mask)
    values = [weighed.detach(), weights.sum(), *(load * weights.sum() for load in loads)]
    reported = dict(zip(reported_names(len(loads)), values, strict=True))
    return loss + coefficient(model) * weighed / weights.sum().clamp(min=1e-12), reported


def reported_names(layers: int) -> list[str]:
    """What `balanced` reports for a model with `layers` routed layers, in its order."""
    return [f"aux_loss{PER}{UNITS}", UNITS, *(f"expert_load/layer_{i}{PER}{UNITS}" for i in range(layers))]
