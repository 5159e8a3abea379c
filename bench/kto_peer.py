"""trainkit's KTO (the dpo recipe's --loss_type kto) against TRL's KTOTrainer (bench/peers/trl_kto.py): the same
model, unpaired answers, chat template, LoRA, batch, optimizer, schedule and data order, the loss and the reference
point (kl) step by step.

    pip install trl==1.16.0       # the peer (not in requirements.txt: only the benchmarks use it)
    python bench/kto_peer.py      # about a minute on 2 CPU cores; run it alone on the machine

The model is the tiny transformer exported after one step (a Llama, vocab 1,024); the answers are data/pairs.jsonl's
first 96 pairs taken apart (the chosen answer desirable, the rejected one not) and shuffled, 192 answers, 8 per step:
the global batch is far smaller than the data, so the reference point is estimated from each batch's own answers
(each prompt with the answer before it in the batch, as TRL rotates them). Both sides: LoRA r 8 / alpha 16 on
all-linear, seq_len / max_length 128, AdamW lr 5e-4 with 10 warm-up steps and the cosine to 0.1x, clipping at 1.0,
beta 0.1, fp32. TRL is handed the answers in the order trainkit trains them for seed 0 (data.epoch_order) and reads
them in that order (train_sampling_strategy sequential, which its KL rows require).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from packing import run  # noqa: E402
from sections import replace_section  # noqa: E402

from trainkit.data.batches import epoch_order  # noqa: E402

START, END = "<!-- kto peer: written by bench/kto_peer.py -->", "<!-- end of kto peer -->"
ANSWERS, STEPS, SEQ_LEN, SEED = 8, 16, 128, 0


def measure() -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    tmp = Path(tempfile.mkdtemp(prefix="kto-peer-"))
    run(["--recipe", "tiny_transformer", "--max_steps", "1", "--eval_every", "0"], tmp / "base", env)
    base = tmp / "base" / "final"
    pairs = [json.loads(line) for line in (ROOT / "data" / "pairs.jsonl").read_text().splitlines()[:96]]
    answers = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
               for p in pairs for side in ("chosen", "rejected")]
    random.Random(0).shuffle(answers)
    lines = [json.dumps(a) for a in answers]
    (tmp / "answers.jsonl").write_text("\n".join(lines) + "\n")
    (tmp / "trl.jsonl").write_text("\n".join(lines[i] for i in epoch_order(len(lines), SEED, 0).tolist()) + "\n")
    metrics = run(["--recipe", "dpo", "--loss_type", "kto", "--model_name_or_path", str(base), "--data",
                   str(tmp / "answers.jsonl"), "--eval_data", str(tmp / "answers.jsonl"), "--chat_template", "chatml",
                   "--seq_len", str(SEQ_LEN), "--batch_size", str(ANSWERS), "--lr", "5e-4", "--lora_r", "8",
                   "--max_steps", str(STEPS), "--eval_every", "0", "--seed", str(SEED)], tmp / "ours", env)
    subprocess.run([sys.executable, str(ROOT / "bench" / "peers" / "trl_kto.py"), "--model", str(base), "--data",
                    str(tmp / "trl.jsonl"), "--report", str(tmp / "trl.json"), "--max_steps", str(STEPS),
                    "--batch_size", str(ANSWERS), "--seq_len", str(SEQ_LEN)], cwd=ROOT, env=env, check=True,
                   capture_output=True, text=True)
    logs = json.loads((tmp / "trl.json").read_text())["logs"]
    rows = [f"| {m['step']} | {m['loss']:.7f} | {log['loss']:.7f} | {m['kl']:.7f} | {log['kl']:.7f} |"
            for m, log in zip(metrics, logs, strict=True)]
    loss_gap = max(abs(m["loss"] - log["loss"]) / abs(log["loss"]) for m, log in zip(metrics, logs, strict=True))
    kl_gap = max(abs(m["kl"] - log["kl"]) for m, log in zip(metrics, logs, strict=True))
    load = os.getloadavg()
    return "\n".join([
        START, "## Against TRL's KTOTrainer: LoRA KTO on unpaired calculator answers, batches smaller than the data",
        "", f"Command: `python bench/kto_peer.py`. {__doc__.split(chr(10) + chr(10), 2)[2].strip()}", "",
        "| step | trainkit loss | TRL loss | trainkit kl | TRL kl |", "|---:|---:|---:|---:|---:|", *rows, "",
        f"Largest relative loss difference over the {STEPS} steps: {loss_gap:.1e}; largest kl difference: "
        f"{kl_gap:.1e} (TRL logs its values rounded as it logs them). Load average when it ended: {load[0]:.2f} / "
        f"{load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min).", "", END])


if __name__ == "__main__":
    replace_section(measure(), START, END)
