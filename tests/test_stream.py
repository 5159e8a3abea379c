"""Streamed data (--streaming, mixtures in --data): pieces that cover every record once, the global batches that
depend only on the seed, the global batch size and the sources, a resume that reads on from recorded positions on any
number of processes, the mixture's shares, and bad input named. The in-process tests drive trainkit/data/stream.py's
StreamedTrain rank by rank, as data.py's tests drive TrainStream; the launched ones train the tiny transformer."""

from __future__ import annotations

import gzip
import json
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import assert_refused, launch, max_rel_diff
from trainkit.data import stream_sources, text
from trainkit.data.batches import BatchLayout
from trainkit.data.stream import Streamed, StreamedTrain
from trainkit.data.stream_rows import TextBlocks
from trainkit.errors import ConfigError, TrainingError

WORDS = "the a cat dog sat on mat ran far away quickly slowly red blue green under over into house tree".split()
GLOBAL = 16


def documents(seed: int, count: int, shout: bool = False) -> list[str]:
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120))) for _ in range(count)]
    return [d.upper() for d in docs] if shout else docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """a-0..5.jsonl (lines of 15 to 700 bytes), b.txt, c-00..39.jsonl.gz, d.parquet (40 row groups), and the BPE
    tokenizer trained on them."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(6):
        (root / f"a-{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(i, 80)))
    (root / "b.txt").write_text("".join(d + "\n" for d in documents(10, 300, shout=True)))
    for i in range(40):
        with gzip.open(root / f"c-{i:02d}.jsonl.gz", "wt") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in documents(100 + i, 10))
    pq.write_table(pa.table({"text": documents(200, 400)}), root / "d.parquet", row_group_size=10)
    docs = [{"text": d} for i in range(6) for d in documents(i, 80)]
    text.train_tokenizer(docs, 300, root / "tokenizer")
    return root


def streamed(corpus: Path, data: str, bad_lines: str = "stop") -> Streamed:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(corpus / "tokenizer"))
    return Streamed.open(data, "text", "", 0.05, bad_lines).with_rows(TextBlocks(tokenizer, 32))


def global_batches(data: Streamed, world: int, grad_accum: int, steps: int, seed: int = 0, workers: int = 0,
                   start: int = 0, states: list[dict] | None = None, key: str = "input_ids",
                   ) -> tuple[list[torch.Tensor], list[StreamedTrain]]:
    """Every global batch's `key` (its rows, rank after rank) from global batch `start` on, and the ranks' streams."""
    micro = GLOBAL // (world * grad_accum)
    streams = [StreamedTrain(data, BatchLayout(micro, grad_accum, r, world), seed, workers) for r in range(world)]
    for s in streams:
        s.seek(0, start, states)
    batches = [torch.cat([mb[key] for s in streams for mb in s.next_global_batch()]) for _ in range(steps)]
    return batches, streams


def mixture(corpus: Path) -> str:
    return f"{corpus}/a-*.jsonl:0.5,{corpus}/b.txt:0.2,{corpus}/c-*.jsonl.gz:0.2,{corpus}/d.parquet:0.1"


# --- pieces --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern", ["a-*.jsonl", "b.txt", "c-*.jsonl.gz", "d.parquet"])
def test_the_pieces_give_every_record_once_and_any_position_reads_on_from_there(corpus, pattern, monkeypatch):
    monkeypatch.setattr(stream_sources, "MIN_PIECE", 97)  # pieces shorter than many lines: most start inside one
    source = stream_sources.parse_data(str(corpus / pattern), "text")[0]
    pieces = stream_sources.pieces(source)
    read = [(piece, record, at) for piece in pieces for record, at in stream_sources.records(source, piece, None)]
    expected = [json.loads(line)["text"] for f in source.files for line in
                (gzip.open(f, "rt") if f.endswith(".gz") else open(f)).read().splitlines()] \
        if source.kind == "json" else [d + "\n" for d in documents(10, 300, shout=True)] \
        if source.kind == "text" else documents(200, 400)
    assert [record["text"] for _, record, _ in read] == expected
    # plain files in pieces of 97 bytes (many empty: inside a line begun before), .gz files and row groups whole
    assert len(pieces) == {"c-*.jsonl.gz": 40, "d.parquet": 40}.get(pattern, max(len(pieces), len(read) + 1))
    for piece, record, at in read[::37]:  # a recorded position gives that record and the rest of its piece
        rest = [r for p, r, _ in read if p == piece]
        assert [r for r, _ in stream_sources.records(source, piece, at)] == rest[rest.index(record):]


# --- the invariant -------------------------------------------------------------------------------------------------

def test_streamed_global_batches_depend_only_on_the_seed_the_global_batch_and_the_sources(corpus):
    data = streamed(corpus, mixture(corpus))
    reference, _ = global_batches(data, 1, 1, steps=12)
    for world, grad_accum, workers in [(2, 1, 0), (4, 1, 0), (2, 2, 0), (4, 2, 0), (2, 1, 2)]:
        got, _ = global_batches(data, world, grad_accum, steps=12, workers=workers)
        assert all(torch.equal(a, b) for a, b in zip(got, reference, strict=True)), (world, grad_accum, workers)
    other_seed, _ = global_batches(data, 1, 1, steps=1, seed=1)
    assert not torch.equal(other_seed[0], reference[0])
    rows = torch.cat(reference)
    assert len({tuple(row.tolist()) for row in rows}) == len(rows)  # no row twice: the lanes read different text


def test_a_resume_reads_on_from_the_lanes_states_on_any_process_count(corpus, monkeypatch):
    monkeypatch.setattr(stream_sources, "MIN_PIECE", 301)  # lanes go from piece to piece after a resume, many times
    data = streamed(corpus, mixture(corpus))
    uninterrupted, _ = global_batches(data, 2, 1, steps=60)
    _, stopped = global_batches(data, 2, 1, steps=24)
    states = [json.loads(json.dumps(s.rank_state())) for s in stopped]  # as the checkpoint keeps them
    for world, grad_accum, steps in [(2, 1, 36), (1, 1, 6), (4, 2, 6)]:
        resumed, streams = global_batches(data, world, grad_accum, steps=steps, start=24, states=states)
        assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted[24:24 + steps], strict=True)), world
    assert streams[0].rows_of.sum() == 30 * GLOBAL  # the mixture's counts go on too


def test_a_resumed_lane_reads_every_later_piece_from_its_start(corpus, monkeypatch):
    """Only the piece a lane resumes in starts at the recorded position: the pieces after it, of every source, are
    read from their starts, at whatever round the lane's other sources stand."""
    monkeypatch.setattr(stream_sources, "MIN_PIECE", 301)
    data = streamed(corpus, f"{corpus}/a-[0-2].jsonl:1,{corpus}/a-[3-5].jsonl:1")  # alike: their rounds meet
    far = [{"lanes": {str(lane): {"0": [3, None, 0], "1": [3, None, 0]} for lane in range(GLOBAL)},
            "rows_of_sources": [0, 0]}]  # both sources' lanes in their round 3
    uninterrupted, _ = global_batches(data, 1, 1, steps=40, states=far)
    _, stopped = global_batches(data, 1, 1, steps=2, states=far)
    resumed, _ = global_batches(data, 1, 1, steps=38, start=2, states=[s.rank_state() for s in stopped])
    assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted[2:], strict=True))


