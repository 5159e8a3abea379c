"""Preference pairs and the losses that learn from them (recipes/dpo.py, recipes/reward.py).

Data, in TRL's layouts (https://huggingface.co/docs/trl/dataset_formats), one pair per record:

    standard         {"prompt": "...", "chosen": "...", "rejected": "..."}: the completions follow the prompt's text
                     and end with the tokenizer's EOS (added where a completion lacks it), as TRL's DPOTrainer does
    conversational   {"prompt": [messages], "chosen": [messages], "rejected": [messages]}: the prompt rendered by the
                     chat template with the assistant's turn opened, each completion exactly what the template adds
                     for the assistant turn (nothing appended)
    implicit prompt  {"chosen": [messages], "rejected": [messages]}: the prompt is the messages both begin with

A completion starts where the tokenised prompt and prompt + completion part (TRL's rule: a template or a merge
across the boundary can make the two differ at the prompt's end). A pair is two rows of seq_len tokens, chosen and
rejected, with a mask of the completion's tokens; prompt + completion keeps its first seq_len tokens (the completion's
end is what is cut), and a pair whose prompt fills seq_len is dropped (nothing of it could be learned).

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
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from trainkit import sft, text
from trainkit.errors import ConfigError, Problem
from trainkit.finetune import FineTuneConfig, tokenizer_of

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")  # losses that need no reference model
# A pair as the model reads it (encode_pair)
PAIR_COLUMNS = ("chosen_ids", "rejected_ids", "chosen_attention", "rejected_attention", "chosen_mask", "rejected_mask")
# TRL's metric names, as metrics.jsonl, TensorBoard and the plots carry them (eval_ prefixed at evaluation)
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@dataclass(kw_only=True, slots=True)
class PairsConfig(FineTuneConfig):
    """The settings of a recipe that trains on preference pairs (recipes/dpo.py, recipes/reward.py): the model's
    (trainkit/finetune.py) and the pairs'."""

    # --data and --eval_data hold pairs in TRL's layouts (above)
    seq_len: int = 256  # prompt + completion
    eval_every: int = 20

    def check(self) -> list[Problem]:
        problems = FineTuneConfig.check(self)
        if not self.data:
            return [*problems, Problem("no preference pairs to train on", "config field data",
                                       "pass --data with .jsonl files of prompt/chosen/rejected records")]
        problems += [problem for data, flag in ((self.data, "--data"), (self.eval_data, "--eval_data")) if data
                     for path in text.local_files(data) or [] if path.suffix in (".jsonl", ".json")
                     and path.is_file() and (problem := check_records(path, flag, text.CHECKED_BYTES))]
        return problems + text.check_data(self.data, None)


def tokens_per_pair(cfg: PairsConfig) -> int:
    """A pair's tokens, for tokens/s and MFU: its chosen and its rejected row."""
    return 2 * cfg.seq_len


def pair_datasets(cfg: PairsConfig, cache_dir: Path):
    """(train, held-out) pairs as tensors (PAIR_COLUMNS): --eval_data's pairs held out, or eval_fraction of --data's
    drawn from the seed."""
    if cfg.eval_data:
        return _pairs(cfg, cfg.data, cache_dir), _pairs(cfg, cfg.eval_data, cache_dir, cfg.eval_split)
    return text.drawn_held_out(_pairs(cfg, cfg.data, cache_dir), cfg.eval_fraction, cfg.seed, cfg.data,
                               "pairs with a completion within --seq_len")


def _pairs(cfg: PairsConfig, data: str, cache_dir: Path, split: str = "train"):
    flag = cfg.flag_of(data)
    records = text.load_records(data, cfg.data_config, None, cache_dir, split, flag)
    tokenizer = tokenizer_of(cfg)
    template, pad = sft.chat_template(tokenizer, cfg.chat_template), sft.pad_id(tokenizer)

    def encode(batch):
        listed = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
        if bad := next((why for record in listed if (why := record_problem(record))), None):  # a Hub dataset's
            raise ConfigError([Problem(f"a record of {data} {bad}", f"{flag} {data}", "mend the data")])
        if template is None and any(layout(record) != "standard" for record in listed):
            raise ConfigError([Problem("the tokenizer has no chat template to render conversational pairs with",
                                       "--chat_template", f"pass --chat_template {' or '.join(sft.TEMPLATES)}")])
        made = [pair for record in listed
                if (pair := encode_pair(record, tokenizer, template, cfg.seq_len, pad)) is not None]
        return {key: [pair[key] for pair in made] for key in PAIR_COLUMNS}

    pairs = records.map(encode, batched=True, remove_columns=records.column_names)
    if len(pairs) == 0:
        raise ConfigError([Problem(f"every prompt of {data} fills --seq_len {cfg.seq_len}: no completion token is "
                                   "left to compare", "--seq_len", "pass a larger --seq_len")])
    return pairs.with_format("torch")


