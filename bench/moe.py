"""A mixture of experts' training step: the experts as a Python loop against grouped matmuls, and a dense model with
the same active parameters beside them; and each rank's memory with expert parallelism and without.

    python bench/moe.py           # about four minutes on 2 CPU cores; run it alone on the machine
    python bench/moe.py kernels   # the first part alone (about two minutes)
    python bench/moe.py ep        # the second part alone

One process, fp32, a Qwen3-MoE built from its config (4 layers, hidden 256, 8 experts of 256, top 2, its balancing
loss on) trained by AdamW on micro-batches of 8 x 256 tokens, with transformers' experts implementations
(`--experts_implementation` in the fine-tuning recipes): eager (a loop over the experts that tokens picked),
grouped_mm (one grouped matmul over every expert: transformers' default) and batched_mm; and a dense Qwen3 whose MLP
is 512 wide, the two active experts' width. Rounds alternate the four so that the machine's drift falls on each
alike; each round's step time is the median of its steps after two warm-up steps, and the ratios are taken within a
round. The losses of the three kernels are compared at the first step (the same weights and batch).

Expert parallelism: a Qwen3-MoE whose experts are most of its weights (4 layers, hidden 256, 8 experts of 1,024, top
2), saved with a tokenizer trained on the default corpus, fine-tuned by the causal_lm recipe on that corpus (2 rows of
256 tokens per rank, fp32: few tokens per expert weight, as in fine-tuning a large one) under fsdp.yaml and
fsdp_ep.yaml, and under deepspeed_zero2.yaml and deepspeed_zero2_ep.yaml (DeepSpeed's AutoEP), 2 processes each:
each rank's model state and the most its live tensors grow over the second step (bench/live_peak.py: a GPU's
max_memory_allocated, measured on a CPU), and in a plain run of 6 steps the tokens per second.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sections import replace_section  # noqa: E402

START, END = "<!-- moe table: written by bench/moe.py -->", "<!-- end of moe table -->"
EP_START, EP_END = "<!-- moe ep: written by bench/moe.py -->", "<!-- end of moe ep -->"
EP_CONFIGS = ("fsdp", "fsdp_ep", "deepspeed_zero2", "deepspeed_zero2_ep")  # each without EP, then with it
MiB = 1024 ** 2
KERNELS = ("eager", "grouped_mm", "batched_mm")
ROUNDS, STEPS, WARMUP = 3, 6, 2
SIZES = {"vocab_size": 1024, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64}


def model(kind: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if kind == "dense":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZES, intermediate_size=512))
    config = transformers.Qwen3MoeConfig(**SIZES, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                                         output_router_logits=True, router_aux_loss_coef=0.01)
    built = transformers.Qwen3MoeForCausalLM(config)
    built.set_experts_implementation(kind)
    return built


def steps(kind: str, batches: list[torch.Tensor]) -> tuple[list[float], float]:
    """Seconds of each training step (forward, backward, AdamW) and the first step's loss, on the batches' device
    (a GPU's work waited for before each step's clock stops)."""
    device = batches[0].device
    built = model(kind).to(device)
    optimizer = torch.optim.AdamW(built.parameters(), lr=1e-4)
    times, first = [], None
    for ids in batches:
        started = time.perf_counter()
        loss = built(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        first = loss.item() if first is None else first
    return times[WARMUP:], first


def kernel_rounds(device: str) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Per round, each kind's median step; each kind's first loss (bench/gpu.py runs it on a GPU)."""
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, SIZES["vocab_size"], (8, 256), generator=g).to(device)
               for _ in range(WARMUP + STEPS)]
    rounds, losses = [], {}
    for _ in range(ROUNDS):
        medians = {}
        for kind in (*KERNELS, "dense"):
            times, losses[kind] = steps(kind, batches)
            medians[kind] = statistics.median(times)
        rounds.append(medians)
        print(json.dumps(medians), flush=True)
    return rounds, losses


