"""Text data for language-model recipes: a corpus that needs no download, a BPE tokenizer trained on it, and
fixed-length token blocks made with `datasets.map` in bounded slices, so that memory stays flat whatever the corpus's
size (cached, so the second run starts at once; measured in bench/data_prep.py).

The default corpus is the English reference text that CPython ships in `pydoc_data` (the help() topics): it
exists on every machine with Python. `--data` takes local .txt/.jsonl/.json/.csv files or a Hugging Face dataset
name; with no network a hub name fails with a message that says so.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from trainkit.data import sft, stream_sources
from trainkit.errors import ConfigError, Problem, disk_full, said, write_error, writing
from trainkit.launch.hardware import cpu_cores

EOS = "<|endoftext|>"
EOS_ID = 0  # BpeTrainer gives the special tokens the first ids; the model configs need it before any tokenizer exists
LOCAL_FORMATS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".csv": "csv"}


def default_corpus(cache_dir: Path) -> Path:
    """CPython's pydoc topics as JSON lines, one topic per document, written once into the cache under a name that
    holds their digest: another Python's topics (a cache shared between interpreters) are another file."""
    import pydoc_data.topics

    path = cache_dir / f"pydoc_topics-{corpus_digest()}.jsonl"
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            with writing(path), open(tmp, "w") as f:
                for name in sorted(pydoc_data.topics.topics):
                    f.write(json.dumps({"text": pydoc_data.topics.topics[name]}) + "\n")
            tmp.replace(path)  # atomic: concurrent builders never see half a file
        finally:
            tmp.unlink(missing_ok=True)
    return path


def local_files(data: str) -> list[Path] | None:
    """The local files `--data` names (a glob gives the files it matches, sorted), or None when it names a Hugging
    Face dataset (or the built-in corpus).

    Local means: the path exists, or it ends in a suffix of LOCAL_FORMATS (a missing file is then refused by name).
    Anything else is a dataset name, dots and slashes included (`org/name-1.0`).
    """
    if data == "pydoc":
        return None
    files = [Path(f) for p in data.split(",") for f in (sorted(glob.glob(p)) if glob.has_magic(p) else []) or [p]]
    return files if any(p.exists() or p.suffix in LOCAL_FORMATS for p in files) else None


# A streamed corpus's tokenizer is trained on its first records, this much text (weighed over a mixture's sources).
TOKENIZER_SAMPLE_BYTES = 16 << 20
# Local files past this size are streamed when --streaming is auto: preparing them first would take minutes of an
# idle machine, and a disk's worth of cache, before the first step.
STREAM_PAST_BYTES = 1 << 30


def streams(data: str, streaming: str) -> bool:
    """Whether --data is read as the run trains (trainkit/data/stream.py): --streaming true; or auto, and a mixture
    (weights, a YAML) or local files past STREAM_PAST_BYTES."""
    if streaming != "auto":
        return streaming == "true"
    files = local_files(data) or []
    return stream_sources.is_mixture(data) or sum(p.stat().st_size for p in files if p.is_file()) > STREAM_PAST_BYTES


def streamed_data(data: str, cache_dir: Path) -> str:
    """--data as trainkit/data/stream_sources.py reads it: the built-in corpus is its JSON-lines file in the cache."""
    return str(default_corpus(cache_dir)) if data == "pydoc" else data


def check_streaming(data: str, text_field: str, streaming: str, bad_lines: str) -> list[Problem]:
    """The streaming fields' values, and a mixture asked to be prepared first."""
    problems = [Problem(f"{name} must be {' or '.join(allowed)}, got {value!r}", f"config field {name}",
                        f"use --{name} {allowed[0]}")
                for name, value, allowed in (("streaming", streaming, ("auto", "true", "false")),
                                             ("bad_lines", bad_lines, ("stop", "skip"))) if value not in allowed]
    if streaming == "false" and stream_sources.is_mixture(data):
        problems.append(Problem(f"--data {data} is a mixture, which is read as a stream", "--streaming false",
                                "drop --streaming false, or name one source"))
    return problems


# What --dry_run reads of each local data file: its size and its first records, up to this many bytes (a file's later
# lines are read, and their mistakes named the same way, when the run loads it).
CHECKED_BYTES = 1 << 20


TEXT_RECORD = '{"text": "..."}'  # what a fix shows as one line of a JSON-lines file of text


