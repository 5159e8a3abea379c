"""Distil a large causal language model (the teacher) into a smaller one (the student): both any
AutoModelForCausalLM of one vocabulary, of the same architecture or not.

Trains: the student that --model_name_or_path names on --data as the causal_lm recipe reads it (this recipe is
causal_lm's Config and data: plain text, prompt/completion, chat messages, packing, --eval_data), its objective the
divergence of its next-token distributions from the teacher's (--teacher_model_name_or_path, frozen) at every
position it learns: the answers of instruction and chat data, every token of plain text. --beta picks the divergence
as TRL does (0 forward KL, 0.5 JSD, 1 reverse KL, TRL's default; trainkit/losses/distill.py has the formulas), at
--temperature; --sft_weight adds that times the cross entropy on the data's answers. The loss of a step is the mean
over every learned token of its global batch, whatever its split.
On-policy (GKD, Agarwal et al. 2024): with --lmbda, that share of the steps (drawn from the seed and the step, the
same on any number of processes) trains instead on the student's own completions of the data's prompts (the text
before each example's first learned token; trainkit/rl/sampling.py, each seeded by the run's seed, the step and the
prompt's tokens), up to --max_completion_length tokens, at --temperature.
Reports divergence and cross_entropy (token means), and on on-policy steps on_policy 1 and completions/mean_length;
rollouts.jsonl holds the student's completions.
Output: final/ holds the student only, as the causal_lm recipe exports it.

The teacher is held inside the model this recipe builds, beside the student, so every strategy holds it as it holds
the student: ZeRO-3 partitions it, FSDP2 shards it (its decoder layers are blocks too), the offload configs offload
it, --estimate and state_bytes count it. Offline, with --precompute_teacher_topk K, the run holds no teacher: before
the student is built, the teacher (whole on every process, in --model_dtype) computes its K likeliest tokens at every
position of both splits once, each process a share (trainkit/data/precompute.py; the tables take rows x seq_len x K
x 8 bytes of CPU memory per process and go into every checkpoint), and is freed; the divergence then compares the
student with those K and the rest's mass (trainkit/losses/distill.py: K the whole vocabulary gives the live teacher's
loss).
Both tokenizers must give the same ids (checked at plan time on the data's first records, naming the first
difference). Where one model pads its embeddings past the tokenizer (a Qwen2.5-7B's 152,064 against a 0.5B's
151,936), the logits are compared on the tokenizer's entries.

    python train.py --recipe distill --model_name_or_path runs/small/final --teacher_model_name_or_path runs/big/final
    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml train.py --recipe distill \\
        --model_name_or_path runs/small/final --teacher_model_name_or_path runs/chat/final --data data/chat.jsonl \\
        --chat_template chatml --beta 0.5 --lmbda 0.5
"""

from __future__ import annotations

import dataclasses
import functools
import random
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import causal_lm  # this recipe's data, evaluation answers and export are causal_lm's (recipes/causal_lm.py)
import torch
from torch import nn

from trainkit.data import sft
from trainkit.data.precompute import OwnModel
from trainkit.errors import Problem
from trainkit.losses import chunked_loss, router
from trainkit.losses import distill as distill_loss
from trainkit.models import finetune, pretrained
from trainkit.models.finetune import FineTuneConfig, tokenizer_of
from trainkit.recipes import Rollout
from trainkit.rl import sampling


