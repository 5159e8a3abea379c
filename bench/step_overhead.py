"""What trainkit adds to a training step, measured inside the processes that take the step; BENCHMARKS.md + a chart.

    python bench/step_overhead.py        # one process, DDP, ZeRO-2, ZeRO-3; about 4 minutes on 2 CPU cores

The peers section of bench/throughput.py times trainkit and the loops users would write instead in separate runs, and
on a shared machine such runs differ by 10-15% from one to the next: more than a runner adds to a step. Here every
rank builds trainkit's run (train.py's plan and build: the same Accelerator, model, optimizer and batches) and then
alternates, step by step, trainkit's step (the batches from its stream, trainkit/step.py's train_step with its loss
agreement, finite checks, clipping and optimizer step, then the metrics line) with the step of a plain Accelerate
loop on the same prepared objects (bench/peers/accelerate_loop.py's body: forward, `accelerator.backward`,
`clip_grad_norm_`, `optimizer.step`, `scheduler.step`, `zero_grad`), and in one process with a bare PyTorch step as
well. A busy spell of the machine slows every kind alike; the median of each round's difference is what trainkit
costs per step.
"""

from __future__ import annotations

import itertools
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

from sections import bar_chart, replace_section  # noqa: E402
from throughput import threads_for  # noqa: E402

CONFIGS = ("single", "ddp", "deepspeed_zero2", "deepspeed_zero3")  # those both peers run (bench/throughput.py)
WARMUP, ROUNDS = 3, 40  # rounds of one trainkit step and one loop step
ARGS = ["--recipe", "tiny_transformer", "--batch_size", "16", "--eval_every", "0", "--warmup_steps", "2",
        "--max_steps", str(2 * (WARMUP + ROUNDS))]  # the schedule and the data run over both kinds of step
START, END = "<!-- step overhead: written by bench/step_overhead.py -->", "<!-- end of step overhead -->"


def measure(argv: list[str], report: Path) -> None:
    """In each rank of a launch: build trainkit's run, alternate the two steps, rank 0 writes the timings."""
    import torch

    import train
    from trainkit.command_line import parse_command_line
    from trainkit.launch.library_noise import silence_library_noise
    from trainkit.plan import make_plan
    from trainkit.run.metrics import MetricsLog, peak_memory_bytes, process_seconds
    from trainkit.run.stopping import FiniteCheck
    from trainkit.step import train_step

    silence_library_noise()
    plan = make_plan(*parse_command_line(argv))
    run = train.build(plan)
    engine, cfg = run.engine, plan.cfg
    accelerator, model, loss_fn = engine.accelerator, engine.model, plan.recipe.compute_loss
    log = MetricsLog(accelerator, plan.options.output_dir, cfg.max_steps, initial_step=0)
    finite = FiniteCheck(fp16=False)

    trainkit_steps = itertools.count(1)

    def trainkit_step() -> None:  # train.py's loop body, less its evaluation and checkpoint branches
        step = next(trainkit_steps)
        result = train_step(engine, step, run.stream.next_global_batch(), loss_fn, finite, False)
        log.step({"step": step, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
                  "peak_mem_bytes": peak_memory_bytes(accelerator.device), "elapsed_s": process_seconds()})

    def loop_step() -> None:  # bench/peers/accelerate_loop.py's body, on trainkit's next batch
        batch = engine.cast_batch(run.stream.next_global_batch()[0])
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model, batch))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            engine.optimizer.step()
            engine.scheduler.step()
            engine.optimizer.zero_grad(set_to_none=False)  # as trainkit: the gradient buffers stay allocated

    def bare_step() -> None:  # bench/peers/torch_loop.py's body, without Accelerate's wrappers (one process only)
        raw_model, raw_optimizer = engine.unwrapped_model, engine.optimizer.optimizer
        loss_fn(raw_model, run.stream.next_global_batch()[0]).backward()
        torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.max_grad_norm)
        raw_optimizer.step()
        engine.scheduler.scheduler.step()
        raw_optimizer.zero_grad(set_to_none=False)

    steps = {"trainkit": trainkit_step, "loop": loop_step, **({"bare": bare_step} if accelerator.num_processes == 1
                                                              else {})}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(WARMUP + ROUNDS):
        names = list(steps)[i % len(steps):] + list(steps)[:i % len(steps)]  # each goes first in turn
        for name in names:
            started = time.perf_counter()
            steps[name]()
            if i >= WARMUP:
                times[name].append(time.perf_counter() - started)
    log.close()
    if accelerator.is_main_process:
        report.write_text(json.dumps({**times, "world_size": accelerator.num_processes,
                                      "threads": torch.get_num_threads(), "strategy": plan.resolved["strategy"]}))


