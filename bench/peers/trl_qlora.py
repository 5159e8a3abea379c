"""TRL's SFTTrainer with peft's LoRA over a 4-bit base from bitsandbytes: the peer that bench/qlora.py compares
trainkit's `causal_lm --load_in_4bit` with, step by step.

    python bench/peers/trl_qlora.py --model BASE --data chat.jsonl --report r.json --batch_size 16 [--longest]

The base quantised as trainkit quantises it (BitsAndBytesConfig NF4, double quantisation, fp32 compute, uint8
storage, on this rank's device) and prepared as trainkit prepares it (peft's prepare_model_for_kbit_training), then
LoRA r 8 / alpha 16 on all-linear made after set_seed(0) (the adapters' initial weights are train.py's). The
conversations (one user turn, one assistant turn) as TRL's conversational prompt-completion records, so that the
loss is on the assistant's turn, as trainkit's; ChatML; rows padded, not packed, to --seq_len as trainkit pads them
(--longest: to the batch's longest row, TRL's default); --batch_size rows per step, the
whole file (full-batch steps: the data order cannot differ); AdamW at lr 5e-4 with 10 warm-up steps and the cosine
to 10%, clipping at 1.0. SFTTrainer casts the adapters of a quantised model to bf16 (after the QLoRA paper); they are
cast back to fp32, trainkit's (and the one the run's fp32 comparison needs), before the optimizer is made. The report
holds each step's end time and loss.
"""

from __future__ import annotations

import json
import time

import torch
from trl import SFTConfig, SFTTrainer
from trl_record import Record, lora_peer


def main() -> None:
    args, tokenizer, data, model = lora_peer(__doc__, quantised=True, more=[("--longest", {"action": "store_true"})])
    data = data.map(lambda row: {"prompt": row["messages"][:-1], "completion": row["messages"][-1:]},
                    remove_columns=["messages"])
    config = SFTConfig(
        output_dir=str(args.report.parent / "trl-qlora"), max_length=args.seq_len, packing=False,
        pad_to_multiple_of=None if args.longest else args.seq_len,
        per_device_train_batch_size=args.batch_size, max_steps=args.max_steps, learning_rate=args.lr, warmup_steps=10,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1}, weight_decay=0.0,
        optim="adamw_torch", max_grad_norm=1.0, logging_steps=1, save_strategy="no", eval_strategy="no",
        report_to="none", use_cpu=not torch.cuda.is_available(), seed=0, dataloader_drop_last=True,
        bf16=False, gradient_checkpointing=False)  # TRL's defaults that trainkit's run does not have
    record = Record()
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer, callbacks=[record])
    for param in trainer.model.parameters():  # SFTTrainer casts a quantised model's adapters to bf16: back to fp32
        if param.requires_grad:
            param.data = param.data.float()
    rows = trainer.train_dataset
    started = time.perf_counter()
    trainer.train()
    args.report.write_text(json.dumps({
        "started": started, "ends": record.ends, "losses": record.losses, "rows": len(rows),
        "tokens": sum(len(row["input_ids"]) for row in rows)}))


if __name__ == "__main__":
    main()
