"""Instruction and chat data for supervised fine-tuning: records to token ids with the loss only on the answers.

The layouts a user's file comes in (`--data_format`, or detected from the first record's fields):

    text               {"text": ...}: every token learned (the plain-text path of recipes/causal_lm.py)
    prompt_completion  {"prompt": ..., "completion": ...}: the completion and the end-of-text token learned
    messages           {"messages": [{"role": ..., "content": ...}, ...]}: rendered with the tokenizer's chat
                       template; every assistant turn learned, with the template's end of turn
    alpaca             {"instruction": ..., "input": ..., "output": ...}: a user turn (the instruction, then the input
                       after a blank line when there is one) and the output as the assistant's turn
    sharegpt           {"conversations": [{"from": "human" | "gpt" | "system", "value": ...}, ...]}

Which tokens are learned is decided on characters, then carried to tokens through the tokenizer's offsets: the
template renders the conversation up to each assistant turn (with the generation prompt) and up to its end, and the
characters between the two are that turn's answer. Tokenising the whole text once and marking the tokens that overlap
an answer gives the same ids as training on the whole text, whatever the tokenizer merges across a boundary.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from trainkit.errors import ConfigError, Problem

# Where a template's turn ends, when its end marker is plain text to the tokenizer (ChatML on a tokenizer trained
# without it): generation stops at the first of these.
TURN_ENDS = ["<|im_end|>", "<|eot_id|>", "<|end|>"]

FORMATS = ("text", "prompt_completion", "messages", "alpaca", "sharegpt")
FIELDS = {"text": ("text",), "prompt_completion": ("prompt", "completion"), "messages": ("messages",),
          "alpaca": ("instruction", "output"), "sharegpt": ("conversations",)}
IGNORE = -100  # the label of a token the loss skips (torch's cross_entropy ignore_index)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}

# ChatML (the layout of Qwen's and many other chat models' templates), for a tokenizer without a template of its own:
# `--chat_template chatml`.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TEMPLATES = {"chatml": CHATML}


def detect(columns: Sequence[str], text_field: str) -> str:
    """The layout whose fields the data has: the plain-text field first, and text where none matches (the text
    checks then name the missing field)."""
    return next((name for name in ("messages", "prompt_completion", "alpaca", "sharegpt")
                 if text_field not in columns and all(field in columns for field in FIELDS[name])), "text")


def chat_template(tokenizer, choice: str) -> str | None:
    """--chat_template: "" the tokenizer's own, a name from TEMPLATES, or a Jinja file."""
    if not choice:
        return tokenizer.chat_template
    if choice in TEMPLATES:
        return TEMPLATES[choice]
    path = Path(choice)
    if not path.is_file():
        raise ConfigError([Problem(f"no chat template {choice!r}", "--chat_template",
                                   f"pass {' or '.join(TEMPLATES)}, or the path of a Jinja template file")])
    return path.read_text()


# The roles a conversation may hold (what chat templates know); --role_map renames others to these.
ROLES = ("system", "user", "assistant", "tool")


def parse_role_map(text: str) -> dict[str, str]:
    """--role_map "bot=assistant,human=user" as a dict (checked by role_map_problems)."""
    return dict(pair.split("=", 1) for pair in (p.strip() for p in text.split(",")) if "=" in pair)


def role_map_problems(text: str) -> list[Problem]:
    pairs = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in pairs if "=" not in p or p.split("=", 1)[1] not in ROLES]
    return [Problem(f"--role_map {text!r}: {', '.join(bad)} is not name=role with a role of {', '.join(ROLES)}",
                    "--role_map", "write it as bot=assistant,human=user")] if bad else []


def record_problem(record: Any, layout: str, role_map: Mapping[str, str]) -> str | None:
    """What stops one record of a chat-like layout from being rendered (a missing field, a message that is not a
    role and a content, a role no template knows, content that is not text), or None: said with its file and line by
    check_records, before anything trains."""
    if not isinstance(record, dict):
        return f"is a JSON {type(record).__name__}, not an object with the {layout} layout's fields"
    if missing := [f for f in FIELDS[layout] if f not in record]:
        return f"has no field(s) {', '.join(missing)} of the {layout} layout (its fields: {', '.join(record)})"
    if layout == "prompt_completion":  # two strings, read as they are (render); no turns to check
        if other := [f for f in FIELDS[layout] if not isinstance(record[f], str)]:
            return (f"has a {' and a '.join(other)} that is not a string (a conversation's turns go in one "
                    "`messages` list)")
        return None
    try:
        to_messages(record, layout, role_map)
    except RecordError as e:
        return str(e)
    return None


