"""TRL's DPOTrainer on the pairs bench/dpo_peer.py gives it, in the order given (the order trainkit trains them in),
with LoRA and the same optimizer and schedule: the loss of every step and the end time of every step.

    python bench/peers/trl_dpo.py --model BASE --data pairs.jsonl --report trl.json --max_steps 16
"""

from __future__ import annotations

import json
import time

import torch
from torch.utils.data import SequentialSampler
from trl import DPOConfig, DPOTrainer
from trl_record import Record, lora_peer


class InOrder(DPOTrainer):
    """The pairs in the file's order: the file is already in trainkit's order for the seed."""

    def _get_train_sampler(self, train_dataset=None):
        return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)


def main() -> None:
    args, tokenizer, data, model = lora_peer(__doc__)
    config = DPOConfig(
        output_dir=str(args.report.parent / "trl-dpo"), max_length=args.seq_len, beta=0.1, loss_type=["sigmoid"],
        per_device_train_batch_size=args.batch_size, max_steps=args.max_steps, learning_rate=args.lr,
        warmup_steps=10, lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
        weight_decay=0.0, optim="adamw_torch", max_grad_norm=1.0, logging_steps=1, save_strategy="no",
        eval_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(), seed=0,
        dataloader_drop_last=True,
        # TRL's defaults that trainkit's run does not have: bf16 autocast (even on a CPU) and activation checkpointing
        bf16=False, gradient_checkpointing=False)
    record = Record()
    trainer = InOrder(model=model, args=config, train_dataset=data, processing_class=tokenizer, callbacks=[record])
    started = time.perf_counter()
    trainer.train()
    report = {"started": started, "ends": record.ends, "losses": record.losses, "logs": record.logs}
    args.report.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
