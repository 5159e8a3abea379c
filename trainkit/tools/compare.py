"""Run one recipe under several strategy configs and compare each loss curve with one process's.

    python -m trainkit.tools.compare --recipe mlp --configs ddp,deepspeed_zero3,fsdp --max_steps 30
    python -m trainkit.tools.compare --recipe tiny_transformer --configs ddp,fsdp --mixed_precision bf16 -- --hidden 64

The reference is one process without a launcher whose micro-batch is the whole global batch of the others
(batch_size x grad_accum x num_processes), so every run sees the same global batches (the data-order invariant). A
config whose processes split the model (tp.yaml: both see the same samples) gets the micro-batch that keeps that
global batch, and one whose parallelism sizes fix its process count (fsdp_tp.yaml, hsdp.yaml) runs with that count.
Prints each config's max relative loss difference per step and writes the curves to a PNG (trainkit/tools/plot.py's
panels, with each config's relative difference from the reference on a log scale).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

from matplotlib.figure import Figure

from trainkit.data.batches import global_batch_size
from trainkit.errors import ConfigError
from trainkit.launch.launcher import Launch, config_path
from trainkit.launch.train_process import Run, max_rel_diff, run_config
from trainkit.tools.plot import RunCurves, plot_runs, save


def plot(curves: list[Run], path: Path, title: str) -> Figure:
    """The runs' panels (trainkit/tools/plot.py: loss, throughput, MFU, memory, and each config's relative loss
    difference from the first run, the one-process reference) saved to `path`; returns the figure. Call it while the
    runs'
    folders exist: the curves are read from their metrics.jsonl."""
    figure = plot_runs([RunCurves(curve.name, curve.metrics) for curve in curves], title)
    save(figure, path)
    return figure


def split_for(config: str, recipe: str, num_processes: int, global_batch: int, grad_accum: int) -> tuple[int, int]:
    """(processes, micro-batch) that run `config` on the reference's global batch."""
    from trainkit.recipes import load_recipe
    from trainkit.strategies.registry import for_launch

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
