"""The DPO family's losses over preference pairs (recipes/dpo.py; the pairs are trainkit/data/preference.py's).

Losses, over sequence log-probabilities: logps = the sum of a completion's token log-probs under the policy, ref_logps
under the reference, and `avg` the same divided by the completion's tokens (references are the papers'):

    sigmoid  DPO, Rafailov et al. 2023 (eq. 7), with cDPO's label smoothing eps (Mitchell 2023):
             d = (logps_c - ref_c) - (logps_r - ref_r);  -(1 - eps) log s(beta d) - eps log s(-beta d)
    ipo      IPO, Azar et al. 2023 (eq. 17), on per-token averages as TRL computes it with the authors:
             (d_avg - 1 / (2 beta))^2
    hinge    SLiC, Zhao et al. 2023: relu(1 - beta d)
    simpo    SimPO, Meng et al. 2024 (eq. 6), no reference: -log s(beta (avg_c - avg_r) - gamma)
    orpo     ORPO, Hong et al. 2024 (eqs. 4-7), no reference: the chosen completion's mean token NLL minus
             beta log s(log odds_c - log odds_r), log odds = avg - log(1 - exp(avg))

Every loss is a mean over pairs of a per-pair value, so a step's loss is the mean over the pairs of its global batch
however they are split. The rewards TRL reports: beta (logps - ref_logps) (beta logps without a reference).

KTO (Ethayarajh et al. 2024, eq. 8, as TRL's KTOTrainer computes it) learns from unpaired answers, each desirable or
not: with r = logps - ref_logps of the answer and z0 the reference point (kto_losses):

    kto      desirable:   w_d (1 - s(beta (r - z0)))      undesirable:   w_u (1 - s(beta (z0 - r)))

z0 estimates KL(policy || reference) by the mean log-ratio of the KL rows, clamped at 0 and without gradient: each
answer's prompt followed by the completion of the answer before it in the batch (the first by the last's: kl_rows),
as TRL's KTOTrainer rotates the completions of its batch. TRL does it within each process's micro-batch and averages
the means; here the batch is the whole global batch, the rows made and their mean taken before the step
(recipes/dpo.py's rollout), so that the reference point is TRL's one-process value for that batch on any split of it.
At the first step the policy is its reference: r = z0 = 0 and every answer's loss is its weight x 0.5.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

from trainkit.errors import Problem

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "simpo", "orpo", "kto")
UNPAIRED = ("kto",)  # losses that learn from unpaired answers with a label
REFERENCE_FREE = ("simpo", "orpo")  # losses that need no reference model
# TRL's metric names, as metrics.jsonl, TensorBoard and the plots carry them (eval_ prefixed at evaluation)
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def sequence_logps(token_losses: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the summed log-probability of each row's masked tokens, their count), from the loss of predicting each token
    from the one before (trainkit/losses/chunked_loss.py's next_token_losses: -log softmax, in fp32)."""
    logps = -token_losses
    kept = mask[:, 1:].float()
    return (logps * kept).sum(-1), kept.sum(-1)


