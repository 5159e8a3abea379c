"""Recipe configuration: the typed base every recipe extends, command-line overrides, and config errors.

A recipe's `Config` is a keyword-only dataclass that subclasses `TrainConfig`. Every field can be set from the
command line, either through a named flag (`--lr 3e-4`) or the generic `--set field=value`; values are parsed
against the field's annotation and unknown fields are rejected with the closest known names.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from trainkit.errors import ConfigError, Problem

problem = Problem  # the name recipes written before trainkit.errors imported from here (copies of old recipes)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Fields every recipe has. A recipe subclasses this, adds its own fields and changes the defaults."""

    batch_size: int = 32  # per-process micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # the cosine schedule ends at lr * min_lr_ratio
    warmup_steps: int = 10
    weight_decay: float = 0.0
    optimizer: str = "adamw"  # adamw | sgd (sgd: plain, no momentum; the classic data-parallel check)
    max_steps: int = 100
    max_grad_norm: float = 1.0  # one max-norm for every strategy; 0 turns clipping off
    # fp16's first loss scale (torch's GradScaler: one process, DDP, FSDP2; DeepSpeed's fp16 takes its JSON's
    # initial_scale_power). It halves on every overflow and doubles after 2000 steps without one.
    loss_scale: float = 2.0 ** 16
    eval_every: int = 50  # optimizer steps between evaluations; 0 evaluates only at the end
    eval_batches: int = 4  # global batches of the held-out split per evaluation
    seed: int = 0
    # DDP: parameters may take no part in a step (a mixture of experts, a branch taken only sometimes). DDP then
    # has to search the graph for them every step, a cost; without it such a model stops with an error naming this.
    find_unused_parameters: bool = False
    # Pipeline parallelism (trainkit/strategies/pipeline.py): the model's layers cut into this many stages, one per
    # process (the processes of a launch: stages x data-parallel replicas); 1 = off. Each step's grad_accum
    # micro-batches flow through the stages; the recipe says where the model can be cut (recipes/README.md).
    pipeline_stages: int = 1
    pipeline_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved (two stages per process, a smaller bubble)
    # Where stages start, as layer indices ("2" or "1,3"); empty: cut where the stages' parameter counts balance.
    pipeline_split: str = ""
    # torch.compile (inductor) on the model's repeated blocks, or the whole model where it declares none
    # (trainkit/strategies/engine.py, Engine.compile_model); a strategy it does not work under refuses it at plan time.
    compile: bool = False

    # What a resumed run may set anew (--resume restores every other field from the checkpoint and refuses a flag that
    # differs): the schedule's length, evaluation, how the global batch is split (its size is checked on its own) and
    # how the model is (pipeline stages), DDP's search for unused parameters, torch.compile (speed, not math). A recipe
    # adds its own, e.g. gradient checkpointing (memory, not math).
    may_change_on_resume: ClassVar[frozenset[str]] = frozenset({
        "max_steps", "eval_every", "eval_batches", "batch_size", "grad_accum", "find_unused_parameters",
        "pipeline_stages", "pipeline_schedule", "pipeline_split", "compile"})
    # Named sizes a recipe offers, selected by its `size` field (`--size NAME`): {name: {field: value}}. build_config
    # applies the chosen one over the recipe's defaults, under a resumed checkpoint's values and the flags
    # (`--size cpu --layers 2`: the cpu preset with 2 layers). A recipe with presets declares `size: str` too,
    # defaulting to the preset that its defaults are (one with no values).
    presets: ClassVar[Mapping[str, Mapping[str, Any]]] = {}

    def __post_init__(self) -> None:
        problems = [Problem(f"{name} must be {rule}, got {getattr(self, name)!r}", f"config field {name}", fix)
                    for name, ok, rule, fix in self._common_rules() if not ok]
        problems += self.check()
        if problems:
            raise ConfigError(problems)

    def _common_rules(self) -> list[tuple[str, bool, str, str]]:
        return [
            ("batch_size", self.batch_size >= 1, ">= 1", "pass --batch_size 1 or more"),
            ("grad_accum", self.grad_accum >= 1, ">= 1", "pass --grad_accum 1 or more"),
            ("lr", self.lr > 0, "> 0", "pass a positive --lr"),
            ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]", "use --set min_lr_ratio=0.1"),
            ("warmup_steps", self.warmup_steps >= 0, ">= 0", "use --set warmup_steps=0 or more"),
            ("weight_decay", self.weight_decay >= 0, ">= 0", "use --set weight_decay=0 or more"),
            ("optimizer", self.optimizer in ("adamw", "sgd"), "adamw or sgd", "use --set optimizer=adamw"),
            ("max_steps", self.max_steps >= 1, ">= 1", "pass --max_steps 1 or more"),
            ("max_grad_norm", self.max_grad_norm >= 0, ">= 0 (0 = no clipping)", "use --set max_grad_norm=1.0"),
            ("loss_scale", self.loss_scale > 0, "> 0", "use --set loss_scale=65536 (torch's default)"),
            ("eval_every", self.eval_every >= 0, ">= 0", "use --set eval_every=0 to evaluate only at the end"),
            ("eval_batches", self.eval_batches >= 1, ">= 1", "use --set eval_batches=1 or more"),
            # numpy's seeding (accelerate's set_seed) takes 0 ... 2**32 - 1 and fails otherwise, mid-setup
            ("seed", 0 <= self.seed < 2 ** 32, "in [0, 2**32 - 1]", "pass --seed 0 or another count"),
            ("pipeline_stages", self.pipeline_stages >= 1, ">= 1 (1 = no pipeline)", "pass --pipeline_stages 2"),
            ("pipeline_schedule", self.pipeline_schedule in ("gpipe", "1f1b", "interleaved"),
             "gpipe, 1f1b or interleaved", "pass --pipeline_schedule 1f1b"),
            ("pipeline_split", re.fullmatch(r"(\d+(,\d+)*)?", self.pipeline_split.replace(" ", "")) is not None,
             "comma-separated layer indices", "pass --pipeline_split 2 (stage 2 starts at layer 2), or leave it out"),
        ]

    def check(self) -> list[Problem]:
        """Recipe-specific validation: return problems (trainkit.errors.Problem); the base fields are already
        checked."""
        return []


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def parse_value(text: str, annotation: Any, name: str) -> Any:
    """Parse a command-line string as the field's annotated type (int, float, bool, str, or Optional of one)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if text.lower() in ("none", "null"):
            return None
        annotation = options[0]
    if annotation is bool:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name} takes true or false, got {text!r}")
    if annotation is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{name} takes an integer, got {text!r}") from None
    if annotation is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{name} takes a number, got {text!r}") from None
    if annotation is str:
        return text
    raise ValueError(f"{name} has type {annotation!r}, which cannot be set from the command line")


def build_config(config_cls: type[TrainConfig], overrides: list[tuple[str, str, str]],
                 restored: Mapping[str, Any] | None = None, flags: Sequence[str] = ()) -> TrainConfig:
    """Build the recipe's config from (field, text value, where it came from) overrides on top of `restored` values
    (a resumed checkpoint's); report every problem. An unknown name is matched against the recipe's fields and
    train.py's own `flags` for the "did you mean"."""
    hints = typing.get_type_hints(config_cls)
    known = field_names(config_cls)
    values: dict[str, Any] = {k: v for k, v in (restored or {}).items() if k in known}
    problems: list[Problem] = []
    for name, text, where in overrides:
        if name not in known:
            close = difflib.get_close_matches(name, [*known, *flags], n=3)
            named = [c if c in known else f"--{c}" for c in close]
            fix = f"did you mean {', '.join(named)}?" if close else \
                f"known fields: {', '.join(known)}; train.py's flags: python train.py --help"
            problems.append(Problem(f"unknown config field {name!r}", where, fix))
            continue
        try:
            values[name] = parse_value(text, hints[name], name)
        except ValueError as e:
            default = next(f.default for f in dataclasses.fields(config_cls) if f.name == name)
            problems.append(Problem(str(e), where, f"write it as the recipe's default is written: {name}={default}"
                                    if default is not None else "write one, or none to leave it unset"))
    if config_cls.presets and not problems:
        preset, problems = _preset(config_cls, values, overrides, known)
        values = {**preset, **values}
    if problems:
        raise ConfigError(problems)
    return config_cls(**values)


def _preset(config_cls: type[TrainConfig], values: Mapping[str, Any], overrides: list[tuple[str, str, str]],
            known: list[str]) -> tuple[Mapping[str, Any], list[Problem]]:
    """The values of the preset that the `size` field names (set, restored, or the recipe's default), or the problem."""
    if "size" not in known:
        return {}, [Problem(f"{config_cls.__qualname__} declares presets but no size field to choose one", "the recipe",
                            "add `size: str = \"<the preset its defaults are>\"` to its Config")]
    size = values.get("size", next(f.default for f in dataclasses.fields(config_cls) if f.name == "size"))
    chosen = config_cls.presets.get(size)
    if chosen is None:
        where = next((source for name, _, source in reversed(overrides) if name == "size"), "config field size")
        return {}, [Problem(f"unknown size {size!r}", where, f"use one of {', '.join(config_cls.presets)}")]
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        return {}, [Problem(f"preset {size!r} sets unknown field(s) {', '.join(unknown)}", "the recipe's presets",
                            "name fields of its Config")]
    return chosen, []


def config_dict(cfg: TrainConfig) -> dict[str, Any]:
    return {name: getattr(cfg, name) for name in field_names(type(cfg))}


# Flags of the contract that set recipe fields; any other `--<field> value` works too, as does `--set field=value`.
RECIPE_FLAGS = ("max_steps", "batch_size", "grad_accum", "lr", "seed")


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
                         precision={"fp32": "no"}.get(args.precision, args.precision), given=given)
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
        overrides.append((name, value, f"--set {item}"))
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
        overrides.append((name, value, flag if sep else f"--{name}"))
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
    for flag, value in (("--save_every", options.save_every), ("--keep_last", options.keep_last)):
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


def field_sources(cfg: TrainConfig, overrides: list[tuple[str, str, str]],
                  restored: Mapping[str, Any] | None = None, restored_from: str = "") -> dict[str, str]:
    """Where each recipe field's value came from: the flag that set it, the resumed checkpoint, the size preset, or
    the recipe's default."""
    where = {name: source for name, _, source in overrides}
    size = getattr(cfg, "size", None)
    preset = type(cfg).presets.get(size, {})
    return {name: where.get(name, restored_from if name in (restored or {}) else
                            f"size {size}" if name in preset else "recipe default")
            for name in field_names(type(cfg))}


def parse_bytes(text: str) -> int:
    """'80GB', '80GiB', '512MB': a size with its unit (a bare number is refused: 80 could mean bytes or GB)."""
    units = {"B": 1, "KB": 1000, "MB": 1000 ** 2, "GB": 1000 ** 3, "TB": 1000 ** 4,
             "KIB": 1024, "MIB": 1024 ** 2, "GIB": 1024 ** 3, "TIB": 1024 ** 4}
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in units:
        raise ValueError(f"cannot read {text!r} as a size: write it with its unit, like 80GB, 24GiB or 512MB")
    return int(float(match.group(1)) * units[match.group(2).upper()])
