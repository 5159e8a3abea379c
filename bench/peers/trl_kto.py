"""TRL's KTOTrainer on the unpaired answers bench/kto_peer.py gives it, in the order given (the order trainkit trains
them in), with LoRA and the same optimizer and schedule: the loss, KL and rewards of every step.

    python bench/peers/trl_kto.py --model BASE --data answers.jsonl --report trl.json --max_steps 16
"""

from __future__ import annotations

import json
import time

import torch
from trl import KTOConfig, KTOTrainer
from trl_record import Record, lora_peer


def main() -> None:
    args, tokenizer, data, model = lora_peer(__doc__)
    config = KTOConfig(
        output_dir=str(args.report.parent / "trl-kto"), max_length=args.seq_len, beta=0.1, loss_type="kto",
        per_device_train_batch_size=args.batch_size, max_steps=args.max_steps, learning_rate=args.lr,
        warmup_steps=10, lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
        weight_decay=0.0, optim="adamw_torch", max_grad_norm=1.0, logging_steps=1, save_strategy="no",
        eval_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(), seed=0,
        dataloader_drop_last=True, train_sampling_strategy="sequential",  # KTO's KL rows need it; the file is ordered
        bf16=False, gradient_checkpointing=False)  # TRL's defaults that trainkit's run does not have
    record = Record()
    trainer = KTOTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer, callbacks=[record])
    started = time.perf_counter()
    trainer.train()
    args.report.write_text(json.dumps({"started": started, "ends": record.ends, "logs": record.logs}))


if __name__ == "__main__":
    main()
