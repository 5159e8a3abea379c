"""TRL's DistillationTrainer on the prompts bench/distill_peer.py gives it, in the order given (trainkit's order for
the seed; shuffle_dataset off), with the same student, teacher, beta, temperature, optimizer and schedule: each step's
logged metrics and end time.

DistillationTrainer always trains on the student's own completions; to compare the losses number by number, its
generation is replaced here by the completions trainkit trains on (--tokens: each prompt's token ids and its
completion's, as trainkit's distill recipe encodes them off-policy), so that both sides score the same tokens. Its
loss, its chunked divergence, its optimizer step and its schedule are TRL's own.

    python bench/peers/trl_distill.py --student S --teacher T --data prompts.jsonl --tokens tokens.json \\
        --report trl.json --max_steps 20
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
from trl.trainer.distillation_config import DistillationConfig
from trl.trainer.distillation_trainer import DistillationTrainer
from trl_record import Record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--student", required=True)
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--tokens", type=Path, required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--max_steps", type=int, default=20)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--beta", type=float, default=1.0)
    args = parser.parse_args()
    tokens = json.loads(args.tokens.read_text())  # prompt -> [its ids, its completion's ids]
    tokenizer = AutoTokenizer.from_pretrained(args.student)
    data = Dataset.from_list([{"prompt": json.loads(line)["prompt"]} for line in args.data.read_text().splitlines()])
    set_seed(0)
    student, teacher = (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
                        for path in (args.student, args.teacher))
    config = DistillationConfig(
        output_dir=str(args.report.parent / "trl-distill"), per_device_train_batch_size=args.batch_size,
        max_steps=args.max_steps, learning_rate=args.lr, warmup_steps=0, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1}, weight_decay=0.0, optim="adamw_torch", max_grad_norm=1.0,
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none",
        use_cpu=not torch.cuda.is_available(), seed=0, shuffle_dataset=False, beta=args.beta, temperature=1.0,
        max_completion_length=64,
        # TRL's defaults that trainkit's run does not have: bf16 autocast (even on a CPU) and activation checkpointing
        bf16=False, gradient_checkpointing=False)
    record = Record()
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=config, train_dataset=data,
                                  processing_class=tokenizer, callbacks=[record])
    completions = {tuple(prompt_ids): completion_ids for prompt_ids, completion_ids in tokens.values()}
    # the prompts as trainkit encodes them, and in place of sampling the completions it trains on
    trainer._tokenize_prompts = lambda prompts: ([tokens[p][0] for p in prompts], None, {})
    trainer._generate_single_turn = lambda prompt_ids, images, fields, *rest: [completions[tuple(p)]
                                                                              for p in prompt_ids]
    started = time.perf_counter()
    trainer.train()
    args.report.write_text(json.dumps({"started": started, "ends": record.ends, "logs": record.logs}))


if __name__ == "__main__":
    main()
