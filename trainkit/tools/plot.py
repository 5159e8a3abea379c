"""Runs side by side in one PNG: loss, throughput, MFU and memory against the optimizer step; for a mixture of
experts also its router's balancing loss and each layer's expert load.

    python -m trainkit.tools.plot runs/mlp runs/mlp_ddp --png runs.png
    python -m trainkit.tools.plot runs/a runs/b --labels adamw,sgd --png runs.png

Each argument is a run's --output_dir: its metrics.jsonl gives the curves, its resolved_config.json the label
(strategy/recipe; the folder's name where that is missing or not unique). With two runs or more a last panel shows
each run's relative loss difference from the first run, the reference, on a log scale: curves that agree to 1e-7
look like one line in the loss panel. Where a run logs `aux_loss` and `expert_load/layer_<i>` (a mixture of experts:
docs/recipes.md) a row shows them: the busiest expert's share of the routed tokens times the number of experts, 1.0
being an even spread. `python -m trainkit.tools.compare` draws its picture with the same function.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from trainkit.errors import ConfigError, Problem, write_failure

# Where the difference panel draws a step whose losses are equal: a log axis cannot show 0. Far below float32's
# resolution (a relative 6e-8), so a drawn difference is never mistaken for this floor.
DIFF_FLOOR = 1e-10


@dataclass(frozen=True, slots=True)
class RunCurves:
    """One run's metrics lines (one per optimizer step, steps increasing) and its name in the legend."""

    label: str
    metrics: list[dict[str, Any]]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the lines that have `key`; a null (a non-finite number in metrics.jsonl) is NaN, so
        the line has a gap there."""
        rows = [(m["step"], m[key]) for m in self.metrics if key in m]
        return [s for s, _ in rows], [math.nan if v is None else float(v) for _, v in rows]


def read_run(folder: Path, label: str | None = None) -> RunCurves:
    """A run folder's metrics.jsonl; the label from resolved_config.json unless given. Raises ConfigError."""
    path = folder / "metrics.jsonl"
    where = str(folder)
    if not folder.is_dir():
        raise ConfigError([Problem("no such run folder", where, "pass the --output_dir of a run")])
    if not path.is_file():
        raise ConfigError([Problem("no metrics.jsonl in this folder", where,
                                   "pass a run's --output_dir (train.py writes metrics.jsonl there from its first "
                                   "step), not a folder of runs")])
    metrics = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError([Problem(f"line {number} of metrics.jsonl is not JSON", where,
                                       "the run was stopped while writing it: delete that line")]) from None
        if not isinstance(record, dict) or not {"step", "loss"} <= record.keys():
            raise ConfigError([Problem(f"line {number} of metrics.jsonl has no step or loss", where,
                                       "pass a folder that train.py wrote")])
        if metrics and record["step"] <= metrics[-1]["step"]:
            raise ConfigError([Problem(f"metrics.jsonl goes back to step {record['step']} at line {number}", where,
                                       "keep one line per step (train.py's resume does so)")])
        metrics.append(record)
    if not metrics:
        raise ConfigError([Problem("metrics.jsonl is empty", where,
                                   "the run has not finished a step yet: plot it after its first step")])
    return RunCurves(label or default_label(folder), metrics)


def default_label(folder: Path) -> str:
    """strategy/recipe from resolved_config.json (ddp/mlp), or the folder's name without one."""
    try:
        resolved = json.loads((folder / "resolved_config.json").read_text())
        return f"{resolved['strategy']}/{Path(resolved['recipe']).stem}"
    except (OSError, ValueError, KeyError, TypeError):
        return folder.name


def overlap(run: RunCurves, reference: RunCurves) -> tuple[list[int], list[float], bool]:
    """(steps, |loss - reference loss| / |reference loss|, whether the two runs have different steps) on the steps
    where both have a finite loss (and the reference's is not 0)."""
    ref = dict(zip(*reference.series("loss"), strict=True))
    own = run.series("loss")
    rows = [(s, abs(a - ref[s]) / abs(ref[s])) for s, a in zip(*own, strict=True)
            if s in ref and math.isfinite(a) and math.isfinite(ref[s]) and ref[s] != 0]
    return [s for s, _ in rows], [d for _, d in rows], set(own[0]) != ref.keys()