def test_a_resume_reads_only_what_comes_after_its_position(corpus, monkeypatch):
    data = streamed(corpus, f"{corpus}/a-*.jsonl")
    _, stopped = global_batches(data, 1, 1, steps=40)
    states = [s.rank_state() for s in stopped]
    lines = []
    real = stream_sources._byte_range

    def counted(*args):
        for item in real(*args):
            lines.append(item)
            yield item

    monkeypatch.setattr(stream_sources, "_byte_range", counted)
    global_batches(data, 1, 1, steps=2)
    fresh = len(lines)
    lines.clear()
    global_batches(data, 1, 1, steps=2, start=40, states=states)
    # 2 global batches from the start read what 2 read from step 40 (one record each lane again), not 42 batches'
    assert len(lines) <= fresh + GLOBAL


# --- mixtures -----------------------------------------------------------------------------------------------------

def test_a_mixture_gives_each_source_its_share_and_a_used_up_source_starts_a_new_epoch(corpus, tmp_path):
    for i in range(3):  # 3 small .gz files, 2 to train on: about 4 rows each
        with gzip.open(tmp_path / f"small-{i}.jsonl.gz", "wt") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in documents(300 + i, 2))
    data = streamed(corpus, f"{corpus}/a-*.jsonl:3,{tmp_path}/small-*.jsonl.gz:1")
    assert [s.weight for s in data.sources] == [0.75, 0.25]
    _, streams = global_batches(data, 2, 1, steps=60)
    share = streams[0].metrics(None, 1)["data_share"]
    assert abs(share[f"{corpus}/a-*.jsonl"] - 0.75) < 0.05 and abs(sum(share.values()) - 1) < 1e-6
    rounds = [streams[0].states[str(lane)]["1"][0] for lane in range(8) if "1" in streams[0].states[str(lane)]]
    assert max(rounds) >= 2  # lanes read the 2 pieces over and over: epoch after epoch, each in a new order


