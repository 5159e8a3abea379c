"""GRPO and its family (recipes/grpo.py): advantages from rewards, and the clipped policy-gradient loss on the
completions' tokens, with TRL's formulas and names (trl/trainer/grpo_trainer.py, 1.16).

Advantages (one value per completion, from the rewards of the G completions of its prompt):
- group: r_i - mean(r of its group) (GRPO: Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, eq. 3);
- rloo: r_i - mean(r of the other G - 1) (RLOO: Ahmadian et al. 2024, arXiv:2402.14740, eq. 6); G/(G-1) times the
  group's;
then divided by the std of the group's rewards (--scale_rewards group, GRPO's), of the whole global batch's (batch:
Dr. GRPO's remark that the group's std biases towards easy prompts, Liu et al. 2025, arXiv:2503.20783, sec. 3.1, as
TRL scales it) or not at all (none: Dr. GRPO), + 1e-4 (TRL's guard against a group whose rewards are all equal).

The loss of a completion token t, with ratio r_t = pi(t) / pi_old(t) (1 on the step that sampled it; with
--importance_sampling_level sequence one ratio per completion, the exponential of the mean log-ratio of its tokens:
GSPO, Zheng et al. 2025, arXiv:2507.18071, eq. 7) and advantage A of its completion:

    -min(r_t A, clip(r_t, 1 - epsilon, 1 + epsilon_high) A) + beta KL_t            (PPO's clipped surrogate,
                                                                                    Schulman et al. 2017, eq. 7)
    KL_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1                              (k3, Schulman 2020, "Approximating
                                                                                    KL divergence"; GRPO eq. 4)

and the losses of the tokens are averaged by --loss_type (every normaliser over the whole global batch, so that the
step's loss does not depend on its split into micro-batches and processes: the runner weighs each micro-batch's mean
by its units, recipes/grpo.py's loss_weight):
- grpo: each completion's mean over its tokens, then the mean over completions (GRPO eq. 3);
- dr_grpo: the sum over tokens / (completions x max_completion_length) (Dr. GRPO eq. 5);
- dapo: the sum over tokens / the global batch's completion tokens (DAPO's token-level loss, Yu et al. 2025,
  arXiv:2503.14476, eq. 8; TRL's default);
- bnpo: the same token-level mean. TRL's bnpo divides by the tokens of each micro-batch, a loss that changes with
  the accumulation split; over the whole global batch, as here, it is dapo's.
On the step that sampled the completions the ratio is 1, so the policy term's value is -mean(A): 0 for GRPO's group
advantages whatever the gradient (which is not 0). The loss reads near 0 by construction; the reward is what moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainkit.errors import Problem

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
SCALES = ("group", "batch", "none")
ADVANTAGES = ("group", "rloo")
LEVELS = ("token", "sequence")
TOKEN_LEVEL = ("dapo", "bnpo")  # their unit is a completion token; grpo's and dr_grpo's a completion
STD_GUARD = 1e-4  # added to the std the advantages are divided by (TRL's)


def problems(loss_type: str, scale_rewards: str, advantage: str, level: str, beta: float, epsilon: float,
             epsilon_high: float | None, group: int) -> list[Problem]:
    found = []
    for value, choices, flag, default in ((loss_type, LOSS_TYPES, "--loss_type", "dapo"),
                                          (scale_rewards, SCALES, "--scale_rewards", "group"),
                                          (advantage, ADVANTAGES, "--advantage", "group"),
                                          (level, LEVELS, "--importance_sampling_level", "token")):
        if value not in choices:
            found.append(Problem(f"{flag} must be one of {', '.join(choices)}, got {value!r}", flag,
                                 f"use {flag} {default}"))
    if beta < 0:
        found.append(Problem(f"beta must be >= 0, got {beta}", "--beta", "use --beta 0 (no reference model) or 0.04"))
    for name, value in (("epsilon", epsilon), ("epsilon_high", epsilon_high)):
        if value is not None and not value > 0:
            found.append(Problem(f"{name} must be > 0, got {value}", f"--{name}", f"use --{name} 0.2"))
    if group < 2:
        found.append(Problem(f"num_generations must be >= 2 (the advantages compare a prompt's completions with each "
                             f"other), got {group}", "--num_generations", "use --num_generations 8"))
    return found


def advantages(rewards: torch.Tensor, group: int, scale: str, estimator: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantage of each completion, whether its std is 0) from the global batch's rewards [completions], whose
    consecutive `group` entries are one prompt's completions."""
    grouped = rewards.view(-1, group)
    if estimator == "rloo":
        baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group - 1)
    else:
        baseline = grouped.mean(dim=1, keepdim=True)
    centred = (grouped - baseline).reshape(-1)
    if scale == "batch":
        std = rewards.std().expand_as(rewards)
    else:  # group; under none only said (frac_reward_zero_std)
        std = grouped.std(dim=1).repeat_interleave(group)
    scaled = centred / (std + STD_GUARD) if scale != "none" else centred
    return scaled, torch.isclose(std, torch.zeros_like(std))


