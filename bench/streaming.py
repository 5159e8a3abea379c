"""Streamed data (trainkit/data/stream.py) against preparing it first (trainkit/data/text.py), as the corpus grows.

    python bench/streaming.py                 # about 15 minutes on 2 CPU cores; 4 GiB of free disk for the 1B-token
                                              # corpus; writes BENCHMARKS.md's section
    python bench/streaming.py --tokens 100    # a quicker look: streamed sizes up to 100M tokens

The corpus is CPython's pydoc topics in a freshly shuffled document order, copy after copy, as JSON lines in shards of
about 5M tokens (counted with the BPE trained on it, vocabulary 1024, EOS included); the 10M, 100M and 1B corpora
are the first 2, 20 and 200 shards, streamed as a mixture of two sources: the shards of even number (weight 0.7)
and of odd number (0.3). Each figure comes from a fresh process that reads the data as a one-process run of the tiny
transformer's default global batch does (32 rows of 128 tokens) and nothing else: the data path alone.
The parent samples the memory of that process and its data workers every 50 ms and keeps the peak of their sum
(RSS, and the proportional share of anonymous memory, bench/data_prep.py's measure). The file pages are dropped
from the kernel's cache before each process where this is allowed (root), so every read comes from the disk.

Streamed: `first batch` is the seconds from the process's start of work (its imports done) to its first global
batch: the sources listed and cut into pieces, the cached tokenizer loaded, the first rows of every lane made.
`resume at N%`: the same for a stream continuing from lane positions N% of the way through the corpus (each lane's
position taken from a stream that got there and made two batches, as a checkpoint keeps them). Prepared: `first
batch` is the preparation (text.token_blocks, nothing cached) and the first batch; `resume at 90%` loads the cached
blocks and seeks there. `tokens/s` is the data path's rate over 100 global batches after the first.

Then whole runs on the 1B-token mixture (`python train.py --recipe tiny_transformer --data <mixture>`): the seconds
from the command to its first step (metrics.jsonl's first elapsed_s, the interpreter's start included), with the
tokenizer still to train on the sources' first 16 MiB and with it cached; and the share of each step that waited for
its data (data_wait_s over the step's time, median of 60 steps after the first 5) with the rows made in the training
process and with one data worker, at one compute thread.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from data_prep import run_watched  # noqa: E402
from sections import BENCHMARKS, replace_section  # noqa: E402

from trainkit.data import text  # noqa: E402
from trainkit.launch.hardware import cpu_cores  # noqa: E402

START, END = "<!-- streaming: written by bench/streaming.py -->", "<!-- end of streaming -->"
SEQ_LEN, VOCAB, GLOBAL, STEPS = 128, 1024, 32, 100
SHARD_TOKENS = 5 * 10**6
GIB = 1 << 30


def child(kind: str, data: str, tokenizer_dir: Path, cache: Path, position: float, workers: int) -> None:
    """One measurement, printed as a JSON line."""
    import torch
    from transformers import PreTrainedTokenizerFast

    from trainkit.data.batches import BatchLayout, TrainStream
    from trainkit.data.stream import Streamed, StreamedTrain
    from trainkit.data.stream_rows import TextBlocks

    torch.set_num_threads(1)
    layout, started = BatchLayout(GLOBAL, 1, 0, 1), time.perf_counter()
    if kind == "stream":
        streamed = Streamed.open(data, "text", "", 0.0001, "stop")
        rows = TextBlocks(PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir)), SEQ_LEN)
        streamed = streamed.with_rows(rows)
        stream = StreamedTrain(streamed, layout, 0, workers)
        if position:
            stream.seek(0, 0, [lane_states(streamed, position)])
            stream.next_global_batch(), stream.next_global_batch()  # the lanes now stand inside their pieces
            states = [json.loads(json.dumps(stream.rank_state()))]
            drop_caches()
            started = time.perf_counter()
            stream = StreamedTrain(streamed, layout, 0, workers)
            stream.seek(0, 2, states)
    else:
        docs = text.load_documents(data, "", "text", cache)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
        blocks = text.token_blocks(docs, tokenizer, SEQ_LEN).with_format("torch")
        stream = TrainStream(blocks, layout, 0)
        stream.seek(0, int(position * stream.sampler.batches_per_epoch))
    stream.next_global_batch()
    first = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(STEPS):
        stream.next_global_batch()
    rate = STEPS * GLOBAL * SEQ_LEN / (time.perf_counter() - started)
    print(json.dumps({"first_s": first, "tokens_per_s": rate}))


def lane_states(streamed, position: float) -> dict:
    """Every lane, in every source, at the piece that lies `position` of the way through its training pieces."""
    def at(pieces: int, lane: int) -> list:
        return [max(0, int((position * pieces - lane) // GLOBAL)), None, 0]

    return {"lanes": {str(lane): {str(s): at(len(pieces), lane) for s, pieces in enumerate(streamed.train)}
                      for lane in range(GLOBAL)}, "rows_of_sources": [0] * len(streamed.sources)}


def drop_caches() -> bool:
    """The kernel's file cache emptied (root only), so that reads come from the disk; whether it could be."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def measured(kind: str, data: str, tokenizer_dir: Path, cache: Path, position: float = 0.0,
             workers: int = 0) -> dict:
    drop_caches()
    cmd = [sys.executable, __file__, "--child", kind, "--data", data, "--tokenizer", str(tokenizer_dir),
           "--cache", str(cache), "--position", str(position), "--workers", str(workers)]
    return run_watched(cmd, f"{kind} {data}")