@dataclass(kw_only=True, slots=True)
class Config(causal_lm.Config):  # the student's and the data's settings: recipes/causal_lm.py
    # The teacher: a local folder (from_pretrained's layout) or a Hub id, loaded as the student is (its dtype,
    # --allow_pickle, --trust_remote_code), frozen
    teacher_model_name_or_path: str = ""
    # The teacher's weights quantised to 4-bit NF4 by bitsandbytes, as QLoRA's base (--load_in_4bit): for a teacher
    # that fits the memory only so; its logits then are the 4-bit model's
    teacher_load_in_4bit: bool = False
    # The divergence (trainkit/losses/distill.py): beta 0 the forward KL, 0.5 the JSD, 1 the reverse KL (TRL's
    # default); both models' logits divided by temperature first
    beta: float = 1.0
    temperature: float = 1.0
    # Plus sft_weight x the cross entropy on the data's answers (off-policy steps: on-policy ones have none)
    sft_weight: float = 0.0
    # The share of steps trained on the student's own completions (GKD's lambda; 0: all on the data's answers)
    lmbda: float = 0.0
    max_completion_length: int = 64  # tokens the student generates per prompt on an on-policy step, at most
    # Offline: the teacher's K likeliest tokens per position computed once before the student is built, then no
    # teacher held (0: the teacher held and run at every step)
    precompute_teacher_topk: int = 0
    lr: float = 5e-5

    may_change_on_resume = causal_lm.Config.may_change_on_resume

    def check(self) -> list[Problem]:
        problems = causal_lm.Config.check(self) + distill_loss.problems(self.beta, self.temperature)
        if not self.teacher_model_name_or_path:
            problems.append(Problem("no teacher", "--teacher_model_name_or_path",
                                    "pass the folder (or Hub id) of the model to distil, e.g. runs/chat/final"))
        if not 0 <= self.lmbda <= 1 or self.sft_weight < 0:
            problems.append(Problem(f"lmbda must be in [0, 1] and sft_weight >= 0, got {self.lmbda} and "
                                    f"{self.sft_weight}", "--lmbda, --sft_weight", "use --lmbda 0 --sft_weight 0"))
        if self.lmbda and (self.packing or self.layout() == "text"):
            problems.append(Problem("--lmbda > 0 samples completions of the data's prompts: it needs instruction or "
                                    f"chat examples one per row ({'packed rows' if self.packing else 'plain text'} "
                                    "hold none)", "--lmbda", "pass --lmbda 0, or prompt/completion or messages data "
                                                             "without --packing"))
        if self.lmbda and not 0 < self.max_completion_length < self.seq_len:
            problems.append(Problem(f"max_completion_length must be between 1 and seq_len - 1, got "
                                    f"{self.max_completion_length} with seq_len {self.seq_len}",
                                    "--max_completion_length", f"pass --max_completion_length below {self.seq_len}"))
        if self.precompute_teacher_topk < 0:
            problems.append(Problem(f"precompute_teacher_topk must be >= 0, got {self.precompute_teacher_topk}",
                                    "--precompute_teacher_topk", "pass a K > 0 (the teacher's K likeliest tokens per "
                                    "position, computed once), or 0 to hold the teacher and run it at every step"))
        elif self.precompute_teacher_topk and self.lmbda:
            problems.append(Problem(f"--precompute_teacher_topk {self.precompute_teacher_topk} with --lmbda "
                                    f"{self.lmbda}: the teacher's tables cover the data's tokens, not the completions "
                                    "the student will sample", "--precompute_teacher_topk",
                                    "pass a K > 0 with --lmbda 0, or --precompute_teacher_topk 0 (the teacher held)"))
        if self.teacher_model_name_or_path:
            problems += pretrained.weights_problems(self.teacher_model_name_or_path, self.allow_pickle,
                                                    "--teacher_model_name_or_path")
        if not problems:
            problems += vocabulary_problems(self.model_name_or_path, self.teacher_model_name_or_path, self.tokenizer,
                                            self.trust_remote_code, self.data)
        if not problems and self.precompute_teacher_topk > (vocab := vocab_of(self)):
            problems.append(Problem(f"--precompute_teacher_topk {self.precompute_teacher_topk} is more than the "
                                    f"{vocab} tokens the models share", "--precompute_teacher_topk",
                                    f"pass --precompute_teacher_topk {vocab} for the whole distribution, or fewer"))
        return problems


def teacher_config(cfg: Config) -> FineTuneConfig:
    """The teacher's model settings: the student's, but its own folder, whole (or in 4 bits), frozen."""
    shared = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(FineTuneConfig)}
    teacher = FineTuneConfig(**{**shared, "model_name_or_path": cfg.teacher_model_name_or_path, "lora_r": 0,
                                "trainable": "", "gradient_checkpointing": False, "load_in_4bit": False})
    teacher.load_in_4bit = cfg.teacher_load_in_4bit  # after the checks: a frozen 4-bit model without adapters
    return teacher


CHECKED_RECORDS = 64  # the data's first records that both tokenizers encode at plan time


