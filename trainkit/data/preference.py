"""Preference pairs in TRL's layouts, as recipes/dpo.py and recipes/reward.py read them; the losses that learn
from them are trainkit/losses/dpo.py's.

Data, in TRL's layouts (https://huggingface.co/docs/trl/dataset_formats), one pair per record:

    standard         {"prompt": "...", "chosen": "...", "rejected": "..."}: the completions follow the prompt's text
                     and end with the tokenizer's EOS (added where a completion lacks it), as TRL's DPOTrainer does
    conversational   {"prompt": [messages], "chosen": [messages], "rejected": [messages]}: the prompt rendered by the
                     chat template with the assistant's turn opened, each completion exactly what the template adds
                     for the assistant turn (nothing appended)
    implicit prompt  {"chosen": ..., "rejected": ...}, strings or lists of messages: the prompt is what both begin
                     with (TRL's rule: a string's completions start at the space before their first difference)

A completion starts where the tokenised prompt and prompt + completion part (TRL's rule: a template or a merge
across the boundary can make the two differ at the prompt's end). A pair is two rows of seq_len tokens, chosen and
rejected, with a mask of the completion's tokens; prompt + completion keeps its first seq_len tokens (the completion's
end is what is cut). A pair whose prompt fills seq_len, or whose two answers are the same, teaches nothing: it is
left out and counted (_pairs).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainkit.data import sft, text
from trainkit.errors import ConfigError, Problem
from trainkit.models.finetune import FineTuneConfig, tokenizer_of

# One line of a pairs file, as the fixes show it
PAIR_RECORD = '{"prompt": "...", "chosen": "...", "rejected": "..."}'
# Why a pair is left out of training (encode_pair), in words
LEFT_OUT = {"prompt": "whose prompt fills --seq_len (pass a larger --seq_len)",
            "same": "whose chosen answer equals its rejected one (nothing to prefer)"}
# A pair as the model reads it (encode_pair)
PAIR_COLUMNS = ("chosen_ids", "rejected_ids", "chosen_attention", "rejected_attention", "chosen_mask", "rejected_mask")


@dataclass(kw_only=True, slots=True)
class PairsConfig(FineTuneConfig):
    """The settings of a recipe that trains on preference pairs (recipes/dpo.py, recipes/reward.py): the model's
    (trainkit/models/finetune.py) and the pairs'."""

    # --data and --eval_data hold pairs in TRL's layouts (above)
    seq_len: int = 256  # prompt + completion
    eval_every: int = 20
    preview: int = 0  # which pair --dry_run shows as the model reads it (from 0)
    may_change_on_resume = FineTuneConfig.may_change_on_resume | {"preview"}

    def check(self) -> list[Problem]:
        problems = FineTuneConfig.check(self)
        if not self.data:
            return [*problems, Problem("no preference pairs to train on", "config field data",
                                       "pass --data with .jsonl files of prompt/chosen/rejected records")]
        files = [(data, flag) for data, flag in ((self.data, "--data"), (self.eval_data, "--eval_data")) if data]
        return problems + text.records_problems(files, PAIR_RECORD, check_records)


