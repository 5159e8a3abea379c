"""QLoRA: what a 4-bit base saves per rank, what it costs per token, and trainkit against TRL's SFTTrainer with the same
peft and bitsandbytes settings (bench/peers/trl_qlora.py).

    pip install trl==1.16.0       # the peer (not in requirements.txt: only the benchmarks use it)
    python bench/qlora.py         # about 20 minutes on 2 CPU cores; run it alone on the machine

Memory: one model shape (the tiny transformer's Llama at hidden 512, 4 layers, 8 heads, feed-forward 2,048: 17.3M
weights, 16.8M of them in the layers' linear layers, embeddings tied, exported after one step), fine-tuned on 2
processes under fsdp.yaml and deepspeed_zero3.yaml three ways: QLoRA (`--load_in_4bit --lora_r 8`, fp32 compute), LoRA r
8 over the base in bf16 (`--model_dtype bf16`) and a full fine-tune in fp32; chat rows of 128 tokens, 4 per process, 8
steps. Held bytes are rank 0's `state_bytes` after the last step (parameters, gradients, optimizer states and a 4-bit
base's constants) beside the estimate; tokens per second are the median of steps 3-8 (`tokens_per_s`, both ranks).

Against TRL: the tiny transformer as it ships (hidden 128, 4 layers), 16 short conversations, all of them in every
step (full-batch steps, so the data order cannot differ), LoRA r 8 / alpha 16 on all-linear over the NF4 base, AdamW
lr 5e-4 with 10 warm-up steps and the cosine to 0.1x, clipping at 1.0, 16 steps, one process. Three rounds; a run's
time is the median of steps 5-16.
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

from packing import conversations, run  # noqa: E402
from sections import replace_section  # noqa: E402

MEMORY = ("<!-- qlora memory: written by bench/qlora.py -->", "<!-- end of qlora memory -->")
PEER = ("<!-- qlora peer: written by bench/qlora.py -->", "<!-- end of qlora peer -->")
CONFIGS = ("fsdp", "deepspeed_zero3")
WAYS = {"QLoRA (4-bit base)": ["--lora_r", "8", "--load_in_4bit", "true"],
        "LoRA (bf16 base)": ["--lora_r", "8", "--model_dtype", "bf16"],
        "full fine-tune (fp32)": []}
ROUNDS, STEPS, FIRST, CHATS = 3, 16, 5, 16


def launched(config: str, args: list[str], out: Path, env: dict) -> list[dict]:
    subprocess.run(["accelerate", "launch", "--config_file", f"accelerate_configs/{config}.yaml", "train.py", *args,
                    "--output_dir", str(out), "--overwrite", "--report_to", "none"], cwd=ROOT, env=env, check=True,
                   capture_output=True, text=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def memory(tmp: Path, env: dict) -> str:
    run(["--recipe", "tiny_transformer", "--max_steps", "1", "--eval_every", "0", "--hidden", "512", "--heads", "8",
         "--ffn", "2048"], tmp / "wide", env)
    data = tmp / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(400)))
    common = ["--recipe", "causal_lm", "--model_name_or_path", str(tmp / "wide" / "final"), "--data", str(data),
              "--eval_data", str(data), "--chat_template", "chatml", "--seq_len", "128", "--batch_size", "4",
              "--max_steps", "8", "--eval_every", "0", "--lr", "5e-4"]
    rows, held = [], {}
    for config in CONFIGS:
        for way, flags in WAYS.items():
            out = tmp / f"{config}-{len(held)}"
            metrics = launched(config, [*common, *flags], out, env)
            estimated = json.loads((out / "resolved_config.json").read_text())["estimated_state_bytes"]
            held[config, way] = metrics[-1]["state_bytes"]
            rate = statistics.median(m["tokens_per_s"] for m in metrics[2:])
            rows.append(f"| {config} | {way} | {held[config, way] / 2**20:,.1f} | {estimated / 2**20:,.1f} | "
                        f"{metrics[-1]['peak_mem_bytes'] / 2**20:,.0f} | {rate:,.0f} |")
            print(rows[-1], flush=True)
    saved = ", ".join(f"{config} {held[config, 'full fine-tune (fp32)'] / held[config, 'QLoRA (4-bit base)']:.1f}x "
                      f"(bf16 LoRA {held[config, 'LoRA (bf16 base)'] / held[config, 'QLoRA (4-bit base)']:.1f}x)"
                      for config in CONFIGS)
    load = os.getloadavg()
    return "\n".join([
        MEMORY[0], "## QLoRA: each rank's memory against a bf16 LoRA and a full fine-tune", "",
        f"Command: `python bench/qlora.py`. {__doc__.split(chr(10) + chr(10), 3)[2].strip()}", "",
        "| config | fine-tune | held MiB (rank 0) | estimated MiB | peak MiB (process) | tokens/s |",
        "|---|---|---:|---:|---:|---:|", *rows, "",
        f"A full fine-tune holds this much more than QLoRA per rank: {saved}. The 4-bit base is half a byte a weight, "
        "sharded by both configs (stored in the compute dtype for them to shard: trainkit/models/quantised.py), and "
        "only the adapters have gradients and AdamW states. Per token, QLoRA skips the base's weight gradients "
        "but dequantises every weight in each forward and backward; FSDP2's bf16 LoRA computes in bf16, which this "
        "AVX2-only CPU emulates, where fp32 ZeRO-3 holds and computes the bf16 base in fp32 (docs/recipes.md); on "
        "a GPU the speeds compare otherwise (not measured: no GPU). Load average when it ended: "
        f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min).", "", MEMORY[1]])


def trl(base: Path, data: Path, report: Path, env: dict, *more: str) -> dict:
    subprocess.run([sys.executable, str(ROOT / "bench" / "peers" / "trl_qlora.py"), "--model", str(base), "--data",
                    str(data), "--report", str(report), "--max_steps", str(STEPS), "--batch_size", str(CHATS),
                    "--seq_len", "128", *more], cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    return json.loads(report.read_text())


def step_time(ends: list[float]) -> float:
    """The median time of steps FIRST..STEPS from the end times of steps 1..STEPS."""
    return statistics.median(b - a for a, b in zip(ends[FIRST - 2:], ends[FIRST - 1:], strict=False))


def peer(tmp: Path, env: dict) -> str:
    run(["--recipe", "tiny_transformer", "--max_steps", "1", "--eval_every", "0"], tmp / "base", env)
    base, data = tmp / "base" / "final", tmp / "few.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(CHATS)))
    args = ["--recipe", "causal_lm", "--model_name_or_path", str(base), "--data", str(data), "--eval_data", str(data),
            "--chat_template", "chatml", "--seq_len", "128", "--batch_size", str(CHATS), "--max_steps", str(STEPS),
            "--eval_every", "0", "--lr", "5e-4", "--lora_r", "8", "--load_in_4bit", "true"]
    times: dict[str, list[float]] = {"trainkit": [], "trl": [], "trl longest": []}
    for i in range(ROUNDS):
        ours = run(args, tmp / "ours", env)
        times["trainkit"].append(statistics.median(CHATS / m["samples_per_s"] for m in ours[FIRST - 1:]))
        theirs = trl(base, data, tmp / "trl.json", env)
        times["trl"].append(step_time(theirs["ends"]))
        times["trl longest"].append(step_time(trl(base, data, tmp / "longest.json", env, "--longest")["ends"]))
        print(f"round {i + 1}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items()) + " a step", flush=True)
    ratios = {peer: [b / a for a, b in zip(times["trainkit"], times[peer], strict=True)] for peer in ("trl",
                                                                                                   "trl longest")}
    table = [f"| {m['step']} | {m['loss']:.7f} | {loss:.7f} |" for m, loss in zip(ours, theirs["losses"], strict=True)]
    gap = max(abs(m["loss"] - loss) / abs(loss) for m, loss in zip(ours, theirs["losses"], strict=True))
    load = os.getloadavg()
    return "\n".join([
        PEER[0], "## Against TRL's SFTTrainer: QLoRA over the same 4-bit base", "",
        f"Command: `python bench/qlora.py`. {__doc__.split(chr(10) + chr(10), 4)[3].strip()}", "",
        "| step | trainkit loss | TRL loss |", "|---:|---:|---:|", *table, "",
        f"Largest relative loss difference over the {STEPS} steps: {gap:.1e} (TRL logs its losses rounded). "
        f"Seconds a step, median of 3: trainkit {statistics.median(times['trainkit']):.3f}, TRL "
        f"{statistics.median(times['trl']):.3f} with the rows padded to 128 as trainkit pads them, "
        f"{statistics.median(times['trl longest']):.3f} padded to each batch's longest row (its default). trainkit "
        "over TRL, round by round: " + ", ".join(f"{r:.2f}x" for r in ratios["trl"]) + " at the same padding (goal: "
        "at least 1.0x); " + ", ".join(f"{r:.2f}x" for r in ratios["trl longest"]) + " against TRL's default, which "
        "computes fewer positions: trainkit pads every row to --seq_len, and `--packing` is its answer to short rows "
        f"(BENCHMARKS.md's packing section). Load average when it ended: {load[0]:.2f} / {load[1]:.2f} / "
        f"{load[2]:.2f} (1 / 5 / 15 min), nothing else running.", "", PEER[1]])


if __name__ == "__main__":
    environment = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    folder = Path(tempfile.mkdtemp(prefix="qlora-"))
    replace_section(peer(folder, environment), *PEER)
    replace_section(memory(folder, environment), *MEMORY)