def check_data(data: str, text_field: str | None = None, streamed: bool = False,
               flag: str = "--data", example: str = TEXT_RECORD) -> list[Problem]:
    """Problems with `--data` that can be seen cheaply, before anything is built: missing files, mixed formats, and
    each local file's first CHECKED_BYTES (empty, a line that is not valid JSON, no `text_field`, a field that is not
    text, a CSV row of the wrong width), named by file and line. text_field None checks no field. Streamed data: its
    sources, and each one's first record (trainkit/data/stream_sources.py). `example`: a record of the layout the
    recipe reads, shown in the fixes."""
    if streamed and data != "pydoc":
        try:  # text_field None: the records' own layout is checked when the run reads them
            return stream_sources.check_first_records(stream_sources.parse_data(data, text_field or "text"),
                                               None if text_field else ())
        except ConfigError as e:
            return e.problems
    files = local_files(data)
    if files is None:
        return []
    where = f"{flag} {data}"
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        return [Problem(f"data file(s) not found: {', '.join(missing)}", where,
                        "pass existing .txt/.jsonl/.csv files, comma-separated")]
    formats = {LOCAL_FORMATS.get(p.suffix) for p in files}
    if len(formats) != 1 or None in formats:
        return [Problem(f"cannot tell one format from the suffixes of {data}", where,
                        "use files of one kind: .txt, .jsonl/.json or .csv")]
    return [problem for path in files if (problem := file_problem(path, text_field, CHECKED_BYTES, flag, example))]


def file_problem(path: Path, text_field: str | None, limit: int | None = None, flag: str = "--data",
                 example: str = TEXT_RECORD) -> Problem | None:
    """The first mistake in a local data file (its first `limit` bytes; None: all of it), as editors count lines
    (from 1), or None."""
    import csv
    import io

    where = f"{flag} {path}"
    if path.stat().st_size == 0:
        return Problem(f"{path} is empty", where, "pass a file that holds the text to train on")
    with open(path, "rb") as f:
        raw = f.read(limit) if limit else f.read()
    cut = limit is not None and len(raw) == limit  # the last line may be cut short: not judged
    try:
        content = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if not (cut and e.start > len(raw) - 4):  # a character cut at the limit is not a mistake
            line = raw[:e.start].count(b"\n") + 1
            return Problem(f"{path}:{line} is not UTF-8 text (byte {e.start})", where, "save the file as UTF-8")
        content = raw[:e.start].decode("utf-8")
    lines = content.splitlines()[:-1] if cut else content.splitlines()
    blank = None if cut or any(line.strip() for line in lines) else \
        Problem(f"{path} holds only blank lines", where, f"pass a file of records such as {example}")
    kind = LOCAL_FORMATS[path.suffix]
    if kind == "text":
        return blank
    if kind == "csv":
        rows = csv.reader(io.StringIO("\n".join(lines)))
        header = next(rows, [])
        if text_field and text_field not in header:
            return Problem(f"{path}:1: the header has no column {text_field!r} (its columns: {', '.join(header)})",
                           where, "name the text column with --text_field")
        for row in rows:
            if len(row) != len(header):
                return Problem(f"{path}:{rows.line_num} has {len(row)} fields, the header {len(header)}", where,
                               "quote fields that hold commas or line breaks (\"...\"), or fix that line")
        return None
    stripped = content.lstrip()
    if path.suffix == ".json" and stripped.startswith("[") and not cut:  # one JSON document rather than lines
        try:
            records = json.loads(content)
        except json.JSONDecodeError as e:
            return Problem(f"{path}:{e.lineno} is not valid JSON ({e.msg}, column {e.colno})", where,
                           "fix that line, or write one JSON object per line (.jsonl)")
        return _record_problem(records[0], path, 1, text_field, where, example) if records else \
            Problem(f"{path} holds an empty list", where, f"pass a file of records such as {example}")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            return Problem(f"{path}:{number} is not valid JSON ({e.msg}, column {e.colno})", where,
                           f"fix that line: each line holds one JSON object, such as {example}")
        if problem := _record_problem(record, path, number, text_field, where, example):
            return problem
    return blank


def _record_problem(record, path: Path, line: int, text_field: str | None, where: str,
                    example: str = TEXT_RECORD) -> Problem | None:
    if not isinstance(record, dict):
        return Problem(f"{path}:{line} is a JSON {type(record).__name__}, not an object", where,
                       f"write one object per line, such as {example}")
    if text_field is None:
        return None
    if text_field not in record:
        return Problem(f"{path}:{line} has no field {text_field!r} (its fields: {', '.join(record) or 'none'})",
                       where, "name the text field with --text_field")
    if not isinstance(record[text_field], str):
        return Problem(f"{path}:{line}: field {text_field!r} holds a {_json_type(record[text_field])}, not text",
                       where, "put the text to train on in that field as a string")
    return None