@functools.cache  # the settings are made more than once per run; the tokenizers are compared once
def vocabulary_problems(student_folder: str, teacher_folder: str, tokenizer: str, trust_remote_code: bool,
                        data: str) -> list[Problem]:
    """The student's and the teacher's tokenizers: the same token for every id, and the same ids for the text of the
    data's first records (a teacher whose logits mean other tokens would teach nonsense without an error)."""
    cfg = FineTuneConfig(model_name_or_path=student_folder, tokenizer=tokenizer, trust_remote_code=trust_remote_code)
    student = tokenizer_of(cfg)
    with pretrained.named("--teacher_model_name_or_path"):
        teacher = tokenizer_of(dataclasses.replace(cfg, model_name_or_path=teacher_folder))
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    fix = "distil from a teacher of the student's tokenizer (the same family), or train the student's tokenizer's " \
          "model as the teacher"
    if mine != theirs:
        first = min(set(mine.items()) ^ set(theirs.items()), key=lambda item: item[1])
        token = first[0]
        return [Problem(f"the teacher's tokenizer differs from the student's: {token!r} is id {mine.get(token)} to "
                        f"the student and {theirs.get(token)} to the teacher ({len(mine)} and {len(theirs)} tokens)",
                        "--teacher_model_name_or_path", fix)]
    for i, text in enumerate(_first_texts(data)):
        a, b = (t(text, add_special_tokens=False)["input_ids"] for t in (student, teacher))
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            return [Problem(f"the two tokenizers encode record {i} of {data} differently from token {at} on "
                            f"(student {a[at:at + 4]}, teacher {b[at:at + 4]}): their normalisers or pre-tokenisers "
                            "differ", "--teacher_model_name_or_path", fix)]
    with pretrained.named("--teacher_model_name_or_path"):
        sizes = logit_entries(cfg, dataclasses.replace(cfg, model_name_or_path=teacher_folder))
    if min(sizes) < len(student):
        return [Problem(f"the models' logits have {sizes[0]} (student) and {sizes[1]} (teacher) entries, fewer than "
                        f"the tokenizer's {len(student)} tokens", "--teacher_model_name_or_path", fix)]
    return []


def _first_texts(data: str) -> list[str]:
    """The text of --data's first CHECKED_RECORDS records (local files of any format the data is read from): every
    string in a JSON record or a CSV row (prompts, answers, chat turns), a plain-text file's lines."""
    import csv

    from trainkit.data import sft, text

    found: list[str] = []

    def strings(value: Any) -> list[str]:
        if isinstance(value, str):
            return [value]
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
        return [s for item in items for s in strings(item)]

    for path in text.local_files(data) or []:
        kind = text.LOCAL_FORMATS.get(path.suffix)
        if not path.is_file() or kind is None:
            continue
        with open(path, encoding="utf-8", errors="replace", newline="" if kind == "csv" else None) as f:
            records = (record for _, record in sft.json_records(path, text.CHECKED_BYTES)) if kind == "json" else \
                csv.DictReader(f) if kind == "csv" else f
            for record in records:
                found.append(" ".join(strings(record)))
                if len(found) >= CHECKED_RECORDS:
                    return found
    return found


class Distillation(nn.Module):
    """The model this recipe trains: the student and its frozen teacher. Its forward takes a micro-batch of rows and
    returns the loss and the metrics' sums, so that the strategy's wrapper runs the whole objective and holds the
    teacher as it holds the student (ZeRO-3's and FSDP2's gathers)."""

    def __init__(self, student: nn.Module, teacher: nn.Module | None, cfg: Config) -> None:
        super().__init__()
        self.student, self.teacher = student, teacher  # teacher None: its top K come with the batch
        self.beta, self.temperature, self.sft_weight = cfg.beta, cfg.temperature, cfg.sft_weight
        self.vocab = vocab_of(cfg)
        # both models' logits live in a chunk: each gets half of --loss_chunk_mib
        self.chunk = chunked_loss.chunk_tokens(cfg.loss_chunk_mib / 2, self.vocab)
        self.config = student.config  # what the runner reads of a transformers model (sizes, FLOPs)
        # FSDP2's blocks: both models' decoder layers
        self._no_split_modules = list(dict.fromkeys([*(getattr(student, "_no_split_modules", None) or []),
                                                     *(getattr(teacher, "_no_split_modules", None) or [])]))

    def train(self, mode: bool = True) -> Distillation:
        super().train(mode)
        if self.teacher is not None:
            self.teacher.eval()  # it never trains: no dropout in its pass
        return self

    def forward(self, mode: str = "loss", generated: torch.Tensor | None = None,
                teacher_topk_logps: torch.Tensor | None = None, teacher_topk_ids: torch.Tensor | None = None,
                teacher_rest_logp: torch.Tensor | None = None, **batch: Any) -> Any:
        """mode "loss": the micro-batch's mean over its learned tokens and the metrics' sums; "generate": the
        student's output (sampling). `generated` marks the rows the student wrote (on-policy): no cross entropy.
        teacher_topk_*: the teacher's top K at every position (--precompute_teacher_topk), in place of the teacher."""
        if mode == "generate":
            return self.student(**batch, **router.generating(self.student))
        learned = causal_lm.learned_positions(batch)
        if self.teacher is None:
            teacher, teacher_inputs = distill_loss.TopK(teacher_topk_logps, teacher_topk_ids, teacher_rest_logp), {}
        else:
            teacher, teacher_inputs = self.teacher, causal_lm.model_inputs(self.teacher, batch)
        found = distill_loss.learned_divergences(self.student, teacher, causal_lm.model_inputs(self.student, batch),
                                                 teacher_inputs, learned, self.beta, self.temperature, self.chunk,
                                                 self.vocab)
        tokens = learned.sum().float()
        divergence, cross_entropy = found.divergence.sum(), found.cross_entropy.sum()
        total = divergence + (self.sft_weight * cross_entropy if self.sft_weight and generated is None else 0.0)
        mean = total / tokens.clamp(min=1)
        sums = {"divergence per _tokens": divergence.detach(), "cross_entropy per _tokens": cross_entropy.detach(),
                "_tokens": tokens}
        if found.aux_loss is None:
            return mean, sums
        # a mixture of experts' router balance: each row's weighed as its learned tokens (trainkit/losses/router.py)
        objective, reported = router.with_router_loss(self.student, mean, found.aux_loss, found.router_logits,
                                                      batch.get("attention_mask"), learned.sum(dim=1).float())
        return objective, {**sums, **reported}


