"""Sequence parallelism at 8,192 tokens: each rank's peak memory under deepspeed_zero3_sp.yaml (DeepSpeed's Ulysses,
sp 2) against one process, both against the estimate; and the peer, the Transformers Trainer under the same YAML
(Accelerate's own sequence parallelism): tokens per second and peak resident memory side by side.

    python bench/sequence_parallel.py      # about 15 minutes on 2 CPU cores; run it alone on the machine

The model is bench/long_sequence.py's (a Llama built from a config: vocabulary 32,000, hidden 256, 4 layers, sdpa,
untied), saved with a byte-level BPE trained on the default corpus, whose text is cut into documents of one row each;
the causal-LM recipe at its defaults (the loss in chunks past 1 GiB of logits: whole at this length), one sequence of
8,192 tokens per optimizer step, fp32. Each configuration runs twice: under bench/live_peak.py (each rank's model
state plus the most its live tensors grow over a step: a GPU's max_memory_allocated, measured on a CPU) and plainly
for its speed and resident memory.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from long_sequence import HIDDEN, LAYERS, VOCAB, longest  # noqa: E402
from sections import replace_section  # noqa: E402

TOKENS, STEPS = 8192, 6
# label -> the YAML (None: `python train.py`, one process)
CONFIGS = {"one process": None, "deepspeed_zero3 (2 processes, a whole sequence each)": "deepspeed_zero3.yaml",
           "deepspeed_zero3_sp (sp 2: the ranks share a sequence)": "deepspeed_zero3_sp.yaml"}
GOAL = 0.6  # the sp 2 rank's peak over one process's
START, END = "<!-- sequence parallel: written by bench/sequence_parallel.py -->", "<!-- end of sequence parallel -->"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # two ranks on two cores; one process gets the same single thread
GiB = 1024 ** 3


def model_folder(folder: Path, cache_dir: Path) -> Path:
    """The Llama with a tokenizer trained on the default corpus (its vocabulary holds what the corpus gives, below
    the model's 32,000 rows: the head still computes all of them)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainkit.data.text import load_documents, train_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                                 num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
                                 tie_word_embeddings=False, max_position_embeddings=TOKENS)).save_pretrained(folder)
    corpus = load_documents("pydoc", "", "text", cache_dir)
    tokenizer = train_tokenizer(corpus, VOCAB, folder.with_name("tokenizer"))
    tokenizer.save_pretrained(folder)
    long_documents(folder / "long.jsonl", tokenizer, list(corpus["text"]))
    return folder


def long_documents(path: Path, tokenizer, topics: list[str]) -> Path:
    """Documents that `tokenizer` makes into exactly one row each (8,191 tokens and the end-of-text one): the default
    corpus's topics twice (once in order, once reversed), cut into windows of its tokens. A document cut into rows
    leaves a padded last row, and a padded row gives sdpa an attention mask: a step on this machine then also holds a
    heads x tokens x tokens fp32 copy of it, 1 GiB at this length (measured; the estimate does not count it)."""
    ids = tokenizer("\n\n".join(topics + topics[::-1]), add_special_tokens=False)["input_ids"]
    docs, start, wanted = [], 0, TOKENS - 1
    while start + wanted <= len(ids):
        # decoding a window and encoding it again may merge its ends otherwise: the longest that comes back whole
        doc = next((text for n in range(wanted, wanted - 64, -1)
                    if len(tokenizer(text := tokenizer.decode(ids[start:start + n]),
                                     add_special_tokens=False)["input_ids"]) == wanted), None)
        if doc is None:  # a window that begins inside a character's bytes: one token later
            start += 1
            continue
        docs.append(doc)
        start += wanted
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    return path


def flags(folder: Path, out: Path, steps: int) -> list[str]:
    return ["--recipe", "causal_lm", "--model_name_or_path", str(folder), "--tokenizer", "saved", "--seq_len",
            str(TOKENS), "--batch_size", "1", "--max_steps", str(steps), "--warmup_steps", "1", "--eval_every", "0",
            "--eval_batches", "1", "--eval_answers", "0", "--output_dir", str(out), "--report_to", "none",
            "--data", str(folder / "long.jsonl")]


def launcher(yaml: str | None) -> list[str]:
    if yaml is None:
        return [sys.executable]
    return ["accelerate", "launch", "--config_file", str(ROOT / "accelerate_configs" / yaml)]


def estimate(folder: Path, yaml: str | None) -> int:
    """The estimate's peak bytes per rank for this launch (what `--estimate` prints as its own row)."""
    from trainkit.command_line import parse_command_line
    from trainkit.plan import make_plan

    with tempfile.TemporaryDirectory() as tmp:
        argv = flags(folder, Path(tmp) / "out", STEPS) + ["--estimate"]
        if yaml:
            argv += ["--accelerate_config", str(ROOT / "accelerate_configs" / yaml)]
        return make_plan(*parse_command_line(argv)).estimate.device