def test_auto_streams_a_mixture_and_files_past_a_size(corpus, monkeypatch):
    assert text.streams(mixture(corpus), "auto") and text.streams(str(corpus / "b.txt"), "true")
    assert not text.streams(f"{corpus}/a-*.jsonl", "auto") and not text.streams("pydoc", "auto")
    monkeypatch.setattr(text, "STREAM_PAST_BYTES", 100_000)  # the six a-*.jsonl files hold about 190 kB
    assert text.streams(f"{corpus}/a-*.jsonl", "auto") and not text.streams(f"{corpus}/a-*.jsonl", "false")


def test_a_source_that_is_one_piece_is_refused_naming_it(corpus):
    with pytest.raises(ConfigError) as refused:
        Streamed.open(f"{corpus}/c-00.jsonl.gz", "text", "", 0.05, "stop")
    assert refused.value.problems[0].where == f"--data {corpus}/c-00.jsonl.gz"


# --- bad input -----------------------------------------------------------------------------------------------------

def bad_mixtures(corpus: Path, tmp: Path) -> dict[str, tuple[str, str]]:
    """data -> (what the first problem says, where it points)."""
    (tmp / "other.jsonl").write_text('{"content": "no text field here"}\n' * 50)
    (tmp / "t.csv").write_text("text\nhello\n")
    (tmp / "mix.yaml").write_text("sources:\n  - weight: 1\n")
    return {
        f"{corpus}/a-*.jsonl:0.7,{corpus}/missing-*.jsonl:0.3": ("no file matches", f"--data {corpus}/missing-*.jsonl"),
        f"{corpus}/a-*.jsonl:0.7,{corpus}/b.txt:0": ("has weight 0.0", "--data"),
        f"{corpus}/a-*.jsonl:1,{corpus}/b.txt:-2": ("has weight -2.0", "--data"),
        f"{corpus}/a-*.jsonl:1,{corpus}/b.txt": ("without a weight", "--data"),
        f"{corpus}/a-*.jsonl:0.5,{tmp}/other.jsonl:0.5": ("no field 'text'", f"--data {tmp}/other.jsonl"),
        f"{tmp}/t.csv:1,{corpus}/b.txt:1": ("cannot stream", f"--data {tmp}/t.csv"),
        f"{tmp}/mix.yaml": ("source 1 is", f"--data {tmp}/mix.yaml"),
        f"{tmp}/none.yaml": ("not found", f"--data {tmp}/none.yaml"),
    }


def test_a_bad_mixture_is_named_before_anything_is_read(corpus, tmp_path):
    for data, (what, where) in bad_mixtures(corpus, tmp_path).items():
        problems = text.check_data(data, "text", streamed=True)
        assert problems and what in problems[0].what and problems[0].where.startswith(where), (data, problems)


def test_a_yaml_mixture_names_fields_and_weights_per_source(corpus, tmp_path):
    (tmp_path / "other.jsonl").write_text("".join(json.dumps({"content": d}) + "\n" for d in documents(5, 200)))
    (tmp_path / "mix.yaml").write_text(f"sources:\n  - path: '{corpus}/a-*.jsonl'\n    weight: 2\n"
                                       f"  - path: {tmp_path}/other.jsonl\n    weight: 1\n    text_field: content\n")
    data = streamed(corpus, str(tmp_path / "mix.yaml"))
    assert [(s.weight, s.text_field) for s in data.sources] == [(2 / 3, "text"), (1 / 3, "content")]
    assert global_batches(data, 1, 1, steps=3)[0][2].shape == (GLOBAL, 32)


