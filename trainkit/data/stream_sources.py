"""What `--data` names when it is read as the run trains (trainkit/data/stream.py): sources with weights, each cut into
pieces that any process can start reading at any recorded position without reading what comes before.

    --data 'shards/a-*.jsonl'                    one source: the files a glob (or a comma-separated list) matches
    --data 'a-*.jsonl:0.7,b/*.parquet:0.3'       a mixture: each source with its weight (any positive numbers)
    --data mix.yaml                              a mixture written out: sources, fields, formats and weights
    --data org/name, --data a_dataset_folder/    a Hugging Face dataset through `datasets`' streaming mode

A piece is a byte range of a plain .jsonl/.txt file (a line belongs to the piece where it starts, so the ranges need no
index: a file's size is all), a row group of a .parquet file, or a whole .gz file or dataset shard (which cannot be
entered in the middle: a position there is a record count, replayed within that one piece).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainkit.errors import ConfigError, Problem, TrainingError

# The suffix of a file (under .gz, the one before it) -> how its records are read.
KINDS = {".jsonl": "json", ".json": "json", ".txt": "text", ".text": "text", ".parquet": "parquet"}
# Plain files are cut into about this many pieces, of 4 KiB to 8 MiB each: small pieces for a small source, so
# that the lanes of a global batch start on different text; never so many that listing them costs time.
PIECES_PER_SOURCE = 4096
MIN_PIECE, MAX_PIECE = 4 << 10, 8 << 20


@dataclass(frozen=True, slots=True)
class Source:
    """One source of a mixture."""

    spec: str  # as written: a glob or list of files, or a dataset name
    weight: float  # normalised: the weights of a mixture add up to 1
    files: tuple[str, ...]  # sorted; empty for a dataset read through `datasets`
    kind: str  # json | text | parquet | hub
    text_field: str = "text"
    config: str = ""  # a Hugging Face dataset's configuration
    compressed: bool = False  # .gz files


@dataclass(frozen=True, slots=True)
class Piece:
    """A part of a source that is read from its start or from a recorded position in it."""

    file: int  # index into Source.files (a shard index for a dataset)
    start: int  # byte offset (plain files), row group (parquet); 0 for a whole file or shard
    end: int  # byte end (exclusive), row group + 1; -1 for a whole file or shard


def parse_data(data: str, text_field: str, data_config: str = "") -> list[Source]:
    """The sources `--data` names (see the module docstring); every problem at once, each naming the source."""
    if data.endswith((".yaml", ".yml")):
        entries = _yaml_entries(data, text_field, data_config)
    else:
        entries, problems = _comma_entries(data, text_field, data_config)
        if problems:
            raise ConfigError(problems)
    problems = [Problem(f"source {spec!r} has weight {weight}: a weight must be positive", f"--data {data}",
                        "give it a positive weight, or leave the source out")
                for spec, weight, *_ in entries if not weight > 0]
    if problems:
        raise ConfigError(problems)
    total = sum(weight for _, weight, *_ in entries)
    sources = []
    for spec, weight, field, config in entries:
        try:
            sources.append(_source(spec, weight / total, field, config))
        except ConfigError as e:
            problems += e.problems
    if problems:
        raise ConfigError(problems)
    return sources


def is_mixture(data: str) -> bool:
    """--data names a mixture: a YAML of sources, or sources with weights."""
    return data.endswith((".yaml", ".yml")) or any(_weight(item)[1] is not None for item in data.split(","))


def _comma_entries(data: str, text_field: str, config: str) -> tuple[list[tuple], list[Problem]]:
    """`a:0.7,b:0.3` (a mixture) or `a,b` (one source of several files; as --data has always read)."""
    items = [item.strip() for item in data.split(",") if item.strip()]
    weighed = [_weight(item) for item in items]
    if all(w is None for _, w in weighed):
        return [(",".join(items), 1.0, text_field, config)], []
    bare = [spec for spec, w in weighed if w is None]
    if bare:
        # a source written with a weight that is not a number (books/*.txt:abc) is that source, weighed 1 in the fix
        spec_of = {spec: spec.rpartition(":")[0] if ":" in spec else spec for spec in bare}
        unread = [f"{spec} (its weight {spec.rpartition(':')[2]!r} is not a number)" for spec in bare if ":" in spec]
        said = ", ".join(unread) if unread else f"{', '.join(bare)} in a mixture without a weight"
        return [], [Problem(said, f"--data {data}", "give every source a weight: " + ",".join(
            f"{spec_of.get(s, s)}:{1 if w is None else f'{w:g}'}" for s, w in weighed))]
    return [(spec, w, text_field, config) for spec, w in weighed], []


def _weight(item: str) -> tuple[str, float | None]:
    spec, sep, tail = item.rpartition(":")
    try:
        return (spec, float(tail)) if sep and spec else (item, None)
    except ValueError:
        return item, None


def _yaml_entries(path: str, text_field: str, config: str) -> list[tuple]:
    import yaml

    where = f"--data {path}"
    if not Path(path).is_file():
        raise ConfigError([Problem(f"mixture file {path} not found", where, "pass the path of a mixture YAML")])
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ConfigError([Problem(f"{path} is not valid YAML: {e}", where, "fix the YAML")]) from None
    listed = doc.get("sources") if isinstance(doc, dict) else None
    example = "sources: [{path: 'a-*.jsonl', weight: 0.7}, {path: org/name, weight: 0.3, text_field: content}]"
    if not isinstance(listed, list) or not listed:
        raise ConfigError([Problem(f"{path} lists no sources", where, f"write {example}")])
    entries, problems = [], []
    for i, entry in enumerate(listed):
        unknown = sorted(set(entry) - {"path", "weight", "text_field", "config"}) if isinstance(entry, dict) else []
        if not isinstance(entry, dict) or "path" not in entry or unknown:
            problems.append(Problem(f"{path}: source {i + 1} is {entry!r}", where,
                                    f"give each source path, weight and optionally text_field, config: {example}"))
            continue
        weight = entry.get("weight", 1.0)
        entries.append((str(entry["path"]), weight if isinstance(weight, int | float) else float("nan"),
                        str(entry.get("text_field", text_field)), str(entry.get("config", config))))
    if problems:
        raise ConfigError(problems)
    return entries


def _source(spec: str, weight: float, text_field: str, config: str) -> Source:
    where = f"--data {spec}"
    patterns = spec.split(",")
    if not any(glob.has_magic(p) or Path(p).is_file() or _suffix(p) in KINDS for p in patterns):
        return Source(spec, weight, (), "hub", text_field, config)  # a dataset name or a dataset folder
    files, missing = [], []
    for pattern in patterns:
        found = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern] if Path(pattern).is_file() else []
        files += found
        missing += [] if found else [pattern]
    if missing:
        raise ConfigError([Problem(f"no file matches {', '.join(missing)}", where,
                                   "check the path or glob (quote it, so that the shell leaves it to train.py)")])
    kinds = {KINDS.get(_suffix(f)) for f in files}
    if len(kinds) != 1 or None in kinds:
        raise ConfigError([Problem(f"cannot stream {spec}: its files are not all of one of "
                                   f"{', '.join(sorted(KINDS))} (optionally .gz)", where,
                                   "give each kind of file its own source, or convert them to .jsonl")])
    compressed = {f.endswith(".gz") for f in files}
    if len(compressed) != 1 or (kinds == {"parquet"} and True in compressed):
        raise ConfigError([Problem(f"{spec} mixes .gz files and plain ones", where, "give each its own source")])
    empty = [f for f in files if os.path.getsize(f) == 0]
    if empty:
        raise ConfigError([Problem(f"{', '.join(empty[:3])} {'is' if len(empty) == 1 else 'are'} empty", where,
                                   "leave empty files out of the source")])
    return Source(spec, weight, tuple(files), kinds.pop(), text_field, config, compressed.pop())


def _suffix(path: str) -> str:
    parts = Path(path).suffixes
    return parts[-2] if len(parts) > 1 and parts[-1] == ".gz" else parts[-1] if parts else ""


def pieces(source: Source) -> list[Piece]:
    """The source's pieces in their one order: files sorted, offsets ascending."""
    if source.kind == "hub":
        return [Piece(i, 0, -1) for i in range(_hub(source).n_shards)]
    if source.compressed:
        return [Piece(i, 0, -1) for i in range(len(source.files))]
    if source.kind == "parquet":
        import pyarrow.parquet as pq

        return [Piece(i, group, group + 1) for i, f in enumerate(source.files)
                for group in range(pq.ParquetFile(f).metadata.num_row_groups)]
    sizes = [os.path.getsize(f) for f in source.files]
    size = min(MAX_PIECE, max(MIN_PIECE, sum(sizes) // PIECES_PER_SOURCE))
    return [Piece(i, start, min(start + size, total)) for i, total in enumerate(sizes)
            for start in range(0, total, size)]


class BadRecord:
    """A record that cannot be read, and why; `place` names where it is, computed only when it is reported."""

    def __init__(self, why: str):
        self.why = why


def records(source: Source, piece: Piece, at: int | None) -> Iterator[tuple[dict[str, Any] | BadRecord, int]]:
    """The piece's records from its start (at None) or from position `at` (a position this yielded before), each
    with its position: a byte offset in a plain file, a record count in a row group, a .gz file or a shard."""
    if source.kind == "hub":
        shards = _hub(source)
        yield from _counted(iter(shards.shard(num_shards=shards.n_shards, index=piece.file)), at or 0)
    elif source.kind == "parquet":
        yield from _counted(_parquet_rows(source, piece), at or 0)
    elif source.compressed:
        with gzip.open(source.files[piece.file], "rb") as f:
            yield from _counted((_parse(source, line) for line in f), at or 0)
    else:
        yield from _byte_range(source, piece, at)


def place(source: Source, piece: Piece, position: int) -> str:
    """Where the record at `position` is, as an editor counts lines (from 1)."""
    if source.kind == "hub":
        return f"{source.spec}, shard {piece.file}, record {position + 1}"
    path = source.files[piece.file]
    if source.kind == "parquet":
        return f"{path}, row group {piece.start}, row {position + 1}"
    if source.compressed:
        return f"{path}:{position + 1}"
    lines, left = 1, position  # the line that starts at this byte: counted only when a bad line is reported
    with open(path, "rb") as f:
        while left > 0:
            chunk = f.read(min(left, 1 << 24))
            lines, left = lines + chunk.count(b"\n"), left - len(chunk)
    return f"{path}:{lines}"


def _byte_range(source: Source, piece: Piece, at: int | None) -> Iterator[tuple[Any, int]]:
    with open(source.files[piece.file], "rb") as f:
        if at is not None:
            f.seek(at)
        elif piece.start > 0:
            f.seek(piece.start - 1)
            f.readline()  # the end of a line that began in the piece before (or the newline before this one)
        position = f.tell()
        while position < piece.end:
            line = f.readline()
            if not line:
                return
            yield _parse(source, line), position
            position += len(line)


def _parse(source: Source, line: bytes) -> dict[str, Any] | BadRecord:
    """A line as a record ({text_field: line} for text files), or the BadRecord that says why it is not one."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return BadRecord(f"not UTF-8 text (byte {e.start} of the line)")
    if source.kind == "text":
        return {source.text_field: text}
    if not text.strip():
        return BadRecord("a blank line")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        return BadRecord(f"not valid JSON ({e.msg}, column {e.colno})")
    if not isinstance(record, dict):
        return BadRecord(f"a JSON {type(record).__name__}, not an object")
    return record


def _parquet_rows(source: Source, piece: Piece) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    table = pq.ParquetFile(source.files[piece.file]).read_row_group(piece.start)
    yield from table.to_pylist()


def _counted(rows: Iterator[Any], skip: int) -> Iterator[tuple[Any, int]]:
    for n, row in enumerate(rows):
        if n >= skip:
            yield row, n


_HUB: dict[tuple[str, str], Any] = {}


def _hub(source: Source):
    """The dataset's streaming `datasets.IterableDataset` (its train split), opened once per process."""
    key = (source.spec, source.config)
    if key not in _HUB:
        import datasets

        datasets.disable_progress_bars()
        try:
            _HUB[key] = datasets.load_dataset(source.spec, source.config or None, split="train", streaming=True)
        except Exception as e:  # offline, unknown name, gated: the library's own words, and what to do instead
            raise ConfigError([Problem(f"could not stream the Hugging Face dataset {source.spec!r}: "
                                       f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                                       f"--data {source.spec}", "check the name and the network, or pass local "
                                       ".jsonl/.txt/.parquet files")]) from None
    return _HUB[key]


def text_of(record: dict[str, Any] | BadRecord, source: Source) -> str | BadRecord:
    """The record's text field, or the BadRecord that says what is wrong with it."""
    if isinstance(record, BadRecord):
        return record
    value = record.get(source.text_field)
    if isinstance(value, str):
        return value
    return BadRecord(f"no field {source.text_field!r} (its fields: {', '.join(record) or 'none'})" if value is None
                     else f"field {source.text_field!r} holds a {type(value).__name__}, not text")


def first_record(source: Source) -> tuple[Piece, dict[str, Any] | BadRecord, int] | None:
    """The source's first record, its piece and position; None for a source without one."""
    for piece in pieces(source):
        for record, position in records(source, piece, None):
            return piece, record, position
    return None


def check_first_records(sources: list[Source], fields: tuple[str, ...] | None = None) -> list[Problem]:
    """Each source's first record read and the fields it must have found (None: its text field; an empty tuple:
    none): a mixture whose fields disagree is named before any process starts training."""
    fix = "name each source's text field (--text_field, or text_field: in a mixture YAML)" if fields is None else \
        f"give every source the fields {', '.join(fields)} (--data_format names another layout)"
    problems = []
    for source in sources:
        first = first_record(source)
        if first is None:
            problems.append(Problem(f"{source.spec} holds no record", f"--data {source.spec}", fix))
            continue
        piece, record, position = first
        if fields is not None and isinstance(record, dict):
            missing = [field for field in fields if field not in record]
            record = BadRecord(f"no field {', '.join(map(repr, missing))} (its fields: {', '.join(record)})") \
                if missing else record
        found = record if fields is not None else text_of(record, source)
        if isinstance(found, BadRecord):
            problems.append(Problem(f"{place(source, piece, position)}: {found.why}", f"--data {source.spec}", fix))
    return problems


def reading_error(where: str, bad: BadRecord) -> TrainingError:
    return TrainingError(f"cannot read {where}: {bad.why}",
                         "fix or remove that line and run the same command with --resume auto (from the last "
                         "checkpoint, or anew where none was written yet), or pass --bad_lines skip to count and "
                         "skip such lines")