@dataclass(frozen=True, slots=True)
class Sequences:
    """Each pair's completions scored by one model: summed log-probs and token counts, chosen and rejected."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    aux_loss: torch.Tensor | None = None  # the model's own auxiliary loss over the pairs' forward (a router's)
    router_logits: tuple[torch.Tensor, ...] | None = None  # and its router's logits, per layer

    def averages(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.chosen / self.chosen_tokens.clamp(min=1), self.rejected / self.rejected_tokens.clamp(min=1)


def pair_losses(loss_type: str, beta: float, policy: Sequences, reference: Sequences | None,
                label_smoothing: float = 0.0, gamma: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each pair's loss (the module docstring's formulas) and its metrics (per pair: the rewards TRL reports, whether
    the chosen one's is larger, their margin, the policy's log-probs)."""
    if loss_type in REFERENCE_FREE:
        avg_c, avg_r = policy.averages()
        if loss_type == "simpo":
            losses = -F.logsigmoid(beta * (avg_c - avg_r) - gamma)
        else:  # orpo: log odds = log p - log(1 - p), p the completion's mean token probability
            log_odds = (avg_c - avg_r) - (torch.log1p(-torch.exp(avg_c)) - torch.log1p(-torch.exp(avg_r)))
            losses = -avg_c - beta * F.logsigmoid(log_odds)
        rewards_c, rewards_r = beta * avg_c.detach(), beta * avg_r.detach()
    else:
        assert reference is not None
        ratio_c, ratio_r = policy.chosen - reference.chosen, policy.rejected - reference.rejected
        d = ratio_c - ratio_r
        if loss_type == "sigmoid":
            losses = -(1 - label_smoothing) * F.logsigmoid(beta * d) - label_smoothing * F.logsigmoid(-beta * d)
        elif loss_type == "ipo":
            (pc, pr), (rc, rr) = policy.averages(), reference.averages()
            losses = ((pc - rc) - (pr - rr) - 1 / (2 * beta)) ** 2
        else:  # hinge
            losses = torch.relu(1 - beta * d)
        rewards_c, rewards_r = beta * ratio_c.detach(), beta * ratio_r.detach()
    return losses, dict(zip(METRICS, (rewards_c, rewards_r, (rewards_c > rewards_r).float(), rewards_c - rewards_r,
                                      policy.chosen.detach(), policy.rejected.detach()), strict=True))


def kl_rows(ids: torch.Tensor, attention: torch.Tensor, mask: torch.Tensor,
            pad: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KTO's mismatched rows of a batch of answers (rows of the same width; mask: each completion's tokens): row i's
    prompt (its tokens before its completion) followed by the completion tokens of row i - 1 (row 0 takes the last
    row's), cut to the width; the same three tensors for them."""
    width = ids.shape[1]
    out_ids, out_attention, out_mask = (torch.zeros_like(t) for t in (ids, attention, mask))
    out_ids.fill_(pad)
    for i in range(len(ids)):
        prompt = ids[i, :int(mask[i].nonzero()[0]) if mask[i].any() else int(attention[i].sum())]
        completion = ids[i - 1][mask[i - 1].bool()]
        row = torch.cat([prompt, completion])[:width]
        out_ids[i, :len(row)], out_attention[i, :len(row)] = row, 1
        out_mask[i, len(prompt):len(row)] = 1
    return out_ids, out_attention, out_mask


def kto_losses(beta: float, logps: torch.Tensor, ref_logps: torch.Tensor, kl: torch.Tensor, desirable: torch.Tensor,
               desirable_weight: float, undesirable_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each answer's KTO loss (the module docstring's formula; kl: z0) and its reward beta r."""
    ratio = logps - ref_logps
    wanted = desirable.bool()
    losses = torch.where(wanted, desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))))
    return losses, beta * ratio.detach()


def loss_problems(loss_type: str, beta: float, label_smoothing: float) -> list[Problem]:
    found = []
    if loss_type not in LOSS_TYPES:
        found.append(Problem(f"unknown loss_type {loss_type!r}", "config field loss_type",
                             f"use one of {', '.join(LOSS_TYPES)}"))
    if beta <= 0:
        found.append(Problem(f"beta must be > 0, got {beta}", "config field beta", "use --beta 0.1"))
    if not 0 <= label_smoothing < 0.5:
        found.append(Problem(f"label_smoothing must be in [0, 0.5), got {label_smoothing}",
                             "config field label_smoothing", "use --label_smoothing 0"))
    if label_smoothing and loss_type != "sigmoid":
        found.append(Problem(f"label_smoothing is cDPO's, of the sigmoid loss, not of {loss_type}",
                             "config field label_smoothing", "drop --label_smoothing, or use --loss_type sigmoid"))
    return found