class RecordError(ValueError):
    """One record that cannot be rendered; record_problem says it with the record's file and line."""


def content_text(content: Any) -> str:
    """A message's content: a string, or a list of parts whose text parts are joined (the layout of OpenAI's and
    transformers' multimodal chats); a part that is not text is refused."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if other := sorted({str(p.get("type")) for p in content} - {"text"}):
            raise RecordError(f"has a message with a part of type {', '.join(other)}, which a text model cannot "
                              f"read (only {{\"type\": \"text\", \"text\": ...}} parts)")
        return "".join(str(p.get("text", "")) for p in content)
    raise RecordError(f"has a message whose content is a {type(content).__name__}, not text or a list of text parts")


def to_messages(record: Mapping[str, Any], layout: str,
                role_map: Mapping[str, str] | None = None) -> list[dict[str, str]]:
    """A conversation as role/content messages, from any of the chat-like layouts; --role_map renames roles."""
    role_map = role_map or {}
    if layout == "alpaca":
        prompt = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]
    sharegpt = layout == "sharegpt"
    turns, role, content = (record["conversations"], "from", "value") if sharegpt else \
        (record["messages"], "role", "content")
    if not isinstance(turns, list) or not all(isinstance(t, dict) and role in t and content in t for t in turns):
        raise RecordError(f"has a {'conversation' if sharegpt else 'messages'} field that is not a list of "
                          f"{{{role!r}: ..., {content!r}: ...}} objects")
    known = {**(SHAREGPT_ROLES if sharegpt else dict(zip(ROLES, ROLES, strict=True))), **role_map}
    if unknown := sorted({str(t[role]) for t in turns} - set(known)):
        raise RecordError(f"has a turn from {', '.join(unknown)}, a role no chat template knows (known: "
                          f"{', '.join(known)}): without a mapping its turns would be rendered and never learned")
    return [{"role": known[t[role]], "content": content_text(t[content])} for t in turns]


# Examples that teach less than they seem to (answer_gap), in words: counted and said before a run trains, the
# first two left out (nothing of them is learned), the others kept.
ANSWER_GAPS = {"no_answer": "have no assistant answer to learn (no assistant turn): left out",
               "cut": "have no answer token within --seq_len: left out",
               "empty": "have only empty answers: the end of the turn is all they teach",
               "unanswered": "end with a turn after the last answer: that turn is read, never learned"}


def answer_gap(record: Mapping[str, Any], layout: str, role_map: Mapping[str, str] | None = None) -> str:
    """Which of ANSWER_GAPS a renderable record of an instruction or chat layout falls in, or "" (its answers are
    there; "cut" is for the caller, who knows what --seq_len left)."""
    if layout == "prompt_completion":
        return "" if record["completion"] else "empty"
    messages = to_messages(record, layout, role_map)
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    if not answers:
        return "no_answer"
    if not any(answers):
        return "empty"
    return "" if messages[-1]["role"] == "assistant" else "unanswered"


CHAT_DEFAULTS = "chat_defaults.json"  # in final/: the system turn the training conversations opened with


def shared_system_turn(records: Sequence[Mapping[str, Any]], layout: str,
                       role_map: Mapping[str, str] | None = None) -> str | None:
    """The system turn that every one of these conversations opens with, or None (no system turn, or several): what
    a model fine-tuned on them expects before a question (trainkit/tools/ask.py asks with it)."""
    if layout not in ("messages", "sharegpt") or not records:
        return None
    opening = set()
    for record in records:
        try:
            messages = to_messages(record, layout, role_map)
        except RecordError:
            return None
        opening.add(messages[0]["content"] if messages and messages[0]["role"] == "system" else None)
    return opening.pop() if len(opening) == 1 else None


def json_records(path: Path, limit: int | None = None) -> Iterator[tuple[int, Any]]:
    """(line number, record) of each JSON line of a local file's first `limit` bytes (None: all of it); a line cut
    by the limit, an empty one or one that is not JSON is left out (trainkit/data/text.py names those). A .json file
    that holds one JSON array (as datasets reads it too) gives its elements, numbered from 1, the whole file read."""
    import json

    with open(path, "rb") as f:
        raw = f.read(limit) if limit else f.read()
    if path.suffix == ".json" and raw.lstrip().startswith(b"["):
        try:
            listed = json.loads(path.read_bytes() if limit and len(raw) == limit else raw)
        except json.JSONDecodeError:
            return
        yield from ((number, record) for number, record in enumerate(listed, start=1) if record is not None)
        return
    lines = raw.decode("utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines[:-1] if limit and len(raw) == limit else lines, start=1):
        try:
            record = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            continue
        if record is not None:
            yield number, record


def check_records(path: Path, layout: str, role_map: Mapping[str, str], flag: str,
                  limit: int | None = None) -> Problem | None:
    """The first record of a local JSON-lines file (its first `limit` bytes; None: all of it) that cannot be
    rendered in the layout, named by file and line."""
    for number, record in json_records(path, limit):
        if what := record_problem(record, layout, role_map):
            fix = ("pass --role_map with each of its roles named as one of "
                   f"{', '.join(ROLES)} (--role_map bot=assistant)" if "no chat template knows" in what else
                   "mend that record, or pass --data_format for the layout the file has")
            return Problem(f"{path}:{number} {what}", f"{flag} {path}", fix)
    return None


def render(record: Mapping[str, Any], layout: str, tokenizer, template: str | None,
           role_map: Mapping[str, str] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The text the model reads and the character spans it learns (every answer), for every layout but text (the
    recipe cuts plain text into blocks instead)."""
    if layout == "prompt_completion":
        text = record["prompt"] + record["completion"] + tokenizer.eos_token
        return text, [(len(record["prompt"]), len(text))]
    if template is None:
        raise ConfigError([Problem(f"the tokenizer has no chat template to render {layout} data with",
                                   "--chat_template", f"pass --chat_template {' or '.join(TEMPLATES)} or a Jinja "
                                   "file (the template the model will be asked with later)")])
    try:
        messages = to_messages(record, layout, role_map)
    except RecordError as e:  # a record no file check saw (a Hub dataset's)
        raise ConfigError([Problem(f"a record {e}", f"--data_format {layout}",
                                   "pass --role_map name=role for a role that is named otherwise, or mend the data")]
                          ) from None

    def text_of(turns: list, prompt: bool) -> str:
        return tokenizer.apply_chat_template(turns, chat_template=template, tokenize=False,
                                             add_generation_prompt=prompt)

    whole, spans = text_of(messages, False), []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = text_of(messages[:i], True), text_of(messages[:i + 1], False)
        if not (whole.startswith(before) and whole.startswith(through)):
            raise ConfigError([Problem("the chat template renders a conversation's beginning otherwise than the "
                                       "whole conversation, so its answers cannot be found in the text",
                                       "--chat_template", "use a template that renders each turn the same whatever "
                                       "follows it (chatml does), or --train_on all")])
        spans.append((len(before), len(through)))
    return whole, spans


