"""Train a reward model: a pretrained transformer that scores the chosen answer of a pair above the rejected one.

The model is AutoModelForSequenceClassification with one output: a scoring head on the pretrained transformer.

Trains: the model that --model_name_or_path names (its new head initialised by transformers), on the same pairs as
recipes/dpo.py (TRL's layouts: trainkit/data/preference.py), each answer scored after its prompt. The loss is the
Bradley-Terry model's (Bradley and Terry 1952; Ouyang et al. 2022, eq. 1): -log sigmoid(r_chosen - r_rejected), the
mean over the pairs of the global batch. Reports TRL's RewardTrainer metrics: accuracy (the share of pairs scored the
right way round), margin (r_chosen - r_rejected) and mean_reward, on the held-out pairs as eval_<name>.
Output: final/ loads with AutoModelForSequenceClassification.from_pretrained (under LoRA the adapters merged, and
alone in final/adapter/); docs/recipes.md shows how to score answers with it.

A score is the head's output at the sequence's last token that is not padding (transformers' own pooling, which
finds it from the pad token: a tokenizer without one pads with its end-of-text token, so an answer that ends with it is
scored at the token before, in training and in use alike).

    python train.py --recipe reward --model_name_or_path runs/sft/final --data pairs.jsonl --lora_r 16
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from trainkit.data import preference, sft
from trainkit.data.preference import PairsConfig
from trainkit.losses import router
from trainkit.models import finetune
from trainkit.models.finetune import tokenizer_of


@dataclass(kw_only=True, slots=True)
class Config(PairsConfig):  # settings: trainkit/models/finetune.py (model), trainkit/data/preference.py (pairs)
    lr: float = 1e-5


def build_model(cfg: Config) -> nn.Module:
    from transformers import AutoModelForSequenceClassification

    model = finetune.build(cfg, AutoModelForSequenceClassification, lora_task="SEQ_CLS", num_labels=1)
    # the pooling finds each sequence's last token from the pad token, which the rows are padded with
    model.config.pad_token_id = sft.pad_id(tokenizer_of(cfg))
    return model


def build_datasets(cfg: Config, cache_dir: Path):
    """(train, held-out) pairs, as recipes/dpo.py reads them (the completion masks unused)."""
    return preference.pair_datasets(cfg, cache_dir)


def loss(model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bradley-Terry's loss, the mean over the micro-batch's pairs, and the metrics' sums over them. A mixture of
    experts whose config asks for its router logits adds its balancing loss, each answer's weighing alike, as the
    dpo recipe does (trainkit/losses/router.py): transformers' sequence classifier drops the router logits from its
    output, so they are caught from its routers."""
    ids = torch.cat([batch["chosen_ids"], batch["rejected_ids"]])
    attention = torch.cat([batch["chosen_attention"], batch["rejected_attention"]])
    with router.caught(model) as router_logits:
        chosen, rejected = model(input_ids=ids, attention_mask=attention, use_cache=False).logits.squeeze(-1).chunk(2)
    margin = chosen - rejected
    reported = {"accuracy": (margin > 0).float().sum(), "margin": margin.detach().sum(),
                "mean_reward": ((chosen + rejected) / 2).detach().sum()}
    if not router_logits:  # not a mixture of experts that balances its router
        return -F.logsigmoid(margin).mean(), reported
    objective, balance = router.balanced(model, -F.logsigmoid(margin).mean(), tuple(router_logits), attention,
                                         torch.ones(len(ids)))
    return objective, {**reported, **balance}


tokens_per_sample = preference.tokens_per_pair
preview = preference.preview  # --dry_run: a pair as the model reads it, the pairs left out counted


def export(model: nn.Module, state_dict: dict, cfg: Config, cache_dir: Path, out_dir: Path) -> None:
    """final/ as AutoModelForSequenceClassification.from_pretrained loads it (trainkit/models/finetune.py)."""
    from transformers import AutoModelForSequenceClassification

    finetune.export(model, state_dict, cfg, out_dir, AutoModelForSequenceClassification)