def test_an_unreadable_line_mid_stream_stops_the_run_naming_it_or_is_counted_and_skipped(corpus, tmp_path):
    lines = [json.dumps({"text": d}) for d in documents(7, 200)]
    lines[150] = '{"text": "cut short'
    (tmp_path / "broken.jsonl").write_text("\n".join(lines) + "\n")
    for workers in (0, 2):  # from a data worker too: the run's own error, not the DataLoader's RuntimeError
        with pytest.raises(TrainingError, match=f"cannot read {tmp_path}/broken.jsonl:151: not valid JSON"):
            global_batches(streamed(corpus, str(tmp_path / "broken.jsonl")), 1, 1, steps=40, workers=workers)
    _, streams = global_batches(streamed(corpus, str(tmp_path / "broken.jsonl"), "skip"), 1, 1, steps=40)

    class Alone:  # one process: the collective is the number itself
        device = "cpu"

        @staticmethod
        def reduce(tensor, op):
            return tensor

    assert streams[0].metrics(Alone, 1)["skipped_lines"] == 1


# --- instruction and chat data -----------------------------------------------------------------------------------

def test_streamed_chat_examples_are_packed_in_the_order_they_come_and_keep_the_invariant(chat, tmp_path):
    from transformers import PreTrainedTokenizerFast

    from trainkit.data import sft, stream_rows

    folder, data = chat
    (tmp_path / "chat.jsonl").write_text(data.read_text() * 10)  # 1,200 conversations: 80 pieces
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
    opened = Streamed.open(str(tmp_path / "chat.jsonl"), "text", "", 0.05, "stop", sft.FIELDS["messages"])
    one_each = opened.with_rows(stream_rows.Examples(tokenizer, 192, "messages", sft.CHATML))
    packed = opened.with_rows(stream_rows.Examples(tokenizer, 192, "messages", sft.CHATML, packing=True))

    ids, _ = global_batches(packed, 1, 1, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(global_batches(packed, 2, 2, steps=3)[0], ids, strict=True))
    _, stopped = global_batches(packed, 4, 1, steps=1)
    resumed, _ = global_batches(packed, 1, 1, steps=2, start=1, states=[s.rank_state() for s in stopped])
    assert all(torch.equal(a, b) for a, b in zip(resumed, ids[1:], strict=True))
    # lane 0's packed rows hold lane 0's examples whole and in the order they come: its rows when not packed
    segments = [batch[0] for batch in global_batches(packed, 1, 1, steps=3, key="segment")[0]]
    in_rows = [row[segment == n] for row, segment in zip([batch[0] for batch in ids], segments, strict=True)
               for n in range(1, int(segment.max()) + 1)]
    alone = [(batch[0], mask[0]) for batch, mask in zip(global_batches(one_each, 1, 1, steps=len(in_rows))[0],
             global_batches(one_each, 1, 1, steps=len(in_rows), key="attention_mask")[0], strict=True)]
    assert len(in_rows) >= 6 and all(torch.equal(got, row[mask == 1]) for got, (row, mask) in
                                     zip(in_rows, alone, strict=True))
    labels, _ = global_batches(one_each, 1, 1, steps=2, key="labels")
    assert all((row != sft.IGNORE).sum() > 0 for batch in labels for row in batch)  # every row learns something


# --- Hugging Face datasets' streaming ------------------------------------------------------------------------------

def test_a_dataset_folder_streams_through_datasets_shard_by_shard(corpus, tmp_path):
    folder = tmp_path / "my_dataset"
    (folder / "data").mkdir(parents=True)
    for i in range(4):
        shutil.copy(corpus / f"a-{i}.jsonl", folder / "data" / f"train-{i}.jsonl")
    data = streamed(corpus, str(folder))
    assert data.sources[0].kind == "hub" and len(data.train[0]) == 3  # 4 shards, the last held out
    uninterrupted, _ = global_batches(data, 2, 1, steps=8)
    _, stopped = global_batches(data, 2, 1, steps=5)
    resumed, _ = global_batches(data, 1, 1, steps=3, start=5, states=[s.rank_state() for s in stopped])
    assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted[5:], strict=True))


# --- launched ------------------------------------------------------------------------------------------------------

LM = ["--recipe", "tiny_transformer", "--max_steps", "8", "--eval_every", "4", "--hidden", "32", "--layers", "2",
      "--heads", "2", "--seq_len", "32", "--vocab_size", "300", "--warmup_steps", "2", "--save_every", "4"]


