"""Everything that can be checked before a model exists, resolved into one frozen plan.

`make_plan` loads the recipe, builds its config from the command line, reads the launch, picks the strategy and asks
every check (the YAML, the machine, the strategy's own config, the hosts of a hostfile launch, the trackers, the
output directory) for its problems, then raises them all at once. `--dry_run` prints the plan's resolved config and
`--estimate` its memory table; a real run builds from the same plan, so both check exactly what a launch checks.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from trainkit.command_line import RESUMED_OPTIONS, RunOptions, restore_run_options, run_flags, run_option_values
from trainkit.config import TrainConfig, build_config, config_dict, field_sources
from trainkit.data.batches import global_batch_size
from trainkit.errors import ConfigError, Problem
from trainkit.estimate import (
    PRECISION_NAMES,
    Estimate,
    ModelShape,
    attention_note,
    load_host_bytes,
    loss_note,
    meta_model,
    model_shape,
    report,
    run_activations,
)
from trainkit.launch.hostfile import check_hosts, environment_note, rendezvous_note
from trainkit.launch.launcher import Launch, check_machine, check_yaml
from trainkit.models import expert_bias, optimizer, pretrained, quantised
from trainkit.models.pretrained import sizing
from trainkit.recipes import Recipe, load_recipe
from trainkit.run.checkpoint import Found, auto_resume, find_checkpoint, resume_problems
from trainkit.run.metrics import FlopCount, check_trackers, count_flops
from trainkit.run.output_folder import check_output_dir, lock_output_dir
from trainkit.strategies.registry import Strategy, for_launch, shipped_strategies


@dataclass(frozen=True, slots=True)
class Plan:
    """A run, fully resolved and checked; nothing built yet."""

    options: RunOptions
    recipe: Recipe
    cfg: TrainConfig
    launch: Launch
    strategy: Strategy
    shape: ModelShape
    estimate: Estimate  # this run's model-state bytes per rank
    resolved: Mapping[str, Any]  # what resolved_config.json holds (read-only; the run adds the machine's fields)
    resume: Found | None  # the checkpoint --resume names
    flops: FlopCount  # training FLOPs per sample, for MFU
    notes: tuple[str, ...]  # what the plan decided or noticed, said before training (the strategy keeps its own)


def make_plan(options: RunOptions, overrides: list[tuple[str, str, str]]) -> Plan:
    """The plan for this command line and launch, or a ConfigError with every problem found. --estimate sizes a
    pretrained model from its config alone (trainkit/models/pretrained.py's sizing): no weights or tokenizer needed."""
    with sizing(options.estimate):
        return _plan(options, overrides)


def _plan(options: RunOptions, overrides: list[tuple[str, str, str]]) -> Plan:
    recipe = load_recipe(options.recipe)
    options, notes = resolve_resume_auto(options)
    resume = find_checkpoint(options.output_dir, options.resume) if options.resume and not options.estimate else None
    saved = resume.state["resolved_config"] if resume else {}  # --resume continues the checkpoint's settings
    options, restored = restore_run_options(options, saved)
    cfg = build_config(recipe.Config, overrides, restored=saved, flags=run_flags())
    sources = field_sources(cfg, overrides, saved, f"checkpoint {resume.path}" if resume else "")
    sources.update({name: f"--{name}" if name in options.given else f"checkpoint {resume.path}"
                    if resume and name in restored else "default" for name in RESUMED_OPTIONS})
    problems: list[Problem] = []
    if options.accelerate_config:
        problems += check_yaml(options.accelerate_config)
        try:
            launch = Launch.from_yaml(options.accelerate_config).as_launched(options.num_processes,
                                                                              options.num_machines)
        except ConfigError:
            raise ConfigError(problems) from None  # an unknown distributed_type: check_yaml named it
    else:
        launch = Launch.from_env()
    strategy = for_launch(launch, cfg, sources, recipe)
    # --estimate sizes the launch, for this machine or another: what only this machine refuses is left out
    problems += check_machine(launch) + strategy.check(this_machine=not options.estimate)
    problems += settings_under(recipe, cfg, strategy)
    if options.dry_run:  # a hostfile launch: every host answers over ssh, the slots add up, no secret travels
        problems += check_hosts(launch)
        for note in filter(None, (environment_note(launch), rendezvous_note(launch))):
            print(f"note: {note}", file=sys.stderr)  # now: it matters whether or not the launch has problems
    problems += check_trackers(options.report_to) + check_async_save(options.async_save, strategy)
    if not options.estimate:
        problems += check_output_dir(options.output_dir, options.resume, options.overwrite)
    if problems:
        raise ConfigError(problems)
    if cfg.warmup_steps >= cfg.max_steps:  # legitimate in a short trial, a mistake in a long run: said, not refused
        notes.append(f"warmup_steps {cfg.warmup_steps} >= max_steps {cfg.max_steps}: the learning rate is "
                     f"still warming up when the run ends and never reaches lr {cfg.lr:g}; pass "
                     f"--warmup_steps below --max_steps to train at it")
    if cfg.activation_offload and not torch.cuda.is_available():
        notes.append("--activation_offload: on a CPU run the activations already are in host memory; nothing moves")
    model = meta_model(recipe, cfg)
    if problems := strategy.check_model(model):  # a split the model does not declare, for example
        raise ConfigError(problems)
    shape = model_shape(recipe, cfg, model)
    tokens = recipe.tokens_per_sample(cfg)
    activations = run_activations(shape, cfg, per_rank(tokens, strategy), launch.mixed_precision)
    estimate = strategy.estimate(shape, options.num_processes or launch.world_size, activations)
    flops = count_flops(model, tokens)
    resolved = resolved_config(recipe, cfg, sources, launch, strategy, estimate, flops, run_option_values(options))
    if restored:  # said on screen: a resumed run that saves (or not) as its first launch did is no surprise
        notes.append("run options from the checkpoint: " + ", ".join(  # a switch is named when it is on
            f"--{name}" if resolved[name] is True else f"--{name} {resolved[name]}" for name in restored
            if resolved[name] is not False) + " (a flag sets one anew)")
    if resume and (problems := resume_problems(resume, cfg, resolved, overrides)):
        raise ConfigError(problems)
    # last: a plan refused for anything else never takes the folder's lock (nor rewrites who holds it)
    if not options.estimate and int(os.environ.get("RANK", "0")) == 0 and \
            (problems := lock_output_dir(options.output_dir, hold=not options.dry_run)):
        raise ConfigError(problems)
    return Plan(options, recipe, cfg, launch, strategy, shape, estimate, MappingProxyType(resolved), resume, flops,
                tuple(notes))


def per_rank(tokens: int | None, strategy: Strategy) -> int | None:
    """The positions of a sample one rank computes: 1/sp of them under sequence parallelism (rounded up, as the
    runner pads a row to a multiple of sp)."""
    return -(-tokens // strategy.sequence_parallel_size) if tokens else tokens


def check_async_save(async_save: bool, strategy: Strategy) -> list[Problem]:
    """--async_save needs a format that writes beside the training (torch.distributed.checkpoint's)."""
    if not async_save or strategy.engine.format.writes_async:
        return []
    return [Problem(f"--async_save does not work under {strategy.label}: its checkpoints are written by DeepSpeed's "
                    f"engine, which saves synchronously (DeepSpeed's own asynchronous writers need its async_io op "
                    f"and are not wired here)", "--async_save",
                    "drop --async_save, or train under a strategy that saves torch.distributed.checkpoint's format "
                    "(ddp.yaml, fsdp.yaml, tp.yaml, a pipeline)")]


def resolve_resume_auto(options: RunOptions) -> tuple[RunOptions, list[str]]:
    """--resume auto as what it resolves to in this folder (a checkpoint, or a fresh start that may replace a run's
    remains: checkpoint.auto_resume), and the note that says which; other options as they are."""
    if options.resume != "auto":
        return options, []
    if options.overwrite:
        raise ConfigError([Problem("--resume auto and --overwrite contradict each other", "command line",
                                   "pass only one (--resume auto starts fresh where nothing can be continued)")])
    if options.estimate:
        return dataclasses.replace(options, resume=None), []
    found, replaces, note = auto_resume(options.output_dir)
    return dataclasses.replace(options, resume=found, overwrite=replaces), [note]


def settings_under(recipe: Recipe, cfg: TrainConfig, strategy: Strategy) -> list[Problem]:
    """The settings this strategy cannot run: the recipe's own rules, a mixture's bias update, the optimizer, an
    8-bit base."""
    return recipe.check_strategy(cfg, strategy) + expert_bias.strategy_problems(cfg, strategy) + \
        optimizer.strategy_problems(cfg, strategy) + quantised.strategy_problems(cfg, strategy)


def resolved_config(recipe: Recipe, cfg: TrainConfig, sources: dict[str, str], launch: Launch, strategy: Strategy,
                    estimate: Estimate, flops: FlopCount, run_options: dict[str, Any]) -> dict[str, Any]:
    """Every effective value (flat), and under "sources" where each came from."""
    resolved: dict[str, Any] = {
        "recipe": str(recipe.path), **strategy.resolved_fields(), "world_size": launch.world_size,
        "num_machines": launch.num_machines, "mixed_precision": launch.mixed_precision,
        "global_batch_size": global_batch_size(cfg.batch_size, cfg.grad_accum, strategy.data_parallel_size),
        "data_parallel_size": strategy.data_parallel_size,
        "estimated_state_bytes": estimate.state,
        **config_dict(cfg), **run_options,
    }
    if getattr(cfg, "lora_r", 0):  # the frozen base is loaded again from its folder at a resume: it must be this one
        resolved["base_weights_digest"] = pretrained.weights_digest(cfg.model_name_or_path)
    seq_len = recipe.tokens_per_sample(cfg)
    if seq_len is not None and "seq_len" not in resolved:  # a recipe's own seq_len field is what it says (a pair of
        resolved["seq_len"] = seq_len  # dpo.py's has two rows of it)
    resolved.update(flops.resolved())
    sources = dict(sources)
    sources.update({name: launch.source for name in (*strategy.resolved_fields(), "world_size", "num_machines",
                                                     "mixed_precision")})
    sources["global_batch_size"] = "batch_size x grad_accum x data_parallel_size"
    sources["data_parallel_size"] = "world_size / the ranks that split one model (pipeline stages, tensor parallel)"
    sources["estimated_state_bytes"] = "trainkit.estimate"
    sources["base_weights_digest"] = "trainkit.models.pretrained.weights_digest"
    sources.update(dict.fromkeys(flops.resolved(), "trainkit.run.metrics.count_flops"))
    resolved["sources"] = sources
    return resolved


def estimate_report(plan: Plan) -> str:
    """--estimate: every shipped strategy's bytes per rank for this model and launch, and this launch's own."""
    world_size = plan.options.num_processes or plan.launch.world_size
    precision = plan.options.precision or plan.launch.mixed_precision
    # Without a launcher (python train.py --estimate --num_processes 8) the processes asked for are DDP's.
    this = plan.launch if world_size == 1 or plan.launch.distributed_type != "NO" else \
        dataclasses.replace(plan.launch, distributed_type="MULTI_GPU")
    resized = {"world_size": world_size, "mixed_precision": precision}
    mine = for_launch(dataclasses.replace(this, **resized), plan.cfg, {}, plan.recipe)
    # The shipped configs as they are (a pipeline is this run's flags, not theirs).
    with sizing(True):
        plain = dataclasses.replace(plan.cfg, pipeline_stages=1)
        model = meta_model(plan.recipe, plan.cfg)
    candidates = sorted([for_launch(dataclasses.replace(launch, **resized), plain, {}, plan.recipe)
                         for launch in shipped_strategies().values()], key=lambda s: s.speed_rank)
    seq_len = plan.recipe.tokens_per_sample(plan.cfg)
    rows = [s.estimate(plan.shape, world_size, run_activations(plan.shape, plan.cfg, per_rank(seq_len, s), precision))
            for s in candidates]
    # A row is offered only where the plan's own checks (those of --dry_run, but this machine's) accept it
    refused = {s.label: problems[0].what for s in [*candidates, mine] if (problems := s.check(this_machine=False)
                                                                          + s.check_model(model)
                                                                          + settings_under(plan.recipe, plan.cfg, s))}
    per_machine = max(1, world_size // max(1, plan.launch.num_machines))
    pretrained = bool(getattr(model, "name_or_path", ""))  # from_pretrained loads inside zero.Init (ZeRO-3)
    load_host = {s.label: load_host_bytes(plan.shape, per_machine, world_size if getattr(
        s, "builds_partitioned", False) and pretrained else 1) for s in [*candidates, mine]}
    checkpointing = getattr(plan.cfg, "gradient_checkpointing", False)
    assumed = (f"micro-batch {plan.cfg.batch_size}" + (f" x {seq_len} tokens" if seq_len else "")
               + f" (--batch_size{', --seq_len' if seq_len else ''}), {PRECISION_NAMES[precision]}, "
               + f"{attention_note(plan.shape)}, gradient checkpointing {'on' if checkpointing else 'off'}"
               + loss_note(plan.shape, plan.cfg, seq_len)
               + (", each MLP in chunks (--tiled_mlp)" if getattr(plan.cfg, "tiled_mlp", False) else "")
               + (", activation offload not counted (the activations as if on the device)"
                  if plan.cfg.activation_offload else ""))
    activations = run_activations(plan.shape, plan.cfg, per_rank(seq_len, mine), precision)
    return report(plan.shape, rows, mine.estimate(plan.shape, world_size, activations) if plan.launch.chosen else None,
                  world_size, precision, plan.cfg.optimizer, plan.options.device_memory, assumed, refused, load_host)
