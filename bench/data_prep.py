"""Text preparation at 10M and 100M tokens: time and peak memory of trainkit/data/text.py against the code it replaced.

    python bench/data_prep.py                    # 15-30 minutes on 2 CPU cores (the baseline at 100M: 6-10 of
                                                 # them, and 6 GiB of memory), 3 GiB of free disk; writes
                                                 # BENCHMARKS.md's section and docs/images/data_prep.png
    python bench/data_prep.py --baseline_sizes 10    # the baseline at 10M only: about half the time
    python bench/data_prep.py --sizes 1,3 --baseline_sizes 1,3    # a quick look (millions of tokens)

The corpus is CPython's pydoc topics (the tiny transformer's default data), copied in a freshly shuffled document order
until it holds the size's tokens (counted with the BPE trained on it, vocabulary 1024, EOS included), as JSON lines
in a temporary folder. Each measurement is a fresh process that loads the documents (their Arrow copy already made,
not timed), makes the 128-token blocks and the unigram entropy, and reports the seconds that took; the new code
tokenises with one worker per core at every size, so that sizes compare like for like. The parent samples the
memory of that process and of its workers every 50 ms and keeps the peak of their sum: resident memory (RSS) and
the proportional share of anonymous memory (Pss_Anon). The anonymous part is what preparation holds; the rest of
RSS is pages of the memory-mapped Arrow files that the kernel can drop at any time (they count in RSS while mapped).
"Again" is the new code's second run on the same cache: it only reads the cached blocks.

The baseline is a copy of the functions that trainkit/data/text.py had before, kept here only to be measured: it groups
the whole tokenised corpus as one batch of Python lists and counts unigrams with a Counter.
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
from collections import Counter
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sections import BENCHMARKS, IMAGES, replace_section  # noqa: E402

from trainkit.data import text  # noqa: E402
from trainkit.launch.hardware import cpu_cores  # noqa: E402

START, END = "<!-- data preparation: written by bench/data_prep.py -->", "<!-- end of data preparation -->"
PNG = IMAGES / "data_prep.png"
SEQ_LEN, VOCAB = 128, 1024
GIB = 1 << 30


# ---- baseline: trainkit/data/text.py's token_blocks and unigram_entropy before this benchmark's change, verbatim ----
def baseline_token_blocks(docs, tokenizer, seq_len: int):
    """Every document tokenised and followed by EOS, concatenated, and cut into blocks of seq_len tokens."""

    def tokenize(batch):
        return {"input_ids": [ids + [tokenizer.eos_token_id] for ids in tokenizer(batch["text"])["input_ids"]]}

    def group(batch):
        flat = [t for ids in batch["input_ids"] for t in ids]
        usable = len(flat) // seq_len * seq_len
        return {"input_ids": [flat[i:i + seq_len] for i in range(0, usable, seq_len)]}

    tokens = docs.map(tokenize, batched=True, remove_columns=["text"])
    # One batch holds the whole corpus so that no tokens are lost between blocks; fine at this scale.
    return tokens.map(group, batched=True, batch_size=len(tokens))


def baseline_unigram_entropy(blocks) -> float:
    """Entropy (nats per token) of the corpus's token frequencies: the loss of a model that ignores context."""
    import math

    counts = Counter(t for row in blocks["input_ids"] for t in row)
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())
# ---- end of baseline ----


def child(code: str, corpus: Path, cache: Path, tokenizer_dir: Path, num_proc: int) -> None:
    """One measured preparation, in its own process; prints one JSON line."""
    from transformers import PreTrainedTokenizerFast

    docs = text.load_documents(str(corpus), "", "text", cache)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    if code == "load":
        return
    before = pss_anon(os.getpid())
    processes = 1 if code == "baseline" else num_proc
    start = time.perf_counter()
    if code == "baseline":
        blocks = baseline_token_blocks(docs, tokenizer, SEQ_LEN)
        entropy = baseline_unigram_entropy(blocks)
    else:
        blocks = text.token_blocks(docs, tokenizer, SEQ_LEN, num_proc=num_proc)
        entropy = text.unigram_entropy(blocks)
    print(json.dumps({"seconds": time.perf_counter() - start, "blocks": len(blocks), "entropy": entropy,
                      "anon_before": before,
                      "processes": processes}))


