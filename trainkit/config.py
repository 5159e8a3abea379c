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
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainkit.strategy import Launch


class ConfigError(Exception):
    """One or more problems with what the user asked for; each says what, where it came from, and the fix."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def problem(what: str, where: str, fix: str) -> str:
    """The one format every config problem is reported in: `<what> (<where>): <fix>`."""
    return f"{what} ({where}): {fix}"


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
    eval_every: int = 50  # optimizer steps between evaluations; 0 evaluates only at the end
    eval_batches: int = 4  # global batches of the held-out split per evaluation
    seed: int = 0

    def __post_init__(self) -> None:
        problems = [problem(f"{name} must be {rule}, got {getattr(self, name)!r}", f"config field {name}", fix)
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
            ("eval_every", self.eval_every >= 0, ">= 0", "use --set eval_every=0 to evaluate only at the end"),
            ("eval_batches", self.eval_batches >= 1, ">= 1", "use --set eval_batches=1 or more"),
        ]

    def check(self) -> list[str]:
        """Recipe-specific validation: return problems (see `problem`); the base fields are already checked."""
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


def build_config(config_cls: type[TrainConfig], overrides: list[tuple[str, str, str]]) -> TrainConfig:
    """Build the recipe's config from (field, text value, where it came from) overrides; report every problem."""
    hints = typing.get_type_hints(config_cls)
    known = field_names(config_cls)
    values: dict[str, Any] = {}
    problems: list[str] = []
    for name, text, where in overrides:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            fix = f"did you mean {', '.join(close)}?" if close else f"known fields: {', '.join(known)}"
            problems.append(problem(f"unknown config field {name!r}", where, fix))
            continue
        try:
            values[name] = parse_value(text, hints[name], name)
        except ValueError as e:
            problems.append(problem(str(e), where, f"pass a value of the field's type: {hints[name]}"))
    if problems:
        raise ConfigError(problems)
    return config_cls(**values)


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
    resume: str | None
    stop_at: int | None
    estimate: bool
    device_memory: int | None  # bytes
    num_processes: int | None


def parse_command_line(argv: list[str] | None = None) -> tuple[RunOptions, list[tuple[str, str, str]]]:
    """Run options, and recipe overrides as (field, text, where) for `build_config`."""
    parser = argparse.ArgumentParser(
        description="Train a recipe. Strategy and precision come from the launcher: "
                    "accelerate launch --config_file accelerate_configs/<strategy>.yaml train.py --recipe <recipe>",
        epilog="Any recipe field can be set with --<field> VALUE or --set field=VALUE "
               "(python train.py --recipe mlp --dry_run prints them all).")
    parser.add_argument("--recipe", required=True, help="a shipped recipe's name (mlp, tiny_transformer) or a path")
    parser.add_argument("--output_dir", type=Path, help="where the run writes (default: runs/<recipe>)")
    parser.add_argument("--overwrite", action="store_true", help="replace the outputs of an earlier run there")
    parser.add_argument("--dry_run", action="store_true", help="validate, print the resolved config, train nothing")
    parser.add_argument("--accelerate_config", help="with --dry_run outside a launcher: the Accelerate YAML to check")
    parser.add_argument("--report_to", default="tensorboard",
                        help="comma-separated Accelerate trackers: tensorboard, wandb, mlflow, trackio, or none")
    parser.add_argument("--peak_flops", type=float, help="device peak FLOP/s for MFU (known GPUs need nothing)")
    parser.add_argument("--cache_dir", type=Path, default=Path(os.environ.get("TRAINKIT_CACHE",
                                                                              Path.home() / ".cache" / "trainkit")),
                        help="tokenizers and tokenised data (default: $TRAINKIT_CACHE or ~/.cache/trainkit)")
    parser.add_argument("--save_every", type=int, default=0, help="checkpoint every N optimizer steps (0: never)")
    parser.add_argument("--keep_last", type=int, default=0, help="keep only the newest K checkpoints (0: all)")
    parser.add_argument("--resume", help="continue from a checkpoint: latest (in --output_dir) or a step_<N> path")
    parser.add_argument("--stop_at", type=int, help="end after optimizer step N with a checkpoint there; the "
                        "schedule and data order still follow --max_steps (staged runs)")
    parser.add_argument("--estimate", action="store_true",
                        help="print model-state memory per rank under every strategy, train nothing")
    parser.add_argument("--device_memory", help="with --estimate: memory per device (80GB, 24GiB) to find the "
                        "cheapest strategy that fits")
    parser.add_argument("--num_processes", type=int, help="with --estimate: the world size to estimate for")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="set any recipe field")
    for name in RECIPE_FLAGS:
        parser.add_argument(f"--{name}", help=f"recipe field {name}")
    args, rest = parser.parse_known_args(argv)

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

    report_to = [t for t in args.report_to.split(",") if t and t != "none"]
    options = RunOptions(recipe=args.recipe, output_dir=args.output_dir or Path("runs") / Path(args.recipe).stem,
                         overwrite=args.overwrite, dry_run=args.dry_run, accelerate_config=args.accelerate_config,
                         report_to=report_to, peak_flops=args.peak_flops, cache_dir=args.cache_dir,
                         save_every=args.save_every, keep_last=args.keep_last, resume=args.resume,
                         stop_at=args.stop_at, estimate=args.estimate, device_memory=None,
                         num_processes=args.num_processes)
    if args.device_memory:
        try:
            options.device_memory = parse_bytes(args.device_memory)
        except ValueError as e:
            parser.error(f"--device_memory: {e}")
    if (options.device_memory or options.num_processes) and not options.estimate:
        parser.error("--device_memory and --num_processes go with --estimate")
    for flag, value in (("--save_every", options.save_every), ("--keep_last", options.keep_last)):
        if value < 0:
            parser.error(f"{flag} must be >= 0, got {value}")
    if options.accelerate_config and not (options.dry_run or options.estimate):
        parser.error("--accelerate_config only checks a YAML (with --dry_run or --estimate); to train under it run "
                     f"accelerate launch --config_file {options.accelerate_config} train.py ...")
    if options.stop_at is not None and options.stop_at < 1:
        parser.error(f"--stop_at must be >= 1, got {options.stop_at}")
    return options, overrides


