"""train.py's command line: the run options (what is not part of the recipe) and the recipe-field overrides.

Every recipe field can be set as `--<field> VALUE` or `--set field=VALUE`; they come back as (field, text, where)
triples that trainkit/config.py's `build_config` parses against the recipe's annotations. Dashes and underscores in
flag names are alike, and no flag is taken for an abbreviation of another.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Flags of the contract that set recipe fields; any other `--<field> value` works too, as does `--set field=value`.
RECIPE_FLAGS = ("max_steps", "batch_size", "grad_accum", "lr", "seed")
# Other names for recipe fields: the ones transformers' TrainingArguments (and so TRL) give them
FIELD_ALIASES = {"optim": "optimizer"}


@dataclass(kw_only=True, slots=True)
class RunOptions:
    """Settings of this run that are not part of the recipe."""

    recipe: str
    output_dir: Path
    overwrite: bool
    dry_run: bool
    accelerate_config: str | None
    report_to: list[str]
    peak_flops: float | None
    cache_dir: Path
    save_every: int
    keep_last: int
    async_save: bool
    resume: str | None
    stop_at: int | None
    estimate: bool
    device_memory: int | None  # bytes
    num_processes: int | None  # --estimate's world; with --dry_run --accelerate_config, the launch's total
    num_machines: int | None  # with --dry_run --accelerate_config: the launch's machines
    precision: str | None  # --estimate's: no | bf16 | fp16 (Accelerate's names); None: the launch's
    data_workers: int | None  # streamed data: worker processes per rank; None: from the cores left free
    given: frozenset[str] = frozenset()  # the RESUMED_OPTIONS that the command line set (the others may be restored)


# Run options that a resumed run keeps from its checkpoint unless the command line sets them anew: a preempted job
# restarted with `--resume latest` alone goes on saving (and pruning, and reporting) as the run was started to.
RESUMED_OPTIONS = ("save_every", "keep_last", "async_save", "report_to")
DEFAULTS = {"save_every": 0, "keep_last": 0, "async_save": False, "report_to": "tensorboard"}


def parse_command_line(argv: list[str] | None = None) -> tuple[RunOptions, list[tuple[str, str, str]]]:
    """Run options, and recipe overrides as (field, text, where) for `build_config`.

    Dashes and underscores in flag names are alike (--save-every is --save_every), and no flag is taken for an
    abbreviation of another (--max_step is a typo, not --max_steps).
    """
    argv = [_underscores(a) for a in (sys.argv[1:] if argv is None else argv)]
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    overrides = _overrides(parser, args, rest)
    given = frozenset(name for name in RESUMED_OPTIONS if getattr(args, name) is not None)
    chosen = {name: DEFAULTS[name] if getattr(args, name) is None else getattr(args, name)
              for name in RESUMED_OPTIONS}
    options = RunOptions(recipe=args.recipe, output_dir=args.output_dir or Path("runs") / Path(args.recipe).stem,
                         overwrite=args.overwrite, dry_run=args.dry_run, accelerate_config=args.accelerate_config,
                         report_to=trackers(chosen["report_to"]), peak_flops=args.peak_flops,
                         cache_dir=args.cache_dir, save_every=chosen["save_every"], keep_last=chosen["keep_last"],
                         async_save=chosen["async_save"], resume=args.resume, stop_at=args.stop_at,
                         estimate=args.estimate, device_memory=None,
                         num_processes=args.num_processes, num_machines=args.num_machines,
                         precision={"fp32": "no"}.get(args.precision, args.precision),
                         data_workers=args.data_workers, given=given)
    if args.device_memory:
        try:
            options.device_memory = parse_bytes(args.device_memory)
        except ValueError as e:
            parser.error(f"--device_memory: {e}")
    _check_options(parser, options)
    return options, overrides


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False,
        description="Train a recipe. Strategy and precision come from the launcher: "
                    "accelerate launch --config_file accelerate_configs/<strategy>.yaml train.py --recipe <recipe>",
        epilog="Any recipe field can be set with --<field> VALUE or --set field=VALUE "
               "(python train.py --recipe mlp --dry_run prints them all).")
    parser.add_argument("--recipe", required=True, help="a shipped recipe's name (mlp, tiny_transformer) or a path")
    parser.add_argument("--output_dir", type=Path, help="where the run writes (default: runs/<recipe>)")
    parser.add_argument("--overwrite", action="store_true", help="replace the outputs of an earlier run there")
    parser.add_argument("--dry_run", action="store_true", help="validate, print the resolved config, train nothing")
    parser.add_argument("--accelerate_config", help="with --dry_run outside a launcher: the Accelerate YAML to check")
    parser.add_argument("--report_to", help="comma-separated Accelerate trackers: tensorboard (default), wandb, "
                        "mlflow, trackio, or none")
    parser.add_argument("--peak_flops", type=float, help="device peak FLOP/s for MFU (known GPUs need nothing)")
    parser.add_argument("--cache_dir", type=Path, default=Path(os.environ.get("TRAINKIT_CACHE",
                                                                              Path.home() / ".cache" / "trainkit")),
                        help="tokenizers and tokenised data (default: $TRAINKIT_CACHE or ~/.cache/trainkit)")
    parser.add_argument("--save_every", type=int, help="checkpoint every N optimizer steps (0, the default: never; "
                        "a resumed run keeps its checkpoint's)")
    parser.add_argument("--keep_last", type=int, help="keep only the newest K checkpoints (0, the default: all; a "
                        "resumed run keeps its checkpoint's)")
    parser.add_argument("--async_save", action="store_const", const=True,
                        help="write checkpoints beside the training: a save blocks the loop only while the state is "
                        "copied to CPU memory (torch.distributed.checkpoint's formats; a resumed run keeps its "
                        "checkpoint's)")
    parser.add_argument("--resume", help="continue from a checkpoint: latest (in --output_dir), a step_<N> path, or "
                        "auto (the newest intact checkpoint if there is one, else a fresh start: one command line for "
                        "the first start and every restart)")
    parser.add_argument("--stop_at", type=int, help="end after optimizer step N with a checkpoint there; the "
                        "schedule and data order still follow --max_steps (staged runs)")
    parser.add_argument("--estimate", action="store_true",
                        help="print model-state memory per rank under every strategy, train nothing")
    parser.add_argument("--device_memory", help="with --estimate: memory per device (80GB, 24GiB) to find the "
                        "cheapest strategy that fits")
    parser.add_argument("--num_processes", type=int, help="with --estimate: the world size to estimate for; with "
                        "--dry_run --accelerate_config: the total the launch will start, as accelerate launch "
                        "--num_processes overrides the YAML's")
    parser.add_argument("--num_machines", type=int, help="with --dry_run --accelerate_config: the machines the launch "
                        "will have, as accelerate launch --num_machines overrides the YAML's")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"],
                        help="with --estimate: the precision to estimate for (default: the launch's)")
    parser.add_argument("--data_workers", type=int, help="streamed data (--streaming): worker processes per rank "
                        "that read and tokenise it beside the training (default: the cores the training leaves free, "
                        "at most 4; 0: in the training process)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="set any recipe field")
    for name in RECIPE_FLAGS:
        parser.add_argument(f"--{name}", help=f"recipe field {name}")
    return parser


def _overrides(parser: argparse.ArgumentParser, args: argparse.Namespace,
               rest: list[str]) -> list[tuple[str, str, str]]:
    """The recipe fields set: the shared flags, --set FIELD=VALUE, and any --<field> VALUE (a bare --<field>: true)."""
    overrides = [(name, getattr(args, name), f"--{name}") for name in RECIPE_FLAGS if getattr(args, name) is not None]
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set takes FIELD=VALUE, got {item!r}")
        overrides.append((FIELD_ALIASES.get(name, name), value, f"--set {item}"))
    i = 0
    while i < len(rest):
        flag = rest[i]
        if not flag.startswith("--") or flag == "--":
            parser.error(f"unexpected argument {flag!r}: recipe fields are set as --<field> VALUE")
        name, sep, value = flag[2:].partition("=")
        if not sep:  # `--field value`, or a bare `--field` meaning true
            if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
                value, i = rest[i + 1], i + 1
            else:
                value = "true"
        overrides.append((FIELD_ALIASES.get(name, name), value, flag if sep else f"--{name}"))
        i += 1
    return overrides


def _check_options(parser: argparse.ArgumentParser, options: RunOptions) -> None:
    if (options.device_memory or options.precision) and not options.estimate:
        parser.error("--device_memory and --precision go with --estimate")
    checked = options.dry_run and options.accelerate_config  # a YAML's world as the launch will override it
    if options.num_processes and not (options.estimate or checked):
        parser.error("--num_processes goes with --estimate, or with --dry_run --accelerate_config (the world the "
                     "launch will start)")
    if options.num_machines and not checked:
        parser.error("--num_machines goes with --dry_run --accelerate_config (the machines the launch will have)")
    for flag, value in (("--num_processes", options.num_processes), ("--num_machines", options.num_machines)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    for flag, value in (("--save_every", options.save_every), ("--keep_last", options.keep_last),
                        ("--data_workers", options.data_workers or 0)):
        if value < 0:
            parser.error(f"{flag} must be >= 0, got {value}")
    if options.accelerate_config and not (options.dry_run or options.estimate):
        parser.error("--accelerate_config only checks a YAML (with --dry_run or --estimate); to train under it run "
                     f"accelerate launch --config_file {options.accelerate_config} train.py ...")
    if options.stop_at is not None and options.stop_at < 1:
        parser.error(f"--stop_at must be >= 1, got {options.stop_at}")


def trackers(report_to: str) -> list[str]:
    """--report_to's comma-separated names; none (or nothing) is no tracker."""
    return [t for t in report_to.split(",") if t and t != "none"]