@pytest.mark.slow
def test_a_streamed_mixture_trains_one_curve_on_1_2_4_processes_and_2_machines_and_resumes_exactly(corpus, tmp_path):
    from test_multinode import two_machines

    data = ["--data", mixture(corpus)]
    one = launch(tmp_path / "one", *LM, *data, "--batch_size", "16").check()
    assert one.resolved["streaming"] == "auto" and "--data streamed" in one.stderr
    assert set(one.metrics[-1]["data_share"]) == {s.spec for s in stream_sources.parse_data(mixture(corpus), "text")}
    two = launch(tmp_path / "two", *LM, *data, "--batch_size", "4", "--grad_accum", "2", "--data_workers", "2",
                 config="ddp").check()
    four = launch(tmp_path / "four", *LM, *data, "--batch_size", "4", "--stop_at", "4", config="ddp",
                  extra_launch=("--num_processes", "4")).check()
    machines = [m.wait(timeout=120) for m in two_machines(tmp_path, [*LM, *data, "--batch_size", "8"])]
    for run in (two, four, machines[0].check()):
        assert max_rel_diff(run.losses, one.losses[:len(run.losses)]) <= 1e-6, run
        assert run.metrics[-1]["data_share"] == one.metrics[len(run.losses) - 1]["data_share"]
        assert abs(run.metrics[3]["eval_loss"] - one.metrics[3]["eval_loss"]) <= 1e-6 * one.metrics[3]["eval_loss"]
    # four processes' checkpoint at step 4, resumed on two: the lanes' positions from all four, the same curve on
    resumed = launch(tmp_path / "four", *LM, *data, "--batch_size", "8", "--resume", "latest", config="ddp").check()
    assert max_rel_diff(resumed.losses, one.losses) <= 1e-6 and len(resumed.losses) == 8
    # and on the same two processes, bit for bit
    stopped = launch(tmp_path / "stopped", *LM, *data, "--batch_size", "4", "--grad_accum", "2", "--stop_at", "4",
                     config="ddp").check()
    again = launch(stopped.output_dir, *LM, *data, "--resume", "latest", config="ddp").check()
    assert again.losses == two.losses


def test_a_mixture_cannot_be_prepared_first(check_only, corpus, tmp_path):
    run = check_only(tmp_path / "out", "--recipe", "tiny_transformer", "--data", mixture(corpus), "--streaming",
                     "false", "--dry_run")
    assert_refused(run, "is a mixture, which is read as a stream (--streaming false)")


@pytest.mark.parametrize("data", ["books/*.txt:abc,web.jsonl:0.3", "books/*.txt,web.jsonl:0.3"])
def test_a_mixture_weight_mistake_is_named_and_its_fix_applied_as_printed_reads(data):
    """A weight that is not a number is said as such (it was called "without a weight", and the fix printed,
    books/*.txt:abc:1, was refused again); the fix as printed parses as the mixture meant."""
    from trainkit.data.stream_sources import _comma_entries

    _, (problem,) = _comma_entries(data, "text", "")
    assert problem.what == ("books/*.txt:abc (its weight 'abc' is not a number)" if ":abc" in data else
                            "books/*.txt in a mixture without a weight")
    fixed = problem.fix.removeprefix("give every source a weight: ")
    assert fixed == "books/*.txt:1,web.jsonl:0.3"
    entries, problems = _comma_entries(fixed, "text", "")
    assert not problems and [(spec, weight) for spec, weight, *_ in entries] == [("books/*.txt", 1.0),
                                                                               ("web.jsonl", 0.3)]


def test_a_mixture_is_never_advised_to_train_without_streaming(tmp_path):
    """A mixture is streamed whatever --streaming says: the one-piece refusal offers only what works for it."""
    from trainkit.data.stream import Streamed

    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(b'{"text": "one piece"}\n' * 20))
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(b'{"text": "another"}\n' * 20))
    for data, advice in ((f"{tmp_path}/a.jsonl.gz:0.5,{tmp_path}/b.jsonl.gz:0.5", False), (f"{tmp_path}/a.jsonl.gz",
                                                                                         True)):
        with pytest.raises(ConfigError) as refused:
            Streamed.open(data, "text", "", 0.05, "stop")
        assert ("train without --streaming" in str(refused.value)) == advice, str(refused.value)
