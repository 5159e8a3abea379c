"""Packing against one padded example per row: learned tokens per second and the padding share of each, on a chat
set of short conversations (median 66 tokens) at seq_len 512.

    python bench/packing.py       # about 4 minutes on 2 CPU cores; run it alone on the machine

The model is the project's own tiny transformer, exported after one step (a Llama with its byte-level tokenizer, as
a user's downloaded one would be); the conversations are written here (one question, one answer, lengths drawn from
a fixed generator). Each round runs `python train.py --recipe causal_lm` padded and then packed, same micro-batch
(8 rows), 16 steps; a run's rate is the median of steps 5-16. Learned tokens per second are rows per second times
the mean learned tokens per row of that run's training split (the recipe's own datasets, built here the same way).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sections import replace_section  # noqa: E402

from trainkit.recipes import load_recipe  # noqa: E402

START, END = "<!-- packing: written by bench/packing.py -->", "<!-- end of packing -->"
ROUNDS, STEPS, FIRST, SEQ_LEN, ROWS = 3, 16, 5, 512, 8
WORDS = "the a model trains on data and learns to answer questions about numbers words code files".split()


def conversations(n: int) -> list[dict]:
    """Short chats: a question of 1-4 words and an answer of 1-6, which render to 53-89 tokens (ChatML's markers
    are about 50 of them with the pydoc tokenizer, which does not know them)."""
    rng = random.Random(0)
    return [{"messages": [{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 4))) + "?"},
                          {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 6))) + "."}]}
            for _ in range(n)]


def run(args: list[str], out: Path, env: dict) -> list[dict]:
    subprocess.run([sys.executable, "train.py", *args, "--output_dir", str(out), "--overwrite", "--report_to", "none"],
                   cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def measure() -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    tmp = Path(tempfile.mkdtemp(prefix="packing-"))
    run(["--recipe", "tiny_transformer", "--max_steps", "1", "--seq_len", str(SEQ_LEN), "--eval_every", "0"],
        tmp / "base", env)
    data = tmp / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(4000)))
    common = ["--recipe", "causal_lm", "--model_name_or_path", str(tmp / "base" / "final"), "--data", str(data),
              "--chat_template", "chatml", "--seq_len", str(SEQ_LEN), "--batch_size", str(ROWS), "--max_steps",
              str(STEPS), "--eval_every", "0"]
    recipe = load_recipe("causal_lm")
    kinds = {"padded": [], "packed": ["--packing"]}
    shape = {}
    for kind, flags in kinds.items():
        cfg = recipe.Config(model_name_or_path=str(tmp / "base" / "final"), data=str(data), chat_template="chatml",
                            seq_len=SEQ_LEN, packing=bool(flags))
        train, _ = recipe.make_datasets(cfg, tmp / "cache")
        learned = [int((row["labels"][1:] != -100).sum()) for row in train]
        real = [int(row["attention_mask"].sum()) for row in train]
        shape[kind] = {"rows": len(train), "learned": statistics.mean(learned),
                       "padding": 1 - sum(real) / (len(train) * SEQ_LEN), "median": statistics.median(real)}
    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    row_rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(ROUNDS):
        for kind, flags in kinds.items():
            metrics = run([*common, *flags], tmp / kind, env)
            rows_per_s = statistics.median(m["samples_per_s"] for m in metrics[FIRST - 1:])
            rates[kind].append(rows_per_s * shape[kind]["learned"])
            row_rates[kind].append(rows_per_s)
            print(f"{kind}: {rates[kind][-1]:,.0f} learned tokens/s", flush=True)
    ratios = [b / a for a, b in zip(rates["padded"], rates["packed"], strict=True)]
    load = os.getloadavg()
    table = ["| rows of 512 tokens | rows | learned tokens per row | padding share | rows/s | learned tokens/s "
             f"(median of {ROUNDS}) |", "|---|---:|---:|---:|---:|---:|"]
    for kind in kinds:
        s = shape[kind]
        table.append(f"| {kind} | {s['rows']:,} | {s['learned']:.1f} | {s['padding']:.1%} | "
                     f"{statistics.median(row_rates[kind]):.1f} | {statistics.median(rates[kind]):,.0f} |")
    return "\n".join([
        START, "## Packing: learned tokens per second, packed against padded", "",
        f"Command: `python bench/packing.py`. {__doc__.split(chr(10) + chr(10), 2)[2].strip()} The examples render "
        f"to a median of {shape['padded']['median']:.0f} tokens.", "", *table, "",
        "Packed over padded, round by round: " + ", ".join(f"{r:.2f}x" for r in ratios) +
        f" (median {statistics.median(ratios):.2f}x). Load average when it ended: {load[0]:.2f} / {load[1]:.2f} / "
        f"{load[2]:.2f} (1 / 5 / 15 min), nothing else running. Every row costs the same forward and backward of "
        f"{SEQ_LEN} tokens whatever it holds, so the gain is the learned tokens a row carries (the rows/s column: "
        "the block-diagonal mask that keeps packed examples apart, tests/test_sft.py, is what packed rows pay "
        "beyond padded ones).", "", END])


if __name__ == "__main__":
    replace_section(measure(), START, END)