def check_overlap(runs: list[RunCurves], folders: list[Path]) -> list[str]:
    """Refuses a run that shares no step with the reference; notes for those that share only part of it."""
    notes, problems = [], []
    ref_steps = runs[0].series("loss")[0]
    for run, folder in zip(runs[1:], folders[1:], strict=True):
        steps, _, partial = overlap(run, runs[0])
        own = run.series("loss")[0]
        if not steps:
            problems.append(Problem(f"no step with a loss in common with the reference {folders[0]} (steps "
                                    f"{own[0]}-{own[-1]} against {ref_steps[0]}-{ref_steps[-1]})", str(folder),
                                    "put first the run to compare against, or plot this run on its own"))
        elif partial:
            notes.append(f"{folder}: the difference panel shows steps {steps[0]}-{steps[-1]}, the steps it shares "
                         f"with {folders[0]}")
    if problems:
        raise ConfigError(problems)
    return notes


def plot_runs(runs: list[RunCurves], title: str) -> Figure:
    """The runs' panels against the optimizer step; returns the figure (fig.axes[0] is the loss panel, one line per
    run in order). The first run is the reference: drawn thicker, and the others' loss differences are taken
    from it."""
    loads = sorted({key for run in runs for m in run.metrics for key in m if key.startswith("expert_load/")},
                   key=lambda key: int(key.rsplit("_", 1)[1]))
    router = [["aux_loss", "expert_load"]] if loads else []
    rows = 2 + len(router) + (len(runs) > 1)
    figure = Figure(figsize=(11, 2.8 * rows + 0.5), layout="constrained")
    layout = [["loss", "throughput"], ["mfu", "memory"], *router] + ([["difference", "difference"]]
                                                                      if len(runs) > 1 else [])
    panels = figure.subplot_mosaic(layout)
    figure.suptitle(title)
    styles = [{"color": f"C{i}", "linestyle": "-" if i == 0 else "--", "linewidth": 2.4 if i == 0 else 1.2}
              for i in range(len(runs))]

    ax = panels["loss"]
    for run, style in zip(runs, styles, strict=True):
        ax.plot(*run.series("loss"), label=run.label, **style)
        eval_steps, eval_losses = run.series("eval_loss")
        if eval_steps:
            ax.scatter(eval_steps, eval_losses, color=style["color"], marker="o", zorder=3,
                       label=f"{run.label}: eval_loss")
    finish(ax, "training loss (mean over the global batch)")

    throughput = "tokens_per_s" if all(run.series("tokens_per_s")[0] for run in runs) else "samples_per_s"
    ax = panels["throughput"]
    for run, style in zip(runs, styles, strict=True):
        ax.plot(*run.series(throughput), label=run.label, **style)
    finish(ax, throughput.replace("_per_s", "/s"))

    ax = panels["mfu"]
    mfus = [run.series("mfu") for run in runs]
    if all(math.isnan(v) for _, values in mfus for v in values):
        ax.text(0.5, 0.5, "no MFU: mfu is null on every line of every run", ha="center", va="center",
                transform=ax.transAxes)
        ax.set(title="MFU", xticks=[], yticks=[])
    else:
        for run, (steps, values), style in zip(runs, mfus, styles, strict=True):
            ax.plot(steps, [100 * v for v in values], label=run.label, **style)
        finish(ax, "MFU (%)")

    ax = panels["memory"]
    peak = max(max(run.series("peak_mem_bytes")[1] + run.series("state_bytes")[1], default=0) for run in runs)
    unit, scale = ("GiB", 1024 ** 3) if peak >= 1024 ** 3 else ("MiB", 1024 ** 2)
    for run, style in zip(runs, styles, strict=True):
        for key, linestyle in (("peak_mem_bytes", style["linestyle"]), ("state_bytes", ":")):
            steps, values = run.series(key)
            ax.plot(steps, [v / scale for v in values], label=f"{run.label}: {key}",
                    **{**style, "linestyle": linestyle})
    ax.set_yscale("log")  # a model's state is often a thousandth of the process's peak
    finish(ax, f"memory of rank 0 ({unit}, log scale)")

    if loads:
        draw_router(panels["aux_loss"], panels["expert_load"], runs, styles, loads)
    if len(runs) > 1:
        draw_differences(panels["difference"], runs, styles)
    return figure


