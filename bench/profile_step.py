"""Where the `cpu` preset's training time goes on this machine, by operator (torch.profiler); BENCHMARKS.md + a chart.

    python bench/profile_step.py        # about a minute on 2 CPU cores

Runs `python train.py --recipe tiny_transformer --size cpu --max_steps 10` inside this process under torch.profiler
(the runner's own loop: the model, AdamW, clipping, metrics; every core) and reports each operator's share of the
CPU time of all operators, the matrix products' share, and AdamW's. Shares, unlike MFU, hardly move when the machine
is busy: they explain what MFU does not reach (the MFU section above), whatever its absolute value today.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from sections import bar_chart, replace_section  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import train  # noqa: E402
from trainkit.launch.hardware import cpu_cores, cpu_model  # noqa: E402

STEPS = 10
TOP = 12
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")
START, END = "<!-- profile: written by bench/profile_step.py -->", "<!-- end of profile -->"


def main() -> None:
    load = os.getloadavg()[0]  # a busy machine slows the products more than the rest: the section says how quiet
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            code = train.main(["--recipe", "tiny_transformer", "--size", "cpu", "--max_steps", str(STEPS),
                               "--output_dir", str(out), "--report_to", "none"])
        assert code == 0, code
        resolved = json.loads((out / "resolved_config.json").read_text())
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    mfu = statistics.median(m["mfu"] for m in metrics[2:-1])  # past the first steps; the last one evaluates
    events = prof.key_averages()
    ops = sorted((e for e in events if e.key.startswith("aten::")), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ops)
    share = {e.key: e.self_cpu_time_total / total for e in ops}
    optimizer = sum(e.cpu_time_total for e in events if e.key.startswith("Optimizer.step#")) / total
    matmul = sum(share.get(name, 0.0) for name in MATMULS)
    # MFU = e x s x (1 + a): e the products' rate against the peak, s their share of the time, a the attention term's
    # FLOPs over the products' 6 N (metrics.count_flops). With every product at the peak and the rest unchanged, the
    # products' time shrinks to e x s of today's step: MFU's ceiling at this shape.
    attention = resolved["flops_per_token"] / (6 * resolved["flops_param_count"]) - 1
    efficiency = mfu / (matmul * (1 + attention))
    ceiling = (1 + attention) * efficiency * matmul / (efficiency * matmul + 1 - matmul)
    rows = ["| operator | share of operator time | calls |", "|---|---:|---:|"]
    rows += [f"| `{e.key}` | {share[e.key]:.1%} | {e.count} |" for e in ops[:TOP]]
    chart = bar_chart("profile", f"The cpu preset's operators: share of operator time (top {TOP})",
                      "share of operator time", {"share": {e.key: share[e.key] for e in ops[:TOP]}}, value="{:.1%}")
    print("\n".join(rows), f"\nmatrix products {matmul:.1%}, AdamW steps {optimizer:.1%}; MFU {mfu:.1%}, products at "
          f"{efficiency:.1%} of the peak, ceiling {ceiling:.1%}", sep="")
    section = (f"{START}\n## Where the cpu preset's time goes\n\n"
               f"Command: `python bench/profile_step.py`. Machine: {cpu_model()}, {cpu_cores()} cores; Python "
               f"{platform.python_version()}, torch {torch.__version__}. `python train.py --recipe tiny_transformer "
               f"--size cpu --max_steps {STEPS}` in-process under torch.profiler (every step, the final evaluation and "
               "export included), each operator's self CPU time as a share of all operators'. Measured "
               f"{time.strftime('%Y-%m-%d')}, load average (1 min) {load:.1f} when it started.\n\n"
               f"Matrix products (`{'`, `'.join(MATMULS)}`): **{matmul:.1%}**; AdamW's steps (all their operators): "
               f"{optimizer:.1%}. The top {TOP} operators:\n\n" + "\n".join(rows) + "\n\n" + chart + "\n\n"
               "The rest of the time is memory-bound work between the products (GPT-2's LayerNorm and GELU, one "
               "fused pass over the activations each way; copies; the weights' initialisation and the final export) "
               "and attention's per-head softmax products. Their share "
               "is what keeps MFU below the products' own efficiency: MFU = e x s x (1 + a), with s the products' "
               "share, e their rate against the measured peak and a the attention term of the FLOP count over "
               f"the products' 6 N ({attention:.3f} here). This run's MFU (median of steps 3-{STEPS - 1}, under "
               f"the profiler) was {mfu:.1%}, so the products ran at **{efficiency:.0%}** of the peak; were every "
               f"product at the peak and the rest unchanged, MFU would reach **{ceiling:.1%}**: the ceiling of this "
               "shape on this machine as this profile counts it (the weights' initialisation and the export among the "
               "rest; the steps alone leave the products a larger share).\n"
               f"{END}")
    replace_section(section, START, END)


if __name__ == "__main__":
    main()
