"""The Hugging Face `Trainer` under Accelerate's own sequence parallelism (DeepSpeed's Ulysses, ALST): the peer that
bench/sequence_parallel.py sets beside trainkit's deepspeed_zero3_sp.yaml.

    torchrun --nproc_per_node 2 bench/peers/trainer_sp.py --model FOLDER --seq_len 8192 --data D \
        --report r.json

What trainkit's deepspeed_zero3_sp.yaml selects, given as the Trainer's own arguments: Accelerate's
ParallelismConfig(sp_size=2, sp_backend="deepspeed") and ds_configs/zero3.json (whose "auto" values the Trainer
fills; its buckets as trainkit fills them). `accelerate launch` with that YAML stops in Accelerate before the Trainer
starts: a YAML's mixed_precision beside a deepspeed_config_file is refused there ("the following accelerate config
variables will be ignored"), which trainkit's runner handles. The same model folder, the same token blocks (the
causal-LM recipe's split of the default corpus), one block per micro-batch, AdamW at a constant learning rate, fp32.
Each row carries its position_ids (DeepSpeed's adapter requires them). The Trainer feeds each rank's shard through
Accelerate's data-loader adapter and averages the shards' losses by their tokens (transformers'
deepspeed_sp_compute_loss). The report: the wall-clock time at the end of every optimizer step and each rank's peak
resident memory (the same measure as train.py's peak_mem_bytes on a CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
from pathlib import Path

import torch
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import DeepSpeedSequenceParallelConfig
from common import ROOT, StepClock, what_ran, write_report
from hf_trainer import Clock, configured_state
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, set_seed

from trainkit.recipes import load_recipe
from trainkit.strategies.deepspeed_config import fill_bucket_sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--seq_len", type=int, required=True)
    parser.add_argument("--data", required=True, help="the causal-LM recipe's --data")
    parser.add_argument("--max_steps", type=int, default=6)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--cache_dir", type=Path, default=Path(os.environ.get(
        "TRAINKIT_CACHE", Path.home() / ".cache" / "trainkit")), help="train.py's tokenised-data cache")
    args = parser.parse_args()
    recipe = load_recipe("causal_lm")
    cfg = recipe.Config(model_name_or_path=str(args.model), tokenizer="saved", seq_len=args.seq_len,
                        data=args.data)
    blocks, _ = recipe.make_datasets(cfg, args.cache_dir)
    positions = torch.arange(args.seq_len)
    rows = [{"input_ids": blocks[i]["input_ids"], "labels": blocks[i]["input_ids"], "position_ids": positions}
            for i in range(len(blocks))]
    set_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa", dtype=torch.float32)
    model.config.use_cache = False
    ds_config = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
    fill_bucket_sizes(ds_config, model)
    configured = configured_state(deepspeed=True)
    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        targs = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=1, max_steps=args.max_steps, learning_rate=cfg.lr,
            lr_scheduler_type="constant", weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
            report_to=[], logging_strategy="no", save_strategy="no", eval_strategy="no", seed=cfg.seed,
            dataloader_drop_last=True, disable_tqdm=True, deepspeed=ds_config,
            accelerator_config={"use_configured_state": configured},
            parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed", sp_handler=(
                DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa"))))
        trainer = Trainer(model=model, args=targs, train_dataset=rows, callbacks=[Clock(clock)],
                          data_collator=lambda batch: {k: torch.stack([r[k] for r in batch]) for k in batch[0]})
        trainer.train()
        peak = torch.tensor(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        peaks = trainer.accelerator.gather(peak.reshape(1)).tolist()
        pc = trainer.accelerator.parallelism_config
        ran = {**what_ran(trainer.model_wrapped, trainer.accelerator),
               "sp_size": pc.sp_size if pc is not None else 1, "peak_rss_bytes": peaks}
        write_report(args.report, clock, ran, trainer.accelerator.is_main_process)


if __name__ == "__main__":
    main()