def draw_router(aux: Axes, load: Axes, runs: list[RunCurves], styles: list[dict], loads: list[str]) -> None:
    """A mixture of experts' balancing loss, and each layer's expert load (the keys `loads`), for the runs that log
    them."""
    for run, style in zip(runs, styles, strict=True):
        if (series := run.series("aux_loss"))[0]:  # a dense run, or one balanced by a bias, logs none
            aux.plot(*series, label=run.label, **style)
    finish(aux, "router's balancing loss (aux_loss, unscaled)")
    load.axhline(1.0, color="grey", linestyle=":", linewidth=1, label="an even spread")
    for run, style in zip(runs, styles, strict=True):
        for i, key in enumerate(loads):  # one shade per layer, the run's colour
            if (series := run.series(key))[0]:
                load.plot(*series, label=f"{run.label}: layer {key.rsplit('_', 1)[1]}",
                          **{**style, "alpha": 1.0 - 0.6 * i / max(1, len(loads) - 1)})
    finish(load, "expert load: the busiest expert's share x experts")


def draw_differences(ax, runs: list[RunCurves], styles: list[dict]) -> None:
    """Each run's relative loss difference from the first, per shared step, on a log scale."""
    ax.axhline(DIFF_FLOOR, color="grey", linestyle=":", linewidth=1, label=f"equal losses, drawn at {DIFF_FLOOR:.0e}")
    for run, style in zip(runs[1:], styles[1:], strict=True):
        steps, diffs, partial = overlap(run, runs[0])
        said = [f"max {max(diffs, default=math.nan):.1e}"]
        if equal := sum(d == 0 for d in diffs):
            said.append(f"{equal} equal steps drawn at the floor")
        if partial:
            said.append(f"only the shared steps {steps[0]}-{steps[-1]}" if steps else "no shared step")
        ax.plot(steps, [max(d, DIFF_FLOOR) for d in diffs], marker=".", color=style["color"],
                label=f"{run.label} ({'; '.join(said)})")
    ax.set_yscale("log")
    finish(ax, f"|loss - reference| / |reference|, reference {runs[0].label} (equal losses drawn at "
               f"{DIFF_FLOOR:.0e})")


def finish(ax: Axes, title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: a short run showed 1.5, 2.5
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def save(figure: Figure, path: Path) -> None:
    """Write the PNG; a folder that does not exist yet is made. Raises ConfigError when it cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=80)
    except OSError as e:
        what, fix = write_failure(e, path)
        raise ConfigError([Problem(f"could not write the picture: {what}", str(path),
                                   f"{fix}, or pass --png a path you can write")]) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainkit.tools.plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (--output_dir); the first is the reference")
    parser.add_argument("--png", type=Path, default=Path("runs.png"), help="the picture to write (default runs.png)")
    parser.add_argument("--labels", help="comma-separated legend names, one per run (default: strategy/recipe)")
    parser.add_argument("--title", default="", help="a title above the panels")
    args = parser.parse_args(argv)
    try:
        labels = args.labels.split(",") if args.labels else [None] * len(args.runs)
        if len(labels) != len(args.runs):
            raise ConfigError([Problem(f"{len(labels)} labels for {len(args.runs)} runs", "--labels",
                                       "give one label per run folder, comma-separated")])
        runs = [read_run(folder, label) for folder, label in zip(args.runs, labels, strict=True)]
        if not args.labels and len({run.label for run in runs}) < len(runs):  # two ddp/mlp: say which is which
            runs = [RunCurves(str(folder), run.metrics) for folder, run in zip(args.runs, runs, strict=True)]
        notes = check_overlap(runs, args.runs)
        save(plot_runs(runs, args.title), args.png)
    except ConfigError as e:
        for line in e.lines():
            print(f"error: {line}", file=sys.stderr)
        return e.exit_status
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"plot of {len(runs)} run(s): {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
