"""Records to training rows as they stream in (trainkit/data/stream.py): the RowMakers, one per way a recipe lays out
its samples, each the streamed twin of a prepare-first path.

A RowMaker has `seq_len`, `examples(records, source)` (a batch of records to one example each: token ids, or None for
a record that gives nothing, or a sources.BadRecord) and `pack(examples, used)`, which makes rows of tensors from
(example, location) pairs and says after each row where the next one starts: (the location of an example, what of it
is used). A resume passes that `used` back with the examples from that location on, and gets the same rows again. It
is called in the data workers, so it pickles (a tokenizer does).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from trainkit.data import sft
from trainkit.data.stream_sources import BadRecord, Source, text_of

Located = tuple[Any, tuple[int, int]]  # (example, (round, position of its record))


def _token_ids(tokenizer: Any, records: list[dict], source: Source, **kwargs: Any) -> list[list[int] | BadRecord]:
    """Each record's text tokenised and followed by the end-of-text token (one tokenizer call for all)."""
    texts = [text_of(record, source) for record in records]
    good = [text for text in texts if isinstance(text, str)]
    ids = iter(tokenizer(good, **kwargs)["input_ids"] if good else [])
    return [text if isinstance(text, BadRecord) else [*next(ids), tokenizer.eos_token_id] for text in texts]


@dataclass(frozen=True, slots=True)
class TextBlocks:
    """Documents concatenated and cut into blocks of exactly seq_len tokens, as text.token_blocks prepares them
    (recipes/tiny_transformer.py)."""

    tokenizer: Any
    seq_len: int

    def examples(self, records: list[dict], source: Source) -> list:
        return _token_ids(self.tokenizer, records, source)

    def pack(self, examples: Iterator[Located], used: int) -> Iterator[tuple[dict, tuple]]:
        block: list[int] = []
        for ids, at in examples:
            position, used = used, 0
            while position < len(ids):
                take = min(self.seq_len - len(block), len(ids) - position)
                block += ids[position:position + take]
                position += take
                if len(block) == self.seq_len:
                    yield {"input_ids": torch.tensor(block)}, (at, position)
                    block = []


@dataclass(frozen=True, slots=True)
class TextPieces:
    """Each document cut into pieces of seq_len tokens (recipes/causal_lm.py's plain text; a piece needs two real
    tokens, one to predict): its last piece padded, or with `packing` the pieces of documents that follow each other
    put together in a row, each isolated from the others as packed examples are (sft.packed_row: its own positions
    and mask), so that the same tokens are learned as when each piece had a row of its own. `weights`: loss_average
    samples' per-token weights."""

    tokenizer: Any
    seq_len: int
    weights: bool = False
    packing: bool = False

    def examples(self, records: list[dict], source: Source) -> list:
        return _token_ids(self.tokenizer, records, source, add_special_tokens=False)

    def pieces(self, ids: list[int], start: int = 0) -> Iterator[tuple[dict[str, list], int]]:
        """A document's pieces from token `start` on, unpadded, every token a label (packed_row drops each piece's
        first, which nothing before it in the piece predicts), each with the token the next one starts at."""
        for begin in range(start, len(ids) - 1, self.seq_len):
            piece = ids[begin:begin + self.seq_len]
            weight = {"weight": sft.sample_weights([0] + [1] * (len(piece) - 1))} if self.weights else {}
            yield {"input_ids": piece, "labels": piece, **weight}, begin + self.seq_len

    def cut(self, ids: list[int], start: int = 0) -> Iterator[tuple[dict[str, list], int]]:
        """The pieces, each padded to a row of its own (the real tokens learned: its attention_mask)."""
        pad = sft.pad_id(self.tokenizer)
        for piece, end in self.pieces(ids, start):
            del piece["labels"]
            yield sft.padded(piece, self.seq_len, pad), end

    def pack(self, examples: Iterator[Located], used: int) -> Iterator[tuple[dict, tuple]]:
        """`used`: the token of the first document that its next piece starts at. Packed, a row ends where the next
        piece does not fit, and the next row starts with it."""
        pad, row = sft.pad_id(self.tokenizer), []
        for ids, at in examples:
            for piece, end in (self.pieces if self.packing else self.cut)(ids, used):
                if not self.packing:
                    yield _tensors(piece), (at, end)
                    continue
                if row and sum(len(p["input_ids"]) for p in row) + len(piece["input_ids"]) > self.seq_len:
                    yield _tensors(sft.packed_row(row, self.seq_len, pad)), (at, end - self.seq_len)
                    row = []
                row.append(piece)
            used = 0


@dataclass(frozen=True, slots=True)
class Examples:
    """Instruction and chat records (trainkit/data/sft.py's layouts), one example each with labels on what is learned,
    an example with nothing left to learn dropped: one padded row each, or with `packing` as many whole examples as
    fit in a row, in the order they come (recipes/causal_lm.py)."""

    tokenizer: Any
    seq_len: int
    layout: str
    template: str | None
    train_on_all: bool = False
    weights: bool = False  # loss_average samples
    packing: bool = False
    role_map: tuple[tuple[str, str], ...] = ()  # --role_map's renamings

    def examples(self, records: list[dict], source: Source | None = None) -> list:
        made: list = []
        roles = dict(self.role_map)
        for record in records:
            if problem := sft.record_problem(record, self.layout, roles):
                made.append(BadRecord(problem))
                continue
            ids, labels = sft.encode(*sft.render(record, self.layout, self.tokenizer, self.template, roles),
                                     self.tokenizer, self.seq_len, self.train_on_all)
            learned = [0] + [int(label != sft.IGNORE) for label in labels[1:]]
            weight = {"weight": sft.sample_weights(learned)} if self.weights else {}
            made.append({"input_ids": ids, "labels": labels, **weight} if sum(learned) else None)
        return made

    def pack(self, examples: Iterator[Located], used: int) -> Iterator[tuple[dict, tuple]]:
        """One row per example (`used` 1: the example resumed at is in a row already), or rows of whole examples:
        a row ends where the next example does not fit, and the next row starts with it."""
        pad = sft.pad_id(self.tokenizer)
        row: list[dict] = []
        for example, at in examples:
            if not self.packing:
                if not used:
                    yield _tensors(sft.padded(example, self.seq_len, pad)), (at, 1)
                used = 0
                continue
            if row and sum(len(e["input_ids"]) for e in row) + len(example["input_ids"]) > self.seq_len:
                yield _tensors(sft.packed_row(row, self.seq_len, pad)), (at, 0)
                row = []
            row.append(example)


def _tensors(row: dict[str, list]) -> dict[str, torch.Tensor]:
    return {key: torch.tensor(values) for key, values in row.items()}
