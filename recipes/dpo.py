"""Preference-tune a causal language model (any AutoModelForCausalLM) with DPO or its family, the step after SFT.

Trains: the model that --model_name_or_path names (a causal_lm run's final/, or a Hub id) on pairs of answers to one
prompt, the chosen one preferred to the rejected one, in TRL's layouts (prompt/chosen/rejected as strings, or as lists
of chat messages; trainkit/data/preference.py). --loss_type picks the objective: sigmoid (DPO), ipo, hinge, simpo or
orpo (the last two need no reference model); --beta its strength. --loss_type kto learns instead from unpaired answers
with a thumbs-up or down (prompt/completion/label), --desirable_weight and --undesirable_weight weighing them. Reports
TRL's metrics: rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected
(eval_ prefixed on the held-out pairs; eval_loss is the objective's).
Output: final/ loads with AutoModelForCausalLM.from_pretrained, as the causal_lm recipe exports it (under LoRA the
adapters merged, and alone in final/adapter/).

The reference model is the policy as it starts. Under LoRA it is the same weights with the adapters switched off (no
second copy); in a full fine-tune a frozen copy inside the model this recipe builds, so that every strategy holds it
as it holds the policy (ZeRO-3 partitions it, FSDP2 shards it, offload offloads it; --estimate and state_bytes count
it). With --precompute_ref_logps, a full fine-tune holds no copy: the reference's log-probabilities of every pair
are computed once before the first step (trainkit/data/precompute.py). The policy starts as the reference, so the first
step's loss is ln 2 for DPO whatever the data.

    python train.py --recipe dpo --model_name_or_path runs/sft/final --data pairs.jsonl --lora_r 16
    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml train.py --recipe dpo \\
        --model_name_or_path runs/sft/final --data pairs.jsonl --beta 0.1
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainkit.data import preference
from trainkit.data.preference import PairsConfig
from trainkit.errors import Problem
from trainkit.losses import chunked_loss, router
from trainkit.losses import dpo as dpo_loss
from trainkit.models import finetune, tiled_mlp
from trainkit.recipes import Rollout


@dataclass(kw_only=True, slots=True)
class Config(PairsConfig):  # settings: trainkit/models/finetune.py (model), trainkit/data/preference.py (pairs)
    # The objective (trainkit/losses/dpo.py has each formula and its paper): sigmoid (DPO), ipo, hinge; simpo and
    # orpo without a reference model. beta: how far from the reference the policy may go (ORPO: the weight of its
    # odds-ratio term); label_smoothing: cDPO's share of pairs taken to be mislabelled (sigmoid only);
    # simpo_gamma: SimPO's target margin.
    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    # KTO: the weights of the desirable and the undesirable answers' losses (the paper advises keeping
    # desirable_weight x desirables / (undesirable_weight x undesirables) within [1, 4/3])
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    # The reference's log-probabilities of every pair computed once, before the first step, with the model as it
    # starts: a full fine-tune then keeps no reference copy (half the weights), and no step runs the reference's
    # forward. The values travel with their pairs and with every checkpoint (trainkit/data/precompute.py).
    precompute_ref_logps: bool = False
    # The log-probabilities from at most this many MiB of logits (fp32) at a time (trainkit/losses/chunked_loss.py); 0:
    # whole
    loss_chunk_mib: float = chunked_loss.CHUNK_MIB
    # Each decoder layer's MLP a chunk of `hidden` positions at a time, recomputed in backward
    # (trainkit/models/tiled_mlp.py)
    tiled_mlp: bool = False
    lr: float = 5e-6

    may_change_on_resume = PairsConfig.may_change_on_resume | {"loss_chunk_mib", "tiled_mlp"}

    def unpaired(self) -> bool:
        return self.loss_type in dpo_loss.UNPAIRED

    def check(self) -> list[Problem]:
        problems = PairsConfig.check(self) + dpo_loss.loss_problems(self.loss_type, self.beta, self.label_smoothing)
        problems += chunked_loss.problems(self.loss_chunk_mib)
        for name in ("desirable_weight", "undesirable_weight"):
            if getattr(self, name) <= 0:
                problems.append(Problem(f"{name} must be > 0, got {getattr(self, name)}", f"--{name}",
                                        f"use --{name} 1"))
        if self.precompute_ref_logps and self.unpaired():
            problems.append(Problem("--precompute_ref_logps is not wired for --loss_type kto (its KL rows would need "
                                    "the reference's log-probabilities too)", "--precompute_ref_logps",
                                    "drop --precompute_ref_logps"))
        if self.precompute_ref_logps and self.loss_type in dpo_loss.REFERENCE_FREE:
            problems.append(Problem(f"--loss_type {self.loss_type} uses no reference model, so there are no "
                                    "reference log-probabilities to precompute", "--precompute_ref_logps",
                                    "drop --precompute_ref_logps"))
        return problems


class Preference(nn.Module):
    """The model this recipe trains: the policy, its reference (a frozen copy, or the policy with its LoRA adapters
    off, or none), and the objective. Its forward takes a micro-batch of pairs and returns the loss and the metrics'
    sums, so that the strategy's wrapper runs the whole objective (DDP's gradient hooks, FSDP2's and ZeRO-3's
    gathers) and holds the reference as it holds the policy."""

    def __init__(self, policy: nn.Module, reference: nn.Module | None, cfg: Config) -> None:
        super().__init__()
        self.policy, self.reference, self.lora = policy, reference, bool(cfg.lora_r)
        self.loss_type, self.beta = cfg.loss_type, cfg.beta
        self.label_smoothing, self.gamma = cfg.label_smoothing, cfg.simpo_gamma
        self.weights = cfg.desirable_weight, cfg.undesirable_weight
        self.config = policy.config  # what the runner reads of a transformers model (sizes, FLOPs)
        # Tensor parallelism cuts the policy and its frozen copy alike, by the policy's own plan (tp.yaml)
        plan = getattr(policy, "_tp_plan", None) or {}
        self._tp_plan = {f"{part}.{entry}": style for part in ("policy", "reference") if getattr(self, part) is not None
                         for entry, style in plan.items()}
        self._no_split_modules = getattr(policy, "_no_split_modules", None)  # FSDP2's blocks: the decoder layers

    def train(self, mode: bool = True) -> Preference:
        super().train(mode)
        if self.reference is not None:  # the reference never trains: no dropout in its pass
            self.reference.eval()
        return self

    def forward(self, **batch: torch.Tensor) -> Any:
        """A micro-batch of pairs (_pairs), or of unpaired answers (_answers: --loss_type kto)."""
        return self._answers(**batch) if "completion_ids" in batch else self._pairs(**batch)

    def _answers(self, completion_ids: torch.Tensor, completion_attention: torch.Tensor,
                 completion_mask: torch.Tensor, label: torch.Tensor, kto_kl: torch.Tensor | None = None,
                 kl_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> Any:
        """KTO: the loss and the metrics' sums of a micro-batch of answers, against kto_kl (the global batch's
        reference point, given by the rollout hook before a training step; a held-out micro-batch's own, from its
        rows rotated, otherwise); with kl_rows (for that hook), only the log-ratio of each of those rows."""
        if kl_rows is not None or kto_kl is None:
            rows = kl_rows or dpo_loss.kl_rows(completion_ids, completion_attention, completion_mask)
            with torch.no_grad():
                ratio = self._logps(self.policy, *rows)[0] - self._reference_logps(*rows)
            if kl_rows is not None:
                return ratio
            kl = ratio.mean().clamp(min=0)
        else:
            kl = kto_kl[0]
        logps, out = self._logps(self.policy, completion_ids, completion_attention, completion_mask)
        reference = self._reference_logps(completion_ids, completion_attention, completion_mask)
        losses, rewards = dpo_loss.kto_losses(self.beta, logps, reference, kl, label, *self.weights)
        wanted = label.float()
        sums = {"rewards/chosen per _desirable": (rewards * wanted).sum(),
                "rewards/rejected per _undesirable": (rewards * (1 - wanted)).sum(),
                "logps/chosen per _desirable": (logps.detach() * wanted).sum(),
                "logps/rejected per _undesirable": (logps.detach() * (1 - wanted)).sum(),
                "_desirable": wanted.sum(), "_undesirable": (1 - wanted).sum(), "kl": kl.detach() * len(label)}
        if out.aux_loss is None:
            return losses.mean(), sums
        objective, reported = router.with_router_loss(self.policy, losses.mean(), out.aux_loss, out.router_logits,
                                                      completion_attention, torch.ones(len(label)))
        return objective, {**sums, **reported}

    def _pairs(self, chosen_ids: torch.Tensor, rejected_ids: torch.Tensor, chosen_attention: torch.Tensor,
                rejected_attention: torch.Tensor, chosen_mask: torch.Tensor, rejected_mask: torch.Tensor,
                ref_chosen_logps: torch.Tensor | None = None, ref_rejected_logps: torch.Tensor | None = None,
                reference_only: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | dict[str, torch.Tensor]:
        """The loss and the metrics' sums; with reference_only, the reference's log-probabilities (the precompute
        pass); with ref_*_logps (precomputed), no reference forward."""
        # chosen and rejected in one forward: [chosen; rejected] along the batch
        ids, attention = torch.cat([chosen_ids, rejected_ids]), torch.cat([chosen_attention, rejected_attention])
        mask = torch.cat([chosen_mask, rejected_mask])
        if reference_only:
            reference = self._reference(ids, attention, mask)
            return {"ref_chosen_logps": reference.chosen, "ref_rejected_logps": reference.rejected}
        policy = self._scores(self.policy, ids, attention, mask)
        reference = None
        if ref_chosen_logps is not None:
            reference = dpo_loss.Sequences(ref_chosen_logps, ref_rejected_logps, policy.chosen_tokens,
                                           policy.rejected_tokens)
        elif self.loss_type not in dpo_loss.REFERENCE_FREE:
            reference = self._reference(ids, attention, mask)
        losses, metrics = dpo_loss.pair_losses(self.loss_type, self.beta, policy, reference, self.label_smoothing,
                                               self.gamma)
        sums = {name: values.sum() for name, values in metrics.items()}
        if policy.aux_loss is None:
            return losses.mean(), sums
        # a mixture of experts' router balance: each answer's, all weighing alike (trainkit/losses/router.py)
        objective, reported = router.with_router_loss(self.policy, losses.mean(), policy.aux_loss,
                                                      policy.router_logits, attention, torch.ones(len(ids)))
        return objective, {**sums, **reported}

    def _reference(self, ids: torch.Tensor, attention: torch.Tensor, mask: torch.Tensor) -> dpo_loss.Sequences:
        """The reference's scores: its frozen copy, the policy with its adapters off, or (a full fine-tune that
        precomputes them) the policy itself, which is the reference only before the first step."""
        with torch.no_grad(), self._reference_on():
            return self._scores(self.reference or self.policy, ids, attention, mask)

    def _reference_logps(self, ids: torch.Tensor, attention: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[rows]: the reference's log-probability of each row's masked tokens (_reference)."""
        with torch.no_grad(), self._reference_on():
            return self._logps(self.reference or self.policy, ids, attention, mask)[0]

    def _reference_on(self) -> Any:
        return self.policy.disable_adapter() if self.reference is None and self.lora else nullcontext()

    @staticmethod
    def _logps(model: nn.Module, ids: torch.Tensor, attention: torch.Tensor,
               mask: torch.Tensor) -> tuple[torch.Tensor, chunked_loss.TokenLosses]:
        """[rows]: each row's summed log-probability of its masked tokens, and the whole forward's output."""
        out = chunked_loss.next_token_losses(model, input_ids=ids, attention_mask=attention, use_cache=False)
        return dpo_loss.sequence_logps(out.losses, mask)[0], out

    @staticmethod
    def _scores(model: nn.Module, ids: torch.Tensor, attention: torch.Tensor,
                mask: torch.Tensor) -> dpo_loss.Sequences:
        out = chunked_loss.next_token_losses(model, input_ids=ids, attention_mask=attention, use_cache=False)
        logps, tokens = dpo_loss.sequence_logps(out.losses, mask)
        chosen, rejected = logps.chunk(2)
        chosen_tokens, rejected_tokens = tokens.chunk(2)
        return dpo_loss.Sequences(chosen, rejected, chosen_tokens, rejected_tokens, out.aux_loss, out.router_logits)