def encode(text: str, spans: list[tuple[int, int]], tokenizer, seq_len: int,
           train_on_all: bool) -> tuple[list[int], list[int]]:
    """Token ids and labels (IGNORE where nothing is learned), cut to seq_len."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"][:seq_len]
    # A token that overlaps an answer is learned: the space that ends a prompt and merges with the answer's first
    # word into one token (" 5") is predicted as part of the answer.
    learned = [train_on_all or any(start < b and a < end for a, b in spans)
               for start, end in encoded["offset_mapping"]]
    return ids, [t if keep else IGNORE for t, keep in zip(ids, learned, strict=False)]


def learned_count(labels: Sequence[int]) -> int:
    """Tokens the loss learns from: each label but the first predicts it from the tokens before."""
    return sum(1 for label in labels[1:] if label != IGNORE)


def preview(ids: Sequence[int], labels: Sequence[int], tokenizer) -> str:
    """One example as the model sees it, the learned tokens between [[ and ]] (what --dry_run shows)."""
    out, inside = [], False
    for i, token in enumerate(ids):
        learn = i > 0 and labels[i] != IGNORE
        if learn != inside:
            out.append("[[" if learn else "]]")
            inside = learn
        out.append(tokenizer.decode([token]))
    return "".join(out) + ("]]" if inside else "")


def pack(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Rows of example indices whose lengths fit seq_len together: best fit, longest first (each example goes to the
    row it leaves least room in), which leaves little padding. Deterministic: the same lengths give the same rows."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        at = bisect.bisect_left(free, (lengths[i], -1))
        if at == len(free):
            rows.append([i])
            room, row = seq_len - lengths[i], len(rows) - 1
        else:
            room, row = free.pop(at)
            rows[row].append(i)
            room -= lengths[i]
        bisect.insort(free, (room, row))
    return rows


def sample_weights(learned: list[int]) -> list[float]:
    """loss_average samples: each learned position (1 in `learned`) weighs 1 / the example's learned count, so the
    example's weights sum to 1 and a batch's weighed mean is the mean of its examples' means."""
    share = 1.0 / max(1, sum(learned))
    return [share * flag for flag in learned]


