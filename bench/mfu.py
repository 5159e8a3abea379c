"""MFU of the tiny transformer's CPU presets against this machine's measured fp32 matmul peak; BENCHMARKS.md + a chart.

    python bench/mfu.py               # about 19 minutes on 2 quiet CPU cores
    python bench/mfu.py --rounds 1    # the presets and the tries once each: about 5 minutes

Measures the fp32 matmul peak with every core (trainkit/launch/hardware.py, the measurement that the first CPU runs on a
machine make), then runs `python train.py --recipe tiny_transformer --size <preset> --max_steps 20` for the presets
`tiny` and `cpu`, one process with every core, and reports the median tokens/s of steps 6-19 (the first steps warm
up; the last one evaluates) and the MFU of that rate against the best of the peaks measured before each round and at
the end. Beside the presets, TRIES: what else was tried for the `cpu` preset's 80% goal (other shapes, the Llama
block). The rows take turns, round after round: the presets run in every round, the tries in the first three. The
table gives each row's median round, its best round and the range: on this shared machine a neighbour can slow one
run by 10% or more, and the peak, the best of a second of products, is itself a quiet moment's figure (the best
round is the like-for-like figure; the median says what a run usually sees).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import accelerate  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from sections import BENCHMARKS, bar_chart, replace_section  # noqa: E402

from trainkit.launch.hardware import cpu_cores, cpu_model, cpu_peak_flops, measure_matmul_peak  # noqa: E402
from trainkit.launch.train_process import run_config  # noqa: E402

PRESETS = ("tiny", "cpu")
# What else was tried for the `cpu` preset's goal: other shapes, and the Llama block at the preset's shape and at the
# preset's shape before (the environment settings tried earlier are in BENCHMARKS.md's summary).
TRIES: dict[str, tuple[list[str], dict[str, str]]] = {
    "cpu, hidden 1024, 16 heads": (["--hidden", "1024", "--heads", "16"], {}),
    "cpu, hidden 640, 6 layers, 10 heads": (["--hidden", "640", "--layers", "6", "--heads", "10"], {}),
    "cpu as Llama": (["--arch", "llama"], {}),
    "Llama, hidden 384, 6 layers, 6 heads (the cpu preset before)": (
        ["--arch", "llama", "--hidden", "384", "--layers", "6", "--heads", "6"], {}),
}
STEPS = 20
ROUNDS = 5
TRY_ROUNDS = 3  # the tries are there to compare shapes: fewer rounds keep the bench near 20 minutes
MEDIAN_OF = slice(5, STEPS - 1)  # steps 6-19
START, END = "<!-- mfu: written by bench/mfu.py -->", "<!-- end of mfu -->"


def measure(cache_dir: Path, rounds: int) -> tuple[list[float], str, str]:
    """The peaks measured (FLOP/s), the table of the presets and tries (each run `rounds` times, in turn) and its
    chart. MFU is taken against the best peak measured: one measurement lasts a second, and a busy second would lower
    it and raise every MFU read against it (the runs' own `mfu` uses the first one, which they read from the cache)."""
    for name in ("OMP_NUM_THREADS", "TRAINKIT_CPU_THREADS"):  # the runs take every core, as python train.py does
        os.environ.pop(name, None)
    torch.set_num_threads(cpu_cores())
    peaks = [cpu_peak_flops(torch.float32, cache_dir)[0]]
    rows = {preset: (["--size", preset], {}) for preset in PRESETS} | \
        {label: (["--size", "cpu", *args], env) for label, (args, env) in TRIES.items()}
    runs: dict[str, list[tuple[dict, float]]] = {label: [] for label in rows}  # resolved, median tokens/s
    for round_ in range(rounds):
        if round_:
            peaks.append(measure_matmul_peak(torch.float32))
        print(f"fp32 matmul peak: {peaks[-1] / 1e9:.1f} GFLOP/s with {cpu_cores()} threads", flush=True)
        for i, (label, (args, env)) in enumerate(rows.items()):
            if label not in PRESETS and round_ >= TRY_ROUNDS:
                continue
            run = run_config(None, cache_dir / f"{round_}-{i}", ["--recipe", "tiny_transformer", *args, "--max_steps",
                                                                str(STEPS), "--report_to", "none", "--cache_dir",
                                                                str(cache_dir)], env=env).check()
            assert run.resolved["cpu_threads"] == cpu_cores(), run.resolved["cpu_threads"]
            runs[label].append((run.resolved, statistics.median(m["tokens_per_s"] for m in run.metrics[MEDIAN_OF])))
            print(f"round {round_ + 1}: {label}: {runs[label][-1][1]:,.0f} tokens/s", flush=True)
    peaks.append(measure_matmul_peak(torch.float32))
    table = ["| preset | model | parameters (N) | FLOPs / token | tokens/s | MFU (median round) | best round | range "
             "| rounds |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    mfus: dict[str, dict[str, float]] = {"median round": {}, "best round": {}}
    for label, done in runs.items():
        r = done[0][0]
        each = sorted(r["flops_per_token"] * tokens / max(peaks) for _, tokens in done)
        table.append(f"| {label} | {r['arch']}, hidden {r['hidden']}, {r['layers']} layers, {r['heads']} heads, "
                     f"seq {r['seq_len']}, batch {r['batch_size']} | {r['flops_param_count']:,} | "
                     f"{r['flops_per_token'] / 1e6:.1f}M | {statistics.median(t for _, t in done):,.0f} | "
                     f"{statistics.median(each):.1%} | {each[-1]:.1%} | {each[0]:.1%}-{each[-1]:.1%} | {len(each)} |")
        mfus["median round"][label], mfus["best round"][label] = statistics.median(each), each[-1]
    chart = bar_chart("mfu", f"MFU against the best fp32 matmul peak measured ({max(peaks) / 1e9:.0f} GFLOP/s, "
                      f"{cpu_cores()} cores)", "MFU", mfus,
                      goal=(0.8, "the cpu preset's goal: 80%"), value="{:.1%}")
    return peaks, "\n".join(table), chart


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help=f"rounds of the presets' runs (the tries': at most {TRY_ROUNDS}), the rows in turn")
    rounds = parser.parse_args().rounds
    load = os.getloadavg()[0]  # another busy process lowers every number here: the section says how quiet it was
    with tempfile.TemporaryDirectory() as tmp:
        peaks, table, chart = measure(Path(tmp), rounds)
    section = (f"{START}\n## MFU on CPU: the tiny transformer's presets\n\n"
               f"Command: `python bench/mfu.py{f' --rounds {rounds}' if rounds != ROUNDS else ''}`. Machine: "
               f"{cpu_model()}, {cpu_cores()} cores; Python "
               f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
               f"accelerate {accelerate.__version__}. Peak: the fp32 matmul peak with {cpu_cores()} threads (the "
               "best of square products of 256 to 2048, trainkit/launch/hardware.py), measured before each round "
               f"and at the end: {', '.join(f'{p / 1e9:.1f}' for p in peaks)} GFLOP/s; MFU is taken against the best, "
               f"{max(peaks) / 1e9:.1f}. Each preset: `python train.py --recipe tiny_transformer --size <preset> "
               f"--max_steps {STEPS}`, one process with every core, fp32, AdamW; the median of steps "
               f"{MEDIAN_OF.start + 1}-{MEDIAN_OF.stop} of each run; each row runs once a round, the rows taking "
               f"turns, the presets in all {rounds} rounds and the tries in the first {min(rounds, TRY_ROUNDS)}. "
               "MFU is given for the median round, the best round (like the peak, a quiet moment's figure: the "
               "machine is shared, and a neighbour slows a whole run) and the range. The rows below the presets are "
               "what else was tried for the `cpu` preset's goal (bench/mfu.py's TRIES: the flags after `--size cpu`). "
               f"Load average (1 min) when it started: {load:.1f}.\n\n"
               + table + "\n\n" + chart + "\n\n"
               "FLOPs per token as nanoGPT and PaLM count them: 6 N + 12 x layers x hidden x seq_len (attention), "
               "N = every parameter but the input embedding tables (docs/outputs.md). The `cpu` preset is sized so "
               "that the matmuls, not the framework between them, take the time: the goal is at least 80% MFU on a "
               "2-core machine.\n"
               f"{END}")
    replace_section(section, START, END)
    print(f"wrote {BENCHMARKS}")


if __name__ == "__main__":
    main()
