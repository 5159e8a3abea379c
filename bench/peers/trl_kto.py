"""TRL's KTOTrainer on the unpaired answers bench/kto_peer.py gives it, in the order given (the order trainkit trains
them in), with LoRA and the same optimizer and schedule: the loss, KL and rewards of every step.

    python bench/peers/trl_kto.py --model BASE --data answers.jsonl --report trl.json --max_steps 16
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
from trl import KTOConfig, KTOTrainer
from trl_record import Record

from trainkit.data.sft import CHATML


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--max_steps", type=int, default=16)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--lora_r", type=int, default=8)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.chat_template = CHATML
    data = Dataset.from_list([json.loads(line) for line in args.data.read_text().splitlines()])
    set_seed(0)  # then the model and its adapters, as train.py makes them: the same adapters' initial weights
    lora = LoraConfig(r=args.lora_r, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32), lora)
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
