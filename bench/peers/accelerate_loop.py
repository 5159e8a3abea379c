"""A plain Accelerate training loop, written the way Accelerate's own examples are (examples/nlp_example.py):
`accelerator.prepare`, `accelerator.accumulate`, `accelerator.backward`, `clip_grad_norm_`. The peer that
bench/throughput.py times trainkit against, under the same Accelerate YAMLs.

    accelerate launch --config_file accelerate_configs/ddp.yaml bench/peers/accelerate_loop.py --cpu --report r.json
    accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml bench/peers/accelerate_loop.py \
        --report r.json

What a user of such a loop must add on a machine without GPUs, and nothing more: `--cpu` (the examples' flag:
Accelerator(cpu=True), without which a MULTI_GPU YAML starts unsynchronised copies) for DDP, and the gloo backend for
DeepSpeed (which must not get cpu=True: Accelerate would then train DDP). `--no_sync` skips DDP's gradient all-reduce
on every step (the replicas drift apart): the compute-only time that bench/throughput.py's scaling section compares
with, to measure the all-reduce's share of a step.
"""

from __future__ import annotations

import contextlib
import os

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, set_seed
from common import StepClock, arguments, build_model, param_groups, recipe_setup, what_ran, write_report
from torch.utils.data import DataLoader
from transformers import get_cosine_with_min_lr_schedule_with_warmup


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--cpu", action="store_true", help="Accelerator(cpu=True), as in Accelerate's examples")
    parser.add_argument("--no_sync", action="store_true", help="DDP without its gradient all-reduce (timing only)")
    args = parser.parse_args()
    handlers = [InitProcessGroupKwargs(backend="gloo")] if int(os.environ.get("WORLD_SIZE", "1")) > 1 \
        and not torch.cuda.is_available() and not args.cpu else []
    accelerator = Accelerator(cpu=args.cpu, gradient_accumulation_steps=args.grad_accum, kwargs_handlers=handlers)
    recipe, cfg, train_set = recipe_setup(args)
    set_seed(cfg.seed)
    model = build_model(recipe, cfg)
    # trainkit/models/optimizer.py's
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, fused=True)
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(optimizer, cfg.warmup_steps, cfg.max_steps,
                                                            min_lr_rate=cfg.min_lr_ratio)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True, drop_last=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    clock, steps = StepClock(), 0
    model.train()
    while steps < cfg.max_steps:
        for batch in loader:
            skip = accelerator.no_sync(model) if args.no_sync else contextlib.nullcontext()
            with accelerator.accumulate(model), skip:
                outputs = model(input_ids=batch["input_ids"], labels=batch["input_ids"])
                accelerator.backward(outputs.loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                clock.tick()
                steps += 1
                if steps == cfg.max_steps:
                    break
    write_report(args.report, clock, what_ran(model, accelerator), accelerator.is_main_process)
    accelerator.end_training()


if __name__ == "__main__":
    main()