def run_option_values(options: RunOptions) -> dict[str, Any]:
    """The RESUMED_OPTIONS as resolved_config.json holds them (report_to as its command-line text)."""
    values = {name: getattr(options, name) for name in RESUMED_OPTIONS}
    return {**values, "report_to": ",".join(options.report_to) or "none"}


def restore_run_options(options: RunOptions, saved: Mapping[str, Any]) -> tuple[RunOptions, list[str]]:
    """A resumed run's options: each of RESUMED_OPTIONS that the command line left out comes from the checkpoint's
    resolved config (a checkpoint written before they were saved keeps the defaults). Returns the options and the
    names restored."""
    restored = [name for name in RESUMED_OPTIONS if name not in options.given and name in saved]
    values = {name: trackers(saved[name]) if name == "report_to" else saved[name] for name in restored}
    return dataclasses.replace(options, **values), restored


def _underscores(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg[2:].partition("=")
    return f"--{name.replace('-', '_')}{sep}{value}"


def run_flags() -> list[str]:
    """train.py's own flags (those that are not recipe fields), for suggestions."""
    return [f.name for f in dataclasses.fields(RunOptions)] + ["set"]


def parse_bytes(text: str) -> int:
    """'80GB', '80GiB', '512MB': a size with its unit (a bare number is refused: 80 could mean bytes or GB)."""
    units = {"B": 1, "KB": 1000, "MB": 1000 ** 2, "GB": 1000 ** 3, "TB": 1000 ** 4,
             "KIB": 1024, "MIB": 1024 ** 2, "GIB": 1024 ** 3, "TIB": 1024 ** 4}
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in units:
        raise ValueError(f"cannot read {text!r} as a size: write it with its unit, like 80GB, 24GiB or 512MB")
    return int(float(match.group(1)) * units[match.group(2).upper()])
