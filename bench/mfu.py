"""MFU of the tiny transformer's CPU presets against this machine's measured fp32 matmul peak; writes BENCHMARKS.md.

    python bench/mfu.py               # about 2 minutes on 2 quiet CPU cores

Measures the fp32 matmul peak with every core (trainkit/hardware.py, the measurement every CPU run makes once per
machine), then runs `python train.py --recipe tiny_transformer --size <preset> --max_steps 30` for the presets
`tiny` and `cpu`, one process with every core, and reports the median tokens/s and MFU of steps 11-29 (the first steps
warm up; the last one evaluates). The runs read the peak measured here: their cache directory is a temporary one
that this script fills first. Run it on a quiet machine: another busy process lowers both numbers unevenly.
"""

from __future__ import annotations

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
from sections import BENCHMARKS, replace_section  # noqa: E402

from trainkit.compare import run_config  # noqa: E402
from trainkit.hardware import cpu_cores, cpu_model, cpu_peak_flops  # noqa: E402

PRESETS = ("tiny", "cpu")
STEPS = 30
MEDIAN_OF = slice(10, STEPS - 1)  # steps 11-29
START, END = "<!-- mfu: written by bench/mfu.py -->", "<!-- end of mfu -->"


def measure(cache_dir: Path) -> tuple[float, str]:
    """The peak (FLOP/s) and the table of one run per preset."""
    for name in ("OMP_NUM_THREADS", "TRAINKIT_CPU_THREADS"):  # the runs take every core, as python train.py does
        os.environ.pop(name, None)
    torch.set_num_threads(cpu_cores())
    peak, _ = cpu_peak_flops(torch.float32, cache_dir)
    print(f"fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s with {cpu_cores()} threads", flush=True)
    rows = ["| preset | model | parameters (N) | FLOPs / token | tokens/s | MFU |", "|---|---|---:|---:|---:|---:|"]
    for preset in PRESETS:
        run = run_config(None, cache_dir / preset, ["--recipe", "tiny_transformer", "--size", preset, "--max_steps",
                                                    str(STEPS), "--report_to", "none", "--cache_dir", str(cache_dir)]
                         ).check()
        r, steps = run.resolved, run.metrics[MEDIAN_OF]
        assert r["peak_flops"] == peak and r["cpu_threads"] == cpu_cores(), (r["peak_flops"], r["cpu_threads"])
        tokens = statistics.median(m["tokens_per_s"] for m in steps)
        mfu = statistics.median(m["mfu"] for m in steps)
        rows.append(f"| {preset} | {r['arch']}, hidden {r['hidden']}, {r['layers']} layers, {r['heads']} heads, "
                    f"seq {r['seq_len']}, batch {r['batch_size']} | {r['flops_param_count']:,} | "
                    f"{r['flops_per_token'] / 1e6:.1f}M | {tokens:,.0f} | {mfu:.1%} |")
        print(rows[-1], flush=True)
    return peak, "\n".join(rows)


def main() -> None:
    load = os.getloadavg()[0]  # another busy process lowers every number here: the section says how quiet it was
    with tempfile.TemporaryDirectory() as tmp:
        peak, table = measure(Path(tmp))
    section = (f"{START}\n## MFU on CPU: the tiny transformer's presets\n\n"
               f"Command: `python bench/mfu.py`. Machine: {cpu_model()}, {cpu_cores()} cores; Python "
               f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
               f"accelerate {accelerate.__version__}. Peak: the fp32 matmul peak measured with {cpu_cores()} "
               f"threads, {peak / 1e9:.1f} GFLOP/s (the best of square products of 256 to 2048; "
               "trainkit/hardware.py). Each preset: `python train.py --recipe tiny_transformer --size <preset> "
               f"--max_steps {STEPS}`, one process with every core, fp32, AdamW; the median of steps "
               f"{MEDIAN_OF.start + 1}-{MEDIAN_OF.stop}. Load average (1 min) when it started: {load:.1f}.\n\n"
               + table + "\n\n"
               "FLOPs per token as nanoGPT and PaLM count them: 6 N + 12 x layers x hidden x seq_len (attention), "
               "N = every parameter but the input embedding tables (docs/outputs.md). The `cpu` preset is sized so "
               "that the matmuls, not the framework between them, take the time: the goal is at least 80% MFU on a "
               "2-core machine.\n"
               f"{END}")
    replace_section(section, START, END)
    print(f"wrote {BENCHMARKS}")


if __name__ == "__main__":
    main()