def ours(folder: Path, yaml: str | None, work: Path) -> dict:
    peaks = work / "peaks"
    subprocess.run([*launcher(yaml), str(ROOT / "bench" / "live_peak.py"), str(peaks),
                    *flags(folder, work / "profiled", 2)], cwd=ROOT, env=ENV, check=True, capture_output=True)
    ranks = [json.loads(p.read_text()) for p in sorted(peaks.glob("rank*.json"))]
    subprocess.run([*launcher(yaml), "train.py", *flags(folder, work / "timed", STEPS)], cwd=ROOT, env=ENV,
                   check=True, capture_output=True)
    metrics = [json.loads(line) for line in (work / "timed" / "metrics.jsonl").read_text().splitlines()]
    return {"peak": max(r["held"] + r["step"] for r in ranks), "ranks": len(ranks),
            "tokens_per_s": statistics.median(m["tokens_per_s"] for m in metrics[2:-1]),
            "rss": max(m["peak_mem_bytes"] for m in metrics)}


def peer(folder: Path, work: Path) -> dict:
    report = work / "peer.json"
    subprocess.run(["torchrun", "--nproc_per_node", "2", str(ROOT / "bench" / "peers" / "trainer_sp.py"),
                    "--model", str(folder), "--seq_len", str(TOKENS), "--data", str(folder / "long.jsonl"),
                    "--max_steps", str(STEPS), "--report",
                    str(report)], cwd=ROOT, env=ENV, check=True, capture_output=True)
    r = json.loads(report.read_text())
    ends = r["step_end_s"]
    seconds = [ends[i] - ends[i - 1] for i in range(2, len(ends))]  # the third step on
    return {"tokens_per_s": TOKENS / statistics.median(seconds), "rss": max(r["ran"]["peak_rss_bytes"]),
            "sp_size": r["ran"]["sp_size"], "zero_stage": r["ran"]["zero_stage"]}


def main() -> None:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folder = model_folder(work / "llama", Path(os.environ.get("TRAINKIT_CACHE", Path.home() / ".cache/trainkit")))
        for label, yaml in CONFIGS.items():
            results[label] = {**ours(folder, yaml, work / (yaml or "single")), "estimate": estimate(folder, yaml)}
            print(label, results[label], flush=True)
        theirs = peer(folder, work)
        print("peer", theirs, flush=True)
    one = results["one process"]["peak"]
    rows = ["| launch | ranks | peak per rank, GiB | against one process | estimate, GiB | estimate / peak |",
            "|---|---:|---:|---:|---:|---:|"]
    for label, r in results.items():
        rows.append(f"| {label} | {r['ranks']} | {r['peak'] / GiB:.2f} | {r['peak'] / one:.2f}x | "
                    f"{r['estimate'] / GiB:.2f} | {r['estimate'] / r['peak']:.3f} |")
    sp = results["deepspeed_zero3_sp (sp 2: the ranks share a sequence)"]
    side = ["| deepspeed_zero3_sp.yaml, sp 2 | tokens/s | peak resident memory per rank, GiB |", "|---|---:|---:|",
            f"| trainkit (`train.py --recipe causal_lm`) | {sp['tokens_per_s']:,.0f} | {sp['rss'] / GiB:.2f} |",
            f"| Transformers Trainer (bench/peers/trainer_sp.py) | {theirs['tokens_per_s']:,.0f} | "
            f"{theirs['rss'] / GiB:.2f} |"]
    load = os.getloadavg()
    section = "\n".join([
        START, "## Sequence parallelism: a rank's peak at 8,192 tokens, and the Trainer beside it", "",
        f"`python bench/sequence_parallel.py`: bench/long_sequence.py's Llama (vocabulary {VOCAB:,}, hidden {HIDDEN}, "
        f"{LAYERS} layers, sdpa, untied), one sequence of {TOKENS:,} tokens per optimizer step, fp32, the causal-LM "
        "recipe at its defaults, on the default corpus cut into documents of exactly one row (a padded row gives "
        "sdpa a mask, and on this machine the step then also holds a heads x tokens x tokens fp32 copy of it: 1 GiB "
        "more at this length, measured in an earlier run of this script on rows cut from whole topics, and not in "
        "the estimate). A rank's *peak* is the model state it holds as the second step begins plus the "
        "most its live tensors grow over that step (bench/live_peak.py: every allocation and free torch.profiler "
        "records, as max_memory_allocated counts them on a GPU; the interpreter, the libraries and the data are not "
        "in it). The estimate is the launch's own row of `--estimate` (the same flags and YAML). Goal: the sp 2 "
        f"rank at most {GOAL}x the one process.", "", *rows, "",
        f"sp 2 against one process: **{sp['peak'] / one:.2f}x** (goal <= {GOAL}x). Under ZeRO-3 alone each rank "
        "still holds a whole sequence's activations and logits; sequence parallelism halves them.", "",
        "Beside the peer: what deepspeed_zero3_sp.yaml selects, given as the Trainer's own arguments, the same model "
        "and token blocks, six optimizer steps, the median step from the third on (one sequence of 8,192 tokens a "
        "step for both), one run each, with the resident memory (ru_maxrss: the interpreter and libraries included) "
        f"that both report. The Trainer ran {'sp ' + str(theirs['sp_size'])} under ZeRO "
        f"stage {theirs['zero_stage']}:", "", *side, "",
        "The longest sequence whose activations fit a budget per rank, by the estimate checked above, one process "
        "and sp 2 (bench/long_sequence.py's techniques):", "", *longest((1, 2)), "",
        f"Load average when measured: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min), nothing else "
        "running.", END])
    replace_section(section, START, END)


if __name__ == "__main__":
    main()