def build_model(cfg: Config) -> nn.Module:
    from transformers import AutoModelForCausalLM

    def causal_lm() -> nn.Module:
        model = finetune.build(cfg, AutoModelForCausalLM)
        return chunked_loss.configure(tiled_mlp.tile(model) if cfg.tiled_mlp else model, cfg.loss_chunk_mib)

    if cfg.lora_r or cfg.precompute_ref_logps or cfg.loss_type in dpo_loss.REFERENCE_FREE:
        return Preference(causal_lm(), None, cfg)
    return Preference(causal_lm(), causal_lm().requires_grad_(False), cfg)


def build_datasets(cfg: Config, cache_dir: Path):
    """(train, held-out) pairs: --eval_data's held out, or eval_fraction of --data's drawn from the seed."""
    return preference.pair_datasets(cfg, cache_dir)


def loss(model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean over the micro-batch's pairs, and the metrics' sums over them (reported by the runner as means over
    the step's global batch, and eval_<name> on the held-out pairs)."""
    return model(**batch)


def rollout(model: Preference, cfg: Config, step: int, micro_batches: list[dict]) -> Rollout | None:
    """KTO's reference point before each step: the global batch's answers gathered from every rank (each rank holds a
    contiguous part of it, in order: trainkit/data/batches.py), their KL rows made by rotating the completions over
    the whole global batch (dpo_loss.kl_rows), this rank's rows' log-ratios summed with every other rank's; the mean,
    clamped at 0, is given to each micro-batch as kto_kl. None for the paired losses, which need none."""
    if not cfg.unpaired():
        return None
    import torch.distributed as dist

    device = next(model.parameters()).device
    names = ("completion_ids", "completion_attention", "completion_mask")
    mine = torch.stack([torch.cat([batch[name] for batch in micro_batches]) for name in names]).to(device)
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    parts = [torch.empty_like(mine) for _ in range(world)] if world > 1 else [mine]
    if world > 1:  # [3, rows, width] of each rank, in rank order: the global batch's order
        dist.all_gather(parts, mine)
    rows = dpo_loss.kl_rows(*torch.cat(parts, dim=1))
    start, total = rank * mine.shape[1], torch.zeros(2, device=device)
    for batch in micro_batches:
        size = len(batch["label"])
        ratio = model(**{key: value.to(device) for key, value in batch.items()},
                      kl_rows=tuple(t[start:start + size] for t in rows))
        total += torch.stack([ratio.sum().float(), torch.tensor(float(size), device=device)])
        start += size
    if dist.is_initialized():
        dist.all_reduce(total)
    kl = (total[0] / total[1]).clamp(min=0)
    # kl in metrics.jsonl is what the loss reports of it (held-out: each micro-batch's own)
    return Rollout([{**batch, "kto_kl": kl.cpu().expand(len(batch["label"]))} for batch in micro_batches], {}, [])


def check_strategy(cfg: Config, strategy: Any) -> list[Problem]:
    """KTO's reference point sums the KL rows over every rank: ranks that share a batch (tensor parallelism) would
    count theirs twice."""
    if cfg.unpaired() and strategy.splits_model:
        return [Problem(f"--loss_type kto sums its reference point over the ranks, and {strategy.label} has ranks "
                        "that share a batch", "the config",
                        "train KTO under ddp.yaml, a deepspeed_zero*.yaml or fsdp.yaml (any data-parallel config)")]
    return []


def precompute(cfg: Config):
    """--precompute_ref_logps: the reference's log-probabilities of every pair, from the model as it starts."""
    return reference_logps if cfg.precompute_ref_logps else None


def reference_logps(model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
    return model(**batch, reference_only=True)


tokens_per_sample = preference.tokens_per_pair
preview = preference.preview  # --dry_run: a pair as the model reads it, the pairs left out counted


def export(model: Preference, state_dict: dict, cfg: Config, cache_dir: Path, out_dir: Path) -> None:
    """final/: the policy as causal_lm exports it (trainkit/models/finetune.py), without the reference."""
    from transformers import AutoModelForCausalLM

    policy = {key.removeprefix("policy."): value for key, value in state_dict.items() if key.startswith("policy.")}
    finetune.export(model.policy, policy, cfg, out_dir, AutoModelForCausalLM)