def pss_anon(pid: int) -> int:
    """A process's proportional share of anonymous memory (Linux): a page that forked workers still share with
    their parent counts once over all of them, where RSS would count it in each."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss_Anon:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("this benchmark reads Pss_Anon from /proc/<pid>/smaps_rollup: it needs Linux 5.9 or later")


def tree_memory(proc: psutil.Process) -> tuple[int, int]:
    """(RSS, proportional anonymous memory) summed over a process and its descendants; 0 for any that ended."""
    rss = anon = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            rss, anon = rss + p.memory_info().rss, anon + pss_anon(p.pid)
        except (psutil.Error, OSError):
            continue
    return rss, anon


def measured(code: str, corpus: Path, cache: Path, tokenizer_dir: Path) -> dict:
    # Every size with the same processes (one per core), so that memory is compared like for like: the default
    # (text.default_num_proc) would take one on the smaller corpus.
    cmd = [sys.executable, __file__, "--child", code, "--corpus", str(corpus), "--cache", str(cache),
           "--tokenizer", str(tokenizer_dir), "--num_proc", str(cpu_cores())]
    return run_watched(cmd, f"{code} on {corpus.name}")


def run_watched(cmd: list[str], name: str) -> dict:
    """A child process's last line (JSON) and the peak memory of it and its own children (RSS and anonymous,
    tree_memory), sampled every 50 ms while it runs."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    watched = psutil.Process(proc.pid)
    peak_rss = peak_anon = 0
    while proc.poll() is None:
        rss, anon = tree_memory(watched)
        peak_rss, peak_anon = max(peak_rss, rss), max(peak_anon, anon)
        time.sleep(0.05)
    out = proc.stdout.read()
    if proc.returncode:
        raise SystemExit(f"{name} failed (exit {proc.returncode})")
    return {**json.loads(out.strip().splitlines()[-1]), "peak_rss": peak_rss, "peak_anon": peak_anon}


def write_corpus(path: Path, lines: list[str], copies: int) -> None:
    order = list(range(len(lines)))
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(copies):
            rng.shuffle(order)
            f.writelines(lines[i] for i in order)


def baseline_need(rows: list[dict], tokens: int) -> float:
    """The baseline's peak anonymous memory at `tokens`, extrapolated linearly from its largest measurement."""
    done = [r for r in rows if r["code"] == "baseline" and "first" in r]
    if not done:
        return 0.0
    last = done[-1]
    grown = (last["first"]["peak_anon"] - last["first"]["anon_before"]) / last["tokens"]
    return last["first"]["anon_before"] + grown * tokens


