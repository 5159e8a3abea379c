"""The Hugging Face `Trainer` on the tiny transformer: the peer that bench/throughput.py times trainkit against.

    python bench/peers/hf_trainer.py --report r.json                                   # one process
    torchrun --nproc_per_node 2 bench/peers/hf_trainer.py --strategy ddp --report r.json
    torchrun --nproc_per_node 2 bench/peers/hf_trainer.py --strategy deepspeed_zero2 --report r.json

The same model, blocks, micro-batch, AdamW (lr, weight decay, betas, eps), warm-up + cosine-to-10% schedule and
clipping as `train.py --recipe tiny_transformer`, fp32. DeepSpeed gets the same JSON as trainkit's YAMLs
(ds_configs/zero2.json, zero3.json): the Trainer fills its "auto" values from these arguments, as trainkit fills them
from the run. FSDP is asked for with the Trainer's own settings (`fsdp="full_shard"`, FSDP2). Logging, evaluation
and saving are off so the steps are the Trainer's training steps only.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
from accelerate import PartialState
from common import ROOT, StepClock, arguments, build_model, recipe_setup, what_ran, write_report
from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed

from trainkit.strategies.deepspeed_config import fill_bucket_sizes

DEEPSPEED_JSON = {"deepspeed_zero2": ROOT / "ds_configs" / "zero2.json",
                  "deepspeed_zero3": ROOT / "ds_configs" / "zero3.json"}


class Clock(TrainerCallback):
    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_step_end(self, args, state, control, **kwargs):  # after the optimizer step
        self.clock.tick()


def configured_state(deepspeed: bool) -> bool:
    """Whether the Trainer must take over a state configured here (TrainingArguments' accelerator_config
    use_configured_state): on a CPU the Trainer gives Accelerate no backend under DeepSpeed, so Accelerate counts one
    process while DeepSpeed forms a world of 2, and DeepSpeed's batch-size check fails. The Trainer's own way round
    it: a state configured beforehand with gloo (DeepSpeed's launch variable set, as `accelerate launch` sets it)."""
    configured = deepspeed and not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if configured:
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
    return configured


def language_model_batch(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Blocks are never padded: the labels are the inputs (the model shifts them), as in trainkit's recipe."""
    input_ids = torch.stack([row["input_ids"] for row in rows])
    return {"input_ids": input_ids, "labels": input_ids}


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--strategy", default="single",
                        choices=["single", "ddp", "deepspeed_zero2", "deepspeed_zero3", "fsdp"])
    args = parser.parse_args()
    recipe, cfg, train_set = recipe_setup(args)
    deepspeed = args.strategy in DEEPSPEED_JSON
    set_seed(cfg.seed)
    model = build_model(recipe, cfg)
    ds_config = None
    if deepspeed:
        # The Trainer fills "auto" batch sizes, accumulation, clipping, precision and ZeRO-3's bucket sizes itself, but
        # not allgather_bucket_size (it raises): that one, and the rest of the buckets, as trainkit's runner fills
        # them (trainkit/strategies/deepspeed_config.py), so both run the same DeepSpeed config.
        ds_config = json.loads(DEEPSPEED_JSON[args.strategy].read_text())
        fill_bucket_sizes(ds_config, model)
    configured = configured_state(deepspeed)
    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=cfg.batch_size, gradient_accumulation_steps=cfg.grad_accum,
            max_steps=cfg.max_steps, learning_rate=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=0.9,
            adam_beta2=0.999, adam_epsilon=1e-8, optim="adamw_torch_fused", warmup_steps=cfg.warmup_steps,
            lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": cfg.min_lr_ratio},
            max_grad_norm=cfg.max_grad_norm, seed=cfg.seed, dataloader_drop_last=True,
            # DeepSpeed must not get use_cpu (Accelerate would then train DDP): the Trainer's documented way.
            use_cpu=not deepspeed and not torch.cuda.is_available(),
            # gloo only with a world to join: in one process a backend makes Accelerate look for a process group.
            ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not deepspeed else None,
            deepspeed=ds_config,
            fsdp="full_shard" if args.strategy == "fsdp" else "",
            fsdp_config={"version": 2, "reshard_after_forward": True} if args.strategy == "fsdp" else None,
            accelerator_config={"use_configured_state": configured},
            report_to="none", save_strategy="no", eval_strategy="no", logging_strategy="no", disable_tqdm=True,
        )
        clock = StepClock()
        trainer = Trainer(model=model, args=training_args, train_dataset=train_set,
                          data_collator=language_model_batch, callbacks=[Clock(clock)])
        trainer.train()
        write_report(args.report, clock, what_ran(trainer.model_wrapped, trainer.accelerator),
                     trainer.accelerator.is_main_process)


if __name__ == "__main__":
    main()
