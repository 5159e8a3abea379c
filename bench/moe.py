"""A mixture of experts' training step: the experts as a Python loop against grouped matmuls, and a dense model with
the same active parameters beside them.

    python bench/moe.py       # about two minutes on 2 CPU cores; run it alone on the machine

One process, fp32, a Qwen3-MoE built from its config (4 layers, hidden 256, 8 experts of 256, top 2, its balancing
loss on) trained by AdamW on micro-batches of 8 x 256 tokens, with transformers' experts implementations
(`--experts_implementation` in the fine-tuning recipes): eager (a loop over the experts that tokens picked),
grouped_mm (one grouped matmul over every expert: transformers' default) and batched_mm; and a dense Qwen3 whose MLP
is 512 wide, the two active experts' width. Rounds alternate the four so that the machine's drift falls on each
alike; each round's step time is the median of its steps after two warm-up steps, and the ratios are taken within a
round. The losses of the three kernels are compared at the first step (the same weights and batch).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sections import replace_section  # noqa: E402

START, END = "<!-- moe table: written by bench/moe.py -->", "<!-- end of moe table -->"
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
    """Seconds of each training step (forward, backward, AdamW) and the first step's loss."""
    built = model(kind)
    optimizer = torch.optim.AdamW(built.parameters(), lr=1e-4)
    times, first = [], None
    for ids in batches:
        started = time.perf_counter()
        loss = built(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
        first = loss.item() if first is None else first
    return times[WARMUP:], first


def measure() -> str:
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, SIZES["vocab_size"], (8, 256), generator=g) for _ in range(WARMUP + STEPS)]
    load = os.getloadavg()
    rounds, losses = [], {}
    for _ in range(ROUNDS):
        medians = {}
        for kind in (*KERNELS, "dense"):
            times, losses[kind] = steps(kind, batches)
            medians[kind] = statistics.median(times)
        rounds.append(medians)
        print(json.dumps(medians), flush=True)
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
        f"`python bench/moe.py` (one process, 2 threads, fp32; load average before it {load[0]:.2f} / {load[1]:.2f}"
        f" / {load[2]:.2f}). A Qwen3-MoE of {params['moe'] / 1e6:.1f}M parameters ({active / 1e6:.1f}M active: "
        f"2 of 8 experts) against a dense Qwen3 of {params['dense'] / 1e6:.1f}M with the same active MLP width; "
        f"micro-batches of 8 x 256 tokens, AdamW; the median step of {STEPS} after {WARMUP} warm-up steps, "
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


if __name__ == "__main__":
    replace_section(measure(), START, END)