def write_corpus(tmp: Path, tokens: int) -> tuple[Path, int, float]:
    """Shards of shuffled pydoc copies up to `tokens`; returns their folder, the tokens of one copy and the seconds
    writing took."""
    started = time.perf_counter()
    docs = text.load_documents("pydoc", "", "text", tmp)
    tokenizer = text.train_tokenizer(docs, VOCAB, tmp / "tokenizer")
    lines = [json.dumps({"text": row["text"]}) + "\n" for row in docs]
    per_copy = sum(len(ids) + 1 for ids in tokenizer([row["text"] for row in docs])["input_ids"])
    folder, rng, order = tmp / "shards", random.Random(0), list(range(len(lines)))
    folder.mkdir()
    copies_per_shard = -(-SHARD_TOKENS // per_copy)
    for shard in range(max(2, -(-tokens // (copies_per_shard * per_copy)))):
        with open(folder / f"shard-{shard:05d}.jsonl", "w") as f:
            for _ in range(copies_per_shard):
                rng.shuffle(order)
                f.writelines(lines[i] for i in order)
    return folder, per_copy * copies_per_shard, time.perf_counter() - started


def subset(folder: Path, tokens: int, per_shard: int) -> tuple[str, int]:
    """A folder of links to the first shards that hold `tokens`: the mixture of its even and odd shards, and the
    tokens it holds."""
    name = folder.parent / f"c{tokens // 10**6}M"
    name.mkdir(exist_ok=True)
    shards = sorted(folder.glob("*.jsonl"))[:max(2, -(-tokens // per_shard))]
    for i, shard in enumerate(shards):
        link = name / f"{'ab'[i % 2]}-{shard.name}"
        if not link.exists():
            link.symlink_to(shard)
    return f"{name}/a-*.jsonl:0.7,{name}/b-*.jsonl:0.3", len(shards) * per_shard


def measure(sizes: list[int], prepared: list[int], tmp: Path) -> tuple[list[dict], dict]:
    folder, per_shard, wrote = write_corpus(tmp, max(sizes) * 10**6)
    info = {"per_shard": per_shard, "write_s": wrote, "disk": sum(f.stat().st_size for f in folder.iterdir()),
            "dropped": drop_caches()}
    rows = []
    for millions in sizes:
        data, tokens = subset(folder, millions * 10**6, per_shard)
        row = {"kind": "streamed", "tokens": tokens,
               "start": measured("stream", data, tmp / "tokenizer", tmp),
               "workers": measured("stream", data, tmp / "tokenizer", tmp, workers=2),
               **{f"resume_{p}": measured("stream", data, tmp / "tokenizer", tmp, position=p / 100)
                  for p in (10, 50, 90)}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    for millions in prepared:
        data, tokens = subset(folder, millions * 10**6, per_shard)
        files = ",".join(str(f) for f in sorted(Path(data.split(":")[0]).parent.iterdir()))
        cache = tmp / f"cache{millions}"
        row = {"kind": "prepared", "tokens": tokens,
               "start": measured("prepare", files, tmp / "tokenizer", cache),
               "resume_90": measured("prepare", files, tmp / "tokenizer", cache, position=0.9)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    info["runs"] = whole_runs(subset(folder, max(sizes) * 10**6, per_shard)[0], tmp)
    return rows, info


def whole_runs(data: str, tmp: Path) -> dict:
    """train.py on the mixture: seconds to its first step (tokenizer to train, then cached), and the share of the
    step that waits for data without and with a data worker."""
    def run(name: str, steps: int, *flags: str) -> list[dict]:
        drop_caches()
        out = tmp / name
        env = {**os.environ, "TRAINKIT_CPU_THREADS": "1"}  # the default cache: its measured CPU peak (the data's
        # tokenizer is new: its cache key names the corpus's temporary files)
        subprocess.run([sys.executable, str(ROOT / "train.py"), "--recipe", "tiny_transformer", "--data", data,
                        "--max_steps", str(steps), "--eval_every", "0", "--output_dir", str(out), "--report_to",
                        "none", *flags], check=True, cwd=ROOT, env=env, capture_output=True)
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    def waiting(metrics: list[dict]) -> float:
        shares = sorted(m["data_wait_s"] * m["samples_per_s"] / GLOBAL for m in metrics[5:])
        return shares[len(shares) // 2]

    cold, warm = run("cold", 1), run("warm", 1)
    return {"first_step_cold": cold[0]["elapsed_s"], "first_step_warm": warm[0]["elapsed_s"],
            "wait_in_process": waiting(run("w0", 65, "--data_workers", "0")),
            "wait_one_worker": waiting(run("w1", 65, "--data_workers", "1"))}


def table(rows: list[dict]) -> str:
    out = ["| data | corpus tokens | first batch (s) | resume at 10% / 50% / 90% (s) | tokens/s, in process | "
           "tokens/s, 2 workers | peak RSS | peak anonymous |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        resumes = " / ".join(f"{r[f'resume_{p}']['first_s']:.2f}" if f"resume_{p}" in r else "-" for p in (10, 50, 90))
        workers = f"{r['workers']['tokens_per_s']:,.0f}" if "workers" in r else "-"
        peak = max((r[k] for k in ("start", "workers", "resume_90") if k in r), key=lambda m: m["peak_anon"])
        out.append(f"| {r['kind']} | {r['tokens'] / 1e6:,.0f}M | {r['start']['first_s']:.2f} | {resumes} | "
                   f"{r['start']['tokens_per_s']:,.0f} | {workers} | {peak['peak_rss'] / GIB:.2f} GiB | "
                   f"{peak['peak_anon'] / GIB:.2f} GiB |")
    return "\n".join(out)


def sizes_of(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["kind"] == "streamed"]


def write_section(rows: list[dict], info: dict, command: str, load: tuple[float, float, float]) -> None:
    import tokenizers
    import torch

    section = (
        f"{START}\n## Streamed data: time to the first batch, resume and memory against corpus size\n\n"
        f"Command: `{command}` ({platform.processor() or platform.machine()}, {cpu_cores()} cores, "
        f"{psutil.virtual_memory().total / GIB:.0f} GiB; Python {platform.python_version()}, torch {torch.__version__}"
        f", tokenizers {tokenizers.__version__}); load average before the run {load[0]:.2f} / {load[1]:.2f} / "
        f"{load[2]:.2f} (1 / 5 / 15 min); the corpus: {info['disk'] / GIB:.1f} GiB of JSON lines in shards of "
        f"{info['per_shard'] / 1e6:.1f}M tokens, written in {info['write_s']:.0f} s; file cache "
        f"{'dropped before each process' if info['dropped'] else 'not dropped (not root): reads may come from it'}."
        f"\n\n" + table(rows) + "\n\n"
        f"Whole runs on the {rows[len(sizes_of(rows)) - 1]['tokens'] / 1e9:.1f}B-token mixture, `python train.py "
        f"--recipe tiny_transformer --data <the mixture>`: the first step {info['runs']['first_step_cold']:.1f} s "
        f"after the command with the tokenizer to train (on 16 MiB of the sources), "
        f"{info['runs']['first_step_warm']:.1f} s with it cached. Waiting for data (data_wait_s over the step, "
        f"median): {info['runs']['wait_in_process']:.1%} of the step with the rows made in the training process, "
        f"{info['runs']['wait_one_worker']:.1%} with one data worker (`--data_workers 1`; one compute thread).\n\n"
        "A whole run's first step includes the interpreter's start and imports (about 5 s: torch, transformers, "
        "accelerate), the same for prepared data. One process reading the tiny transformer's global batch (32 rows "
        "of 128 tokens) and nothing else. Streamed, the first batch and a resume cost the same at every corpus "
        "size and position: a stream lists "
        "the shards' sizes, and each of the 32 lanes reads on from its own recorded byte offset, so a resume at 90% "
        "reads no more than one at 10%. The prepared path tokenises the whole corpus before its first batch (its "
        "resume, from the cached blocks, is a seek). Peak memory stays flat as the streamed corpus grows 10x and "
        "100x. On 2 cores the data workers only share the cores that also tokenise in the training process.\n"
        f"{END}")
    replace_section(section, START, END)
    print(f"wrote {BENCHMARKS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1000, help="the largest streamed corpus, millions of tokens")
    parser.add_argument("--prepared", default="10,100", help="sizes the prepare-first path runs at (millions)")
    parser.add_argument("--child", choices=["stream", "prepare"], help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--position", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.data, args.tokenizer, args.cache, args.position, args.workers)
        return
    load = os.getloadavg()
    sizes = [s for s in (10, 100, 1000) if s <= args.tokens]
    prepared = [int(s) for s in args.prepared.split(",") if s]
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        rows, info = measure(sizes, prepared, Path(tmp))
    write_section(rows, info, "python bench/streaming.py" + "".join(f" {a}" for a in sys.argv[1:]), load)


if __name__ == "__main__":
    main()
