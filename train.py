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
import sys
import time

import torch
from accelerate.utils import set_seed

from trainkit.checkpoint import export_final
from trainkit.config import ConfigError, build_config, field_sources, parse_command_line, problem, resolved_config
from trainkit.data import BatchLayout, TrainStream, eval_batches
from trainkit.estimate import count_parameters, estimate_state_bytes
from trainkit.metrics import MetricsLog, Throughput, model_flops_per_token, peak_flops, peak_memory_bytes, state_bytes
from trainkit.optim import build_scheduler
from trainkit.recipes import load_recipe, recipe_path
from trainkit.strategy import Launch, Strategy, build_accelerator, check_launch, zero_stage


class TrainingError(Exception):
    """The run cannot go on (a non-finite loss, say); the message says why and what to do."""


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except (ConfigError, TrainingError) as e:
        if int(os.environ.get("RANK", "0")) == 0:
            for line in getattr(e, "problems", [str(e)]):
                print(f"error: {line}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1


def run(argv: list[str] | None) -> int:
    # --- parse, resolve and validate: everything that can be wrong is found before a model exists ---
    options, overrides = parse_command_line(argv)
    recipe = load_recipe(options.recipe)
    cfg = build_config(recipe.Config, overrides)
    launch = Launch.from_yaml(options.accelerate_config) if options.accelerate_config else Launch.from_env()
    sources = field_sources(cfg, overrides)
    problems, ds = check_launch(launch, cfg, sources)
    existing = [name for name in ("metrics.jsonl", "final") if (options.output_dir / name).exists()]
    if existing and not options.overwrite and not options.dry_run:
        problems.append(problem(f"{options.output_dir} already holds a run ({', '.join(existing)})", "--output_dir",
                                "pick a new --output_dir, or pass --overwrite to replace it"))
    if problems:
        raise ConfigError(problems)
    num_params = count_parameters(recipe, cfg)
    tokens_per_sample = recipe.tokens_per_sample(cfg) if hasattr(recipe, "tokens_per_sample") else None
    resolved = resolved_config(recipe_path(options.recipe), cfg, sources, launch, zero_stage(ds),
                               estimate_state_bytes(num_params, launch, cfg), tokens_per_sample)
    if options.dry_run:
        print(json.dumps(resolved, indent=2))
        return 0

    # --- build ---
    options.output_dir.mkdir(parents=True, exist_ok=True)
    accelerator = build_accelerator(launch, cfg, ds, options.output_dir, options.report_to)
    strategy = Strategy(launch, accelerator, ds)
    is_main = accelerator.is_main_process
    if is_main:
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
    model = strategy.prepare_model(recipe.build_model(cfg))
    optimizer = strategy.build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer)
    model, optimizer, scheduler = strategy.prepare(model, optimizer, scheduler)
    for note in strategy.notes if is_main else []:
        print(f"note: {note}", file=sys.stderr)
    stream = TrainStream(train_set, layout, cfg.seed)
    flops_per_sample = model_flops_per_token(num_params) * (tokens_per_sample or 1)
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
    log = MetricsLog(accelerator, options.output_dir, cfg.max_steps, initial_step=0, append=False)
    throughput, started = Throughput(), time.perf_counter()
    model.train()
    record: dict = {}
    eval_loss, skipped_steps = float("nan"), 0
    fp16 = launch.mixed_precision == "fp16"
    for step in range(1, cfg.max_steps + 1):
        step_loss = torch.zeros(1, device=accelerator.device)  # 1-element: gloo cannot reduce 0-d tensors
        micro_batches = stream.next_global_batch()
        for i, batch in enumerate(micro_batches):
            with accelerator.accumulate(model):
                loss = recipe.loss(model, strategy.cast_batch(batch, model))
                step_loss += loss.detach().float()
                if i == len(micro_batches) - 1:  # before the last backward: DeepSpeed steps inside it
                    loss_value = accelerator.reduce(step_loss / cfg.grad_accum, "mean").item()
                    if not math.isfinite(loss_value):
                        raise TrainingError(f"non-finite loss at step {step} ({loss_value}); the optimizer step was "
                                            f"not taken: lower --lr, raise warmup_steps, or check the data")
                accelerator.backward(loss)
        grad_norm = strategy.clip_grad_norm(model, cfg.max_grad_norm)
        if not math.isfinite(grad_norm) and not fp16:  # under fp16 the loss scaler skips such steps by design
            raise TrainingError(f"non-finite gradient norm at step {step} ({grad_norm}); the optimizer step was not "
                                f"taken: lower --lr, raise warmup_steps, or turn clipping on (--max_grad_norm 1)")
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
            record["eval_loss"] = eval_loss = evaluate()
        log.step(record)
    log.close()

    # --- save and summarise ---
    final = export_final(accelerator, strategy.full_state_dict(model), model, recipe, cfg, options.cache_dir,
                         options.output_dir)
    accelerator.end_training()
    if is_main:
        extra = recipe.summary(cfg, options.cache_dir) if hasattr(recipe, "summary") else {}
        rate = (f"{record['tokens_per_s']:.0f} tokens/s" if tokens_per_sample
                else f"{record['samples_per_s']:.0f} samples/s")
        print(f"done: {cfg.max_steps} steps in {time.perf_counter() - started:.1f}s | train loss {record['loss']:.4f}"
              f" | eval loss {eval_loss:.4f}" + "".join(f" | {k} {v:.4f}" for k, v in extra.items()) +
              f" | {rate} | outputs in {options.output_dir} (weights: {final})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
