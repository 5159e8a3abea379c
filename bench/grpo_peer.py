"""trainkit's grpo recipe against TRL's GRPOTrainer (bench/peers/trl_grpo.py): the same model, prompts in the same
order, reward function, G, lengths, sampling, optimizer, schedule and loss type; the reward curves, completions per
second and completion tokens per second side by side.

    pip install trl==1.16.0       # the peer (not in requirements.txt: only the benchmarks use it)
    python bench/grpo_peer.py     # about 3 minutes on 2 CPU cores; run it alone on the machine

The model is the tiny transformer exported after one step (a Llama, vocab 1,024), which knows nothing yet; the
prompts are data/prompts.jsonl's calculator questions (conversational, the chatml template), in the order trainkit
draws them for seed 0; the reward is bench/peers/grpo_rewards.py's share of tokens among the vocabulary's first tenth
(chance about 0.1), dense enough for learning to show in 20 steps. Both sides: 2 prompts x 8 completions per step, at
most 16 tokens each, temperature 1, loss dapo, beta 0, group-scaled rewards, AdamW lr 1e-2 without warm-up and the
cosine to 0.1x, clipping at 1.0, fp32 (TRL's default bf16 autocast turned off), no vLLM (transformers' generate on
TRL's side). Each round runs trainkit, then TRL, 20 steps each, one process with 2 threads; a run's rate is the
completions of steps 5-20 over their time. The samples differ (TRL draws from the global RNG, trainkit per
completion), so the reward curves compare as two runs of one method, not number by number.
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

START, END = "<!-- grpo peer: written by bench/grpo_peer.py -->", "<!-- end of grpo peer -->"
ROUNDS, STEPS, FIRST, PROMPTS, G, LENGTH, SEED = 3, 20, 5, 2, 8, 16, 0


def trl(base: Path, data: Path, report: Path, env: dict) -> dict:
    subprocess.run([sys.executable, str(ROOT / "bench" / "peers" / "trl_grpo.py"), "--model", str(base), "--data",
                    str(data), "--report", str(report), "--max_steps", str(STEPS), "--batch_size", str(PROMPTS * G),
                    "--num_generations", str(G), "--max_completion_length", str(LENGTH)],
                   cwd=ROOT, env={**env, "PYTHONPATH": f"{ROOT}:{ROOT / 'bench' / 'peers'}"}, check=True,
                   capture_output=True, text=True)
    return json.loads(report.read_text())


def measure() -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    tmp = Path(tempfile.mkdtemp(prefix="grpo-peer-"))
    run(["--recipe", "tiny_transformer", "--max_steps", "1", "--eval_every", "0"], tmp / "base", env)
    base = tmp / "base" / "final"
    lines = (ROOT / "data" / "prompts.jsonl").read_text().splitlines()
    (tmp / "trl.jsonl").write_text("\n".join(lines[i] for i in epoch_order(len(lines), SEED, 0).tolist()) + "\n")
    args = ["--recipe", "grpo", "--model_name_or_path", str(base), "--data", str(ROOT / "data" / "prompts.jsonl"),
            "--eval_data", str(ROOT / "data" / "prompts_eval.jsonl"), "--chat_template", "chatml",
            "--reward_funcs", "bench.peers.grpo_rewards.share_of_low_ids", "--num_generations", str(G),
            "--batch_size", str(PROMPTS * G), "--max_completion_length", str(LENGTH), "--seq_len", "128",
            "--lr", "1e-2", "--warmup_steps", "0", "--max_steps", str(STEPS), "--eval_every", "0",
            "--seed", str(SEED)]
    rates: dict[str, list[float]] = {"trainkit": [], "trl": []}
    tokens: dict[str, list[float]] = {"trainkit": [], "trl": []}
    for i in range(ROUNDS):
        metrics = run(args, tmp / "ours", env)
        ours = statistics.median(m["samples_per_s"] for m in metrics[FIRST - 1:])
        rates["trainkit"].append(ours)
        tokens["trainkit"].append(ours * statistics.mean(m["completions/mean_length"] for m in metrics[FIRST - 1:]))
        peer = trl(base, tmp / "trl.jsonl", tmp / f"trl{i}.json", env)
        ends = peer["ends"]
        theirs = (len(ends) - FIRST + 1) * PROMPTS * G / (ends[-1] - ends[FIRST - 2])
        rates["trl"].append(theirs)
        lengths = [log["completions/mean_length"] for log in peer["logs"][FIRST - 1:]]
        tokens["trl"].append(theirs * statistics.mean(lengths))
        print(f"round {i + 1}: trainkit {ours:.1f}, TRL {theirs:.1f} completions/s", flush=True)
    ratios = [a / b for a, b in zip(rates["trainkit"], rates["trl"], strict=True)]
    ours_reward, theirs_reward = [m["reward"] for m in metrics], [log["reward"] for log in peer["logs"]]
    load = os.getloadavg()
    shown = (1, 5, 10, 15, 20)
    curve = ", ".join(f"{ours_reward[s - 1]:.2f} / {theirs_reward[s - 1]:.2f}" for s in shown)
    return "\n".join([
        START, "## Against TRL's GRPOTrainer: GRPO from a model that knows nothing yet", "",
        f"Command: `python bench/grpo_peer.py`. {__doc__.split(chr(10) + chr(10), 2)[2].strip()}", "",
        "| | completions/s (median of 3) | completion tokens/s | reward, mean of the last 5 steps |",
        "|---|---:|---:|---:|",
        f"| trainkit | {statistics.median(rates['trainkit']):.1f} | {statistics.median(tokens['trainkit']):.0f} | "
        f"{statistics.mean(ours_reward[-5:]):.2f} |",
        f"| TRL | {statistics.median(rates['trl']):.1f} | {statistics.median(tokens['trl']):.0f} | "
        f"{statistics.mean(theirs_reward[-5:]):.2f} |", "",
        f"trainkit over TRL in completions/s, round by round: {', '.join(f'{r:.2f}x' for r in ratios)} (median "
        f"{statistics.median(ratios):.2f}x; goal 1.0x). Reward at steps {', '.join(map(str, shown))} (trainkit / TRL, "
        f"last round): {curve}. Load average when it ended: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} "
        "(1 / 5 / 15 min), nothing else running.", "", END])


if __name__ == "__main__":
    replace_section(measure(), START, END)
