"""A mixture of experts' router loss, kept in the objective of a recipe that computes its own loss.

transformers' MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...) compute a load-balancing loss from their router
logits when their config sets `output_router_logits` (Switch Transformer, Fedus et al. 2021, eq. 4: experts x the
sum over experts of the share of tokens routed to each times its mean router probability), return it unscaled as the
output's `aux_loss`, and add `router_aux_loss_coef` times it to their own loss only when given `labels`. The recipes
here compute the next-token loss from the hidden states in chunks (trainkit/losses/chunked_loss.py) and pass no labels,
so without this the balance is silently dropped: a coefficient of 10 and of 0.01 trained to the same losses.

The objective is then the recipe's loss + coefficient x aux_loss, per micro-batch, as transformers' loss is per
forward; metrics.jsonl's `loss` is that objective (what the optimizer sees) and `aux_loss` the unscaled term, a mean
over the step's samples. Beside it, `expert_load/layer_<i>`: each layer's busiest expert's share of the micro-batch's
top-k assignments (padding left out) times the number of experts, 1.0 when the router spreads the tokens evenly and
the number of experts when one expert takes them all; the mean over the step's micro-batches. transformers' MoE layers
are dropless (no capacity), so no token is dropped to count. The coefficient is the model config's
router_aux_loss_coef; a recipe's --router_aux_loss_coef sets it (trainkit/models/finetune.py).
"""

from __future__ import annotations

import torch
from torch import nn


def coefficient(model: nn.Module) -> float:
    """The model's router_aux_loss_coef (its config's, as its own loss uses it); 0 where it has none."""
    from accelerate.utils import extract_model_from_parallel

    config = getattr(extract_model_from_parallel(model), "config", None)
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


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


def with_router_loss(model: nn.Module, loss: torch.Tensor, aux_loss: torch.Tensor | None, samples: int,
                     router_logits: tuple[torch.Tensor, ...] | None = None, attention_mask: torch.Tensor | None = None
                     ) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`loss` as it is where the model computed no auxiliary loss; else (loss + coefficient x aux_loss, the metrics
    aux_loss and expert_load/layer_<i> summed over the micro-batch's `samples`: a recipe loss's reported sums,
    trainkit/recipes.py)."""
    if aux_loss is None:
        return loss
    reported = {"aux_loss": aux_loss.detach().float() * samples}
    from accelerate.utils import extract_model_from_parallel

    top_k = getattr(getattr(extract_model_from_parallel(model), "config", None), "num_experts_per_tok", None)
    if router_logits and top_k:
        loads = expert_load(router_logits, top_k, attention_mask)
        reported.update({f"expert_load/layer_{i}": load * samples for i, load in enumerate(loads)})
    return loss + coefficient(model) * aux_loss, reported
