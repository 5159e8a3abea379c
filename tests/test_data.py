"""The data-order invariant: global batches depend only on the seed and the global batch size. And text preparation:
the token blocks are the concatenated corpus cut into pieces, whatever the slicing and the number of processes."""

from __future__ import annotations

import json
import math
import pydoc_data.topics
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from conftest import assert_refused, error_lines, launch
from trainkit.data import text
from trainkit.data.batches import BatchLayout, GlobalBatchSampler, TrainStream

NUM_SAMPLES, GLOBAL = 100, 8


def global_batches(world_size: int, grad_accum: int, epochs: int, seed: int = 3) -> list[list[int]]:
    """The global batches as every rank together sees them: rank 0's micro-batches, then rank 1's..."""
    micro = GLOBAL // (world_size * grad_accum)
    streams = [TrainStream(TensorDataset(torch.arange(NUM_SAMPLES)), BatchLayout(micro, grad_accum, r, world_size),
                           seed) for r in range(world_size)]
    steps = epochs * (NUM_SAMPLES // GLOBAL)
    batches = []
    for _ in range(steps):
        per_rank = [[i for (mb,) in s.next_global_batch() for i in mb.tolist()] for s in streams]
        batches.append([i for part in per_rank for i in part])
    return batches


@pytest.mark.parametrize("world_size, grad_accum", [(2, 1), (1, 2), (2, 2), (4, 2), (8, 1)])
def test_same_global_batches_whatever_the_split(world_size, grad_accum):
    assert global_batches(world_size, grad_accum, epochs=3) == global_batches(1, 1, epochs=3)


def test_each_epoch_is_a_fresh_permutation():
    batches = global_batches(1, 1, epochs=3)
    per_epoch = NUM_SAMPLES // GLOBAL
    epochs = [[i for b in batches[e * per_epoch:(e + 1) * per_epoch] for i in b] for e in range(3)]
    for order in epochs:  # no sample twice in an epoch; the 4 left over (100 % 8) are dropped
        assert len(set(order)) == len(order) == per_epoch * GLOBAL
    assert epochs[0] != epochs[1] != epochs[2]  # the set_epoch lesson: not the same order every epoch


def test_the_seed_changes_the_order_and_nothing_else_does():
    assert global_batches(1, 1, 1, seed=3) != global_batches(1, 1, 1, seed=4)
    assert global_batches(2, 2, 1, seed=4) == global_batches(1, 1, 1, seed=4)


def test_ranks_compute_disjoint_parts():
    layouts = [BatchLayout(2, 2, r, 2) for r in range(2)]
    parts = [list(GlobalBatchSampler(NUM_SAMPLES, layout, seed=0)) for layout in layouts]
    first = [set(parts[r][0]) | set(parts[r][1]) for r in range(2)]
    assert not first[0] & first[1] and len(first[0] | first[1]) == GLOBAL


def test_seek_continues_mid_epoch():
    full = TrainStream(TensorDataset(torch.arange(NUM_SAMPLES)), BatchLayout(4, 1, 0, 1), seed=0)
    expected = [full.next_global_batch() for _ in range(40)][17:]
    resumed = TrainStream(TensorDataset(torch.arange(NUM_SAMPLES)), BatchLayout(4, 1, 0, 1), seed=0)
    resumed.seek(*divmod(17, NUM_SAMPLES // 4))
    got = [resumed.next_global_batch() for _ in range(23)]
    assert [[t.tolist() for (t,) in b] for b in got] == [[t.tolist() for (t,) in b] for b in expected]


def test_iterating_does_not_consume_the_global_rng():
    """Dropout after a resume must see the RNG as it was saved: making a DataLoader iterator must not draw from it."""
    torch.manual_seed(0)
    before = torch.get_rng_state()
    stream = TrainStream(TensorDataset(torch.arange(NUM_SAMPLES)), BatchLayout(4, 1, 0, 1), seed=0)
    for _ in range(30):  # crosses an epoch boundary: a new iterator
        stream.next_global_batch()
    assert torch.equal(before, torch.get_rng_state())


# ---- text preparation (trainkit/data/text.py) ----
SEQ_LEN = 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """40 pydoc topics as a .jsonl file (about 60k tokens), and a small BPE trained on them."""
    folder = tmp_path_factory.mktemp("text")
    path = folder / "docs.jsonl"
    topics = pydoc_data.topics.topics
    path.write_text("".join(json.dumps({"text": topics[name]}) + "\n" for name in sorted(topics)[:40]))
    docs = text.load_documents(str(path), "", "text", folder)
    return docs, text.train_tokenizer(docs, 300, folder / "tokenizer")


def stream(docs, tokenizer) -> list[int]:
    """The corpus as one token stream: each document's tokens, then EOS."""
    return [t for ids in tokenizer(list(docs["text"]))["input_ids"] for t in [*ids, tokenizer.eos_token_id]]


def test_blocks_cut_the_concatenated_corpus(corpus):
    """Below TOKENS_PER_SLICE tokens (the built-in corpus too) one slice holds everything: nothing is lost but the
    corpus's last partial block, as when the whole corpus was grouped in one batch."""
    docs, tokenizer = corpus
    flat = stream(docs, tokenizer)
    blocks = text.token_blocks(docs, tokenizer, SEQ_LEN, num_proc=1)
    assert len(flat) < text.TOKENS_PER_SLICE
    assert blocks.features["input_ids"] == datasets.List(datasets.Value("int32"))
    assert np.array_equal(np.array(blocks["input_ids"]).ravel(), flat[:len(flat) // SEQ_LEN * SEQ_LEN])


def test_slices_drop_at_most_a_block_each_and_processes_change_nothing(corpus, monkeypatch):
    docs, tokenizer = corpus
    flat = stream(docs, tokenizer)
    monkeypatch.setattr(text, "TOKENS_PER_SLICE", 5000)  # several slices of the 60k tokens
    monkeypatch.setattr(text, "TEXT_BYTES_PER_SLICE", 20_000)
    blocks = text.token_blocks(docs, tokenizer, SEQ_LEN, num_proc=1)
    got = np.array(blocks["input_ids"])
    rows = text.rows_per_slice(len(docs), len(flat), 5000)
    expected, start = [], 0  # each slice of `rows` documents packed alone, its remainder dropped
    for first in range(0, len(docs), rows):
        end = start + sum(len(ids) + 1 for ids in tokenizer(docs[first:first + rows]["text"])["input_ids"])
        expected += flat[start:start + (end - start) // SEQ_LEN * SEQ_LEN]
        start = end
    slices = -(-len(docs) // rows)
    assert slices > 3 and len(flat) // SEQ_LEN - slices < len(got) <= len(flat) // SEQ_LEN
    assert np.array_equal(got.ravel(), expected)
    in_two = text.token_blocks(docs, tokenizer, SEQ_LEN, num_proc=2)  # tokenised by 2 worker processes
    assert np.array_equal(np.array(in_two["input_ids"]), got)


def test_second_preparation_reads_the_cache(corpus):
    docs, tokenizer = corpus
    first = text.token_blocks(docs, tokenizer, SEQ_LEN)
    mtimes = [(f["filename"], Path(f["filename"]).stat().st_mtime_ns) for f in first.cache_files]
    again = text.token_blocks(docs, tokenizer, SEQ_LEN)
    assert mtimes and [(f["filename"], Path(f["filename"]).stat().st_mtime_ns) for f in again.cache_files] == mtimes


def test_unigram_entropy_counts_every_token():
    blocks = datasets.Dataset.from_dict({"input_ids": [[0, 1, 1, 2], [2, 2, 3, 0], [5, 5, 5, 5]] * 700})
    counts = Counter(t for row in blocks["input_ids"] for t in row)  # 2100 rows: more than one batch of 1000
    total = sum(counts.values())
    expected = -sum(c / total * math.log(c / total) for c in counts.values())
    assert text.unigram_entropy(blocks) == pytest.approx(expected, rel=1e-12)


# --- a user's data files: every mistake named by file and line (as editors count), at --dry_run already ------------

GOOD = json.dumps({"text": "a line of text to train on"})
MISTAKES = [  # (file name, content, what the error says)
    ("empty.jsonl", "", "{path} is empty (--data {path}): pass a file that holds the text"),
    ("empty.txt", "", "{path} is empty"),
    ("blank.txt", "\n\n  \n", "{path} holds only blank lines"),
    ("cut.jsonl", f"{GOOD}\n{GOOD}\n{GOOD[:12]}\n{GOOD}\n", "{path}:3 is not valid JSON (Unterminated string"),
    ("field.jsonl", f"{GOOD}\n" + json.dumps({"body": "x"}) + "\n", "{path}:2 has no field 'text' (its fields: body) "
                                                                    "(--data {path}): name the text field with "
                                                                    "--text_field"),
    ("number.jsonl", json.dumps({"text": 7}) + "\n", "{path}:1: field 'text' holds a number, not text"),
    ("list.jsonl", "[1, 2]\n", "{path}:1 is a JSON list, not an object"),
    ("header.csv", "body,label\nhello,1\n", "{path}:1: the header has no column 'text' (its columns: body, label)"),
    ("width.csv", "text,label\nhello,1\nhello, world,2\n", "{path}:3 has 3 fields, the header 2"),
    ("latin1.txt", "caf\xe9\n", "{path}:1 is not UTF-8 text"),
]


@pytest.mark.parametrize("recipe", ["tiny_transformer", "causal_lm"])
@pytest.mark.parametrize("name, content, message", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_data_file_mistake_is_named_by_the_dry_run(check_only, tmp_path, recipe, name, content, message):
    path = tmp_path / name
    path.write_bytes(content.encode("latin-1" if "latin1" in name else "utf-8"))
    data = str(path)
    if name.endswith(".txt"):  # one of several files: the one at fault is named
        (tmp_path / "ok.txt").write_text("text\n")
        data = f"{tmp_path / 'ok.txt'},{path}"
    model = ["--model_name_or_path", str(tmp_path)] if recipe == "causal_lm" else []
    run = check_only(tmp_path / "out", "--recipe", recipe, "--data", data, *model, "--dry_run")
    assert_refused(run, message.format(path=path))


@pytest.mark.slow
@pytest.mark.parametrize("config", [None, "ddp"])
def test_a_mistake_past_what_the_dry_run_reads_is_named_when_the_run_loads_it(run_dir, tmp_path, config):
    """The dry run reads a file's first MiB; the line at fault further on is found when the run loads the file,
    named the same way (not as datasets' DatasetGenerationError blamed on the recipe), once, under a launch too."""
    lines = [json.dumps({"text": f"document {i} " * 40}) for i in range(3000)]  # about 1.5 MB
    lines[2500] = lines[2500][:40]
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert path.stat().st_size > text.CHECKED_BYTES
    args = ["--recipe", "tiny_transformer", "--data", str(path), "--max_steps", "2"]
    assert launch(run_dir("dry"), *args, "--dry_run").returncode == 0
    run = launch(run_dir("run"), *args, config=config)
    assert_refused(run, f"{path}:2501 is not valid JSON (Unterminated string starting at, column 10) (--data {path})")
    assert len(error_lines(run.stderr)) == 1 and "Failed to load JSON" not in run.stderr


@pytest.mark.slow
def test_too_little_text_says_so_naming_the_data(run_dir, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("hello\n")
    assert_refused(launch(run_dir("run"), "--recipe", "tiny_transformer", "--data", str(path)),
                   f"too little text: --data {path} gives 0 blocks of 128 tokens, and a training and a held-out split "
                   f"need 2 at least (--data {path}): pass more text, or a smaller --seq_len")


@pytest.mark.parametrize("held_out", [1, 3, 49, 50, 62, 64, 97, 200])
@pytest.mark.parametrize("micro_batch, grad_accum, world_size", [(16, 4, 1), (16, 2, 2), (8, 1, 2), (4, 2, 4)])
def test_every_held_out_sample_is_evaluated_once_on_any_layout(held_out, micro_batch, grad_accum, world_size):
    """The ranks' real micro-batches cover the first samples (all, or eval_batches global batches' worth) once each,
    in one micro-batch size that divides them; every rank runs the same number of micro-batches, grad_accum a round
    (a pipeline's schedule), and the copies that fill the last round are marked as such."""
    from trainkit.data.batches import EvalLayout

    for global_batches in (0, 1, 2):
        dealt = [list(EvalLayout.of(BatchLayout(micro_batch, grad_accum, rank, world_size), held_out,
                                    global_batches).micro_batches()) for rank in range(world_size)]
        expected = min(held_out, global_batches * micro_batch * grad_accum * world_size) if global_batches else \
            held_out
        real = sorted(i for rank in dealt for indices, is_real in rank if is_real for i in indices)
        assert real == list(range(expected))
        sizes = {len(indices) for rank in dealt for indices, _ in rank}
        assert len(sizes) == 1 and expected % sizes.pop() == 0
        assert len({len(rank) for rank in dealt}) == 1 and len(dealt[0]) % grad_accum == 0


@pytest.mark.slow
def test_a_small_held_out_split_gives_one_process_eval_loss(run_dir):
    """2 processes x 16 x 2 (a global batch of 64) with 50 held-out samples: all 50 evaluated, in micro-batches of 10
    (5 real ones, dealt over 2 x 2 a round: the last round's empty places evaluate a copy that weighs nothing), give
    the eval loss of one process that trains on the same global batches (16 x 4); so do 3 held-out samples, fewer
    than the places of one round."""
    args = ["--recipe", "mlp", "--max_steps", "3", "--eval_every", "0"]
    for samples in ("50", "3"):
        ddp = launch(run_dir(f"ddp{samples}"), *args, "--eval_samples", samples, "--batch_size", "16", "--grad_accum",
                     "2", config="ddp").check()
        one = launch(run_dir(f"one{samples}"), *args, "--eval_samples", samples, "--batch_size", "16", "--grad_accum",
                     "4").check()
        if samples == "50":
            assert "note: in micro-batches of 10, the largest that divides the 50 samples evaluated" in ddp.stderr
        assert abs(ddp.metrics[-1]["eval_loss"] - one.metrics[-1]["eval_loss"]) <= 1e-6 * one.metrics[-1]["eval_loss"]


def test_the_cache_key_changes_with_the_code_that_fills_it_and_the_corpus(monkeypatch):
    """A tokenizer cached by older code (another CACHE_VERSION) or from another Python's pydoc topics is not read as
    this one's: each gets a folder of its own."""
    from trainkit.data import text

    key = text.data_key("pydoc", "", "text", 1024)
    monkeypatch.setattr(text, "CACHE_VERSION", text.CACHE_VERSION + 1)
    newer = text.data_key("pydoc", "", "text", 1024)
    monkeypatch.setattr(text, "corpus_digest", lambda: "another-python")
    assert len({key, newer, text.data_key("pydoc", "", "text", 1024)}) == 3


def test_precomputed_tables_are_summed_across_ranks_a_slice_at_a_time(monkeypatch):
    """The tables stay on the CPU and go through the device's reduction a slice of samples at a time: every slice
    summed, in place, whatever the slice size (here 3 samples of a [10, 4, 2] int32 table: 4 slices)."""
    from types import SimpleNamespace

    from trainkit.data import precompute

    seen = []

    def reduce(part: torch.Tensor, how: str) -> torch.Tensor:  # two ranks holding the same values
        seen.append(len(part))
        return part * 2

    engine = SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu"), reduce=reduce))
    monkeypatch.setattr(precompute, "SLICE_BYTES", 3 * 4 * 2 * 4)
    table = torch.arange(80, dtype=torch.int32).reshape(10, 4, 2)
    summed = precompute._summed(engine, table.clone())
    assert torch.equal(summed, 2 * table) and summed.dtype == torch.int32 and seen == [3, 3, 3, 1]
