"""Prompts for online RL (recipes/grpo.py), in TRL's layouts: `prompt` a string (the model continues it as it is),
or a list of chat messages (rendered with the tokenizer's chat template, the assistant's turn opened). Every other
field of a record is passed to the reward functions by name (trainkit/rl/rewards.py).

A training sample is one completion slot: prompt p's generation j, the global batch `G` slots of each of its prompts
side by side (Slots: the data order permutes whole groups, trainkit/data/batches.py), so that the advantages of a
prompt's completions are computed from the same global batch on any number of processes. Streamed (--streaming, or a
mixture of sources with weights), a global batch of B slots reads B / G prompts, one per lane of
trainkit/data/stream.py, and each fills its G positions (Streamed.grouped): the same prompts on any number of
processes, read as the run trains.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from trainkit.data import sft, stream_sources, text
from trainkit.data.stream import Streamed
from trainkit.data.stream_sources import BadRecord
from trainkit.errors import ConfigError, Problem
from trainkit.models.finetune import FineTuneConfig, tokenizer_of

PROMPT_RECORD = '{"prompt": "...", "answer": "..."}'  # a prompt, and what the reward functions read beside it


@dataclass(kw_only=True, slots=True)
class PromptsConfig(FineTuneConfig):
    """The settings of prompts and their completions (recipes/grpo.py)."""

    seq_len: int = 256  # prompt + completion
    max_completion_length: int = 64  # tokens generated per completion, at most (its end token included)
    num_generations: int = 8  # completions per prompt: the global batch counts completions
    preview: int = 0  # which prompt --dry_run shows as the model reads it (from 0)
    # auto | true | false: read the prompts as the run trains (trainkit/data/stream.py), as the causal_lm recipe reads
    # its data; auto streams mixtures (`a.jsonl:0.7,b.jsonl:0.3`) and local files past 1 GiB. bad_lines: a streamed
    # record that cannot be read stops the run, or skip
    streaming: str = "auto"
    bad_lines: str = "stop"
    may_change_on_resume = FineTuneConfig.may_change_on_resume | {"preview"}

    def check(self) -> list[Problem]:
        problems = FineTuneConfig.check(self) + text.check_streaming(self.data, "prompt", self.streaming,
                                                                    self.bad_lines)
        if not 0 < self.max_completion_length < self.seq_len:
            problems.append(Problem(f"max_completion_length must be between 1 and seq_len - 1 (--seq_len counts the "
                                    f"prompt and its completion), got {self.max_completion_length} with seq_len "
                                    f"{self.seq_len}", "--max_completion_length",
                                    f"pass --max_completion_length below {self.seq_len}, or a larger --seq_len"))
        if not self.data:
            return [*problems, Problem("no prompts to train on", "config field data",
                                       f"pass --data with .jsonl files of records like {PROMPT_RECORD}")]
        if text.streams(self.data, self.streaming):  # each source's first record here, the rest as the run reads them
            try:
                problems += stream_sources.check_first_records(
                    stream_sources.parse_data(self.data, "prompt", self.data_config), ("prompt",))
            except ConfigError as e:
                problems += e.problems
        files = [(data, flag) for data, flag in ((self.data, "--data"), (self.eval_data, "--eval_data"))
                 if data and not (flag == "--data" and text.streams(data, self.streaming))]
        return problems + text.records_problems(files, PROMPT_RECORD, check_records)

    @property
    def prompt_length(self) -> int:
        """The longest prompt: what seq_len leaves beside a whole completion."""
        return self.seq_len - self.max_completion_length


def record_problem(record: Any, first: str | None = None) -> str | None:
    """What keeps a record from being a prompt, in words, or None; `first`: the layout of the file's first one."""
    if not isinstance(record, Mapping):
        return f"is not an object ({type(record).__name__})"
    if "prompt" not in record:
        return "has no prompt field"
    kind = layout(record)
    if kind is None:
        return "has a prompt that is neither a string nor a list of chat messages"
    if first is not None and kind != first:
        return f"is a {kind} prompt while the first record is a {first} one"
    if kind == "standard" and not record["prompt"].strip():
        return "has an empty prompt"
    return None


def layout(record: Mapping[str, Any]) -> str | None:
    prompt = record.get("prompt")
    if isinstance(prompt, str):
        return "standard"
    if isinstance(prompt, list) and prompt and all(isinstance(m, Mapping) and "role" in m for m in prompt):
        return "conversational"
    return None


