"""Run one recipe under several strategy configs and compare each loss curve with one process's.

    python -m trainkit.compare --recipe mlp --configs ddp,deepspeed_zero3,fsdp --max_steps 30
    python -m trainkit.compare --recipe tiny_transformer --configs ddp,fsdp --mixed_precision bf16 -- --hidden 64

The reference is one process without a launcher whose micro-batch is the whole global batch of the others
(batch_size x grad_accum x num_processes), so every run sees the same global batches (the data-order invariant). A
config whose processes split the model (tp.yaml: both see the same samples) gets the micro-batch that keeps that
global batch, and one whose parallelism sizes fix its process count (fsdp_tp.yaml, hsdp.yaml) runs with that count.
Prints each config's max relative loss difference per step and writes the curves to a PNG (trainkit/plot.py's
panels, with each config's relative difference from the reference on a log scale).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from matplotlib.figure import Figure

from trainkit.data import global_batch_size
from trainkit.errors import ConfigError
from trainkit.launch import Launch, config_path
from trainkit.plot import RunCurves, plot_runs, save

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Run:
    """A finished train.py run: its exit status, output and output directory."""

    name: str
    returncode: int
    stdout: str
    stderr: str
    output_dir: Path

    @property
    def metrics(self) -> list[dict]:
        path = self.output_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]

    @property
    def resolved(self) -> dict:
        return json.loads((self.output_dir / "resolved_config.json").read_text())

    def check(self) -> Run:
        assert self.returncode == 0, f"{self.name} failed ({self.returncode}):\n{self.stderr[-4000:]}"
        return self


def launch_command(config: str | None, output_dir: Path, args: list[str], num_processes: int | None = None,
                   launch_args: tuple[str, ...] = (), script: str = "train.py") -> list[str]:
    """`python SCRIPT ARGS` (config None), or `accelerate launch --config_file CONFIG [--num_processes N] LAUNCH_ARGS
    SCRIPT ARGS` on a free port, CONFIG a name from accelerate_configs/ or a path to a .yaml; train.py also gets
    --output_dir and --report_to none."""
    if config is None:
        cmd = [sys.executable, script]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_path(config)),
               "--main_process_port", "0", *launch_args]
        if num_processes:
            cmd += ["--num_processes", str(num_processes)]
        cmd.append(script)
    if script == "train.py":
        cmd += ["--output_dir", str(output_dir), "--report_to", "none"]
    return [*cmd, *args]


def run_config(config: str | None, output_dir: Path, args: list[str], num_processes: int | None = None,
               launch_args: tuple[str, ...] = (), script: str = "train.py", env: dict | None = None,
               timeout: float | None = None) -> Run:
    """Run launch_command(...) from the repository root to its end, or for at most `timeout` seconds: a launch still
    running then (a rank that hung) is killed with every process under it and reads as failed."""
    cmd = launch_command(config, output_dir, args, num_processes, launch_args, script)
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, **(env or {})}) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            stdout, stderr = proc.communicate()
            stderr += f"\nkilled after {timeout:.0f} s: the launch had not ended\n"
    return Run(config or "one process", proc.returncode, stdout, stderr, output_dir)


def kill_tree(proc: subprocess.Popen | psutil.Process, sig: int = signal.SIGKILL) -> None:
    """Signal a launch and every process under it, workers first (torchrun starts its workers in their own
    sessions, so a process group would miss them)."""
    try:
        parent = psutil.Process(proc.pid)
        tree = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    if sig == signal.SIGKILL:
        _wait_ended(tree)


def _wait_ended(procs: list[psutil.Process], timeout: float = 10.0) -> None:
    """Return once every process has ended (gone, or a zombie that its parent has not reaped yet): a killed process
    closes its pipes before it has ended, so a caller that read the launch's output to its end could still see it
    running."""
    deadline = time.monotonic() + timeout
    for p in procs:
        while time.monotonic() < deadline:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)


def max_rel_diff(curve: list[float], reference: list[float]) -> float:
    if len(curve) != len(reference):
        return float("inf")
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(curve, reference, strict=True))


def plot(curves: list[Run], path: Path, title: str) -> Figure:
    """The runs' panels (trainkit/plot.py: loss, throughput, MFU, memory, and each config's relative loss difference
    from the first run, the one-process reference) saved to `path`; returns the figure. Call it while the runs'
    folders exist: the curves are read from their metrics.jsonl."""
    figure = plot_runs([RunCurves(curve.name, curve.metrics) for curve in curves], title)
    save(figure, path)
    return figure


def split_for(config: str, recipe: str, num_processes: int, global_batch: int, grad_accum: int) -> tuple[int, int]:
    """(processes, micro-batch) that run `config` on the reference's global batch."""
    from trainkit.recipes import load_recipe
    from trainkit.strategies import for_launch

    loaded = load_recipe(recipe)
    launch = Launch.from_yaml(config_path(config))
    strategy = for_launch(dataclasses.replace(launch, world_size=num_processes), loaded.Config(), {}, loaded)
    if strategy.check():  # the YAML's parallelism sizes fix its process count
        num_processes, strategy = launch.world_size, for_launch(launch, loaded.Config(), {}, loaded)
    return num_processes, global_batch // (grad_accum * strategy.data_parallel_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--configs", required=True,
                        help="comma-separated names from accelerate_configs/ or paths to .yaml files")
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=8, help="per-process micro-batch of the launched runs")
    parser.add_argument("--grad_accum", type=int, default=1)
    parser.add_argument("--max_steps", type=int, default=20)
    parser.add_argument("--mixed_precision", choices=["no", "bf16", "fp16"], help="for the launched runs")
    parser.add_argument("--png", type=Path, default=Path("loss_curves.png"))
    parser.add_argument("recipe_args", nargs="*", help="more train.py flags, after --")
    args = parser.parse_args(argv)

    # The recipe's own evaluation cadence: every evaluation is a point on the PNG's loss panel.
    common = ["--max_steps", str(args.max_steps), *args.recipe_args]
    global_batch = global_batch_size(args.batch_size, args.grad_accum, args.num_processes)
    with tempfile.TemporaryDirectory() as tmp:
        reference = run_config(None, Path(tmp) / "reference",
                               ["--recipe", args.recipe, "--batch_size", str(global_batch), *common])
        if reference.returncode != 0:
            print(f"error: the one-process reference failed:\n{reference.stderr[-2000:]}", file=sys.stderr)
            return 1
        curves = [reference]
        # The table is printed in one block after the runs: what the libraries print while they start (DeepSpeed's
        # "Setting accelerator to CPU") does not land between its rows.
        rows = [f"{'config':<28} max relative loss difference vs one process ({args.max_steps} steps, "
                f"global batch {global_batch})"]
        failed = False
        for i, config in enumerate(args.configs.split(",")):
            precision = ("--mixed_precision", args.mixed_precision) if args.mixed_precision else ()
            processes, micro_batch = split_for(config, args.recipe, args.num_processes, global_batch, args.grad_accum)
            curve = run_config(config, Path(tmp) / f"{i}_{Path(config).stem}",
                               ["--recipe", args.recipe, "--batch_size", str(micro_batch), "--grad_accum",
                                str(args.grad_accum), *common], processes, precision)
            if curve.returncode != 0:
                failed = True
                errors = [line for line in curve.stderr.splitlines() if line.startswith("error:")]
                rows.append(f"{config:<28} FAILED: {errors[0] if errors else curve.stderr.strip().splitlines()[-1]}")
                continue
            curves.append(curve)
            rows.append(f"{config:<28} {max_rel_diff(curve.losses, reference.losses):.2e}")
        sys.stderr.flush()
        print("\n".join(rows), flush=True)
        # Inside the block: the curves are read from the runs' metrics.jsonl, which go with the temporary folder.
        try:
            plot(curves, args.png, f"{args.recipe}: each config against one process (global batch {global_batch})")
        except ConfigError as e:
            print(*(f"error: {line}" for line in e.lines()), sep="\n", file=sys.stderr)
            return e.exit_status
    print(f"loss curves: {args.png}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