def field_sources(cfg: TrainConfig, overrides: list[tuple[str, str, str]]) -> dict[str, str]:
    """Where each recipe field's value came from: the flag that set it, or the recipe's default."""
    where = {name: source for name, _, source in overrides}
    return {name: where.get(name, "recipe default") for name in field_names(type(cfg))}


def resolved_config(recipe_path: Path, cfg: TrainConfig, sources: dict[str, str], launch: Launch,
                    zero_stage: int | None, estimated_state_bytes: int, seq_len: int | None) -> dict[str, Any]:
    """Every effective value (flat), and where each came from under `sources`."""
    values = config_dict(cfg)
    resolved: dict[str, Any] = {
        "recipe": str(recipe_path), "strategy": launch.kind, "world_size": launch.world_size,
        "num_machines": launch.num_machines, "mixed_precision": launch.mixed_precision, "zero_stage": zero_stage,
        "global_batch_size": cfg.batch_size * cfg.grad_accum * launch.world_size,
        "estimated_state_bytes": estimated_state_bytes,
        **values,
    }
    if seq_len is not None:
        resolved["seq_len"] = seq_len
    sources = dict(sources)
    sources.update({name: launch.source for name in ("strategy", "world_size", "num_machines", "mixed_precision")})
    sources["global_batch_size"] = "batch_size x grad_accum x world_size"
    sources["estimated_state_bytes"] = "trainkit.estimate"
    sources["zero_stage"] = launch.deepspeed_config or "no DeepSpeed"
    resolved["sources"] = sources
    return resolved


def parse_bytes(text: str) -> int:
    """'80GB', '80GiB', '512MB' or a plain number of bytes."""
    units = {"": 1, "B": 1, "KB": 1000, "MB": 1000 ** 2, "GB": 1000 ** 3, "TB": 1000 ** 4,
             "KIB": 1024, "MIB": 1024 ** 2, "GIB": 1024 ** 3, "TIB": 1024 ** 4}
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in units:
        raise ValueError(f"cannot read {text!r} as a size: write it like 80GB, 24GiB or 512MB")
    return int(float(match.group(1)) * units[match.group(2).upper()])