def preview(cfg: PairsConfig, cache_dir: Path) -> str:
    """--dry_run's view of the pairs, encoded as the run encodes them (so a file with nothing to learn is refused
    here, and the pairs left out are counted): pair --preview (from 0) as the model reads it, each completion's
    learned tokens between [[ and ]]."""
    pairs = _pairs(cfg, cfg.data, cache_dir).with_format(None)
    if cfg.preview >= len(pairs):
        raise ConfigError([Problem(f"--preview {cfg.preview}: {cfg.data} holds {len(pairs)} pairs to train on",
                                   "--preview", f"pass a number from 0 to {len(pairs) - 1}")])
    pair, tokenizer = pairs[cfg.preview], tokenizer_of(cfg)
    shown = []
    for side in ("chosen", "rejected"):
        real = sum(pair[f"{side}_attention"])
        ids, mask = pair[f"{side}_ids"][:real], pair[f"{side}_mask"][:real]
        shown.append(f"{side} ({sum(mask)} of {real} tokens learned): "
                     + sft.preview(ids, [t if m else sft.IGNORE for t, m in zip(ids, mask, strict=True)], tokenizer))
    return f"pair {cfg.preview} of {len(pairs)} as the model reads it, between [[ and ]] what is compared:\n" + \
        "\n".join(shown)


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
    """The pairs of `data` encoded (PAIR_COLUMNS); those with nothing to learn (LEFT_OUT) counted and said, and all of
    them left out refused; a record that is not a pair, or of another layout than the first, refused naming it."""
    flag = cfg.flag_of(data)
    records = text.load_records(data, cfg.data_config, None, cache_dir, split, flag, PAIR_RECORD)
    tokenizer = tokenizer_of(cfg)
    template, pad = sft.chat_template(tokenizer, cfg.chat_template), sft.pad_id(tokenizer)
    first = layout(records[0]) if len(records) else None

    def encode(batch, indices):
        listed = text.listed_records(batch, indices, lambda record: record_problem(record, first), data, flag,
                                     f"mend that record: a pair is {PAIR_RECORD}, strings or lists of chat messages, "
                                     "in one layout per file")
        if template is None and any(isinstance(record["chosen"], list) for record in listed):
            raise ConfigError([Problem("the tokenizer has no chat template to render conversational pairs with",
                                       "--chat_template", f"pass --chat_template {' or '.join(sft.TEMPLATES)}")])
        made = [encode_pair(record, tokenizer, template, cfg.seq_len, pad) for record in listed]
        return {**{key: [pair[key] if isinstance(pair, dict) else [] for pair in made] for key in PAIR_COLUMNS},
                "left_out": ["" if isinstance(pair, dict) else pair for pair in made], "record": indices}

    encoded = records.map(encode, batched=True, with_indices=True, remove_columns=records.column_names)
    left_out = Counter(encoded["left_out"])
    kept = len(records) - sum(n for why, n in left_out.items() if why)
    if kept == 0:
        raise ConfigError([Problem(f"none of the {len(records)} pairs of {data} has anything to learn: "
                                   + "; ".join(f"{n} {LEFT_OUT[why]}" for why, n in left_out.items()),
                                   f"{flag} {data}", "pass a larger --seq_len, or pairs whose answers differ")])
    if kept < len(records) and int(os.environ.get("RANK", "0")) == 0:
        said = [f"{n} {LEFT_OUT[why]}, the first record {encoded['record'][encoded['left_out'].index(why)] + 1}"
                for why, n in sorted(left_out.items()) if why]
        print(f"note: {len(records) - kept} of the {len(records)} pairs of {data} are left out: {'; '.join(said)}",
              file=sys.stderr, flush=True)
    pairs = encoded.filter(lambda why: not why, input_columns="left_out") if kept < len(records) else encoded
    return pairs.remove_columns(["left_out", "record"]).with_format("torch")


def layout(record: Mapping[str, Any]) -> str | None:
    """standard, conversational, implicit (strings or messages without a prompt: what both begin with), or None for
    another record."""
    chosen, rejected, prompt = record.get("chosen"), record.get("rejected"), record.get("prompt")
    for kind, named in ((str, "standard"), (list, "conversational")):
        if isinstance(chosen, kind) and isinstance(rejected, kind):
            return "implicit" if "prompt" not in record else named if isinstance(prompt, kind) else None
    return None


def split_pair(record: Mapping[str, Any]) -> dict[str, Any]:
    """prompt, chosen and rejected of a pair of any layout: an implicit prompt is what both completions begin with,
    a string's cut back to the space before their first difference (TRL's extract_prompt), so that each completion
    starts with it as in the standard layout."""
    if layout(record) != "implicit":
        return {key: record[key] for key in ("prompt", "chosen", "rejected")}
    chosen, rejected = record["chosen"], record["rejected"]
    shared = _common_prefix(chosen, rejected)
    if isinstance(chosen, str) and 0 < shared < min(len(chosen), len(rejected)) and chosen[shared - 1] == " ":
        shared -= 1
    return {"prompt": chosen[:shared], "chosen": chosen[shared:], "rejected": rejected[shared:]}


