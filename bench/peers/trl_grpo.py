"""TRL's GRPOTrainer on the prompts bench/grpo_peer.py gives it, in the order given (trainkit's order for the seed;
shuffle_dataset off, so TRL's RepeatSampler reads them in turn),
with the same reward, G, lengths, sampling, optimizer, schedule and loss type: each step's logged metrics and end
time.

    python bench/peers/trl_grpo.py --model BASE --data prompts.jsonl --report trl.json --max_steps 20
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from datasets import Dataset
from grpo_rewards import share_of_low_ids
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
from trl import GRPOConfig, GRPOTrainer
from trl_record import Record

from trainkit.data.sft import CHATML


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--max_steps", type=int, default=20)
    parser.add_argument("--batch_size", type=int, default=16)  # completions per step
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--max_completion_length", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--loss_type", default="dapo")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.chat_template = CHATML
    data = Dataset.from_list([json.loads(line) for line in args.data.read_text().splitlines()])
    set_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(args.report.parent / "trl-grpo"), per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length, temperature=1.0,
        top_p=1.0, top_k=0, loss_type=args.loss_type, beta=0.0, scale_rewards="group", max_steps=args.max_steps,
        learning_rate=args.lr, warmup_steps=0, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1}, weight_decay=0.0, optim="adamw_torch", max_grad_norm=1.0,
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none",
        use_cpu=not torch.cuda.is_available(), seed=0, shuffle_dataset=False, log_completions=False,
        # TRL's defaults that trainkit's run does not have: bf16 autocast (even on a CPU) and activation checkpointing
        bf16=False, gradient_checkpointing=False)
    record = Record("reward")
    trainer = GRPOTrainer(model=model, reward_funcs=[share_of_low_ids], args=config, train_dataset=data,
                      processing_class=tokenizer, callbacks=[record])
    started = time.perf_counter()
    trainer.train()
    args.report.write_text(json.dumps({"started": started, "ends": record.ends, "logs": record.logs}))


if __name__ == "__main__":
    main()
