"""Training data read as it trains (--streaming): the global batch order of trainkit/data/batches.py kept without
preparing the corpus first, and a resume that continues from recorded positions instead of reading the corpus up to
them.

Lanes. A global batch of G samples has G positions; position j of every global batch is fed by lane j, a stream of
rows of its own. Of each source (trainkit/data/stream_sources.py) a lane reads the pieces j, j + G, j + 2G, ... of the
endless sequence that lists the source's training pieces in a permutation drawn from (seed, source, epoch), epoch after
epoch: a source that runs out starts again in a new order (the rule for an exhausted source). The lane tokenises the
records and packs them into rows (a RowMaker, trainkit/data/stream_rows.py). Row k of a lane comes from the source that
a uniform number drawn from (seed, k) for that lane picks by the sources' weights. So global batch k is row k of lanes
0 .. G - 1: it depends on the seed, G and the sources, never on the number of processes or the micro-batch split, and
each process reads only the lanes of the positions it computes (no process reads what another one trains on).

A lane's state is, per source, [round, position of a record in its piece, what of that record is used]: a resume
re-reads one record and goes on. Each process writes its lanes' states into the checkpoint; a resume with another
number of processes reads them all and takes its own.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from trainkit.data import stream_sources as src
from trainkit.data.batches import BatchLayout, TrainStream, private_generator
from trainkit.errors import ConfigError, Problem, TrainingError
from trainkit.launch.hardware import cpu_cores, local_processes

# The held-out split: the last pieces of each source (eval_fraction of them, one at least), read into memory up to
# this many tokens in all; evaluation reads eval_batches global batches of it.
HELD_OUT_TOKENS = 1 << 18
RECORDS_PER_CALL = 64  # records tokenised in one call of the tokenizer, which pays its per-call cost once for them
MAX_WORKERS = 4  # data workers per process, at most: more only compete with the training for the cores


@dataclass(frozen=True, slots=True)
class Streamed:
    """A recipe's training split when it is streamed: what build_datasets returns in place of a map-style dataset.
    `rows` (a RowMaker) runs in the data workers, so it pickles."""

    sources: tuple[src.Source, ...]
    train: tuple[tuple[src.Piece, ...], ...]  # each source's training pieces, in their one order
    held: tuple[tuple[src.Piece, ...], ...]  # each source's held-out pieces
    bad_lines: str = "stop"  # stop | skip
    rows: Any = None
    mixture: bool = False  # weighed sources (or a mixture YAML): streamed whatever --streaming says
    # Online RL's completion slots (trainkit/data/prompts.py): each row fills `group` positions side by side (its
    # completions), and each global batch is given `repeats` steps in a row (--num_iterations)
    group: int = 1
    repeats: int = 1

    @classmethod
    def open(cls, data: str, text_field: str, data_config: str, eval_fraction: float, bad_lines: str,
             fields: tuple[str, ...] | None = None) -> Streamed:
        """The sources --data names, each cut into pieces, its last eval_fraction of them held out; every source's
        first record must have `fields` (None: its text field)."""
        sources = src.parse_data(data, text_field, data_config)
        problems, train, held = src.check_first_records(sources, fields), [], []
        for source in sources:
            pieces = src.pieces(source)
            cut = len(pieces) - max(1, round(len(pieces) * eval_fraction))
            if cut < 1:
                problems.append(Problem(f"{source.spec} is one piece: nothing is left to train on once the held-out "
                                        f"split is taken", f"--data {source.spec}", "stream more data (a .gz file "
                                        "or a dataset shard is one piece)" + unstreamed(src.is_mixture(data))))
            train.append(tuple(pieces[:cut]))
            held.append(tuple(pieces[cut:]))
        if problems:
            raise ConfigError(problems)
        return cls(tuple(sources), tuple(train), tuple(held), bad_lines, mixture=src.is_mixture(data))

    def with_rows(self, rows: Any) -> Streamed:
        return dataclasses.replace(self, rows=rows)

    def grouped(self, group: int, repeats: int = 1) -> Streamed:
        """Rows that fill `group` positions each, every global batch given `repeats` times (trainkit/data/prompts.py's
        Slots, streamed)."""
        return dataclasses.replace(self, group=group, repeats=repeats)

    def sample_text(self, max_bytes: int) -> list[str]:
        """The text of each source's first training records, up to its weight's share of max_bytes (what a
        tokenizer is trained on)."""
        texts: list[str] = []
        for s, source in enumerate(self.sources):
            left = max_bytes * source.weight
            for record, *_ in self._records(s, ((0, piece, None) for piece in self.train[s]), [0]):
                if isinstance(text := src.text_of(record, source), str):
                    texts.append(text)
                    left -= len(text)
                if left <= 0:
                    break
        return texts

    def first_row(self) -> dict[str, Any] | None:
        """The first row of the first source's training pieces (what --dry_run shows), None where it gives none; a
        bad line on the way is named or skipped as the run would (bad_lines)."""
        made = self.rows.pack(self._examples(0, ((0, piece, None) for piece in self.train[0]), [0]), 0)
        return next((row for row, _ in made), None)

    def held_out(self) -> list[dict[str, torch.Tensor]]:
        """The held-out split: each source's held-out pieces made into rows, up to its weight's share of
        HELD_OUT_TOKENS, source after source."""
        held = []
        for s, source in enumerate(self.sources):
            made = self.rows.pack(self._examples(s, ((0, piece, None) for piece in self.held[s]), [0]), 0)
            limit = max(1, int(HELD_OUT_TOKENS * source.weight) // self.rows.seq_len)
            held += [row for row, _ in itertools.islice(made, limit)]
        return held

    def _records(self, s: int, located: Iterator[tuple[int, src.Piece, int | None]],
                 skipped: list[int]) -> Iterator[tuple]:
        """(record, round, piece, position) of each readable record of the pieces, from a position in the first;
        a bad line stops the run naming it, or is counted (in skipped[0]) and skipped: bad_lines."""
        source = self.sources[s]
        for round_, piece, at in located:
            for record, position in src.records(source, piece, at):
                if isinstance(record, src.BadRecord):
                    self._bad(source, piece, position, record, skipped)
                    continue
                yield record, round_, piece, position

    def _examples(self, s: int, located: Iterator[tuple[int, src.Piece, int | None]],
                  skipped: list[int]) -> Iterator[tuple]:
        """(example, (round, position)) of each record the RowMaker keeps, tokenised 1, 2, 4 ... RECORDS_PER_CALL
        records at a time: a lane that needs one row reads little more, one that reads on pays the tokenizer's
        per-call cost once per RECORDS_PER_CALL records."""
        records, size = self._records(s, located, skipped), 1
        while batch := list(itertools.islice(records, size)):
            size = min(2 * size, RECORDS_PER_CALL)
            made = self.rows.examples([record for record, *_ in batch], self.sources[s])
            for example, (_, round_, piece, position) in zip(made, batch, strict=True):
                if isinstance(example, src.BadRecord):
                    self._bad(self.sources[s], piece, position, example, skipped)
                elif example is not None:
                    yield example, (round_, position)

    def _bad(self, source: src.Source, piece: src.Piece, position: int, bad: src.BadRecord,
             skipped: list[int]) -> None:
        where = src.place(source, piece, position)
        if self.bad_lines != "skip":
            raise src.reading_error(where, bad)
        skipped[0] += 1
        print(f"warning: skipped {where}: {bad.why} (--bad_lines skip)", file=sys.stderr, flush=True)


def unstreamed(mixture: bool) -> str:
    """The other way out, where there is one: a mixture is always streamed (its weights are the stream's)."""
    return "" if mixture else ", or train without --streaming"


def lane_pieces(pieces: tuple[src.Piece, ...], s: int, lane: int, lanes: int, seed: int,
                first_round: int) -> Iterator[tuple[int, src.Piece]]:
    """(round, piece) of a lane from a round on: piece lane + round x lanes of the source's endless sequence of
    epochs, each epoch a permutation of its pieces drawn from (seed, source, epoch)."""
    order, epoch_of = None, -1
    for round_ in itertools.count(first_round):
        epoch, index = divmod(lane + round_ * lanes, len(pieces))
        if epoch != epoch_of:
            order, epoch_of = np.random.default_rng((seed, 1, s, epoch)).permutation(len(pieces)), epoch
        yield round_, pieces[order[index]]


def draws(seed: int, k: int, lanes: int) -> np.ndarray:
    """The uniform numbers that pick each lane's source for row k (the same in every process)."""
    return np.random.default_rng((seed, 2, k)).random(lanes)


def lane_rows(streamed: Streamed, lane: int, lanes: int, seed: int, first: int,
              state: dict[str, list]) -> Iterator[tuple[dict[str, torch.Tensor], dict[str, list]]]:
    """A lane's rows from row `first` on, each with the lane's state after it: {source index: [round, position,
    used]} and the bad lines it skipped."""
    state = dict(state)
    skipped = [state.get("skipped", 0)]
    readers: dict[int, Iterator] = {}
    for k in itertools.count(first):
        s = int(source_of(streamed, draws(seed, k, lanes)[lane]))
        if s not in readers:
            first_round, at, used = state.get(str(s), (0, None, 0))
            located = resumed_at(lane_pieces(streamed.train[s], s, lane, lanes, seed, first_round), at)
            readers[s] = streamed.rows.pack(streamed._examples(s, located, skipped), used)
        row, ((round_, position), used) = next(readers[s])
        state = {**state, str(s): [round_, position, used], "skipped": skipped[0]}
        yield row, state


def resumed_at(pieces: Iterator[tuple[int, src.Piece]], at: int | None) -> Iterator[tuple[int, src.Piece, int | None]]:
    """(round, piece, where to start reading it): the first piece from the recorded position `at`, every later one
    from its start."""
    for i, (round_, piece) in enumerate(pieces):
        yield round_, piece, at if i == 0 else None


def source_of(streamed: Streamed, draw: np.ndarray) -> np.ndarray:
    """The source that each uniform draw picks, by the sources' weights."""
    cumulative = np.cumsum([source.weight for source in streamed.sources])
    return np.minimum(np.searchsorted(cumulative, draw, side="right"), len(cumulative) - 1)


class _Lanes(IterableDataset):
    """This process's lanes from row k on: for each row, one item of (lane, row, state after it) for its lanes. A
    data worker makes the lanes whose index (among this process's) is its own modulo the number of workers, so that
    the DataLoader's turn-taking between workers hands them out row after row. Rows travel as NumPy arrays, pickled
    with the item: a tensor would get a shared-memory segment of its own, which cost more than the row (measured in
    bench/streaming.py)."""

    def __init__(self, streamed: Streamed, lanes: list[int], width: int, seed: int, k: int, states: dict):
        self.streamed, self.lanes, self.width, self.seed, self.k, self.states = \
            streamed, lanes, width, seed, k, states

    def __iter__(self) -> Iterator[list[tuple[int, dict[str, np.ndarray], dict]] | _Failure]:
        info = get_worker_info()
        mine = self.lanes if info is None else self.lanes[info.id::info.num_workers]
        rows = [lane_rows(self.streamed, lane, self.width, self.seed, self.k, self.states.get(str(lane), {}))
                for lane in mine]
        try:
            while True:
                made = [(lane, *next(lane_made)) for lane, lane_made in zip(mine, rows, strict=True)]
                yield [(lane, {key: value.numpy() if torch.is_tensor(value) else value for key, value in row.items()},
                        state) for lane, row, state in made]
        except TrainingError as e:  # a bad line: named in the training process, as the run's own error
            yield _Failure(e.what, e.fix)
        except ConfigError as e:
            yield _Failure("", "", tuple(e.problems))


@dataclass(frozen=True, slots=True)
class _Failure:
    """An error of a data worker, carried to the training process and raised there as itself: the DataLoader would
    raise it again as a RuntimeError holding the worker's traceback."""

    what: str
    fix: str
    problems: tuple[Problem, ...] = ()

    def error(self) -> TrainingError | ConfigError:
        return ConfigError(list(self.problems)) if self.problems else TrainingError(self.what, self.fix)


def _as_they_are(item: Any) -> Any:
    """The DataLoader's conversion of each item (none): the rows stay NumPy arrays until they are collated."""
    return item


class StreamedTrain:
    """The runner's stream over Streamed data: the interface of trainkit/data/batches.py's TrainStream
    (next_global_batch,
    position, seek), the lanes' states for the checkpoint (rank_state) and the sources' shares for metrics.jsonl."""

    def __init__(self, streamed: Streamed, layout: BatchLayout, seed: int, workers: int):
        self.streamed, self.layout, self.seed = streamed, layout, seed
        first = layout.rank * layout.micro_batch * layout.grad_accum
        self.positions = range(first, first + layout.micro_batch * layout.grad_accum)
        # a lane per row of a global batch: `group` positions each (streamed.grouped), this process's the rows of
        # its positions
        self.width = layout.global_batch // streamed.group
        self.lanes = sorted({position // streamed.group for position in self.positions})
        # a divisor of the lanes, so that each worker always makes the same lanes (_Lanes)
        self.workers = max(w for w in range(min(workers, len(self.lanes)) + 1) if w == 0 or len(self.lanes) % w == 0)
        self.k = 0  # global batches done
        self.states: dict[str, dict] = {}  # lane -> its state after the last row read
        self.before: dict[str, dict] = {}  # lane -> its state before it (the row a repeated batch is made of)
        self.last: list | None = None  # the last global batch, given again while it repeats
        self.rows_of = np.zeros(len(streamed.sources), dtype=np.int64)  # rows each source gave, every lane, so far
        self._iterator: Iterator | None = None
        mixture = ", ".join(f"{source.spec} {source.weight:.2f}" for source in streamed.sources)
        self.note = (f"--data streamed: {mixture}; {sum(map(len, streamed.train)):,} pieces to train on; "
                     f"{self.workers} data worker(s) per process" + ("" if self.workers else
                     " (rows made in the training process; --data_workers N starts N beside it)"))
        few = [source.spec for source, pieces in zip(streamed.sources, streamed.train, strict=True)
               if len(pieces) < self.width]
        if few:  # lanes j and j + pieces start on the same piece (in two epochs' orders): rows can repeat
            self.note += (f"; {', '.join(few)}: fewer pieces to train on than the {self.width} rows of a "
                          f"global batch, so a global batch can hold a row twice (stream more data"
                          f"{unstreamed(streamed.mixture)})")

    @property
    def position(self) -> tuple[int, int]:
        return 0, self.k

    def rank_state(self) -> dict[str, Any]:
        """What the checkpoint keeps of this process's stream (data/rank_<r>.json): where each lane reads its next
        row, or within a repeated batch (streamed.repeats) where it reads that batch's row again."""
        states = self.before if self.k % self.streamed.repeats else self.states
        return {"lanes": {lane: states[lane] for lane in map(str, self.lanes) if lane in states},
                "rows_of_sources": self.rows_of.tolist()}

    def seek(self, epoch: int, k: int, rank_states: list[dict[str, Any]] | None = None) -> None:
        """Continue after global batch k, from the lanes' states that the checkpoint's processes wrote."""
        self.k, self._iterator, self.last, rank_states = k, None, None, rank_states or []
        self.states = {lane: state for saved in rank_states for lane, state in saved["lanes"].items()}
        self.rows_of = np.array(rank_states[0]["rows_of_sources"]) if rank_states else self.rows_of

    def next_global_batch(self) -> list:
        if self.k % self.streamed.repeats and self.last is not None:  # the same batch, trained on again
            self.k += 1
            return [dict(micro_batch) for micro_batch in self.last]  # as a new batch: its users may change it
        row_k = self.k // self.streamed.repeats  # the lanes' row this batch is made of
        if self._iterator is None:
            if self.workers:  # the tokenizer's own threads would be stopped in each forked worker, with a warning
                os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            lanes = _Lanes(self.streamed, self.lanes, self.width, self.seed, row_k, self.states)
            self._iterator = iter(DataLoader(lanes, batch_size=None, num_workers=self.workers,
                                             collate_fn=_as_they_are, generator=private_generator()))
        items = [next(self._iterator) for _ in range(max(1, self.workers))]
        if failed := next((item for item in items if isinstance(item, _Failure)), None):
            raise failed.error()
        made = {lane: (row, state) for item in items for lane, row, state in item}
        assert sorted(made) == self.lanes, sorted(made)  # one row of every lane: the workers took turns
        self.before = dict(self.states)
        for lane in self.lanes:
            self.states[str(lane)] = made[lane][1]
        if self.k % self.streamed.repeats == 0:  # a batch resumed within its repeats was counted when first read
            self.rows_of += np.bincount(source_of(self.streamed, draws(self.seed, row_k, self.width)),
                                        minlength=len(self.rows_of))
        rows = [self._slot(made[position // self.streamed.group][0], position, row_k) for position in self.positions]
        self.k += 1
        m = self.layout.micro_batch
        self.last = [default_collate(rows[a * m:(a + 1) * m]) for a in range(self.layout.grad_accum)]
        return self.last

    def _slot(self, row: dict[str, Any], position: int, row_k: int) -> dict[str, Any]:
        """Position `position`'s sample of its lane's row: the row itself, or one of a group's slots (its number in
        the group, and the row's number in the run's order, which seeds its sampling: trainkit/rl/sampling.py)."""
        if self.streamed.group == 1:
            return row
        lane = position // self.streamed.group
        return {**row, "index": np.int64(row_k * self.width + lane),
                "generation": np.int64(position % self.streamed.group)}

    def metrics(self, accelerator: Any, copies: int) -> dict[str, Any]:
        """Each source's share of the rows trained on so far (a mixture), and the bad lines every process skipped
        (--bad_lines skip; a collective then: `copies` processes read each lane)."""
        out: dict[str, Any] = {}
        if len(self.rows_of) > 1:
            out["data_share"] = {source.spec: round(float(rows / self.rows_of.sum()), 6)
                                 for source, rows in zip(self.streamed.sources, self.rows_of, strict=True)}
        if self.streamed.bad_lines == "skip":
            # a lane whose group spans processes is counted by the one that holds its first position
            owned = [str(lane) for lane in self.lanes if lane * self.streamed.group in self.positions]
            mine = sum(state.get("skipped", 0) for state in map(self.states.get, owned) if state)
            total = accelerator.reduce(torch.tensor([float(mine)], device=accelerator.device), "sum").item()
            out["skipped_lines"] = round(total / copies)
        return out


def default_workers(lanes_per_process: int) -> int:
    """Data workers per process: the cores this machine's processes leave free of their compute threads, shared
    between them, at most MAX_WORKERS; 0 (the data made in the training process) where none are free."""
    free = cpu_cores() - local_processes(os.environ) * torch.get_num_threads()
    return max(0, min(MAX_WORKERS, free // local_processes(os.environ), lanes_per_process))


def open_stream(train_set: Any, layout: BatchLayout, seed: int, workers: int | None) -> TrainStream | StreamedTrain:
    """This process's stream of micro-batches: over streamed data (workers None: default_workers), or over a
    prepared data set (trainkit/data/batches.py)."""
    if isinstance(train_set, Streamed):
        lanes = layout.micro_batch * layout.grad_accum
        return StreamedTrain(train_set, layout, seed, default_workers(lanes) if workers is None else workers)
    return TrainStream(train_set, layout, seed)