def _json_type(value) -> str:
    return {bool: "boolean", int: "number", float: "number", list: "list", dict: "object",
            type(None): "null"}.get(type(value), type(value).__name__)


def load_documents(data: str, data_config: str, text_field: str, cache_dir: Path, split: str = "train",
                   flag: str = "--data"):
    """A `datasets.Dataset` with a `text` column, from the default corpus, local files, or a hub dataset (its
    `split`); flag: the option that named the data, for the errors."""
    ds, where = load_records(data, data_config, text_field, cache_dir, split, flag), f"{flag} {data}"
    if text_field not in ds.column_names:
        raise ConfigError([Problem(f"the data has no column {text_field!r} (columns: {', '.join(ds.column_names)})",
                                   where, "name the text column with --text_field")])
    kind = getattr(ds.features[text_field], "dtype", None)
    if kind not in ("string", "large_string"):
        raise ConfigError([Problem(f"the data's column {text_field!r} holds {kind or ds.features[text_field]}, not "
                                   f"text", where, "name the text column with --text_field")])
    return ds.select_columns([text_field]).rename_column(text_field, "text") if text_field != "text" else \
        ds.select_columns(["text"])


def first_fields(data: str) -> list[str] | None:
    """The fields of the first record of --data's first local JSON or CSV file (what a layout is detected from), or
    None where that cannot be read cheaply (a Hub name, plain text)."""
    import csv

    if stream_sources.is_mixture(data):  # the first source's first record (a bad mixture: its checks name it)
        try:
            first = stream_sources.first_record(stream_sources.parse_data(data, "text")[0])
        except ConfigError:
            return None
        return list(first[1]) if first and isinstance(first[1], dict) else None
    files = local_files(data)
    if not files or not files[0].is_file() or LOCAL_FORMATS.get(files[0].suffix) not in ("json", "csv"):
        return None
    with open(files[0], encoding="utf-8", errors="replace") as f:
        if files[0].suffix == ".csv":
            return next(csv.reader(f), [])
        if files[0].suffix == ".json" and f.read(4096).lstrip().startswith("["):  # one array of records
            record = next((record for _, record in sft.json_records(files[0])), None)
            return list(record) if isinstance(record, dict) else None
        f.seek(0)
        for line in f:
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    return None  # check_data names the line
                return list(record) if isinstance(record, dict) else None
    return None


def records_problems(files: list[tuple[str, str]], example: str,
                     check_records: Callable[[Path, str, int | None], Problem | None]) -> list[Problem]:
    """What the dry run finds in a recipe's record files (`files`: (data, its flag) each): check_data's problems, or
    else the first bad record of each local JSON-lines file by `check_records` (path, flag, bytes to read)."""
    read = [problem for data, flag in files for problem in check_data(data, None, flag=flag, example=example)]
    return read or [problem for data, flag in files for path in local_files(data) or []
                    if path.suffix in (".jsonl", ".json") and path.is_file()
                    and (problem := check_records(path, flag, CHECKED_BYTES))]


def listed_records(batch: dict[str, list], indices: list[int], problem: Callable[[Any], str | None], data: str,
                   flag: str, fix: str) -> list[dict[str, Any]]:
    """A datasets.map batch as one dict per record, the first record `problem` names refused with its number."""
    listed = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
    for number, record in zip(indices, listed, strict=True):
        if bad := problem(record):
            raise ConfigError([Problem(f"record {number + 1} of {data} {bad}", f"{flag} {data}", fix)])
    return listed


