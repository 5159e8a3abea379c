"""Preference-tune a causal language model (any AutoModelForCausalLM) with DPO or its family, the step after SFT.

Trains: the model that --model_name_or_path names (a causal_lm run's final/, or a Hub id) on pairs of answers to one
prompt, the chosen one preferred to the rejected one, in TRL's layouts (prompt/chosen/rejected as strings, or as
lists of chat messages; trainkit/data/preference.py). --loss_type picks the objective: sigmoid (DPO), ipo, hinge, simpo
or orpo (the last two need no reference model); --beta its strength. Reports TRL's metrics: rewards/chosen,
rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected (eval_ prefixed on the held-out
pairs; eval_loss is the objective's).
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

import torch
from torch import nn

from trainkit.data import preference
from trainkit.data.preference import PairsConfig
from trainkit.errors import Problem
from trainkit.losses import chunked_loss, router
from trainkit.losses import dpo as dpo_loss
from trainkit.models import finetune, tiled_mlp


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

    def check(self) -> list[Problem]:
        problems = PairsConfig.check(self) + dpo_loss.loss_problems(self.loss_type, self.beta, self.label_smoothing)
        problems += chunked_loss.problems(self.loss_chunk_mib)
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

    def forward(self, chosen_ids: torch.Tensor, rejected_ids: torch.Tensor, chosen_attention: torch.Tensor,
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
        lora_off = self.policy.disable_adapter() if self.reference is None and self.lora else nullcontext()
        with torch.no_grad(), lora_off:
            return self._scores(self.reference or self.policy, ids, attention, mask)

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
