"""What the TRL peers (bench/peers/trl_*.py) record of a Trainer's run: the end time of every optimizer step and the
logs of the steps, those holding `key` (the trainer's own loss, or GRPO's reward); and the set-up the preference
peers (trl_dpo.py, trl_kto.py) share: their flags, the records, and the base model with LoRA as train.py makes it."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback


def lora_peer(doc: str, quantised: bool = False,
              more: list[tuple[str, dict]] = ()) -> tuple[argparse.Namespace, Any, Any, Any]:
    """(flags, tokenizer with ChatML, the records of --data in their order, the model with LoRA r --lora_r / alpha 16
    on all-linear, fp32, made after set_seed(0) as train.py makes it: the same adapters' initial weights). `quantised`:
    the base in 4 bits as QLoRA's users load it (NF4, double quantisation, fp32 compute, uint8 storage) and prepared
    with peft's prepare_model_for_kbit_training. `more`: the peer's own flags, as (name, add_argument's keywords)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, set_seed

    from trainkit.data.sft import CHATML

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--max_steps", type=int, default=16)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--lora_r", type=int, default=8)
    for name, keywords in more:
        parser.add_argument(name, **keywords)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.chat_template = CHATML
    data = Dataset.from_list([json.loads(line) for line in args.data.read_text().splitlines()])
    set_seed(0)
    lora = LoraConfig(r=args.lora_r, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    if not quantised:
        return args, tokenizer, data, get_peft_model(AutoModelForCausalLM.from_pretrained(
            args.model, dtype=torch.float32), lora)
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.uint8)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, quantization_config=config,
                                                device_map={"": "cuda" if torch.cuda.is_available() else "cpu"})
    return args, tokenizer, data, get_peft_model(prepare_model_for_kbit_training(
        base, use_gradient_checkpointing=False), lora)


class Record(TrainerCallback):
    def __init__(self, key: str = "loss") -> None:
        self.key = key
        self.ends: list[float] = []
        self.logs: list[dict] = []

    @property
    def losses(self) -> list[float]:
        return [log["loss"] for log in self.logs]

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and self.key in logs:
            self.logs.append(logs)