def measure() -> str:
    torch.set_num_threads(2)
    load = os.getloadavg()
    rounds, losses = kernel_rounds("cpu")
    moe, dense = model("eager"), model("dense")
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in (("moe", moe), ("dense", dense))}
    from trainkit.run.metrics import count_flops

    active = count_flops(moe, 256).params + moe.model.embed_tokens.weight.numel()  # the same terms as params
    rows = []
    for kind in (*KERNELS, "dense"):
        seconds = [r[kind] for r in rounds]
        against_loop = [r["eager"] / r[kind] for r in rounds]
        rows.append(f"| {kind if kind != 'dense' else 'dense Qwen3, MLP 512'} | "
                    f"{statistics.median(seconds) * 1000:,.0f} ms | "
                    f"{' / '.join(f'{x:.2f}' for x in against_loop)} | "
                    f"{losses[kind]:.6f} |")
    spread = max(abs(losses[k] - losses["eager"]) for k in KERNELS)

    def ratio(slow: str, fast: str) -> float:
        """The median over the rounds of slow's step / fast's."""
        return statistics.median(r[slow] / r[fast] for r in rounds)

    return "\n".join([
        START,
        "## Mixture of experts: the experts as a loop, as grouped matmuls, and a dense model",
        "",
        f"`python bench/moe.py kernels` (one process, 2 threads, fp32; load average before it {load[0]:.2f} / "
        f"{load[1]:.2f} / {load[2]:.2f}). A Qwen3-MoE of {params['moe'] / 1e6:.1f}M parameters "
        f"({active / 1e6:.1f}M active: 2 of 8 experts) against a dense Qwen3 of {params['dense'] / 1e6:.1f}M with "
        f"the same active MLP width; micro-batches of 8 x 256 tokens, AdamW; the median step of {STEPS} after "
        f"{WARMUP} warm-up steps, "
        f"{ROUNDS} rounds alternating the four.",
        "",
        "| experts | step | loop's step / this one's, each round | loss at step 1 |",
        "|---|---|---|---|",
        *rows,
        "",
        f"The three kernels' first losses differ by {spread:.1e} at most (the same weights and batch; "
        "`tests/test_moe.py` trains the same curve with eager and grouped_mm). On these CPU cores grouped_mm is "
        f"{ratio('eager', 'grouped_mm'):.2f}x the loop's speed (median of the rounds' ratios): a CPU runs the "
        "loop's few large matmuls as well as one grouped call, whose gain is the kernel launches and host "
        "synchronisations a GPU spends per expert (unmeasured here: no GPU); batched_mm, which multiplies each "
        f"token by its own copy of its experts' weights, is {1 / ratio('eager', 'batched_mm'):.0f}x slower. The "
        f"mixture's step is {1 / ratio('dense', 'grouped_mm'):.2f}x the dense model's at the same active "
        "parameters (the router, its balancing loss and the tokens' sorting to their experts).",
        END,
    ])


def ep_model(folder: Path, cache_dir: Path) -> Path:
    """The expert-heavy Qwen3-MoE with a tokenizer of its vocabulary trained on the default corpus."""
    import transformers

    from trainkit.data.text import load_documents, train_tokenizer

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**SIZES, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=1024,
                                         output_router_logits=True, router_aux_loss_coef=0.01)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(folder)
    corpus = load_documents("pydoc", "", "text", cache_dir)
    train_tokenizer(corpus, SIZES["vocab_size"], folder.with_name("tokenizer")).save_pretrained(folder)
    return folder


def ep_flags(folder: Path, out: Path, steps: int) -> list[str]:
    return ["--recipe", "causal_lm", "--model_name_or_path", str(folder), "--tokenizer", "saved", "--seq_len", "256",
            "--batch_size", "2", "--max_steps", str(steps), "--warmup_steps", "1", "--eval_every", "0",
            "--eval_batches", "1", "--eval_answers", "0", "--output_dir", str(out), "--report_to", "none"]


