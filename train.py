"""Train a recipe under whatever strategy the launcher selects.

    python train.py --recipe mlp
    accelerate launch --config_file accelerate_configs/ddp.yaml train.py --recipe tiny_transformer

Reads top to bottom: parse -> resolve and validate -> build -> loop -> save. Strategy details live in
trainkit/strategy.py, the data order in trainkit/data.py, the outputs in trainkit/metrics.py and checkpoint.py.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time

import torch
from accelerate.utils import set_seed

from trainkit.checkpoint import Checkpointer, check_output_dir, clear_outputs, export_final
from trainkit.config import ConfigError, build_config, field_sources, parse_command_line, problem, resolved_config
from trainkit.data import BatchLayout, TrainStream, eval_batches
from trainkit.estimate import for_run, model_shape, strategy_name, table
from trainkit.metrics import (MetricsLog, Throughput, check_trackers, model_flops_per_token, peak_flops, peak_memory_bytes, state_bytes,
                              summary_line)
from trainkit.optim import build_scheduler
from trainkit.recipes import load_recipe, recipe_path
from trainkit.strategy import (Launch, Strategy, build_accelerator, check_hosts, check_launch, check_yaml, end_process,
                               lost_contact, offloads_optimizer, zero_stage)


class TrainingError(Exception):
    """The run cannot go on (a non-finite loss, say); the message says why and what to do."""


class StopSignal:
    """SIGTERM/SIGINT (preemption, Ctrl-C) asks for a stop; every rank stops at the same step boundary."""

    def __init__(self) -> None:
        self.name: str | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.name = signal.Signals(signum).name

    def agreed(self, accelerator) -> bool:
        """Whether any rank got a signal (a collective: every rank calls it after every step)."""
        flag = torch.tensor([1.0 if self.name else 0.0], device=accelerator.device)
        return accelerator.reduce(flag, "sum").item() > 0


class FiniteCheck:
    """A non-finite loss or gradient norm stops the run before the optimizer step.

    Under fp16 the loss scaler skips such steps itself (counted in skipped_steps) and a skipped step leaves the
    weights as they were, so only a loss that stays non-finite for `fp16_patience` steps in a row, on different
    batches, stops the run: then the weights or the data are broken, and no loss scale mends that.
    """

    def __init__(self, fp16: bool, fp16_patience: int = 3) -> None:
        self.fp16, self.fp16_patience, self.losses_in_a_row = fp16, fp16_patience, 0

    def loss(self, step: int, value: float) -> None:
        self.losses_in_a_row = 0 if math.isfinite(value) else self.losses_in_a_row + 1
        if self.losses_in_a_row and (not self.fp16 or self.losses_in_a_row >= self.fp16_patience):
            during = f" ({self.losses_in_a_row} steps in a row under fp16)" if self.fp16 else ""
            raise TrainingError(f"non-finite loss at step {step} ({value}){during}; the optimizer step was not "
                                f"taken: lower --lr, raise warmup_steps, or check the data")

    def grad_norm(self, step: int, value: float | None) -> None:
        if value is not None and not math.isfinite(value) and not self.fp16:
            raise TrainingError(f"non-finite gradient norm at step {step} ({value}); the optimizer step was not "
                                f"taken: lower --lr, raise warmup_steps, or turn clipping on (--max_grad_norm 1)")


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except (ConfigError, TrainingError) as e:
        # Every rank prints: when all of them refuse, the launcher kills the slower ones as soon as one exits, so a
        # message left to rank 0 alone can be lost (seen in CI). Duplicate lines beat a silent failure.
        for line in getattr(e, "problems", [str(e)]):
            print(f"error: {line}", file=sys.stderr, flush=True)
        return 2 if isinstance(e, ConfigError) else 1
    except RuntimeError as e:
        reason = lost_contact(e)
        if reason is None:
            raise
        print(f"error: rank {os.environ.get('RANK', '0')} lost contact with the other processes ({reason}): a machine "
              f"or process died, froze or lost its network. Check the other machines' logs, then continue with "
              f"--resume latest (the last complete checkpoint is intact)", file=sys.stderr)
        return 1


def run(argv: list[str] | None) -> int:
    # --- parse, resolve and validate: everything that can be wrong is found before a model exists ---
    options, overrides = parse_command_line(argv)
    recipe = load_recipe(options.recipe)
    cfg = build_config(recipe.Config, overrides)
    launch = Launch.from_yaml(options.accelerate_config) if options.accelerate_config else Launch.from_env()
    sources = field_sources(cfg, overrides)
    problems, ds = check_launch(launch, cfg, sources)
    if options.dry_run and launch.hostfile:  # a DeepSpeed hostfile launch: every host answers, the slots add up
        problems += check_hosts(launch)
    if options.accelerate_config:
        problems += check_yaml(options.accelerate_config)
    problems += check_trackers(options.report_to)
    if problems:
        raise ConfigError(problems)
    shape = model_shape(recipe, cfg)
    tokens_per_sample = recipe.tokens_per_sample(cfg) if hasattr(recipe, "tokens_per_sample") else None
    strategy_label = strategy_name(launch.kind, zero_stage(ds), launch.fsdp_offload or offloads_optimizer(ds))
    world_size = options.num_processes or launch.world_size
    mine = for_run(shape, cfg, strategy_label, world_size, launch.mixed_precision)
    if options.estimate:
        print(table(shape, world_size, launch.mixed_precision, cfg.optimizer, mine.activations, options.device_memory))
        print(f"this launch ({strategy_label}, {world_size} process(es)): {mine.state:,} bytes of model state per rank")
        return 0
    resolved = resolved_config(recipe_path(options.recipe), cfg, sources, launch, zero_stage(ds), mine.state,
                               tokens_per_sample)
    found = None
    if not options.dry_run:
        problems, found = check_output_dir(options.output_dir, options.resume, options.overwrite, resolved)
        if problems:
            raise ConfigError(problems)
    if options.dry_run:
        print(json.dumps(resolved, indent=2))
        return 0

    # --- build ---
    accelerator = build_accelerator(launch, cfg, ds, options.output_dir, options.report_to)
    strategy = Strategy(launch, accelerator, ds)
    checkpointer = Checkpointer(accelerator, strategy, options.output_dir, options.keep_last)
    is_main = accelerator.is_main_process
    if is_main:
        if options.overwrite:  # asked for explicitly: the earlier run's outputs go
            clear_outputs(options.output_dir)
        options.output_dir.mkdir(parents=True, exist_ok=True)
        (options.output_dir / "resolved_config.json").write_text(json.dumps(resolved, indent=2) + "\n")
    accelerator.init_trackers("train", config={k: v for k, v in resolved.items() if isinstance(v, (int, float, str))})
    with accelerator.local_main_process_first():  # one process per machine builds the data caches
        train_set, eval_set = recipe.build_datasets(cfg, options.cache_dir)
    layout = BatchLayout(cfg.batch_size, cfg.grad_accum, accelerator.process_index, accelerator.num_processes)
    for name, dataset in (("training", train_set), ("held-out", eval_set)):
        if len(dataset) < layout.global_batch:
            raise ConfigError([problem(f"the {name} split has {len(dataset)} samples, fewer than one global batch "
                                       f"({layout.global_batch})", "batch_size x grad_accum x world_size",
                                       "use a smaller --batch_size or --grad_accum, or more data")])
    set_seed(cfg.seed)  # the same initial weights on every rank and in a one-process run
    model = recipe.build_model(cfg)
    if found and not checkpointer.exact(found):  # another strategy's checkpoint: weights only, said out loud
        strategy.notes.append(checkpointer.warm_start(found, model))
    model = strategy.prepare_model(model)
    if found and (note := checkpointer.reshard(found)):  # a ZeRO checkpoint of another world size or stage
        strategy.notes.append(note)
    optimizer = strategy.build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer)
    model, optimizer, scheduler = strategy.prepare(model, optimizer, scheduler)
    stream = TrainStream(train_set, layout, cfg.seed)
    start_step, skipped_steps = 0, 0
    if found:
        checkpointer.load(found, model, optimizer, scheduler)  # last: it restores this rank's RNG
        stream.seek(found.state["epoch"], found.state["batch_in_epoch"])
        start_step, skipped_steps = found.state["step"], found.state["skipped_steps"]
        strategy.notes.append(f"resumed from {found.path} at step {start_step}")
    for note in strategy.notes if is_main else []:
        print(f"note: {note}", file=sys.stderr)
    flops_per_sample = model_flops_per_token(shape.num_params) * (tokens_per_sample or 1)
    peak = peak_flops(accelerator.device, options.peak_flops)

    def evaluate() -> float:
        model.eval()
        total, count = torch.zeros(1, device=accelerator.device), 0
        with torch.no_grad():
            for batch in eval_batches(eval_set, layout, cfg.eval_batches):
                total += recipe.loss(model, strategy.cast_batch(batch, model)).detach().float()
                count += 1
        model.train()
        return accelerator.reduce(total / count, "mean").item()  # equal micro-batches: mean of means = mean

    # --- the loop: one iteration per optimizer step; each rank computes grad_accum micro-batches of it ---
    log = MetricsLog(accelerator, options.output_dir, cfg.max_steps, initial_step=start_step)
    throughput, started = Throughput(), time.perf_counter()
    model.train()
    record: dict = {}
    finite = FiniteCheck(fp16=launch.mixed_precision == "fp16")
    stop = StopSignal()
    last_step, step = min(cfg.max_steps, options.stop_at or cfg.max_steps), start_step
    for step in range(start_step + 1, last_step + 1):
        step_loss = torch.zeros(1, device=accelerator.device)  # 1-element: gloo cannot reduce 0-d tensors
        micro_batches = stream.next_global_batch()
        for i, batch in enumerate(micro_batches):
            with accelerator.accumulate(model):
                loss = recipe.loss(model, strategy.cast_batch(batch, model))
                step_loss += loss.detach().float()
                if i == len(micro_batches) - 1:  # before the last backward: DeepSpeed steps inside it
                    loss_value = accelerator.reduce(step_loss / cfg.grad_accum, "mean").item()
                    finite.loss(step, loss_value)
                accelerator.backward(loss)
        grad_norm = strategy.clip_grad_norm(model, cfg.max_grad_norm)
        finite.grad_norm(step, grad_norm)
        record = {"step": step, "loss": loss_value, "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm}
        optimizer.step()
        skipped_steps += strategy.step_was_skipped()
        scheduler.step()
        optimizer.zero_grad(set_to_none=False)  # keep gradient buffers: state_bytes counts them as held
        samples_per_s = throughput.lap(layout.global_batch)
        record.update(samples_per_s=samples_per_s,
                      mfu=samples_per_s * flops_per_sample / (peak * accelerator.num_processes) if peak else None,
                      state_bytes=state_bytes(model, optimizer), peak_mem_bytes=peak_memory_bytes(accelerator.device),
                      skipped_steps=skipped_steps)
        if tokens_per_sample:
            record["tokens_per_s"] = samples_per_s * tokens_per_sample
        if step == cfg.max_steps or (cfg.eval_every and step % cfg.eval_every == 0):
            record["eval_loss"] = evaluate()
        log.step(record)
        stopping = stop.agreed(accelerator) or step == options.stop_at
        if stopping or (options.save_every and step % options.save_every == 0):
            checkpointer.save(step, model, optimizer, scheduler, stream.position, skipped_steps, resolved)
        if stopping:
            break
    log.close()
    if step < cfg.max_steps:  # --stop_at or a signal: a checkpoint, no final export
        accelerator.end_training()
        if is_main:
            print(f"stopped after step {step} ({stop.name or '--stop_at'}); checkpoint in "
                  f"{checkpointer.root / f'step_{step}'}; continue with --resume latest")
        return 0

    # --- save and summarise ---
    final = export_final(accelerator, strategy.full_state_dict(model), model, recipe, cfg, options.cache_dir,
                         options.output_dir)
    accelerator.end_training()
    if is_main:
        extra = recipe.summary(cfg, options.cache_dir) if hasattr(recipe, "summary") else {}
        print(summary_line(record, step - start_step, time.perf_counter() - started, extra, final))
    return 0


if __name__ == "__main__":
    end_process(main())
