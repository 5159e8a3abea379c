"""The pipeline bubble measured against its theory: 2 stages, m = 1, 2, 4, 8 micro-batches per step.

    python bench/pipeline_bubble.py        # about 3 minutes on 2 CPU cores; writes BENCHMARKS.md's section and
                                           # docs/images/pipeline_bubble.png

Each run trains the tiny transformer (hidden 256, 4 layers, 128-token sequences, micro-batch 4, so a step's work grows
with m) for 12 steps on 2 processes with `--pipeline_stages 2`; `pipeline_idle` in metrics.jsonl is the fraction of
each step that a stage did not compute (waiting for its neighbour, or sending), averaged over steps 3-12. GPipe's
theory is (p - 1) / (m + p - 1); 1F1B has the same bubble with fewer activations held; interleaved 1F1B (two stages
per process) divides it by two.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sections import IMAGES, replace_section  # noqa: E402

from trainkit.launch.train_process import run_config  # noqa: E402

MODEL = ["--recipe", "tiny_transformer", "--hidden", "256", "--layers", "4", "--seq_len", "128", "--batch_size", "4",
         "--max_steps", "12", "--eval_every", "0", "--pipeline_stages", "2"]
RUNS = [("gpipe", 1), ("gpipe", 2), ("gpipe", 4), ("gpipe", 8), ("1f1b", 2), ("1f1b", 4), ("1f1b", 8),
        ("interleaved", 4), ("interleaved", 8)]
START, END = "<!-- pipeline bubble: written by bench/pipeline_bubble.py -->", "<!-- end of pipeline bubble -->"
PNG = IMAGES / "pipeline_bubble.png"


def measure() -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for schedule, m in RUNS:
            run = run_config(str(ROOT / "accelerate_configs" / "ddp.yaml"), Path(tmp) / f"{schedule}-{m}",
                             [*MODEL, "--pipeline_schedule", schedule, "--grad_accum", str(m)]).check()
            steps = run.metrics[2:]
            idle = [statistics.mean(r["pipeline_idle"][s] for r in steps) for s in range(2)]
            rows.append({"schedule": schedule, "m": m, "theory": steps[-1]["pipeline_bubble_theory"], "idle": idle,
                         "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps)})
            print(rows[-1], flush=True)
    return rows


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for schedule, marker in (("gpipe", "o"), ("1f1b", "s"), ("interleaved", "^")):
        mine = [r for r in rows if r["schedule"] == schedule]
        ms = [r["m"] for r in mine]
        ax.plot(ms, [sum(r["idle"]) / 2 for r in mine], marker=marker, label=f"{schedule}: measured (mean of stages)")
        ax.plot(ms, [r["theory"] for r in mine], marker=marker, linestyle=":", color=ax.lines[-1].get_color(),
                label=f"{schedule}: theory")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches per step (m), 2 stages")
    ax.set_ylabel("fraction of the step idle")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    ax.set_title("Pipeline bubble, tiny transformer on 2 CPU processes")
    fig.tight_layout()
    PNG.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PNG, dpi=110)


def main() -> None:
    rows = measure()
    plot(rows)
    table = ["| schedule | m | theory | stage 0 idle | stage 1 idle | tokens/s |", "|---|---:|---:|---:|---:|---:|"]
    table += [f"| {r['schedule']} | {r['m']} | {r['theory']:.1%} | {r['idle'][0]:.1%} | {r['idle'][1]:.1%} | "
              f"{r['tokens_per_s']:,.0f} |" for r in rows]
    section = (f"{START}\n## Pipeline bubble: measured idle time per stage vs theory\n\n"
               "Command: `python bench/pipeline_bubble.py` (tiny transformer, hidden 256, 4 layers, seq 128, "
               "micro-batch 4, 2 processes x 1 thread, `--pipeline_stages 2`; CPU, torch 2.13.0).\n\n"
               + "\n".join(table) + "\n\n![pipeline bubble](docs/images/pipeline_bubble.png)\n\n"
               "Idle is measured per process: the share of the step outside its stages' forward and backward "
               "computations. It sits above the theory by the cost of the sends and by the stages' unequal work (the "
               f"last stage also computes the output layer and the loss).\n{END}")
    replace_section(section, START, END)
    print("\n".join(table))


if __name__ == "__main__":
    main()
