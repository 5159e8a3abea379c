"""TRL's SFTTrainer with peft's LoRA and packing: the peer that bench/sft_peer.py times trainkit's causal_lm against.

    python bench/peers/trl_sft.py --model BASE --data chat.jsonl --report r.json

The same model and tokenizer (with ChatML as its chat template), the same conversations (one user turn, one
assistant turn) as TRL's conversational prompt-completion records, so that the loss is on the completion and its end
of turn only (trainkit learns the same tokens: the assistant's turn), the same LoRA (r 8, alpha 16, all-linear, no
dropout), rows of 512 tokens packed best-fit (TRL's "bfd", padding-free), 8 rows per step, AdamW fused at
causal_lm's lr 1e-4 with 10 warm-up steps and the cosine to 10%, clipping at 1.0, fp32. Logging every step (the
loss), no evaluation or saving. The report holds each step's end time, loss and learned-token count, and what the
padding-free collator's packed rows do to one example's losses (isolated or not: `contamination`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
from trl import SFTConfig, SFTTrainer
from trl_record import Record

from trainkit.data.sft import CHATML


def contamination(model, collator, rows: list[dict]) -> float:
    """The largest difference between an example's per-token losses inside the collator's packed batch and the
    same example alone: 0 when packed examples are isolated (flash attention's variable-length path), more when the
    attention lets them see each other (sdpa and eager on padding-free rows)."""
    batch = collator(rows[:2])
    loss = torch.nn.functional.cross_entropy
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        first = len(rows[0]["input_ids"])
        second = torch.tensor([rows[1]["input_ids"]])
        alone = model(input_ids=second).logits[0]
        ids = second[0]
        packed_loss = loss(logits[first:first + len(ids) - 1], ids[1:], reduction="none")
        alone_loss = loss(alone[:-1], ids[1:], reduction="none")
    return float((packed_loss - alone_loss).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--max_steps", type=int, default=16)
    args = parser.parse_args()
    set_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.chat_template = CHATML
    records = [json.loads(line)["messages"] for line in args.data.read_text().splitlines()]
    data = Dataset.from_list([{"prompt": m[:-1], "completion": m[-1:]} for m in records])
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = SFTConfig(
        output_dir=str(args.report.parent / "trl"), max_length=512, packing=True, packing_strategy="bfd",
        per_device_train_batch_size=8, max_steps=args.max_steps, learning_rate=1e-4, warmup_steps=10,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1}, weight_decay=0.0,
        optim="adamw_torch_fused", max_grad_norm=1.0, logging_steps=1, save_strategy="no", eval_strategy="no",
        report_to="none", use_cpu=not torch.cuda.is_available(), seed=0, dataloader_drop_last=True,
        # TRL's defaults that trainkit's run does not have: bf16 autocast (even on a CPU) and activation checkpointing
        bf16=False, gradient_checkpointing=False)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    record = Record()
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                         peft_config=lora, callbacks=[record])
    rows = trainer.train_dataset
    learned = [sum(1 for label in row["labels"] if label != -100) for row in rows]  # the completions' tokens
    started = time.perf_counter()
    trainer.train()
    alone = [{"input_ids": tokenizer.apply_chat_template(m, tokenize=True, return_dict=True)["input_ids"]}
             for m in records[:2]]
    args.report.write_text(json.dumps({
        "started": started, "ends": record.ends, "losses": record.losses, "rows": len(rows),
        "learned_per_row": sum(learned) / len(learned),
        "padding": 1 - sum(len(row["input_ids"]) for row in rows) / (len(rows) * 512),
        "contamination": contamination(trainer.model.eval(), trainer.data_collator, alone)}))


if __name__ == "__main__":
    main()