def layout(record: Mapping[str, Any]) -> str | None:
    """standard, conversational or implicit (a conversational pair without a prompt), or None for another record."""
    if not all(isinstance(record.get(key), (str, list)) for key in ("chosen", "rejected")):
        return None
    if isinstance(record["chosen"], str):
        return "standard" if isinstance(record.get("prompt"), str) and isinstance(record["rejected"], str) else None
    if not isinstance(record["rejected"], list):
        return None
    return "conversational" if isinstance(record.get("prompt"), list) else "implicit" if "prompt" not in record \
        else None


def record_problem(record: Any) -> str | None:
    """What keeps a record from being a pair, in words, or None."""
    if not isinstance(record, Mapping):
        return f"is not an object ({type(record).__name__})"
    missing = [key for key in ("chosen", "rejected") if key not in record]
    if missing:
        return f"has no {' and no '.join(missing)} field (a pair is prompt, chosen and rejected)"
    if layout(record) is None:
        return ("is neither a standard pair (prompt, chosen and rejected as strings) nor a conversational one (lists "
                "of messages)")
    return None


def check_records(path: Path, flag: str, limit: int | None = None) -> Problem | None:
    """The first record of a local JSON-lines file (its first `limit` bytes; None: all of it) that is not a pair,
    named by file and line."""
    for number, record in sft.json_records(path, limit):
        if what := record_problem(record):
            return Problem(f"{path}:{number} {what}", f"{flag} {path}",
                           "mend that record: {\"prompt\": ..., \"chosen\": ..., \"rejected\": ...}, strings or lists "
                           "of chat messages")
    return None


def _common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def encode_pair(record: Mapping[str, Any], tokenizer: Any, template: str | None, seq_len: int,
                pad: int) -> dict[str, list[int]] | None:
    """A pair as the model reads it: chosen_ids, rejected_ids (each seq_len tokens, padded with `pad`), their
    attention masks (chosen_attention, rejected_attention) and completion masks (chosen_mask, rejected_mask); None for
    a pair whose prompt leaves no completion token within seq_len."""
    kind = layout(record)
    if kind == "standard":
        eos = tokenizer.eos_token
        prompt = tokenizer(record["prompt"])["input_ids"]
        full = {side: tokenizer(record["prompt"] + text + ("" if text.endswith(eos) else eos))["input_ids"]
                for side in ("chosen", "rejected") for text in [record[side]]}
    else:
        if kind == "implicit":
            shared = _common_prefix(record["chosen"], record["rejected"])
            turns = {"prompt": record["chosen"][:shared], "chosen": record["chosen"][shared:],
                     "rejected": record["rejected"][shared:]}
        else:
            turns = {key: record[key] for key in ("prompt", "chosen", "rejected")}

        def ids(messages: list, opened: bool) -> list[int]:
            text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=opened)
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        prompt = ids(turns["prompt"], True)
        full = {side: ids(turns["prompt"] + turns[side], False) for side in ("chosen", "rejected")}
    start = min(_common_prefix(prompt, full["chosen"]), _common_prefix(prompt, full["rejected"]))
    if start >= seq_len:
        return None
    pair: dict[str, list[int]] = {}
    for side, tokens in full.items():
        tokens = tokens[:seq_len]
        real = len(tokens)
        pair[f"{side}_ids"] = tokens + [pad] * (seq_len - real)
        pair[f"{side}_attention"] = [1] * real + [0] * (seq_len - real)
        pair[f"{side}_mask"] = [int(start <= i < real) for i in range(seq_len)]
    return pair


def sequence_logps(token_losses: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the summed log-probability of each row's masked tokens, their count), from the loss of predicting each token
    from the one before (trainkit/chunked_loss.py's next_token_losses: -log softmax, in fp32)."""
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


def problems(loss_type: str, beta: float, label_smoothing: float) -> list[Problem]:
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