def measure(sizes: list[int], baseline_sizes: list[int], tmp: Path) -> list[dict]:
    docs = text.load_documents("pydoc", "", "text", tmp)
    tokenizer = text.train_tokenizer(docs, VOCAB, tmp / "tokenizer")
    lines = [json.dumps({"text": row["text"]}) + "\n" for row in docs]
    per_copy = sum(len(ids) + 1 for ids in tokenizer([row["text"] for row in docs])["input_ids"])
    rows = []
    for millions in sizes:
        copies = -(-millions * 10**6 // per_copy)
        corpus = tmp / f"corpus_{millions}M.jsonl"
        write_corpus(corpus, lines, copies)
        codes = ["new", "baseline"] if millions in baseline_sizes else ["new"]
        need = baseline_need(rows, copies * per_copy)
        if "baseline" in codes and need > psutil.virtual_memory().available / 2:
            codes.remove("baseline")  # it would crowd the machine: say so in the table instead
            rows.append({"tokens": copies * per_copy, "code": "baseline", "skipped_need": need})
        for code in codes:
            cache = tmp / f"cache_{millions}M_{code}"
            subprocess.run([sys.executable, __file__, "--child", "load", "--corpus", str(corpus), "--cache",
                            str(cache), "--tokenizer", str(tmp / "tokenizer")], check=True)
            runs = [measured(code, corpus, cache, tmp / "tokenizer")]
            if code == "new":
                runs.append(measured(code, corpus, cache, tmp / "tokenizer"))
            row = {"tokens": copies * per_copy, "code": code, "first": runs[0],
                   "again": runs[1] if len(runs) > 1 else None, "corpus_bytes": corpus.stat().st_size}
            rows.append(row)
            print(json.dumps(row), flush=True)
        corpus.unlink()
        for code in codes:
            subprocess.run(["rm", "-rf", str(tmp / f"cache_{millions}M_{code}")], check=True)
    return rows


def table(rows: list[dict]) -> str:
    out = ["| code | corpus tokens | tokenising processes | blocks | unigram entropy | seconds | again (cached) | "
           "peak RSS | peak anonymous | anonymous above start |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "skipped_need" in r:
            out.append(f"| {r['code']} | {r['tokens'] / 1e6:.1f}M | not run: it would need about "
                       f"{r['skipped_need'] / GIB:.1f} GiB (extrapolated), over half of the free memory" + " |" * 8)
            continue
        first = r["first"]
        grown = first["peak_anon"] - first["anon_before"]
        again = f"{r['again']['seconds']:.2f} s" if r["again"] else "-"
        out.append(f"| {r['code']} | {r['tokens'] / 1e6:.1f}M | {first['processes']} | {first['blocks']:,} | "
                   f"{first['entropy']:.6f} | "
                   f"{first['seconds']:.1f} | {again} | {first['peak_rss'] / GIB:.2f} GiB | "
                   f"{first['peak_anon'] / GIB:.2f} GiB | {grown / GIB:.2f} GiB |")
    return "\n".join(out)


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for code, marker in (("baseline", "o"), ("new", "s")):
        mine = [r for r in rows if r["code"] == code and "first" in r]
        ax.plot([r["tokens"] / 1e6 for r in mine], [r["first"]["peak_anon"] / GIB for r in mine], marker=marker,
                label=code)
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("corpus tokens (millions)")
    ax.set_ylabel("peak anonymous memory (GiB)")
    ax.set_title("Text preparation: peak memory against corpus size")
    ax.legend()
    fig.tight_layout()
    PNG.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PNG, dpi=100)


def write_section(rows: list[dict], command: str) -> None:
    import datasets
    import tokenizers

    cores = cpu_cores()
    section = (f"{START}\n## Text preparation: time and memory against corpus size\n\n"
               f"Command: `{command}` ({platform.processor() or platform.machine()}, {cores} cores, "
               f"{psutil.virtual_memory().total / GIB:.0f} GiB; Python {platform.python_version()}, datasets "
               f"{datasets.__version__}, tokenizers {tokenizers.__version__}; measured while other jobs shared the "
               f"cores, so the seconds are noisy and the memory is what to read).\n\n" + table(rows) + "\n\n"
               "![peak memory against corpus size](docs/images/data_prep.png)\n\n"
               "The corpus is the pydoc topics repeated in shuffled order; blocks of 128 tokens, BPE vocabulary "
               "1024. `peak anonymous` is the peak of the anonymous memory (not a file's pages) of the preparing "
               "process and its tokenising workers together, each counted by its proportional share (Pss_Anon: "
               "what forked workers still share with their parent counts once); `anonymous above start` the "
               "same less what the process held before preparing (the libraries). Each worker adds its own "
               "bounded slice work: memory grows with the cores, not with the corpus. "
               "RSS also counts the pages of the memory-mapped Arrow files that "
               "were read, which the kernel drops under pressure. The baseline held the whole tokenised corpus as "
               "Python lists: its memory grows with the corpus. trainkit/data/text.py now tokenises in slices of "
               "1 MiB of text (one process per core on corpora of 16 MiB of text or more) and packs about 2^20 "
               "tokens at a time with numpy, so its memory stays nearly flat; it drops at most 127 of each 2^20 "
               "tokens, so its block count can be a few below the baseline's. `again`: the second run reads the "
               f"cached blocks.\n{END}")
    replace_section(section, START, END)
    print(f"wrote {BENCHMARKS} and {PNG}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10,100", help="corpus sizes in millions of tokens, comma-separated")
    parser.add_argument("--baseline_sizes", default="10,100",
                        help="the sizes at which the baseline also runs, unless its memory, extrapolated from the "
                             "previous size, would exceed half of the free memory")
    parser.add_argument("--child", choices=["load", "baseline", "new"], help=argparse.SUPPRESS)
    parser.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--num_proc", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.corpus, args.cache, args.tokenizer, args.num_proc)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    baseline_sizes = [int(s) for s in args.baseline_sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(sizes, baseline_sizes, Path(tmp))
    plot(rows)
    write_section(rows, "python bench/data_prep.py" + "".join(
        f" --{k} {v}" for k, v in (("sizes", args.sizes), ("baseline_sizes", args.baseline_sizes))
        if v != parser.get_default(k)))


if __name__ == "__main__":
    main()
