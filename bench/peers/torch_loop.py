"""A bare PyTorch training loop, one process: what `python train.py --recipe tiny_transformer` must not be slower than.

    python bench/peers/torch_loop.py --report loop.json [--batch_size 16] [--max_steps 24]

The same model, blocks, AdamW (weight decay on matrices), warm-up + cosine schedule and clipping as the runner, and
nothing else: no Accelerate, no metrics, no checks. bench/throughput.py times it against train.py.
"""

from __future__ import annotations

import torch
from accelerate.utils import set_seed
from common import StepClock, arguments, build_model, param_groups, recipe_setup, what_ran, write_report
from torch.utils.data import DataLoader
from transformers import get_cosine_with_min_lr_schedule_with_warmup


def main() -> None:
    args = arguments(__doc__).parse_args()
    recipe, cfg, train_set = recipe_setup(args)
    set_seed(cfg.seed)
    model = build_model(recipe, cfg)
    # trainkit/models/optimizer.py's
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, fused=True)
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(optimizer, cfg.warmup_steps, cfg.max_steps,
                                                            min_lr_rate=cfg.min_lr_ratio)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True, drop_last=True)
    clock, batches = StepClock(), iter(loader)
    model.train()
    for _ in range(cfg.max_steps):
        for _ in range(cfg.grad_accum):
            input_ids = next(batches)["input_ids"]
            loss = model(input_ids=input_ids, labels=input_ids).loss / cfg.grad_accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        clock.tick()
    write_report(args.report, clock, what_ran(model))


if __name__ == "__main__":
    main()