def ep_run(config: str, folder: Path, work: Path) -> dict:
    """Each rank's held bytes and step growth (bench/live_peak.py), the note on the experts it holds, and the plain
    run's median tokens per second after its first two steps."""
    launcher = ["accelerate", "launch", "--config_file", str(ROOT / "accelerate_configs" / f"{config}.yaml")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two ranks on two cores
    peaks = work / config / "peaks"
    profiled = subprocess.run([*launcher, str(ROOT / "bench" / "live_peak.py"), str(peaks),
                               *ep_flags(folder, work / config / "profiled", 3)], cwd=ROOT, env=env, check=True,
                              capture_output=True, text=True)
    ranks = [json.loads(p.read_text()) for p in sorted(peaks.glob("rank*.json"))]
    subprocess.run([*launcher, "train.py", *ep_flags(folder, work / config / "timed", 6)], cwd=ROOT, env=env,
                   check=True, capture_output=True)
    metrics = [json.loads(line) for line in (work / config / "timed" / "metrics.jsonl").read_text().splitlines()]
    held = next((line.split("this rank holds ")[1].split(" expert")[0] for line in profiled.stderr.splitlines()
                 if "this rank holds" in line),
                "a shard of each (all gathered to compute)" if config == "fsdp" else "all of them, whole")
    return {"held": max(r["held"] for r in ranks), "step": max(r["step"] for r in ranks), "experts": held,
            "tokens_per_s": statistics.median(m["tokens_per_s"] for m in metrics[2:])}


def measure_ep() -> str:
    import transformers

    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folder = ep_model(work / "model", work / "cache")
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        total = sum(p.numel() for p in model.parameters())
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        runs = {config: ep_run(config, folder, work) for config in EP_CONFIGS}
    fsdp, ep, zero2, autoep = (runs[config] for config in EP_CONFIGS)
    rows = [f"| {config}.yaml | {r['experts']} | {r['held'] / MiB:.1f} MiB | {r['step'] / MiB:.1f} MiB | "
            f"{(r['held'] + r['step']) / MiB:.1f} MiB | {r['tokens_per_s']:,.0f} |" for config, r in runs.items()]
    return "\n".join([
        EP_START,
        "## Mixture of experts: each rank's memory with expert parallelism and without",
        "",
        f"`python bench/moe.py ep` (2 processes, 1 thread each, fp32; load average before it {load[0]:.2f} / "
        f"{load[1]:.2f} / {load[2]:.2f}). A Qwen3-MoE of {total / 1e6:.1f}M parameters, {experts / 1e6:.1f}M of them "
        "in its experts (4 layers of 8 experts of 1,024, top 2), fine-tuned by causal_lm on 2 x 256 tokens per rank. "
        "Held: the model and optimizer state a rank keeps between steps (metrics.py's state_bytes); step: the most its "
        "live tensors grow over the second step (bench/live_peak.py); their sum is the peak a GPU would report.",
        "",
        "| config | expert parameters on a rank | held | step | peak | tokens/s |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"Expert parallelism holds what FSDP2 holds between steps ({ep['held'] / fsdp['held']:.3f}x: the experts "
        "are sharded either way, over all ranks by FSDP2, split whole by EP), and its step grows "
        f"{ep['step'] / fsdp['step']:.2f}x as much: FSDP2 gathers each layer's experts whole to compute, and "
        "their whole gradients before it reduce-scatters them; EP computes each rank's own experts in place and "
        "moves the tokens instead. What it saves is a layer's experts, against activations that grow with the "
        "tokens: the fewer tokens per expert weight, the larger the share. Peak per rank: "
        f"{(ep['held'] + ep['step']) / (fsdp['held'] + fsdp['step']):.2f}x. The speed on 2 CPU cores is "
        f"{ep['tokens_per_s'] / fsdp['tokens_per_s']:.2f}x FSDP2's (one run each; a CPU has no fast links to lose to "
        "either all-to-all or gather).",
        "",
        f"DeepSpeed's AutoEP under ZeRO-2 holds {autoep['held'] / zero2['held']:.3f}x what ZeRO-2 holds: ZeRO-2 keeps "
        "every weight whole on each rank (only the optimizer state and gradients are partitioned), and AutoEP keeps "
        f"half of the experts' weights; its step grows {autoep['step'] / zero2['step']:.2f}x as much, its peak is "
        f"{(autoep['held'] + autoep['step']) / (zero2['held'] + zero2['step']):.2f}x, its speed "
        f"{autoep['tokens_per_s'] / zero2['tokens_per_s']:.2f}x ZeRO-2's.",
        EP_END,
    ])


if __name__ == "__main__":
    part = sys.argv[1] if len(sys.argv) > 1 else "all"
    if part in ("all", "kernels"):
        replace_section(measure(), START, END)
    if part in ("all", "ep"):
        replace_section(measure_ep(), EP_START, EP_END)
