"""A mixture of experts' router loss, kept in the objective of a recipe that computes its own loss.

transformers' MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...) compute a load-balancing loss from their router
logits when their config sets `output_router_logits` (Switch Transformer, Fedus et al. 2021, eq. 4: experts x the
sum over experts of the share of tokens routed to each times its mean router probability), return it unscaled as the
output's `aux_loss`, and add `router_aux_loss_coef` times it to their own loss only when given `labels`. The recipes
here compute the next-token loss from the hidden states in chunks (trainkit/losses/chunked_loss.py) and pass no labels,
so without this the balance is silently dropped: a coefficient of 10 and of 0.01 trained to the same losses.

The objective is then the recipe's loss + coefficient x aux_loss, per micro-batch, as transformers' loss is per
forward; metrics.jsonl's `loss` is that objective (what the optimizer sees) and `aux_loss` the unscaled term, a mean
over the step's samples.
"""

from __future__ import annotations

import torch
from torch import nn


def coefficient(model: nn.Module) -> float:
    """The model's router_aux_loss_coef (its config's, as its own loss uses it); 0 where it has none."""
    from accelerate.utils import extract_model_from_parallel

    config = getattr(extract_model_from_parallel(model), "config", None)
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def with_router_loss(model: nn.Module, loss: torch.Tensor, aux_loss: torch.Tensor | None,
                     samples: int) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`loss` as it is where the model computed no auxiliary loss; else (loss + coefficient x aux_loss, the metric
    aux_loss summed over the micro-batch's `samples`: a recipe loss's reported sums, trainkit/recipes.py)."""
    if aux_loss is None:
        return loss
    return loss + coefficient(model) * aux_loss, {"aux_loss": aux_loss.detach().float() * samples}
