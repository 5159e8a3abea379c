"""The checks and measurements that need a CUDA GPU, in one run of about 7 minutes on one GPU (bench/gpu.sh runs it).

    python bench/gpu.py --out OUT_DIR              # on the GPU machine: checks, then OUT_DIR/gpu_results.json
    python bench/gpu.py --record OUT_DIR/gpu_results.json    # anywhere: the GPU section of BENCHMARKS.md

1. `accelerate test` (Accelerate's own end-to-end check) under every shipped single-machine config, as one process
   on the GPU, all at once: they are correctness checks, so they may share the device.
2. `pytest -m gpu` (tests/test_gpu.py) at the same time: every config as one process on one GPU against the plain
   single-GPU run, bf16, fp16 with the loss scaler (torch's and DeepSpeed's); the multi-GPU checks skip on one GPU.
3. Then alone on the device, for timings: the tiny transformer's gpt2-small preset (124M parameters, sequence 1024)
   in bf16, eager and with --compile: tokens/s and MFU against the GPU's dense bf16 peak (trainkit/run/metrics.py);
   and bench/moe.py's mixture-of-experts step with its experts as a Python loop, as grouped matmuls (transformers'
   default) and batched, beside a dense model of the same active width, in fp32 on the GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

import yaml
from accelerate.test_utils import path_in_accelerate_package

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import moe  # noqa: E402
from sections import BENCHMARKS, replace_section  # noqa: E402

from trainkit.launch.launcher import shipped_configs  # noqa: E402
from trainkit.launch.train_process import run_config  # noqa: E402

START, END = "<!-- gpu section: written by bench/gpu.py -->", "<!-- end of gpu section -->"
GPT2 = ["--recipe", "tiny_transformer", "--size", "gpt2-small", "--batch_size", "16", "--max_steps", "40",
        "--eval_every", "0"]
SCRIPT = str(path_in_accelerate_package("test_utils", "scripts", "test_script.py"))
MEASURED = slice(10, None)  # steps 11-40: after the allocator, cuDNN and compile warm-ups


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def accelerate_test(name: str, port: int, tmp: Path) -> dict:
    """`accelerate test` under the shipped YAML `name` made one process (one GPU), on its own port: the launch that
    `accelerate test --config_file` makes, without needing Accelerate's console scripts on PATH."""
    config = yaml.safe_load((ROOT / "accelerate_configs" / f"{name}.yaml").read_text())
    config.update(num_processes=1, main_process_port=port)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    started = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(path), SCRIPT],
                              cwd=ROOT, capture_output=True, text=True, timeout=240)
        ok, output = proc.returncode == 0, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        ok, output = False, f"timed out after 240 s\n{e.stdout or ''}"
    return {"ok": ok, "seconds": round(time.perf_counter() - started, 1), "tail": tail(output)}


def pytest_gpu() -> dict:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-q", "-p",
                           "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=420)
    return {"ok": proc.returncode == 0, "seconds": round(time.perf_counter() - started, 1),
            "tail": tail(proc.stdout + proc.stderr, 40)}


def gpt2_small(tmp: Path, compile_: bool) -> dict:
    """The gpt2-small preset in bf16 on one GPU: median tokens/s and MFU of the measured steps."""
    run = run_config("single", tmp / f"gpt2-{'compile' if compile_ else 'eager'}",
                     [*GPT2, *(["--compile"] if compile_ else [])], launch_args=("--mixed_precision", "bf16"))
    if run.returncode:
        return {"ok": False, "tail": tail(run.stderr)}
    steps = run.metrics[MEASURED]
    return {"ok": True, "tokens_per_s": statistics.median(m["tokens_per_s"] for m in steps),
            "mfu": statistics.median(m["mfu"] for m in steps), "peak_mem_bytes": run.metrics[-1]["peak_mem_bytes"],
            "flops_param_count": run.resolved["flops_param_count"], "first_step_s": run.metrics[0].get("elapsed_s"),
            "final_loss": run.losses[-1]}