def check_records(path: Path, flag: str, limit: int | None = None) -> Problem | None:
    """The first record of a local JSON-lines file that is not a prompt, or not of the first one's layout."""
    first = None
    for number, record in sft.json_records(path, limit):
        if what := record_problem(record, first):
            return Problem(f"record {number} of {path} {what}", f"{flag} {path}",
                           f"mend that record: a prompt is {PROMPT_RECORD}, its prompt a string or a list of chat "
                           "messages, one layout per file")
        first = first or layout(record)
    return None


def encode_prompt(prompt: Any, tokenizer: Any, template: str | None) -> list[int]:
    """A prompt's tokens as the model reads them (TRL's: no special tokens added beside the template's own)."""
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    rendered = tokenizer.apply_chat_template(prompt, chat_template=template, tokenize=False, add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def prompt_datasets(cfg: PromptsConfig, cache_dir: Path) -> tuple[Any, Any]:
    """(train, held-out) prompts, encoded: --eval_data's held out, or eval_fraction of --data's drawn from the
    seed; streamed, the train split is a Streamed whose rows are prompts (PromptRows) and the held-out one its
    sources' last pieces (or --eval_data)."""
    if text.streams(cfg.data, cfg.streaming):
        streamed = _streamed(cfg, cache_dir)
        return streamed, _prompts(cfg, cfg.eval_data, cache_dir, cfg.eval_split) if cfg.eval_data else \
            streamed.held_out()
    if cfg.eval_data:
        return _prompts(cfg, cfg.data, cache_dir), _prompts(cfg, cfg.eval_data, cache_dir, cfg.eval_split)
    return text.drawn_held_out(_prompts(cfg, cfg.data, cache_dir), cfg.eval_fraction, cfg.seed, cfg.data,
                               "prompts within --seq_len - --max_completion_length tokens")


def _streamed(cfg: PromptsConfig, cache_dir: Path) -> Streamed:
    """--data read as the run trains: each source cut into pieces, its records made into prompt rows (PromptRows) of
    the first source's first record's layout."""
    streamed = Streamed.open(text.streamed_data(cfg.data, cache_dir), "prompt", cfg.data_config, cfg.eval_fraction,
                             cfg.bad_lines, ("prompt",))
    first = layout(stream_sources.first_record(streamed.sources[0])[1]) or "standard"
    tokenizer = tokenizer_of(cfg)
    template = sft.chat_template(tokenizer, cfg.chat_template)
    check_template(first, template)
    return streamed.with_rows(PromptRows(tokenizer, template, cfg.seq_len, cfg.prompt_length, first))


def check_template(kind: str | None, template: str | None) -> None:
    """Conversational prompts need a chat template to be rendered with."""
    if template is None and kind == "conversational":
        raise ConfigError([Problem("the tokenizer has no chat template to render conversational prompts with",
                                   "--chat_template", f"pass --chat_template {' or '.join(sft.TEMPLATES)}")])


def _prompts(cfg: PromptsConfig, data: str, cache_dir: Path, split: str = "train"):
    """The prompts of `data`: prompt_ids (padded to cfg.prompt_length), prompt_length, index (the record's number in
    the file, from 0) and columns (the record's fields as JSON: the prompt and what the reward functions read). A
    prompt longer than cfg.prompt_length is left out and counted; all of them left out, refused."""
    flag = cfg.flag_of(data)
    records = text.load_records(data, cfg.data_config, None, cache_dir, split, flag, PROMPT_RECORD)
    tokenizer = tokenizer_of(cfg)
    template, pad = sft.chat_template(tokenizer, cfg.chat_template), sft.pad_id(tokenizer)
    first = layout(records[0]) if len(records) else None

    def encode(batch, indices):
        listed = text.listed_records(batch, indices, lambda record: record_problem(record, first), data, flag,
                                     f"mend that record: a prompt is {PROMPT_RECORD}")
        check_template(first, template)
        ids = [encode_prompt(record["prompt"], tokenizer, template) for record in listed]
        return {"prompt_ids": [row[:cfg.prompt_length] + [pad] * (cfg.prompt_length - len(row[:cfg.prompt_length]))
                               for row in ids],
                "prompt_length": [len(row) for row in ids], "index": indices,
                "columns": [json.dumps(record) for record in listed]}

    encoded = records.map(encode, batched=True, with_indices=True, remove_columns=records.column_names)
    fits = [length <= cfg.prompt_length for length in encoded["prompt_length"]]
    if not any(fits):
        raise ConfigError([Problem(f"none of the {len(records)} prompts of {data} fits in --seq_len {cfg.seq_len} "
                                   f"beside a completion of --max_completion_length {cfg.max_completion_length} (the "
                                   f"shortest has {min(encoded['prompt_length'])} tokens)", f"{flag} {data}",
                                   "pass a larger --seq_len, or a smaller --max_completion_length")])
    if not all(fits):
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"note: {fits.count(False)} of the {len(records)} prompts of {data} are left out: longer than "
                  f"--seq_len - --max_completion_length = {cfg.prompt_length} tokens, the first record "
                  f"{fits.index(False) + 1}", file=sys.stderr, flush=True)
        encoded = encoded.select([i for i, fit in enumerate(fits) if fit])
    return encoded.with_format("torch", columns=["prompt_ids", "prompt_length", "index"], output_all_columns=True)


