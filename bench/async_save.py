"""--async_save against synchronous saves: how long each save blocks the training loop; BENCHMARKS.md.

    python bench/async_save.py              # about 9 minutes on 2 quiet CPU cores
    python bench/async_save.py --repeats 5

One process trains the tiny transformer for STEPS steps with a checkpoint every SAVE_EVERY steps, once with
synchronous saves and once with --async_save, in turn, REPEATS times, at two sizes: the `cpu` preset (29M
parameters) and the same with 14 layers (100M parameters; a checkpoint of weights and AdamW's two moments is 1.2 GB),
that one also with a core left to the write (CASES).
The loop's time in saves is metrics.jsonl's checkpoint_s (trainkit/run/checkpoint.py's Checkpointer.blocked: the save
itself, a wait for the write before it, and the rename of a finished asynchronous write); a save blocks for the sum
over the run divided by the number of saves. The last save's write, which the end of the run waits for, is outside
the loop and not counted in either mode. The step's own time (its seconds minus checkpoint_s) says what the write
thread beside the training costs the compute on the same cores, and the loop's seconds (every step with the saves in
it) whether the asynchronous run ended sooner.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sections import replace_section  # noqa: E402

from trainkit.launch.train_process import run_config  # noqa: E402

STEPS, SAVE_EVERY = 7, 2  # saves after steps 2, 4 and 6; their blocking lands in steps 3, 5 and 7
# (recipe flags, environment): the write thread shares the cores with the compute threads, so the 100M model runs
# twice, on every core and on one core less than the machine has (TRAINKIT_CPU_THREADS, trainkit/launch/hardware.py)
CASES = {"cpu preset (29M)": (["--size", "cpu"], {}),
         "100M (cpu preset, 14 layers)": (["--size", "cpu", "--layers", "14"], {}),
         "100M, one core left free": (["--size", "cpu", "--layers", "14"],
                                      {"TRAINKIT_CPU_THREADS": str(max(1, (os.cpu_count() or 2) - 1))})}
ARGS = ["--recipe", "tiny_transformer", "--batch_size", "4", "--max_steps", str(STEPS), "--eval_every", "0",
        "--eval_batches", "1", "--warmup_steps", "2", "--save_every", str(SAVE_EVERY), "--report_to", "none"]
START, END = "<!-- async save table: written by bench/async_save.py -->", "<!-- end of async save table -->"


def blocked_per_save(run) -> float:
    return sum(m["checkpoint_s"] for m in run.metrics) / (STEPS // SAVE_EVERY)


def step_s(run) -> float:
    """The median step's own seconds (its time, less what saves took of it), after the first."""
    batch = run.resolved["global_batch_size"]
    return statistics.median(batch / m["samples_per_s"] - m["checkpoint_s"] for m in run.metrics[1:])


def loop_s(run) -> float:
    """The loop's seconds: every step's time, which holds the saves after the step before it."""
    return sum(run.resolved["global_batch_size"] / m["samples_per_s"] for m in run.metrics)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = ["| model | round | sync: blocked per save (s) | async: blocked per save (s) | async / sync | "
            "step sync (s) | step async (s) | loop sync (s) | loop async (s) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    summary = []
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for size, (size_args, env) in CASES.items():
            ratios = []
            for repeat in range(1, args.repeats + 1):
                runs = {}
                for mode, extra in (("sync", []), ("async", ["--async_save"])):
                    out = Path(tmp) / f"{len(rows)}-{mode}"
                    runs[mode] = run_config(None, out, [*ARGS, *size_args, *extra], env=env).check()
                sync, asynchronous = blocked_per_save(runs["sync"]), blocked_per_save(runs["async"])
                ratios.append(asynchronous / sync)
                rows.append(f"| {size} | {repeat} | {sync:.3f} | {asynchronous:.3f} | {ratios[-1]:.2f} | "
                            f"{step_s(runs['sync']):.2f} | {step_s(runs['async']):.2f} | "
                            f"{loop_s(runs['sync']):.1f} | {loop_s(runs['async']):.1f} |")
                print(rows[-1], flush=True)
            summary.append(f"{size}: async blocks for {min(ratios):.2f}-{max(ratios):.2f} of a synchronous save "
                           f"(median {statistics.median(ratios):.2f})")
    section = (START + f"\n\n`python bench/async_save.py --repeats {args.repeats}`; load average before the run "
               f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min), one process on "
               f"{os.cpu_count()} cores.\n\n" + "\n".join(rows) + "\n\n" + "; ".join(summary) + ".\n" + END)
    replace_section(section, START, END)
    print("\n".join(summary))


if __name__ == "__main__":
    main()