def measure(out: Path) -> dict:
    import accelerate
    import torch

    # Configs whose parallelism sizes fix several processes (tp, fsdp_tp, hsdp) cannot run as one.
    names = [name for name, launch in shipped_configs().items() if launch.num_machines == 1 and not launch.parallelism]
    results: dict = {"date": date.today().isoformat(), "gpu": torch.cuda.get_device_name(0),
                     "versions": {"torch": torch.__version__, "accelerate": accelerate.__version__}}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(len(names) + 1) as pool:
        checks = pool.submit(pytest_gpu)
        tests = {name: pool.submit(accelerate_test, name, 29600 + i, Path(tmp)) for i, name in enumerate(names)}
        results["accelerate_test"] = {name: job.result() for name, job in tests.items()}
        results["pytest_gpu"] = checks.result()
        for name, result in results["accelerate_test"].items():
            print(f"accelerate test {name}: {'ok' if result['ok'] else 'FAILED'} ({result['seconds']} s)", flush=True)
        print(f"pytest -m gpu: {results['pytest_gpu']['tail'].splitlines()[-1]}", flush=True)
        results["gpt2_small_bf16"] = {mode: gpt2_small(Path(tmp), mode == "compile") for mode in ("eager", "compile")}
    rounds, losses = moe.kernel_rounds("cuda")
    results["moe_kernels"] = {"rounds": rounds, "losses": losses}
    for mode, result in results["gpt2_small_bf16"].items():
        print(f"gpt2-small bf16 {mode}: {result}", flush=True)
    (out / "gpu_results.json").write_text(json.dumps(results, indent=2))
    return results


def section(results: dict) -> str:
    lines = [START, "## GPU: checks and gpt2-small MFU", "",
             f"Measured {results['date']} on one {results['gpu']} (torch {results['versions']['torch']}, accelerate "
             f"{results['versions']['accelerate']}), command: `bash bench/gpu.sh OUT` (wheels from "
             "`bash bench/gpu_wheels.sh`), recorded with `python bench/gpu.py --record OUT/gpu_results.json`.", "",
             "| check | result |", "|---|---|"]
    lines += [f"| accelerate test, {name}.yaml as one process | {'passed' if r['ok'] else 'FAILED'} "
              f"({r['seconds']} s) |" for name, r in results["accelerate_test"].items()]
    last = results["pytest_gpu"]["tail"].splitlines()[-1] if results["pytest_gpu"]["tail"] else ""
    lines += [f"| pytest -m gpu (tests/test_gpu.py) | {last} |", "",
              "| gpt2-small, bf16, batch 16 x 1024 tokens | tokens/s | MFU (dense bf16 peak) | peak memory |",
              "|---|---:|---:|---:|"]
    for mode, r in results["gpt2_small_bf16"].items():
        lines.append(f"| {mode} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['peak_mem_bytes'] / 2**30:.1f} GiB |"
                     if r["ok"] else f"| {mode} | failed: {r['tail'].splitlines()[-1]} | | |")
    lines += ["", "The goal is 45% MFU (nanoGPT reports about 37% on an A100; torchtitan 33-39% on H100 with FSDP)."]
    if kernels := results.get("moe_kernels"):
        lines += ["", "| bench/moe.py's step on the GPU, fp32 | step (median of rounds) | loop's step / this one's, "
                  "each round | loss at step 1 |", "|---|---:|---|---:|"]
        for kind, loss in kernels["losses"].items():
            seconds = statistics.median(r[kind] for r in kernels["rounds"])
            ratios = " / ".join(f"{r['eager'] / r[kind]:.2f}" for r in kernels["rounds"])
            lines.append(f"| {kind} | {seconds * 1000:,.1f} ms | {ratios} | {loss:.6f} |")
    return "\n".join([*lines, END])


def record(results_file: Path) -> None:
    replace_section(section(json.loads(results_file.read_text())), START, END)
    print(f"wrote the GPU section of {BENCHMARKS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="run the checks (needs a CUDA GPU); results go here")
    parser.add_argument("--record", type=Path, help="write BENCHMARKS.md's GPU section from this gpu_results.json")
    args = parser.parse_args()
    if args.record:
        record(args.record)
    elif args.out:
        import torch

        if not torch.cuda.is_available():
            sys.exit("bench/gpu.py --out needs a CUDA GPU; on this machine use the CPU benchmarks in bench/")
        args.out.mkdir(parents=True, exist_ok=True)
        measure(args.out)
    else:
        parser.error("pass --out DIR (on a GPU machine) or --record gpu_results.json")


if __name__ == "__main__":
    main()