def _answer_problem(side: str, completion: Any) -> str | None:
    """What is wrong with one completion of a pair, in words, or None."""
    if isinstance(completion, str):
        return None if completion.strip() else f"has an empty {side} answer"
    if not completion or not any(str(m.get("content", "")).strip() for m in completion if isinstance(m, Mapping)):
        return f"has an empty {side} answer"
    roles = [m.get("role") if isinstance(m, Mapping) else type(m).__name__ for m in completion]
    if any(role != "assistant" for role in roles):
        return (f"has a {side} answer in the {next(r for r in roles if r != 'assistant')!r} role: a completion is "
                "the assistant's turn (the prompt holds the user's)")
    return None


def record_problem(record: Any, first: str | None = None) -> str | None:
    """What keeps a record from being a pair, in words, or None; `first`: the layout of the file's first record,
    which every record shares."""
    if not isinstance(record, Mapping):
        return f"is not an object ({type(record).__name__})"
    missing = [key for key in ("chosen", "rejected") if key not in record]
    if missing:
        return f"has no {' and no '.join(missing)} field (a pair is prompt, chosen and rejected)"
    kind = layout(record)
    if kind is None:
        return ("is neither a standard pair (prompt, chosen and rejected as strings) nor a conversational one (lists "
                "of messages)")
    if first is not None and kind != first:
        return f"is a {kind} pair while the first record is a {first} one"
    parts = split_pair(record)
    return next((why for side in ("chosen", "rejected") if (why := _answer_problem(side, parts[side]))), None)


def check_records(path: Path, flag: str, limit: int | None = None) -> Problem | None:
    """The first record of a local JSON-lines file (its first `limit` bytes; None: all of it) that is not a pair, or
    not of the first record's layout, named by file and line; or, where every pair read has the same chosen and
    rejected answer, that (nothing could be learned from the file)."""
    first, same, read = None, 0, 0
    for number, record in sft.json_records(path, limit):
        if what := record_problem(record, first):
            return Problem(f"{path}:{number} {what}", f"{flag} {path}",
                           f"mend that record: a pair is {PAIR_RECORD}, strings or lists of chat messages, in one "
                           "layout per file")
        first = first or layout(record)
        parts = split_pair(record)
        same, read = same + (parts["chosen"] == parts["rejected"]), read + 1
    if read and same == read:
        return Problem(f"every pair of {path} has the same chosen and rejected answer: nothing to prefer",
                       f"{flag} {path}", "pass pairs whose chosen answer differs from the rejected one")
    return None


def _common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def encode_pair(record: Mapping[str, Any], tokenizer: Any, template: str | None, seq_len: int,
                pad: int) -> dict[str, list[int]] | str:
    """A pair as the model reads it: chosen_ids, rejected_ids (each seq_len tokens, padded with `pad`), their
    attention masks (chosen_attention, rejected_attention) and completion masks (chosen_mask, rejected_mask); or, for
    a pair with nothing to learn, why (a key of LEFT_OUT)."""
    turns = split_pair(record)
    if turns["chosen"] == turns["rejected"]:
        return "same"
    if isinstance(turns["chosen"], str):
        eos = tokenizer.eos_token
        prompt = tokenizer(turns["prompt"])["input_ids"]
        full = {side: tokenizer(turns["prompt"] + text + ("" if text.endswith(eos) else eos))["input_ids"]
                for side in ("chosen", "rejected") for text in [turns[side]]}
    else:
        def ids(messages: list, opened: bool) -> list[int]:
            text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=opened)
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        prompt = ids(turns["prompt"], True)
        full = {side: ids(turns["prompt"] + turns[side], False) for side in ("chosen", "rejected")}
    start = min(_common_prefix(prompt, full["chosen"]), _common_prefix(prompt, full["rejected"]))
    if start >= seq_len:
        return "prompt"
    pair: dict[str, list[int]] = {}
    for side, tokens in full.items():
        tokens = tokens[:seq_len]
        real = len(tokens)
        pair[f"{side}_ids"] = tokens + [pad] * (seq_len - real)
        pair[f"{side}_attention"] = [1] * real + [0] * (seq_len - real)
        pair[f"{side}_mask"] = [int(start <= i < real) for i in range(seq_len)]
    return pair