def load_records(data: str, data_config: str, text_field: str | None, cache_dir: Path, split: str = "train",
                 flag: str = "--data", example: str = TEXT_RECORD):
    """A `datasets.Dataset` of --data's records with every field, from the default corpus, local files, or a hub
    dataset (its `split`: local files are one split); text_field is the field check_data looks for in local files
    (None: none)."""
    import datasets

    datasets.disable_progress_bars()
    hf_cache = str(cache_dir / "hf_datasets")
    files = [default_corpus(cache_dir)] if data == "pydoc" else local_files(data)
    where = f"{flag} {data}"
    if files is not None:
        problems = check_data(data, text_field, flag=flag)
        if problems:
            raise ConfigError(problems)
        builder = LOCAL_FORMATS[files[0].suffix]
        kwargs = {"keep_linebreaks": True} if builder == "text" else {}
        verbosity = datasets.logging.get_verbosity()
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its log line of a parse error: said below
        try:
            ds = datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train",
                                       cache_dir=hf_cache, **kwargs)
        except Exception as e:  # a mistake past what check_data read: find it in the whole files
            cause = e.__cause__ or e.__context__ or e
            if disk_full(cause):  # datasets' cache, not the data
                raise write_error(cause, Path(hf_cache)) from None
            found = [problem for path in files if (problem := file_problem(path, text_field, flag=flag,
                                                                             example=example))]
            raise ConfigError(found[:1] or [Problem(f"cannot read {data}: {said(cause)}", where,
                                                    "check the files' format")]) from None
        finally:
            datasets.logging.set_verbosity(verbosity)
    else:
        try:
            ds = datasets.load_dataset(data, data_config or None, split=split, cache_dir=hf_cache)
        except Exception as e:  # offline, unknown name, gated: the library's own words, and what to do instead
            raise ConfigError([Problem(f"could not load the Hugging Face dataset {data!r}: {type(e).__name__}: "
                                       f"{str(e).splitlines()[0] if str(e) else ''}", where,
                                       "check the name and the network, or pass local .txt/.jsonl/.csv files")]
                              ) from None
    return ds


def drawn_held_out(records, eval_fraction: float, seed: int, data: str, units: str):
    """(train, held-out) of a recipe's records (examples, before they are packed into rows), eval_fraction of them
    held out, drawn from the seed: every kind of example is held out as often as it occurs, whatever the file's
    order and however a packer would group them. Too little data for both is said as such, naming the data."""
    import torch

    if len(records) < 2:
        raise ConfigError([Problem(
            f"too little data: --data {data} gives {len(records)} {units}, and a training and a held-out split need "
            f"2 at least", f"--data {data}", "pass more data, or a held-out file (--eval_data)")])
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed)).tolist()
    held_out = max(1, int(len(records) * eval_fraction))
    return records.select(sorted(order[held_out:])), records.select(sorted(order[:held_out]))


def split_held_out(samples, eval_fraction: float, data: str, units: str):
    """(train, held-out) of a recipe's samples, the last eval_fraction held out; too little data for both is said
    as such, naming the data (not as a split that gives no batches). units: what a sample is, in the plural."""
    if len(samples) < 2:
        raise ConfigError([Problem(
            f"too little text: --data {data} gives {len(samples)} {units}, and a training and a held-out split need "
            f"2 at least", f"--data {data}", "pass more text, or a smaller --seq_len")])
    held_out = max(1, int(len(samples) * eval_fraction))
    split = len(samples) - held_out
    return (samples.select(range(split)).with_format("torch"),
            samples.select(range(split, len(samples))).with_format("torch"))