@dataclass(frozen=True, slots=True)
class PromptRows:
    """Streamed prompts (trainkit/data/stream.py's RowMaker): one row per record, as _prompts encodes it; a prompt
    longer than prompt_length gives none (it is passed over, as a streamed chat example with nothing to learn is),
    a record that is not a prompt of the first record's layout is a bad line (named, or skipped: --bad_lines). It
    runs in the data workers: it pickles."""

    tokenizer: Any
    template: str | None
    seq_len: int
    prompt_length: int
    layout: str

    def examples(self, records: list[dict], source: Any = None) -> list:
        made: list = []
        for record in records:
            if what := record_problem(record, self.layout):
                made.append(BadRecord(f"{what}: a prompt is {PROMPT_RECORD}"))
                continue
            ids = encode_prompt(record["prompt"], self.tokenizer, self.template)
            made.append({"prompt_ids": ids, "columns": json.dumps(record)} if len(ids) <= self.prompt_length
                        else None)
        return made

    def pack(self, examples: Any, used: int) -> Any:
        """A row per prompt (`used` 1: the prompt resumed at was given already)."""
        pad = sft.pad_id(self.tokenizer)
        for example, at in examples:
            if not used:
                ids = example["prompt_ids"]
                yield {"prompt_ids": torch.tensor(ids + [pad] * (self.prompt_length - len(ids))),
                       "prompt_length": torch.tensor(len(ids)), "columns": example["columns"]}, (at, 1)
            used = 0


class Slots(Dataset):
    """Completion slots: sample i is prompt i // group's generation i % group. `group_size` tells the data order to
    keep a prompt's slots together (trainkit/data/batches.py's epoch_order); `repeats` to train on each global batch
    that many steps in a row (--num_iterations: its completions are sampled once)."""

    def __init__(self, prompts: Any, group: int, repeats: int = 1) -> None:
        self.prompts, self.group_size, self.repeats = prompts, group, repeats

    def __len__(self) -> int:
        return len(self.prompts) * self.group_size

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {**self.prompts[i // self.group_size], "generation": torch.tensor(i % self.group_size)}


def first_prompt(cfg: PromptsConfig, cache_dir: Path) -> dict[str, Any]:
    """Prompt --preview of --data as a training row has it (prompt_ids, prompt_length, columns), and how many
    prompts there are (None streamed: --preview is then the first source's first prompt that fits)."""
    if text.streams(cfg.data, cfg.streaming):
        row = _streamed(cfg, cache_dir).first_row()  # not the held-out split, which prompt_datasets reads too
        if row is None:
            raise ConfigError([Problem(f"no prompt of {cfg.data} fits in --seq_len {cfg.seq_len} beside a completion "
                                       f"of --max_completion_length {cfg.max_completion_length}", f"--data {cfg.data}",
                                       "pass a larger --seq_len, or a smaller --max_completion_length")])
        return {**row, "count": None}
    prompts = _prompts(cfg, cfg.data, cache_dir)
    if cfg.preview >= len(prompts):
        raise ConfigError([Problem(f"--preview {cfg.preview}: {cfg.data} holds {len(prompts)} prompts to train on",
                                   "--preview", f"pass a number from 0 to {len(prompts) - 1}")])
    return {**prompts[cfg.preview], "count": len(prompts)}


def preview(cfg: PromptsConfig, row: dict[str, Any]) -> str:
    """--dry_run's view of first_prompt's row: the prompt as the model reads it, and how many prompts there are."""
    ids = row["prompt_ids"][:int(row["prompt_length"])].tolist()
    which = f"prompt {cfg.preview} of {row['count']}" if row["count"] is not None else \
        "the first prompt of the stream"
    return (f"{which} as the model reads it ({len(ids)} tokens; each gets {cfg.num_generations} completions of at "
            f"most {cfg.max_completion_length}):\n{tokenizer_of(cfg).decode(ids)}")