FILL = {"labels": IGNORE, "weight": 0.0, "position_ids": 0, "segment": 0}  # past a sample's tokens (ids: pad)


def padded(row: dict[str, list], length: int, pad: int) -> dict[str, list]:
    """A sample of exactly `length` positions: every column filled past its tokens, attention_mask 1 on them."""
    n = len(row["input_ids"])
    return {**{key: values + [pad if key == "input_ids" else FILL[key]] * (length - n) for key, values in row.items()},
            "attention_mask": [1] * n + [0] * (length - n)}


def pad_id(tokenizer) -> int:
    """Many causal LMs have no pad token; which token fills the padding does not matter, it is masked out of the
    loss."""
    return tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id


def packed(examples, length: int, pad: int):
    """Rows of seq_len tokens, each holding whole examples (pack, best fit over them all): packed_row's."""
    from datasets import Dataset

    weights = "weight" in examples.column_names
    columns = ["input_ids", "labels", *(["weight"] if weights else [])]
    rows = [packed_row([{key: examples[key][i] for key in columns} for i in members], length, pad)
            for members in pack([len(ids) for ids in examples["input_ids"]], length)]
    return Dataset.from_dict({key: [row[key] for row in rows] for key in rows[0]})


def packed_row(members: list[dict[str, list]], length: int, pad: int) -> dict[str, list]:
    """Examples in one row of seq_len tokens, with position_ids that restart per example and each token's example
    number (`segment`, from 1; 0 is padding) for the block-diagonal mask. Each example's first label is dropped: in
    a row it would be predicted from the example before it (alone, nothing predicts it)."""
    row: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": [], "segment": [],
                            **({"weight": []} if "weight" in members[0] else {})}
    for number, example in enumerate(members, start=1):
        n = len(example["input_ids"])
        row["input_ids"] += example["input_ids"]
        row["labels"] += [IGNORE] + example["labels"][1:]
        row["position_ids"] += list(range(n))
        row["segment"] += [number] * n
        if "weight" in example:
            row["weight"] += [0.0] + example["weight"][1:]  # its first position is the example before's target
    return padded(row, length, pad)


def block_mask(segments, eager: bool):
    """The attention mask of packed rows (segments: [batch, seq] example numbers from 1, 0 for padding): each token
    sees the earlier tokens of its own example only. position_ids that restart per example do not isolate examples
    under sdpa or eager (measured on a Qwen2: 0.41 apart); this mask does (1e-7). Padding sees itself, so no row
    of the softmax is empty. Boolean for sdpa; eager adds its mask to the scores, so it gets 0 and the lowest float."""
    import torch

    length = segments.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()
    allowed = (segments[:, :, None] == segments[:, None, :]) & causal | torch.eye(length, dtype=torch.bool,
                                                                                  device=segments.device)
    allowed = allowed[:, None]
    if not eager:
        return allowed
    return torch.zeros(allowed.shape, device=segments.device).masked_fill(~allowed, torch.finfo(torch.float32).min)