def logit_entries(*models: FineTuneConfig) -> list[int]:
    """Each model's logits' entries (its config's vocab_size)."""
    from transformers import AutoConfig

    return [pretrained.text_config(pretrained.load("model's config", c, AutoConfig.from_pretrained)).vocab_size
            for c in models]


@functools.cache  # the model is made more than once per run (sized at plan time, then built): its configs read once
def compared_vocab(student_folder: str, teacher_folder: str, tokenizer: str, trust_remote_code: bool) -> int:
    """The logits' entries compared: both models', or the tokenizer's where they pad their embeddings differently
    (vocabulary_problems checked that they cover it)."""
    cfg = FineTuneConfig(model_name_or_path=student_folder, tokenizer=tokenizer, trust_remote_code=trust_remote_code)
    student, teacher = logit_entries(cfg, dataclasses.replace(cfg, model_name_or_path=teacher_folder))
    return len(tokenizer_of(cfg)) if student != teacher else student


def vocab_of(cfg: Config) -> int:
    return compared_vocab(cfg.model_name_or_path, cfg.teacher_model_name_or_path, cfg.tokenizer, cfg.trust_remote_code)


def build_teacher(cfg: Config) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with pretrained.named("--teacher_model_name_or_path"):
        return finetune.build(teacher_config(cfg), AutoModelForCausalLM).requires_grad_(False)


def build_model(cfg: Config) -> nn.Module:
    return Distillation(causal_lm.build_model(cfg), None if cfg.precompute_teacher_topk else build_teacher(cfg), cfg)


