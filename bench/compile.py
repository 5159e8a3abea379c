"""--compile against eager under every shipped config: loss parity, speed and compile time; BENCHMARKS.md + a chart.

    python bench/compile.py                        # 12-15 minutes on 2 quiet CPU cores
    python bench/compile.py --configs ddp,fsdp     # some configs only (the table then holds only those)

Each shipped config that runs on one machine (trainkit.strategies.registry.shipped_strategies: 2 processes, 4 for
fsdp_tp and hsdp) trains the tiny transformer (the recipe's default size: hidden 128, 4 layers, 128-token sequences) for
STEPS optimizer steps twice, eager and with --compile, in fp32 with the same seed and batches. The table gives the
largest relative difference between the two loss curves, the median tokens/s of the steps after WARMUP (the first step
compiles; a second may recompile for a new shape of the data or state), and the first step's seconds, which hold
the compilation. A strategy that refuses --compile shows its reason (refused at plan time, nothing is built).

The runs share one inductor cache, made fresh for this run of the script: a graph compiled once (the whole model
under ddp and the ZeRO stages, one transformer block under the FSDP2 configs) is read from that cache by the later
configs, whose first step then shows the rest of the compilation (tracing, guards). Cut to fit 15 minutes on 2
cores: 10 steps of 8 sequences per process, one held-out batch at the end, and without the offload variants of the
configs that compile (SKIPPED: they compile the same graphs as their plain configs, only the optimizer's work moves
to the host; name them with --configs to measure them).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sections import BENCHMARKS, bar_chart, replace_section  # noqa: E402

from trainkit.launch.train_process import max_rel_diff, run_config  # noqa: E402
from trainkit.recipes import load_recipe  # noqa: E402
from trainkit.strategies.registry import for_launch, shipped_strategies  # noqa: E402

STEPS, WARMUP = 10, 3  # tokens/s: the median of steps WARMUP + 1 .. STEPS
ARGS = ["--recipe", "tiny_transformer", "--batch_size", "8", "--max_steps", str(STEPS), "--eval_every", "0",
        "--eval_batches", "1", "--warmup_steps", "2"]
SKIPPED = ("fsdp_offload", "deepspeed_zero2_offload")
START, END = "<!-- compile table: written by bench/compile.py -->", "<!-- end of compile table -->"


def refusal(name: str) -> str | None:
    """Why the config refuses --compile (its strategy's plan-time check), or None."""
    recipe = load_recipe("tiny_transformer")
    launch = shipped_strategies()[name]
    strategy = for_launch(launch, dataclasses.replace(recipe.Config(), compile=True), {}, recipe)
    return strategy.compile_refusal()


def tokens_per_s(run) -> float:
    return statistics.median(m["tokens_per_s"] for m in run.metrics if m["step"] > WARMUP)


def first_step_s(run) -> float:
    return run.resolved["global_batch_size"] / run.metrics[0]["samples_per_s"]


def measure(names: list[str], tmp: Path) -> tuple[list[str], dict[str, dict[str, float]]]:
    """The table's rows, and the tokens/s of each config that compiles, eager and compiled."""
    speeds: dict[str, dict[str, float]] = {"eager": {}, "--compile": {}}
    rows = ["| config | processes | max rel. loss diff | eager tokens/s | compiled tokens/s | speedup | "
            "first step eager (s) | first step compiled (s) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in names:
        processes = shipped_strategies()[name].world_size
        if reason := refusal(name):
            rows.append(f"| {name} | {processes} | refused: {reason} | | | | | |")
        else:
            eager = run_config(name, tmp / f"{name}-eager", ARGS).check()
            compiled = run_config(name, tmp / f"{name}-compiled", [*ARGS, "--compile"]).check()
            speed = tokens_per_s(eager), tokens_per_s(compiled)
            speeds["eager"][name], speeds["--compile"][name] = speed
            rows.append(f"| {name} | {processes} | {max_rel_diff(compiled.losses, eager.losses):.1e} | "
                        f"{speed[0]:,.0f} | {speed[1]:,.0f} | {speed[1] / speed[0]:.2f}x | "
                        f"{first_step_s(eager):.1f} | {first_step_s(compiled):.1f} |")
        print(rows[-1], flush=True)
    return rows, speeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", help="comma-separated shipped configs (default: all but SKIPPED)")
    args = parser.parse_args()
    names = args.configs.split(",") if args.configs else [n for n in shipped_strategies() if n not in SKIPPED]
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")  # fresh: see the module's docstring
        rows, speeds = measure(names, Path(tmp))
    chart = bar_chart("compile", f"Tiny transformer, eager against --compile (median of steps {WARMUP + 1}-{STEPS})",
                      "tokens/s (all processes)", speeds)
    command = "python bench/compile.py" + (f" --configs {args.configs}" if args.configs else "")
    skipped = "" if args.configs else f"Not run (the same graphs as their plain configs): {', '.join(SKIPPED)}. "
    section = (f"{START}\n## torch.compile (`--compile`) against eager\n\n"
               f"Command: `{command}` (tiny transformer, 1.2M parameters, 128-token sequences, micro-batch 8 per "
               f"process, fp32, AdamW, {STEPS} steps; tokens/s: median of steps {WARMUP + 1}-{STEPS}; "
               f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}, torch {version('torch')}, "
               f"accelerate {version('accelerate')}, deepspeed {version('deepspeed')}).\n\n" + "\n".join(rows) +
               "\n\n" + chart + "\n\n" + skipped +
               "The first step holds the compilation (inductor, C++ on the CPU); the configs after the first of "
               "each graph read it from the run's shared inductor cache (bench/compile.py says which). Compiled per "
               "transformer block under the FSDP2 configs (fsdp, fsdp_offload, tp, fsdp_tp, hsdp), the whole model "
               "otherwise (docs/strategies.md).\n" + END)
    replace_section(section, START, END)
    print(f"wrote {BENCHMARKS}")


if __name__ == "__main__":
    main()
