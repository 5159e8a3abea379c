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

Unpaired feedback (a thumbs-up or down per answer, for --loss_type kto), TRL's unpaired layout, one answer per record:

    unpaired         {"prompt": ..., "completion": ..., "label": true}: prompt and completion strings, or lists of
                     chat messages; label true for a desirable answer, false for an undesirable one

An answer's KL row (its prompt with another answer's completion, whose log-ratio estimates KTO's reference point) is
made where the global batch is known, as TRL makes it within its batch: trainkit/losses/dpo.py's kl_rows. Data whose
answers are all desirable, or all undesirable, is said when it is read.

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
# One line of an unpaired file, and an answer as the model reads it (encode_unpaired): its row and its label
UNPAIRED_RECORD = '{"prompt": "...", "completion": "...", "label": true}'
UNPAIRED_COLUMNS = ("completion_ids", "completion_attention", "completion_mask", "label")


@dataclass(kw_only=True, slots=True)
class PairsConfig(FineTuneConfig):
    """The settings of a recipe that trains on preference pairs (recipes/dpo.py, recipes/reward.py): the model's
    (trainkit/models/finetune.py) and the pairs'."""

    # --data and --eval_data hold pairs in TRL's layouts (above)
    seq_len: int = 256  # prompt + completion
    eval_every: int = 20
    preview: int = 0  # which pair --dry_run shows as the model reads it (from 0)
    may_change_on_resume = FineTuneConfig.may_change_on_resume | {"preview"}

    def unpaired(self) -> bool:
        """Whether the data are unpaired answers with a label (dpo's --loss_type kto) rather than pairs."""
        return False

    def check(self) -> list[Problem]:
        problems = FineTuneConfig.check(self)
        record = UNPAIRED_RECORD if self.unpaired() else PAIR_RECORD
        if not self.data:
            return [*problems, Problem("no preference data to train on", "config field data",
                                       f"pass --data with .jsonl files of {record} records")]
        files = [(data, flag) for data, flag in ((self.data, "--data"), (self.eval_data, "--eval_data")) if data]
        return problems + text.records_problems(
            files, record, lambda path, flag, limit: check_records(path, flag, limit, self.unpaired()))


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
    """A pair's tokens, for tokens/s and MFU: its chosen and its rejected row (an unpaired answer: its row and its KL
    row)."""
    return 2 * cfg.seq_len


def pair_datasets(cfg: PairsConfig, cache_dir: Path):
    """(train, held-out) pairs as tensors (PAIR_COLUMNS): --eval_data's pairs held out, or eval_fraction of --data's
    drawn from the seed."""
    if cfg.eval_data:
        return _pairs(cfg, cfg.data, cache_dir), _pairs(cfg, cfg.eval_data, cache_dir, cfg.eval_split)
    return text.drawn_held_out(_pairs(cfg, cfg.data, cache_dir), cfg.eval_fraction, cfg.seed, cfg.data,
                               "pairs with a completion within --seq_len")


