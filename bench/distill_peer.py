"""trainkit's distill recipe against TRL's DistillationTrainer (bench/peers/trl_distill.py): the same student and
teacher, prompts and completions in the same order, beta, temperature, optimizer and schedule; the losses step by
step and the completion tokens per second side by side.

    pip install trl==1.16.0         # the peer (not in requirements.txt: only the benchmarks use it)
    python bench/distill_peer.py    # about 2 minutes on 2 CPU cores; run it alone on the machine

The teacher is the tiny transformer after 60 steps (a Llama of 4 layers, vocabulary 1,024), the student one of 2
layers after 20 (the same tokenizer); the data are 64 calculator questions ("What is 4 plus 5?") with their answers
(" 4 plus 5 is 9."), prompt/completion strings. TRL's trainer trains only on the student's own samples: its
generation is replaced by the completions trainkit trains on (trainkit off-policy, --lmbda 0), so both sides score
the same tokens and their losses compare number by number. Both: 8 prompts a step, beta 1 (the reverse KL, TRL's
default), temperature 1, AdamW lr 1e-3 without warm-up and the cosine to 0.1x, clipping at 1.0, fp32 (TRL's default
bf16 autocast and activation checkpointing turned off). Each round runs trainkit, then TRL, 20 steps each, one process
with 2 threads; a run's rate is the completion tokens of steps 5-20 over their time.
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

from packing import run  # noqa: E402
from sections import replace_section  # noqa: E402

from trainkit.data.batches import epoch_order  # noqa: E402
from trainkit.recipes import load_recipe  # noqa: E402

START, END = "<!-- distill peer: written by bench/distill_peer.py -->", "<!-- end of distill peer -->"
ROUNDS, STEPS, FIRST, BATCH, SEED = 3, 20, 5, 8, 0


def questions() -> list[dict[str, str]]:
    return [{"prompt": f"What is {a} plus {b}?", "completion": f" {a} plus {b} is {a + b}."}
            for a in range(2, 10) for b in range(2, 10)]


def encoded(args: dict[str, str], cache: Path) -> dict[str, list[list[int]]]:
    """prompt -> [its token ids, its completion's]: the rows trainkit's distill recipe trains on, cut at the first
    learned token."""
    recipe = load_recipe("distill")
    train, _ = recipe.make_datasets(recipe.Config(**args), cache)
    records = [json.loads(line) for line in Path(args["data"]).read_text().splitlines()]
    tokens = {}
    for record, row in zip(records, train, strict=True):
        length = int(row["attention_mask"].sum())
        ids, labels = row["input_ids"][:length].tolist(), row["labels"][:length].tolist()
        start = next(i for i, label in enumerate(labels) if label != -100)
        tokens[record["prompt"]] = [ids[:start], ids[start:]]
    return tokens


def trl(student: Path, teacher: Path, data: Path, tokens: Path, report: Path, env: dict) -> dict:
    subprocess.run([sys.executable, str(ROOT / "bench" / "peers" / "trl_distill.py"), "--student", str(student),
                    "--teacher", str(teacher), "--data", str(data), "--tokens", str(tokens), "--report", str(report),
                    "--max_steps", str(STEPS), "--batch_size", str(BATCH)],
                   cwd=ROOT, env={**env, "PYTHONPATH": f"{ROOT}:{ROOT / 'bench' / 'peers'}"}, check=True,
                   capture_output=True, text=True)
    return json.loads(report.read_text())


def measure() -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    tmp = Path(tempfile.mkdtemp(prefix="distill-peer-"))
    run(["--recipe", "tiny_transformer", "--max_steps", "60", "--eval_every", "0"], tmp / "teacher", env)
    run(["--recipe", "tiny_transformer", "--max_steps", "20", "--eval_every", "0", "--layers", "2"], tmp / "student",
        env)
    student, teacher = tmp / "student" / "final", tmp / "teacher" / "final"
    records = questions()
    (tmp / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:8]))
    fields = {"model_name_or_path": str(student), "teacher_model_name_or_path": str(teacher),
              "data": str(tmp / "data.jsonl"), "eval_data": str(tmp / "eval.jsonl"), "seq_len": "32"}
    tokens = encoded({**fields, "seq_len": 32}, tmp / "cache")
    (tmp / "tokens.json").write_text(json.dumps(tokens))
    # trainkit's order: a permutation per epoch (20 steps x 8 reach into the third epoch of 64)
    order = [i for epoch in range(3) for i in epoch_order(len(records), SEED, epoch).tolist()]
    (tmp / "trl.jsonl").write_text("".join(json.dumps(records[i]) + "\n" for i in order))
    args = ["--recipe", "distill", *[x for k, v in fields.items() for x in (f"--{k}", v)], "--batch_size", str(BATCH),
            "--lr", "1e-3", "--warmup_steps", "0", "--max_steps", str(STEPS), "--eval_every", "0", "--seed", str(SEED),
            "--eval_answers", "0"]
    rates: dict[str, list[float]] = {"trainkit": [], "trl": []}
    for i in range(ROUNDS):
        metrics = run(args, tmp / "ours", env)
        tokens_per_step = [sum(len(tokens[records[j]["prompt"]][1]) for j in order[s * BATCH:(s + 1) * BATCH])
                           for s in range(STEPS)]
        ends = [m["elapsed_s"] for m in metrics]
        rates["trainkit"].append(sum(tokens_per_step[FIRST - 1:]) / (ends[-1] - ends[FIRST - 2]))
        peer = trl(student, teacher, tmp / "trl.jsonl", tmp / "tokens.json", tmp / f"trl{i}.json", env)
        theirs = peer["ends"]
        rates["trl"].append(sum(tokens_per_step[FIRST - 1:]) / (theirs[-1] - theirs[FIRST - 2]))
        print(f"round {i + 1}: trainkit {rates['trainkit'][-1]:.0f}, TRL {rates['trl'][-1]:.0f} completion tokens/s",
              flush=True)
    ours, their = [m["loss"] for m in metrics], [log["loss"] for log in peer["logs"]]
    differences = [abs(a - b) / abs(b) for a, b in zip(ours, their, strict=True)]
    ratios = [a / b for a, b in zip(rates["trainkit"], rates["trl"], strict=True)]
    load = os.getloadavg()
    shown = (1, 5, 10, 15, 20)
    curve = ", ".join(f"{ours[s - 1]:.5f} / {their[s - 1]:.5f}" for s in shown)
    return "\n".join([
        START, "## Against TRL's DistillationTrainer: the same tokens, the same losses", "",
        f"Command: `python bench/distill_peer.py`. {__doc__.split(chr(10) + chr(10), 2)[2].strip()}", "",
        "| | completion tokens/s (median of 3) | loss at step 1 | loss at step 20 |", "|---|---:|---:|---:|",
        f"| trainkit | {statistics.median(rates['trainkit']):.0f} | {ours[0]:.6f} | {ours[-1]:.6f} |",
        f"| TRL | {statistics.median(rates['trl']):.0f} | {their[0]:.6f} | {their[-1]:.6f} |", "",
        f"The losses of the 20 steps differ by at most {max(differences):.1e} (relative); at steps "
        f"{', '.join(map(str, shown))} (trainkit / TRL, last round): {curve}. "
        f"trainkit over TRL in completion tokens/s, round by round: {', '.join(f'{r:.2f}x' for r in ratios)} "
        f"(median {statistics.median(ratios):.2f}x; goal 1.0x). Load average when it ended: {load[0]:.2f} / "
        f"{load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min), nothing else running.", "", END])


if __name__ == "__main__":
    replace_section(measure(), START, END)