def train_tokenizer(docs, vocab_size: int, out_dir: Path):
    """A byte-level BPE trained on the corpus (no download), saved where AutoTokenizer.from_pretrained finds it.
    docs: rows with a "text" field, or a function that gives them (called only when no tokenizer is cached)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if (out_dir / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(out_dir))
    docs = docs() if callable(docs) else docs
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((row["text"] for row in docs), trainer=trainer, length=len(docs))
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    try:
        with writing(out_dir):
            wrapped.save_pretrained(str(tmp))
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return wrapped


# Digits, spaces, case, accents and punctuation: what tokenizers' pre-tokenizers and normalisers treat differently.
# Preparation works in slices of about these sizes, so that its memory stays flat whatever the corpus's size: text is
# tokenised 1 MiB at a time (datasets' default of 1000 rows held 0.3 GiB of Python lists on pydoc's long documents)
# and packed 2^20 tokens (8 MiB) at a time.
TEXT_BYTES_PER_SLICE = 1 << 20
TOKENS_PER_SLICE = 1 << 20
# Text per tokenising process, at least: below it the start-up of a process costs more than it saves.
BYTES_PER_PROCESS = 16 << 20


def default_num_proc(docs) -> int:
    """Processes for tokenising: one per core, but 1 for a small corpus (pydoc is 0.5 MB). Under a launcher the other
    processes of the machine wait meanwhile (`local_main_process_first` in train.py), so all cores are free."""
    return max(1, min(cpu_cores(), docs.data.nbytes // BYTES_PER_PROCESS))


def rows_per_slice(rows: int, total: int, per_slice: int) -> int:
    """How many rows hold about per_slice of a total (bytes or tokens) spread over rows."""
    return max(1, rows * per_slice // max(total, 1))


def token_blocks(docs, tokenizer, seq_len: int, num_proc: int | None = None):
    """Every document tokenised and followed by EOS, concatenated, and cut into blocks of seq_len tokens.

    Both steps are `datasets.map` passes over bounded slices, written to Arrow files (cached: the second run reads
    them at once). Tokenising runs in `num_proc` processes (default: `default_num_proc`); each slice of documents is
    independent. Packing concatenates about TOKENS_PER_SLICE tokens at a time with numpy and cuts them into blocks; a
    slice's last seq_len - 1 tokens at most cannot fill a block and are dropped, as the corpus's last ones always
    were: at most seq_len - 1 tokens per TOKENS_PER_SLICE (0.012% at seq_len 128), and none on a corpus of fewer than
    TOKENS_PER_SLICE tokens, whose blocks are exactly those of one concatenation. Packing runs in one process: it
    only moves memory, and with a shard per process the slices' edges, so the blocks, would depend on the number of
    processes.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    eos = tokenizer.eos_token_id

    def tokenize(batch):
        return {"input_ids": [ids + [eos] for ids in tokenizer(batch["text"])["input_ids"]]}

    def pack(batch: pa.Table) -> pa.Table:
        flat = pc.list_flatten(batch["input_ids"]).to_numpy()
        usable = len(flat) // seq_len * seq_len
        blocks = pa.ListArray.from_arrays(pa.array(np.arange(0, usable + 1, seq_len, dtype=np.int32)), flat[:usable])
        return pa.table({"input_ids": blocks})

    num_proc = num_proc or default_num_proc(docs)
    rows = rows_per_slice(len(docs), docs.data.nbytes, TEXT_BYTES_PER_SLICE)
    cache = Path(docs.cache_files[0]["filename"]).parent if docs.cache_files else Path.cwd()  # where map writes
    with writing(cache):
        # num_proc=1 would still start a pool of one worker (datasets 5.2): None keeps the work in this process.
        tokens = docs.map(tokenize, batched=True, batch_size=rows, writer_batch_size=rows, remove_columns=["text"],
                          num_proc=num_proc if num_proc > 1 else None)
        total = sum(len(chunk.flatten()) for chunk in tokens.data.column("input_ids").chunks)
        rows = rows_per_slice(len(tokens), total, TOKENS_PER_SLICE)
        return tokens.with_format("arrow").map(pack, batched=True, batch_size=rows).with_format(None)


def unigram_entropy(blocks) -> float:
    """Entropy (nats per token) of the corpus's token frequencies: the loss of a model that ignores context. blocks:
    a prepared data set, or a list of token tensors (streamed data's held-out rows)."""
    counts = np.zeros(0, dtype=np.int64)
    batches = [np.asarray(b) for b in blocks] if isinstance(blocks, list) else \
        (batch["input_ids"] for batch in blocks.with_format("numpy").iter(batch_size=1000))  # 1000 blocks at a time
    for batch in batches:
        found = np.bincount(batch.ravel())
        counts = np.pad(counts, (0, max(0, len(found) - len(counts))))
        counts[:len(found)] += found
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# The layout of what a cache folder holds (the tokenizer's training, the blocks): a change to either makes this
# number grow, so that a cache written by older code is never read as this code's (a tokenizer trained otherwise
# gives other blocks and another loss, silently).
CACHE_VERSION = 2


@functools.cache
def corpus_digest() -> str:
    """The built-in corpus's digest: the pydoc topics of the Python that runs (once per process: every load of the
    corpus and every cache key asks for it)."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return hashlib.sha1("".join(f"{k}\0{topics[k]}\0" for k in sorted(topics)).encode()).hexdigest()[:12]


def data_key(data: str, data_config: str, text_field: str, vocab_size: int) -> str:
    """A cache folder name for one corpus + tokenizer choice, and this code's CACHE_VERSION; a local file that
    changes gets a new one, and so does the built-in corpus of another Python."""
    files = [Path(f) for source in stream_sources.parse_data(data, text_field) for f in source.files] \
        if stream_sources.is_mixture(data) else local_files(data) or []
    stamps = [f"{p}:{os.stat(p).st_size}:{os.stat(p).st_mtime_ns}" for p in files if p.is_file()]
    parts = [data, data_config, text_field, str(vocab_size), f"v{CACHE_VERSION}", *stamps,
             *([corpus_digest()] if data == "pydoc" else [])]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]