def _pairs(cfg: PairsConfig, data: str, cache_dir: Path, split: str = "train"):
    """The pairs of `data` encoded (PAIR_COLUMNS; unpaired answers: UNPAIRED_COLUMNS); those with nothing to learn
    (LEFT_OUT) counted and said, and all of them left out refused; a record that is not a pair (an answer), or of
    another layout than the first, refused naming it."""
    flag, unpaired = cfg.flag_of(data), cfg.unpaired()
    records = text.load_records(data, cfg.data_config, None, cache_dir, split, flag,
                                UNPAIRED_RECORD if unpaired else PAIR_RECORD)
    tokenizer = tokenizer_of(cfg)
    template, pad = sft.chat_template(tokenizer, cfg.chat_template), sft.pad_id(tokenizer)
    first = layout(records[0]) if len(records) else None
    columns = UNPAIRED_COLUMNS if unpaired else PAIR_COLUMNS

    def encode(batch, indices):
        listed = text.listed_records(batch, indices, lambda record: record_problem(record, first, unpaired), data,
                                     flag, mend(unpaired))
        if template is None and any(isinstance(record.get("prompt"), list) for record in listed):
            raise ConfigError([Problem("the tokenizer has no chat template to render conversational records with",
                                       "--chat_template", f"pass --chat_template {' or '.join(sft.TEMPLATES)}")])
        made = [encode_unpaired(record, tokenizer, template, cfg.seq_len, pad) if unpaired else
                encode_pair(record, tokenizer, template, cfg.seq_len, pad) for record in listed]
        return {**{key: [pair[key] if isinstance(pair, dict) else [] for pair in made] for key in columns},
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
    if unpaired and int(os.environ.get("RANK", "0")) == 0 and len(set(pairs["label"])) == 1:
        kind = ("desirable", "undesirable") if pairs["label"][0] else ("undesirable", "desirable")
        print(f"note: every answer of {data} is {kind[0]} (no {kind[1]} one): KTO learns from them alone, and the "
              f"metrics of {kind[1]} answers are left out", file=sys.stderr, flush=True)
    return pairs.remove_columns(["left_out", "record"]).with_format("torch")


def layout(record: Mapping[str, Any]) -> str | None:
    """standard, conversational, implicit (strings or messages without a prompt: what both begin with), unpaired
    (prompt, completion and label), or None for another record."""
    chosen, rejected, prompt = record.get("chosen"), record.get("rejected"), record.get("prompt")
    if "completion" in record and "label" in record:
        same_kind = any(isinstance(prompt, kind) and isinstance(record["completion"], kind) for kind in (str, list))
        return "unpaired" if same_kind else None
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


def record_problem(record: Any, first: str | None = None, unpaired: bool = False) -> str | None:
    """What keeps a record from being a pair (unpaired: an answer with a label), in words, or None; `first`: the
    layout of the file's first record, which every record shares."""
    if not isinstance(record, Mapping):
        return f"is not an object ({type(record).__name__})"
    if unpaired and "chosen" in record:
        return f"is a pair (prompt, chosen, rejected): --loss_type kto trains on unpaired answers, {UNPAIRED_RECORD}"
    if not unpaired and "completion" in record:
        return "is an unpaired answer (prompt, completion, label): --loss_type kto trains on those"
    if unpaired:
        missing = [key for key in ("prompt", "completion", "label") if key not in record]
        if missing:
            return f"has no {' and no '.join(missing)} field (an answer is prompt, completion and label)"
        if not isinstance(record["label"], bool):
            return f"has label {record['label']!r}: true (a desirable answer) or false (an undesirable one)"
        if layout(record) is None:
            return "has a prompt and a completion of different kinds: both strings, or both lists of messages"
        return _answer_problem("completion", record["completion"])
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


def mend(unpaired: bool) -> str:
    """The fix for a record that is not a pair (unpaired: an answer with a label)."""
    return (f"mend that record: {'an answer' if unpaired else 'a pair'} is "
            f"{UNPAIRED_RECORD if unpaired else PAIR_RECORD}, strings or lists of chat messages, in one layout per "
            "file")


def check_records(path: Path, flag: str, limit: int | None = None, unpaired: bool = False) -> Problem | None:
    """The first record of a local JSON-lines file (its first `limit` bytes; None: all of it) that is not a pair
    (unpaired: an answer with a label), or not of the first record's layout, named by file and line; or, where every
    pair read has the same chosen and rejected answer, that (nothing could be learned from the file)."""
    first, same, read = None, 0, 0
    for number, record in sft.json_records(path, limit):
        if what := record_problem(record, first, unpaired):
            return Problem(f"{path}:{number} {what}", f"{flag} {path}", mend(unpaired))
        first = first or layout(record)
        if unpaired:
            continue
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
    return _completions(turns["prompt"], {side: turns[side] for side in ("chosen", "rejected")}, tokenizer, template,
                        seq_len, pad)


def encode_unpaired(record: Mapping[str, Any], tokenizer: Any, template: str | None, seq_len: int,
                    pad: int) -> dict[str, Any] | str:
    """An unpaired answer as the model reads it: completion_ids, its attention and completion masks, and its label
    (1 desirable, 0 not); or, for an answer whose prompt fills seq_len, why (a key of LEFT_OUT)."""
    encoded = _completions(record["prompt"], {"completion": record["completion"]}, tokenizer, template, seq_len, pad)
    return encoded if isinstance(encoded, str) else {**encoded, "label": int(record["label"])}


def _completions(prompt_turns: Any, completions: dict[str, Any], tokenizer: Any, template: str | None, seq_len: int,
                 pad: int) -> dict[str, list[int]] | str:
    """Each completion after the prompt (strings: EOS appended where one lacks it; messages: rendered by the
    template) as <name>_ids, <name>_attention and <name>_mask (its tokens), seq_len long; "prompt" where the prompt
    fills seq_len."""
    if isinstance(prompt_turns, str):
        eos = tokenizer.eos_token
        prompt = tokenizer(prompt_turns)["input_ids"]
        full = {name: tokenizer(prompt_turns + text + ("" if text.endswith(eos) else eos))["input_ids"]
                for name, text in completions.items()}
    else:
        def ids(messages: list, opened: bool) -> list[int]:
            text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=opened)
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        prompt = ids(prompt_turns, True)
        full = {name: ids(prompt_turns + messages, False) for name, messages in completions.items()}
    start = min(_common_prefix(prompt, tokens) for tokens in full.values())
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