@dataclass(frozen=True, slots=True)
class Objective:
    """The settings of the loss (recipes/grpo.py's Config)."""

    loss_type: str
    beta: float
    epsilon: float
    epsilon_high: float
    level: str
    max_completion_length: int


@dataclass(frozen=True, slots=True)
class TokenLoss:
    """The loss of a micro-batch of completions, and what it reports: sums over its completion tokens (kl, entropy,
    the clipped shares) with their count."""

    loss: torch.Tensor  # the mean over the micro-batch's units (completions, or tokens: unit_count)
    sums: dict[str, torch.Tensor]


def token_loss(objective: Objective, logps: torch.Tensor, old_logps: torch.Tensor | None,
               ref_logps: torch.Tensor | None, advantage: torch.Tensor, mask: torch.Tensor,
               entropy: torch.Tensor | None = None) -> TokenLoss:
    """logps, old_logps (None: this step sampled them, the ratio is 1), ref_logps (None: beta 0), mask, entropy:
    [completions, tokens]; advantage: [completions]."""
    mask = mask.float()
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if objective.level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - objective.epsilon, 1 + objective.epsilon_high)
    a = advantage.unsqueeze(-1)
    per_token = -torch.min(ratio * a, clipped * a)
    sums: dict[str, torch.Tensor] = {}
    if objective.beta:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        per_token = per_token + objective.beta * kl
        sums["kl"] = (kl.detach() * mask).sum()
    per_token = per_token.expand_as(mask)
    if objective.loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif objective.loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (mask.shape[0] * objective.max_completion_length)
    else:  # dapo, bnpo: the micro-batch's token mean, weighed by its tokens
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    low = ((ratio < 1 - objective.epsilon) & (a < 0)).expand_as(mask).float()
    high = ((ratio > 1 + objective.epsilon_high) & (a > 0)).expand_as(mask).float()
    sums.update({"clip_ratio/low_mean": (low * mask).sum(), "clip_ratio/high_mean": (high * mask).sum(),
                 "clip_ratio/region_mean": (torch.maximum(low, high) * mask).sum()})
    if entropy is not None:
        sums["entropy"] = (entropy * mask).sum()
    return TokenLoss(loss, sums)


def unit_count(loss_type: str, mask: torch.Tensor) -> float:
    """The units a micro-batch's loss is a mean over: its completion tokens (dapo, bnpo), else its completions."""
    return float(row_units(loss_type, mask).sum())


def row_units(loss_type: str, mask: torch.Tensor) -> torch.Tensor:
    """[rows]: each completion's units (unit_count)."""
    return mask.sum(dim=1).float() if loss_type in TOKEN_LEVEL else torch.ones(mask.shape[0], device=mask.device)