def precompute(cfg: Config) -> OwnModel | None:
    """--precompute_teacher_topk: the teacher's top K at every position of every row, before the student exists."""
    if not cfg.precompute_teacher_topk:
        return None
    vocab = vocab_of(cfg)

    def topk(teacher: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
        logits = teacher(**causal_lm.model_inputs(teacher, batch)).logits[:, :-1, :vocab]
        found = distill_loss.teacher_topk(logits, cfg.precompute_teacher_topk, cfg.temperature)
        return {"teacher_topk_logps": found.logps, "teacher_topk_ids": found.ids, "teacher_rest_logp": found.rest}

    return OwnModel(functools.partial(build_teacher, cfg), topk)


# The causal_lm recipe's rows, their --dry_run preview, its summary line's padding share, its tokens per sample
build_datasets, preview, summary, tokens_per_sample = (causal_lm.build_datasets, causal_lm.preview, causal_lm.summary,
                                                       causal_lm.tokens_per_sample)


def loss(model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return model(**batch)


def loss_weight(cfg: Config, batch: dict) -> float:
    """The tokens the micro-batch's mean is over: its learned ones."""
    return float(causal_lm.learned_positions(batch).sum())


def generate(model: Distillation, cfg: Config, eval_set) -> list[dict[str, str]]:
    """The student's answers to the first --eval_answers held-out prompts (causal_lm's)."""
    return causal_lm.generate(model.student, cfg, eval_set)


def on_policy(lmbda: float, seed: int, step: int) -> bool:
    """Whether step `step` trains on the student's own completions: a draw from (seed, step), the same on every
    rank and world size."""
    return bool(lmbda) and random.Random(seed * 1_000_003 + step).random() < lmbda


def rollout(model: Distillation, cfg: Config, step: int, micro_batches: list[dict]) -> Rollout | None:
    """On an on-policy step (on_policy), each row's prompt (its tokens before the first learned one) completed by
    the student, the completion's tokens then learned; None on the others (the data's answers)."""
    if not on_policy(cfg.lmbda, cfg.seed, step):
        return None
    tokenizer, device = tokenizer_of(cfg), next(model.parameters()).device
    vocab = tokenizer.get_vocab()
    stop = {tokenizer.eos_token_id, *(vocab[end] for end in sft.TURN_ENDS if end in vocab)} - {None}
    pad = sft.pad_id(tokenizer)
    how = sampling.Sampling(cfg.max_completion_length, cfg.temperature, stop=tuple(sorted(stop)), pad=pad)
    width = cfg.seq_len - cfg.max_completion_length  # the longest prompt kept: its last tokens
    made_batches, rows = [], []
    for batch in micro_batches:
        starts = causal_lm.learned_positions(batch).int().argmax(dim=1) + 1  # each row's first learned token
        kept = starts.clamp(max=width)
        prompts = torch.full((len(starts), width), pad, dtype=torch.long)
        for r, (start, n) in enumerate(zip(starts.tolist(), kept.tolist(), strict=True)):
            prompts[r, :n] = batch["input_ids"][r, start - n:start]
        seeds = [sampling.slot_seed(cfg.seed, step, zlib.crc32(str(p[:n].tolist()).encode()), 0)
                 for p, n in zip(prompts, kept.tolist(), strict=True)]
        made = sampling.sample(lambda **kw: model(mode="generate", **kw), prompts.to(device), kept.to(device), seeds,
                               how, sampling.processes() > 1)
        ids, attention = sampling.left_padded(prompts.to(device), kept.to(device), pad)
        input_ids, mask = torch.cat([ids, made.ids], 1), torch.cat([attention, made.mask], 1)
        labels = torch.where(torch.cat([torch.zeros_like(attention), made.mask], 1).bool(), input_ids, sft.IGNORE)
        made_batches.append({"input_ids": input_ids.cpu(), "attention_mask": mask.cpu(), "labels": labels.cpu(),
                             "position_ids": sampling.positions(mask).cpu(), "generated": torch.ones(len(starts))})
        rows += [{"prompt": tokenizer.decode(p[:n]), "completion": tokenizer.decode(c[m.bool()])}
                 for p, n, c, m in zip(prompts, kept.tolist(), made.ids.cpu(), made.mask.cpu(), strict=True)]
    # the global batch's mean completion length, the same number on any number of processes
    total = torch.tensor([float(sum(b["generated"].numel() for b in made_batches)),
                          float(sum(int(b["labels"].ne(sft.IGNORE).sum()) for b in made_batches))], device=device)
    if sampling.processes() > 1:
        import torch.distributed as dist

        dist.all_reduce(total)
    return Rollout(made_batches, {"on_policy": 1.0, "completions/mean_length": (total[1] / total[0]).item()}, rows)


def check_strategy(cfg: Config, strategy: Any) -> list[Problem]:
    """Both models whole on every rank's side of the data: the teacher of another architecture has no plan of its
    own to cut it by, and on-policy sampling runs the whole student."""
    if strategy.splits_model or strategy.sequence_parallel_size > 1:
        return [Problem(f"the distill recipe runs the student and a teacher (of any architecture) whole on each "
                        f"rank's data; {strategy.label} cuts the model or its sequences between ranks", "the config",
                        "train under ddp.yaml, a deepspeed_zero*.yaml or fsdp.yaml (any data-parallel config)")]
    return []


def export(model: Distillation, state_dict: dict, cfg: Config, cache_dir: Path, out_dir: Path) -> None:
    """final/: the student as the causal_lm recipe exports it, without the teacher."""
    student = {key.removeprefix("student."): value for key, value in state_dict.items()
               if key.startswith("student.")}
    causal_lm.export(model.student, student, cfg, cache_dir, out_dir)
