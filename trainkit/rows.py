"""Records to training rows as they stream in (trainkit/stream.py): the RowMakers, one per way a recipe lays out its
samples, each the streamed twin of a prepare-first path.

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

from trainkit import sft
from trainkit.sources import BadRecord, Source, text_of

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
    """Each document cut into pieces of seq_len tokens, its last piece padded (recipes/causal_lm.py's plain text):
    a piece needs two real tokens, one to predict. `weights`: loss_average samples' per-token weights."""

    tokenizer: Any
    seq_len: int
    weights: bool = False

    def examples(self, records: list[dict], source: Source) -> list:
        return _token_ids(self.tokenizer, records, source, add_special_tokens=False)

    def pack(self, examples: Iterator[Located], used: int) -> Iterator[tuple[dict, tuple]]:
        pad = sft.pad_id(self.tokenizer)
        for ids, at in examples:
            for start in range(used, len(ids) - 1, self.seq_len):
                piece = ids[start:start + self.seq_len]
                weight = {"weight": sft.sample_weights([0] + [1] * (len(piece) - 1))} if self.weights else {}
                row = sft.padded({"input_ids": piece, **weight}, self.seq_len, pad)
                yield {key: torch.tensor(values) for key, values in row.items()}, (at, start + self.seq_len)
            used = 0