def compared(data: dict, other: str) -> tuple[str, str, str]:
    """`other`'s median step in ms, what trainkit adds to it (the median and quartiles of each round's difference: the
    two steps of a round are neighbours in time, which the machine's drift disturbs least), and that as a share."""
    median = statistics.median(data[other]) * 1000
    paired = statistics.quantiles([(a - b) * 1000 for a, b in zip(data["trainkit"], data[other], strict=True)], n=4)
    return f"{median:.1f}", f"{paired[1]:+.1f} ms ({paired[0]:+.1f} to {paired[2]:+.1f})", f"{paired[1] / median:+.1%}"


def main() -> None:
    from trainkit.launch.hardware import cpu_cores, cpu_model
    from trainkit.launch.train_process import run_config

    rows = ["| config | processes x threads | trainkit step ms | Accelerate loop step ms | trainkit adds per step "
            "(quartiles) | trainkit adds / loop step |", "|---|---|---:|---:|---:|---:|"]
    load, started, bare = os.getloadavg()[0], time.perf_counter(), "not measured"
    labels = {"trainkit": "trainkit", "loop": "Accelerate loop", "bare": "bare PyTorch"}  # the chart's, per kind
    steps: dict[str, dict[str, float]] = {label: {} for label in labels.values()}  # median ms per config
    with tempfile.TemporaryDirectory() as tmp:
        for config in CONFIGS:
            out, report = Path(tmp) / config, Path(tmp) / f"{config}.json"
            processes = 1 if config == "single" else 2
            run = run_config(None if config == "single" else config, out,
                             ["--worker", str(report), *ARGS, "--output_dir", str(out), "--report_to", "none"],
                             script="bench/step_overhead.py",
                             env={"OMP_NUM_THREADS": str(threads_for(processes))})
            if run.returncode != 0 or not report.exists():
                raise SystemExit(f"{config}: the launch failed:\n{run.stderr[-3000:]}")
            data = json.loads(report.read_text())
            rows.append(f"| {config} | {data['world_size']} x {data['threads']} | "
                        f"{statistics.median(data['trainkit']) * 1000:.1f} | {' | '.join(compared(data, 'loop'))} |")
            print(rows[-1], flush=True)
            for kind, label in labels.items():
                if kind in data:
                    steps[label][config] = statistics.median(data[kind]) * 1000
            if "bare" in data:
                bare = "{} ms, trainkit adds {} per step, {}".format(*compared(data, "bare"))
    chart = bar_chart("step_overhead", f"Step time, the kinds alternating in the same processes (median of {ROUNDS})",
                      "ms per optimizer step (rank 0)", steps)
    section = (f"{START}\n## What trainkit adds to a step, measured in the same processes\n\n"
               f"Command: `python bench/step_overhead.py` ({(time.perf_counter() - started) / 60:.1f} min). Machine: "
               f"{cpu_model()}, {cpu_cores()} cores; Python {platform.python_version()}. Measured "
               f"{time.strftime('%Y-%m-%d')}, load average (1 min) {load:.1f} when it started.\n\n"
               "Separate runs of trainkit and of the peers (the section above) differ by 10-15% from one to the next "
               "on this machine, more than a runner adds to a step. Here each rank of one launch builds trainkit's "
               "run and then alternates, step by step on the same prepared model, optimizer and data, trainkit's "
               "step (its batches, trainkit/step.py's train_step with the loss agreement, finite checks, clipping and "
               "optimizer "
               "step, then the metrics line) with bench/peers/accelerate_loop.py's step body (forward, "
               "`accelerator.backward`, `clip_grad_norm_`, `optimizer.step`, `scheduler.step`, `zero_grad`). "
               f"Tiny transformer, micro-batch 16 x 128 tokens per process, fp32; the median of {ROUNDS} steps of "
               f"each kind after {WARMUP} of warm-up, rank 0's clock; the kinds take turns going first. "
               "Both keep the gradient buffers between steps (`zero_grad(set_to_none=False)`, trainkit's choice), so "
               "that neither pays for the other's. The batches of both come from trainkit's stream. What trainkit adds "
               "is the median of each round's difference (its step minus the loop's, neighbours in time), with the "
               "quartiles of those differences: the resolution of the measurement.\n\n"
               + "\n".join(rows) + "\n\nOne process against a bare PyTorch step as well (bench/peers/torch_loop.py's "
               "body on the unwrapped model, optimizer and schedule: forward, `loss.backward`, "
               "`torch.nn.utils.clip_grad_norm_`, the optimizer's and schedule's `step`, `zero_grad`; the three kinds "
               f"in turn): bare step {bare}.\n\n{chart}\n{END}")
    replace_section(section, START, END)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        from trainkit.launch.rank_exit import end_process

        measure(sys.argv[3:], Path(sys.argv[2]))
        end_process(0)  # as train.py: a launched rank skips the teardown that can hang (trainkit/launch/rank_exit.py)
    else:
        main()
