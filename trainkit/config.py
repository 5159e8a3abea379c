"""Recipe configuration: the typed base every recipe extends, and building it from overrides.

A recipe's `Config` is a keyword-only dataclass that subclasses `TrainConfig`. Every field can be set from the
command line (trainkit/command_line.py reads the flags), either through a named flag (`--lr 3e-4`) or the generic
`--set field=value`; values are parsed against the field's annotation and unknown fields are rejected with the
closest known names.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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
    # adamw | adamw_8bit | sgd: adamw_8bit is bitsandbytes' AdamW8bit (its moments in 8 bits, blockwise scaled: a
    # quarter of AdamW's state); sgd plain, no momentum (the classic data-parallel check)
    optimizer: str = "adamw"
    max_steps: int = 100
    max_grad_norm: float = 1.0  # one max-norm for every strategy; 0 turns clipping off
    # fp16's first loss scale (torch's GradScaler: one process, DDP, FSDP2; DeepSpeed's fp16 takes its JSON's
    # initial_scale_power). It halves on every overflow and doubles after 2000 steps without one.
    loss_scale: float = 2.0 ** 16
    eval_every: int = 50  # optimizer steps between evaluations; 0 evaluates only at the end
    eval_batches: int = 4  # global batches of the held-out split per evaluation; 0: all of it
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
    # The activations a forward saves for backward kept in pinned host memory until backward, the parameters excepted
    # (trainkit/models/activation_offload.py): device memory for the copies' time. On a CPU run they already are in host
    # memory.
    activation_offload: bool = False
    # ZeRO-3: the whole model gathered once for each generation (eval answers, rollouts) rather than every layer again
    # for every token (DeepSpeed's unwrap_model_for_generation, TRL's ds3_gather_for_generation): many times faster,
    # but each rank holds the whole model meanwhile. False where it does not fit on one device.
    gather_for_generation: bool = True

    # What a resumed run may set anew (--resume restores every other field from the checkpoint and refuses a flag that
    # differs): the schedule's length, evaluation, how the global batch is split (its size is checked on its own) and
    # how the model is (pipeline stages), DDP's search for unused parameters, torch.compile, activation offload and
    # the gather for generation (speed and memory, not math). A recipe adds its own, e.g. gradient checkpointing.
    may_change_on_resume: ClassVar[frozenset[str]] = frozenset({
        "max_steps", "eval_every", "eval_batches", "batch_size", "grad_accum", "find_unused_parameters",
        "pipeline_stages", "pipeline_schedule", "pipeline_split", "compile", "activation_offload",
        "gather_for_generation"})
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
            ("optimizer", self.optimizer in ("adamw", "adamw_8bit", "sgd"), "adamw, adamw_8bit or sgd",
             "use --set optimizer=adamw"),
            ("max_steps", self.max_steps >= 1, ">= 1", "pass --max_steps 1 or more"),
            ("max_grad_norm", self.max_grad_norm >= 0, ">= 0 (0 = no clipping)", "use --set max_grad_norm=1.0"),
            ("loss_scale", self.loss_scale > 0, "> 0", "use --set loss_scale=65536 (torch's default)"),
            ("eval_every", self.eval_every >= 0, ">= 0", "use --set eval_every=0 to evaluate only at the end"),
            ("eval_batches", self.eval_batches >= 0, ">= 0 (0: the whole held-out split)",
             "use --set eval_batches=0 (all) or more"),
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
