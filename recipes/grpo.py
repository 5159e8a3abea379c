"""Improve a causal language model (any AutoModelForCausalLM) by online RL on its own completions: GRPO and its
family, with rewards you write as Python functions.

Trains: the model that --model_name_or_path names (a causal_lm run's final/, or a Hub id) on --data's prompts (TRL's
layouts, trainkit/data/prompts.py: `prompt` a string or a list of chat messages; every other field goes to the reward
functions by name; --streaming and mixtures as in the causal_lm recipe). Each step, every prompt of the global
batch gets --num_generations completions from the model as it is (trainkit/rl/sampling.py: each from a generator
seeded by the run's seed, the step, the prompt and its number, so the same on any number of processes), the reward
functions score them (--reward_funcs module.function[,...] with --reward_weights: trainkit/rl/rewards.py;
recipes/rewards/chat.py holds the chat walk-through's), each completion's advantage is its reward against its
prompt's other completions, and the loss is the clipped policy gradient (--loss_type grpo|dr_grpo|dapo|bnpo, TRL's
default dapo) with --beta times the KL to the model as it started (trainkit/losses/grpo.py has every formula and its
paper). The global batch counts completions: batch_size x
grad_accum x processes, a multiple of --num_generations.
Reports TRL's metrics: reward, reward_std, rewards/<function>/mean and /std, frac_reward_zero_std, completions/
mean_length, /min_length, /max_length, /clipped_ratio, kl (beta > 0), entropy, clip_ratio/low_mean, /high_mean,
/region_mean; generation_s and rollout_s (the time of the step's sampling, and of sampling + scoring) beside the
step's own. rollouts.jsonl holds every completion: step, prompt, completion, each function's reward, the advantage,
the tokens learned.
At evaluation each held-out prompt gets one greedy completion: eval_reward, eval_rewards/<function>/mean (eval_loss
is minus the weighted reward, so that lower is better there too).
Output: final/ loads with AutoModelForCausalLM.from_pretrained, as the causal_lm recipe exports it.

Why the loss reads near 0: on the step that sampled them the completions' probability ratio is 1, and the group
advantages of a prompt sum to 0, so the policy term's value is 0 (dapo: nearly) while its gradient is not. The reward
is what rises.

The reference model (--beta > 0) is the model as it starts: under LoRA the same weights with the adapters off, else a
frozen copy inside the model this recipe builds, held as the policy is held (ZeRO-3 partitions it, FSDP2 shards it,
offload offloads it; --estimate counts it). With --beta 0 (TRL's default) there is none.

    python train.py --recipe grpo --model_name_or_path runs/sft/final --data prompts.jsonl \\
        --reward_funcs rewards.chat.arithmetic,rewards.chat.one_line --num_generations 8 --lora_r 16
"""

from __future__ import annotations

import functools
import json
import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainkit.data import prompts, sft, text
from trainkit.data.prompts import PromptsConfig
from trainkit.data.stream import Streamed
from trainkit.errors import ConfigError, Problem, TrainingError
from trainkit.losses import chunked_loss, grpo, router
from trainkit.models import finetune, pretrained
from trainkit.models.finetune import tokenizer_of
from trainkit.recipes import Rollout
from trainkit.rl import rewards, sampling


@dataclass(kw_only=True, slots=True)
class Config(PromptsConfig):  # settings: trainkit/models/finetune.py (model), trainkit/data/prompts.py (prompts)
    # Rewards: comma-separated module.function (TRL's signature, trainkit/rl/rewards.py), and/or reward_model (the
    # reward recipe's final/: AutoModelForSequenceClassification with one output, frozen, held as the reference is),
    # each weighed by reward_weights (comma-separated, the functions' then the model's; empty: 1 each)
    reward_funcs: str = ""
    reward_model: str = ""
    reward_weights: str = ""
    # Sampling: the logits divided by temperature, then the top_k likeliest (0: all) and the smallest set holding
    # top_p of the probability
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # The objective (trainkit/losses/grpo.py): loss_type grpo, dr_grpo, dapo or bnpo; advantage group (GRPO's mean
    # baseline) or rloo (leave-one-out); scale_rewards group, batch or none (what the advantages are divided by the
    # std of); beta: the weight of the KL to the reference (0: no reference held); epsilon, epsilon_high (0: epsilon):
    # the clip range of the probability ratio; importance_sampling_level token or sequence (GSPO); num_iterations:
    # steps trained on each batch of completions; mask_truncated_completions: no loss on a completion that ran out
    # of max_completion_length
    loss_type: str = "dapo"
    advantage: str = "group"
    scale_rewards: str = "group"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float = 0.0
    importance_sampling_level: str = "token"
    num_iterations: int = 1
    mask_truncated_completions: bool = False
    # The log-probabilities from at most this many MiB of logits (fp32) at a time (trainkit/losses/chunked_loss.py)
    loss_chunk_mib: float = chunked_loss.CHUNK_MIB
    lr: float = 1e-6
    batch_size: int = 8  # completions per micro-batch

    may_change_on_resume = PromptsConfig.may_change_on_resume | {"loss_chunk_mib"}

    def check(self) -> list[Problem]:
        problems = PromptsConfig.check(self) + chunked_loss.problems(self.loss_chunk_mib)
        problems += grpo.problems(self.loss_type, self.scale_rewards, self.advantage, self.importance_sampling_level,
                                  self.beta, self.epsilon, self.epsilon_high or None, self.num_generations)
        if not (self.reward_funcs or self.reward_model):
            problems.append(Problem("no reward functions and no reward model", "--reward_funcs",
                                    "pass --reward_funcs module.function (recipes/rewards/chat.py: "
                                    "rewards.chat.arithmetic), or --reward_model with a reward run's final/"))
        if not self.temperature > 0:
            problems.append(Problem(f"temperature must be > 0, got {self.temperature}", "--temperature",
                                    "use --temperature 1.0"))
        if not 0 < self.top_p <= 1:
            problems.append(Problem(f"top_p must be in (0, 1], got {self.top_p}", "--top_p", "use --top_p 1.0"))
        if self.top_k < 0 or self.num_iterations < 1:
            problems.append(Problem(f"top_k must be >= 0 and num_iterations >= 1, got {self.top_k} and "
                                    f"{self.num_iterations}", "--top_k, --num_iterations",
                                    "use --top_k 0 --num_iterations 1"))
        if not problems:  # every function importable and callable with the columns, and as many weights
            found = rewards.load(self.reward_funcs, REWARD_FOLDERS)
            rewards.weights(self.reward_weights, reward_names(self, found))
            if (fields := text.first_fields(self.data)) is not None:  # the reward functions get the rest by name
                problems += rewards.signature_problems(found, [f for f in fields if f != "prompt"])
            if self.reward_model:
                problems += pretrained.weights_problems(self.reward_model, self.allow_pickle, "--reward_model") or \
                    pretrained.scorer_problems(self.reward_model, "--reward_model")
        return problems


REWARD_FOLDERS = (Path.cwd(), Path(__file__).resolve().parent)  # where --reward_funcs' modules are imported from
REWARD_MODEL = "reward_model"  # the reward model's name in the metrics: rewards/reward_model/mean


def reward_names(cfg: Config, functions: list[rewards.Reward]) -> list[str]:
    return [r.name for r in functions] + ([REWARD_MODEL] if cfg.reward_model else [])


def check_strategy(cfg: Config, strategy: Any) -> list[Problem]:
    """The global batch holds whole groups; the completions are sampled by the whole model on every rank."""
    problems = []
    completions = cfg.batch_size * cfg.grad_accum * strategy.data_parallel_size
    if completions % cfg.num_generations:
        fit = max(1, cfg.num_generations // (cfg.grad_accum * strategy.data_parallel_size))
        problems.append(Problem(
            f"the global batch holds {completions} completions (batch_size {cfg.batch_size} x grad_accum "
            f"{cfg.grad_accum} x {strategy.data_parallel_size} data-parallel processes), not a multiple of "
            f"--num_generations {cfg.num_generations}: a prompt's completions must be compared within one step",
            "--batch_size", f"pass --batch_size {fit} (or a multiple of it), or --num_generations dividing "
                            f"{completions}"))
    if strategy.splits_model or strategy.sequence_parallel_size > 1:
        problems.append(Problem(
            f"the grpo recipe samples its completions with the whole model on every rank; {strategy.label} cuts the "
            "model or its sequences between ranks, where a token-by-token generation is not wired",
            "the config", "train under ddp.yaml, a deepspeed_zero*.yaml or fsdp.yaml (any data-parallel config)"))
    return problems


class GRPOModel(nn.Module):
    """The model this recipe trains: the policy, its reference (a frozen copy, or the policy with its LoRA adapters
    off, or none at beta 0) and the objective. Every use goes through its forward (mode), so that the strategy's
    wrapper sees each one: FSDP2 gathers the root's parameters there, ZeRO-3 every layer's."""

    def __init__(self, policy: nn.Module, reference: nn.Module | None, scorer: nn.Module | None, cfg: Config) -> None:
        super().__init__()
        self.policy, self.reference, self.scorer, self.lora = policy, reference, scorer, bool(cfg.lora_r)
        self.objective = grpo.Objective(cfg.loss_type, cfg.beta, cfg.epsilon, cfg.epsilon_high or cfg.epsilon,
                                        cfg.importance_sampling_level, cfg.max_completion_length)
        self.temperature, self.settings = cfg.temperature, cfg  # settings: what evaluation samples and scores with
        self.config = policy.config  # what the runner reads of a transformers model (sizes, FLOPs)
        self._no_split_modules = getattr(policy, "_no_split_modules", None)  # FSDP2's blocks: the decoder layers

    def train(self, mode: bool = True) -> GRPOModel:
        super().train(mode)
        for frozen in (self.reference, self.scorer):  # they never train: no dropout in their passes
            if frozen is not None:
                frozen.eval()
        return self

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                completion_mask: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
                ref_logps: torch.Tensor | None = None, old_logps: torch.Tensor | None = None, mode: str = "loss",
                **generating: Any) -> Any:
        """mode "loss": the micro-batch's loss and its reported sums; "generate": the policy's output (sampling,
        with **generating); "reference" / "policy": that model's log-probabilities of the completion tokens;
        "score": the reward model's score of each row (its own tokens)."""
        if mode == "generate":
            return self.policy(input_ids=input_ids, attention_mask=attention_mask, **generating,
                               **router.generating(self.policy))
        if mode == "score":
            return self.scorer(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, 0]
        width = completion_mask.shape[1]
        if mode in ("reference", "policy"):
            model = self.reference if mode == "reference" and self.reference is not None else self.policy
            adapters_off = self.policy.disable_adapter() if mode == "reference" and self.reference is None \
                and self.lora else nullcontext()
            with adapters_off:
                return -self._logps(model, input_ids, attention_mask, width).losses[:, -width:]
        out = self._logps(self.policy, input_ids, attention_mask, width, entropy=True)
        logps, entropy = -out.losses[:, -width:], out.entropy[:, -width:]
        result = grpo.token_loss(self.objective, logps, old_logps, ref_logps, advantages, completion_mask, entropy)
        sums = {f"{name}{COMPLETION_TOKENS}": value for name, value in result.sums.items()}
        sums["completion_tokens"] = completion_mask.sum().float()
        if out.aux_loss is None:
            return result.loss, sums
        objective, reported = router.with_router_loss(self.policy, result.loss, out.aux_loss, out.router_logits,
                                                      attention_mask,
                                                      grpo.row_units(self.objective.loss_type, completion_mask))
        return objective, {**sums, **reported}

    def _logps(self, model: nn.Module, ids: torch.Tensor, attention: torch.Tensor, width: int,
               entropy: bool = False) -> chunked_loss.TokenLosses:
        """The next-token losses at the sampling temperature (minus the log-probabilities), each token's entropy
        (asked for), the model's auxiliary loss and router logits: the completions are the last `width` tokens."""
        return chunked_loss.next_token_losses(model, input_ids=ids, attention_mask=attention,
                                              position_ids=sampling.positions(attention), use_cache=False,
                                              temperature=self.temperature, entropy=entropy)


COMPLETION_TOKENS = " per completion_tokens"  # a token-weighted mean (trainkit/run/metrics.py's reported_means)


def build_model(cfg: Config) -> nn.Module:
    from transformers import AutoModelForCausalLM

    def causal_lm() -> nn.Module:
        return chunked_loss.configure(finetune.build(cfg, AutoModelForCausalLM), cfg.loss_chunk_mib)

    policy = causal_lm()
    reference = causal_lm().requires_grad_(False) if cfg.beta and not cfg.lora_r else None
    return GRPOModel(policy, reference, build_scorer(cfg) if cfg.reward_model else None, cfg)


def build_scorer(cfg: Config) -> nn.Module:
    """--reward_model, frozen, as the reward recipe exported it (one output; its pooling finds each row's end by the
    pad token its rows are padded with)."""
    import dataclasses

    from transformers import AutoModelForSequenceClassification

    own = dataclasses.replace(cfg, model_name_or_path=cfg.reward_model, lora_r=0, trainable="",
                              gradient_checkpointing=False)
    with pretrained.named("--reward_model"):
        scorer = finetune.build(own, AutoModelForSequenceClassification, num_labels=1).requires_grad_(False)
        if scorer.config.pad_token_id is None:
            scorer.config.pad_token_id = sft.pad_id(tokenizer_of(own))
    return scorer


def build_datasets(cfg: Config, cache_dir: Path):
    """(train, held-out): the training prompts as completion slots (num_generations each, num_iterations steps on
    each global batch), the held-out prompts as they are (one greedy completion each at evaluation)."""
    train, held_out = prompts.prompt_datasets(cfg, cache_dir)
    if isinstance(train, Streamed):  # read as the run trains: a prompt per lane, filling its group's slots
        return train.grouped(cfg.num_generations, cfg.num_iterations), held_out
    return prompts.Slots(train, cfg.num_generations, cfg.num_iterations), held_out


@dataclass
class Scoring:
    """What the run reuses at every step: the tokenizer, how to sample, the reward functions and their weights."""

    tokenizer: Any
    how: sampling.Sampling
    rewards: list[rewards.Reward]
    weights: torch.Tensor
    names: list[str]  # every reward's, in the order of weights: the functions', then the reward model's
    scorer_tokenizer: Any  # the reward model's (None without one)

    def ended(self, ids: list[int]) -> bool:
        """Whether a completion's tokens end with an end of turn that the tokenizer spells in several tokens (a
        chat template's <|im_end|> on a tokenizer that has no such token)."""
        tail = self.tokenizer.decode(ids[-self.tail:])
        return any(end in tail for end in sft.TURN_ENDS)

    @functools.cached_property
    def tail(self) -> int:
        """The tokens to decode to find an end of turn: the longest one's, and one more for a merge before it."""
        return 1 + max(len(self.tokenizer(end, add_special_tokens=False)["input_ids"]) for end in sft.TURN_ENDS)

    def text(self, ids: torch.Tensor, mask: torch.Tensor) -> str:
        """A completion as the reward functions read it: its tokens without special tokens and its end of turn
        (TRL's decode, where the chat template's end of turn is a special token)."""
        text = self.tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
        for end in sft.TURN_ENDS:
            text = text.split(end)[0]
        return text


_scorings: dict[tuple, Scoring] = {}  # one per run's settings: the tokenizer and the functions loaded once


def _scoring(cfg: Config) -> Scoring:
    key = tuple(getattr(cfg, name) for name in ("model_name_or_path", "tokenizer", "trust_remote_code",
                                                 "max_completion_length", "temperature", "top_p", "top_k",
                                                 "reward_funcs", "reward_model", "reward_weights", "chat_template"))
    if key not in _scorings:
        tokenizer = tokenizer_of(cfg)
        vocab = tokenizer.get_vocab()
        stop = {tokenizer.eos_token_id, *(vocab[end] for end in sft.TURN_ENDS if end in vocab)} - {None}
        how = sampling.Sampling(cfg.max_completion_length, cfg.temperature, cfg.top_p, cfg.top_k,
                                tuple(sorted(stop)), sft.pad_id(tokenizer))
        found = rewards.load(cfg.reward_funcs, REWARD_FOLDERS)
        names = reward_names(cfg, found)
        scorer_tokenizer = None
        if cfg.reward_model:
            import dataclasses

            with pretrained.named("--reward_model"):
                scorer_tokenizer = tokenizer_of(dataclasses.replace(cfg, model_name_or_path=cfg.reward_model))
            scorer_tokenizer.chat_template = sft.chat_template(scorer_tokenizer, cfg.chat_template)
            scorer_tokenizer.pad_token_id, scorer_tokenizer.padding_side = sft.pad_id(scorer_tokenizer), "right"
        _scorings[key] = Scoring(tokenizer, how, found, torch.tensor(rewards.weights(cfg.reward_weights, names)),
                                 names, scorer_tokenizer)
    return _scorings[key]


# The names a reward function's log_metric and log_extra must not take (those ending in / or _: any name they begin):
# the runner's and this recipe's own in metrics.jsonl, and rollouts.jsonl's own fields
OWN_METRICS = ("step", "loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "data_wait_s", "checkpoint_s", "mfu",
               "state_bytes", "peak_mem_bytes", "skipped_steps", "elapsed_s", "rollout_s", "generation_s", "reward",
               "reward_std", "frac_reward_zero_std", "kl", "entropy", "rewards/", "completions/", "clip_ratio/",
               "eval_")
OWN_COLUMNS = ("step", "prompt", "completion", "generation", "advantage", "tokens", "rewards/")


def _own(name: str, names: tuple[str, ...]) -> bool:
    return name in names or name.startswith(tuple(n for n in names if n.endswith(("/", "_"))))


def _score(scoring: Scoring, batch: dict, made: sampling.Completions, global_step: int, max_steps: int,
           model: nn.Module | None = None) -> tuple[torch.Tensor, list[dict], rewards.Logged]:
    """Each reward's value of each completion [rewards, rows] (the functions', then the reward model's where there
    is one: `model`, whose forward scores), the texts they were given, and what the functions logged (their
    trainer_state says global_step optimizer steps of max_steps are done)."""
    records = [json.loads(columns) for columns in batch["columns"]]
    texts = [scoring.text(ids, mask) for ids, mask in zip(made.ids, made.mask, strict=True)]
    chat = isinstance(records[0]["prompt"], list)
    completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
    ids = [row[mask.bool()].tolist() for row, mask in zip(made.ids, made.mask, strict=True)]
    columns = {key: [record.get(key) for record in records] for key in records[0] if key != "prompt"}
    scored, logged = rewards.score(scoring.rewards, [r["prompt"] for r in records], completions, ids, columns,
                                   global_step, max_steps)
    values = torch.tensor(scored, dtype=torch.float32).reshape(len(scoring.rewards), len(records))
    if scoring.scorer_tokenizer is not None and model is not None:
        values = torch.cat([values, _model_scores(model, scoring.scorer_tokenizer, records, completions)[None]])
    shown = [{"prompt": r["prompt"], "completion": t} for r, t in zip(records, texts, strict=True)]
    taken = [f"log_metric {name!r}" for name in logged.metrics if _own(name, OWN_METRICS)] + \
            [f"log_extra {column!r}" for column in logged.columns if _own(column, OWN_COLUMNS)]
    if taken:
        raise ConfigError([Problem(f"a reward function logged {', '.join(taken)}: a name metrics.jsonl or "
                                   "rollouts.jsonl fills itself", "--reward_funcs",
                                   "log it under a name of your own, e.g. 'my_reward/...'")])
    return values, shown, logged


def _model_scores(model: nn.Module, tokenizer: Any, records: list[dict], completions: list) -> torch.Tensor:
    """The reward model's score of each prompt + completion, in its own tokens (a chat rendered with its template,
    as TRL renders one for a reward model), all of the rank's rows in one forward."""
    if isinstance(records[0]["prompt"], list):
        texts = [tokenizer.apply_chat_template(r["prompt"] + c, tokenize=False) for r, c in
                 zip(records, completions, strict=True)]
    else:
        texts = [r["prompt"] + c for r, c in zip(records, completions, strict=True)]
    encoded = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    device = next(model.parameters()).device
    return model(input_ids=encoded["input_ids"].to(device), attention_mask=encoded["attention_mask"].to(device),
                 mode="score").float().cpu()


_held: dict[str, Any] = {}  # --num_iterations > 1: this rank's last rollout ("rollout") and the process count
_training: dict[str, int] = {"step": 0}  # the step the last rollout was for: evaluation comes after it


def rollout_state() -> dict[str, Any] | None:
    """The completions the next steps train on again (--num_iterations > 1), for the checkpoint."""
    if "rollout" not in _held:
        return None
    held = _held["rollout"]
    return {"micro_batches": held.micro_batches, "metrics": held.metrics, "processes": _held["processes"]}


def load_rollout_state(state: dict[str, Any]) -> None:
    _held.update(rollout=Rollout(state["micro_batches"], state["metrics"], []), processes=state["processes"])


def rollout(model: GRPOModel, cfg: Config, step: int, micro_batches: list[dict]) -> Rollout:
    """The step's completions of this rank's prompt slots, their rewards, the global batch's advantages, and the
    reference's (beta > 0) and the sampling policy's (num_iterations > 1) log-probabilities."""
    import time

    _training["step"] = step
    if (step - 1) % cfg.num_iterations:  # the same completions, trained on again
        if "rollout" not in _held or _held["processes"] != sampling.processes():
            raise TrainingError(
                f"step {step} trains again on the completions sampled at step {step - (step - 1) % cfg.num_iterations}"
                f" (--num_iterations {cfg.num_iterations}), which this checkpoint does not hold for "
                f"{sampling.processes()} processes", "resume on the processes that wrote it, or from a checkpoint at a "
                "step that is a multiple of --num_iterations")
        return Rollout(_held["rollout"].micro_batches, _held["rollout"].metrics, [])
    scoring, device = _scoring(cfg), next(model.parameters()).device
    batch = {key: torch.cat([mb[key] for mb in micro_batches]).to(device) if torch.is_tensor(micro_batches[0][key])
             else [v for mb in micro_batches for v in mb[key]] for key in micro_batches[0]}
    seeds = [sampling.slot_seed(cfg.seed, step, int(p), int(g))
             for p, g in zip(batch["index"], batch["generation"], strict=True)]
    started = time.perf_counter()
    made = sampling.sample(lambda **kw: model(mode="generate", **kw), batch["prompt_ids"], batch["prompt_length"],
                           seeds, scoring.how, sampling.processes() > 1, scoring.ended)
    generation_s = time.perf_counter() - started
    per_function, shown, logged = _score(scoring, batch, made, step - 1, cfg.max_steps, model)
    per_function = per_function.to(device)
    lengths = made.mask.sum(-1).float()
    # the global batch's rewards, lengths and truncations, in rank order (= the data's order): every rank computes
    # the same advantages and metrics from them
    everything = _gathered(torch.cat([per_function, lengths[None], made.truncated.float()[None]]))
    total = (everything[:-2] * scoring.weights[:, None].to(device)).nansum(0)  # a None (NaN) adds nothing, as in TRL
    advantage, zero_std = grpo.advantages(total, cfg.num_generations, cfg.scale_rewards, cfg.advantage)
    mine = slice(_rank() * len(lengths), (_rank() + 1) * len(lengths))
    loss_mask = made.mask * (~made.truncated)[:, None] if cfg.mask_truncated_completions else made.mask
    prompt_ids, prompt_attention = sampling.left_padded(batch["prompt_ids"], batch["prompt_length"], scoring.how.pad)
    rows = {"input_ids": torch.cat([prompt_ids, made.ids], 1),
            "attention_mask": torch.cat([prompt_attention, made.mask], 1),
            "completion_mask": loss_mask, "advantages": advantage[mine]}
    sizes = [len(mb["index"]) for mb in micro_batches]
    trained = [dict(zip(rows, parts, strict=True)) for parts in zip(*(v.split(sizes) for v in rows.values()),
                                                                    strict=True)]
    for part in trained:
        if cfg.beta:
            part["ref_logps"] = model(**part, mode="reference")
        if cfg.num_iterations > 1:
            part["old_logps"] = model(**part, mode="policy")
    metrics = {**_step_metrics(scoring.names, total, zero_std, everything), "generation_s": generation_s,
               **_logged_metrics(logged.metrics)}
    rows = [{**text, "generation": int(g), **{f"rewards/{name}": None if math.isnan(v) else v for name, v in zip(
        scoring.names, per_function[:, i].tolist(), strict=True)}, "advantage": advantage[mine][i].item(),
        "tokens": int(loss_mask[i].sum()), **{column: values[i] for column, values in logged.columns.items()}}
        for i, (text, g) in enumerate(zip(shown, batch["generation"], strict=True))]
    if cfg.num_iterations > 1:
        _held.update(rollout=Rollout(trained, metrics, []), processes=sampling.processes())
    return Rollout(trained, metrics, rows)


def _step_metrics(names: list[str], total: torch.Tensor, zero_std: torch.Tensor,
                  everything: torch.Tensor) -> dict[str, float]:
    """TRL's metrics of the global batch: its rewards (weighted, and each function's: everything's rows but the last
    two) and its completions' lengths and truncations (the last two)."""
    lengths, truncated = everything[-2], everything[-1]
    return {"reward": total.mean().item(), "reward_std": total.std().item(),
            "frac_reward_zero_std": zero_std.float().mean().item(),
            **{key: value for name, values in zip(names, everything[:-2], strict=True)
               for key, value in _reward_stats(name, values).items()},
            "completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(), "completions/clipped_ratio": truncated.mean().item()}


def _logged_metrics(logged: dict[str, list[float]]) -> dict[str, float]:
    """What the reward functions passed to log_metric: each name's mean over this rank's calls, averaged over the
    processes that logged it (an object gather: a name one rank logged and another did not cannot hang a
    collective)."""
    mine = {name: sum(values) / len(values) for name, values in logged.items()}
    every = [mine]
    if sampling.processes() > 1:
        import torch.distributed as dist

        every = [{} for _ in range(sampling.processes())]
        dist.all_gather_object(every, mine)
    names = dict.fromkeys(name for rank in every for name in rank)
    return {name: sum(r[name] for r in every if name in r) / sum(name in r for r in every) for name in names}


def _reward_stats(name: str, values: torch.Tensor) -> dict[str, float]:
    """rewards/<name>/mean and /std over the completions the function scored (NaN where it returned None: TRL's
    nanmean and nanstd); a statistic it has too few values for is left out (metrics.jsonl holds no NaN)."""
    scored = values[~values.isnan()]
    return {**({f"rewards/{name}/mean": scored.mean().item()} if len(scored) else {}),
            **({f"rewards/{name}/std": scored.std().item()} if len(scored) > 1 else {})}


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _gathered(values: torch.Tensor) -> torch.Tensor:
    """[rows, this rank's columns] -> [rows, every rank's columns, in rank order]."""
    if sampling.processes() == 1:
        return values
    import torch.distributed as dist

    parts = [torch.empty_like(values) for _ in range(sampling.processes())]
    dist.all_gather(parts, values.contiguous())
    return torch.cat(parts, dim=1)


def loss(model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's loss (the mean over its units: loss_weight) and the metrics' sums; on held-out prompts
    (no completions yet), one greedy completion each and its rewards."""
    if "completion_mask" not in batch:
        return _held_out(model, batch)
    return model(**batch)


def _held_out(model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from accelerate.utils import extract_model_from_parallel

    settings = extract_model_from_parallel(model).settings
    scoring = _scoring(settings)
    made = sampling.sample(lambda **kw: model(mode="generate", **kw), batch["prompt_ids"], batch["prompt_length"],
                           None, scoring.how, sampling.processes() > 1, scoring.ended)
    per_function, _, _ = _score(scoring, batch, made, _training["step"], settings.max_steps, model)
    per_function = per_function.to(made.ids.device)
    total = (per_function * scoring.weights[:, None].to(made.ids.device)).nansum(0)
    # each function's mean over the prompts it scored (trainkit/run/metrics.py's means_of: "<name> per <count>")
    sums = {"reward": total.sum(), **{key: value for name, values in zip(scoring.names, per_function, strict=True)
                                      for key, value in ((f"rewards/{name}/mean per _scored/{name}", values.nansum()),
                                                         (f"_scored/{name}", (~values.isnan()).sum()))},
            "completions/mean_length": made.mask.sum().float()}
    return -total.mean(), sums


def loss_weight(cfg: Config, batch: dict) -> float:
    """The units a micro-batch's loss is the mean over (trainkit/losses/grpo.py's unit_count): its completion tokens
    (dapo, bnpo) or its completions; a held-out micro-batch's prompts."""
    if "completion_mask" not in batch:
        return float(len(batch["prompt_ids"]))
    return grpo.unit_count(cfg.loss_type, batch["completion_mask"])


def tokens_per_sample(cfg: Config) -> int:
    return cfg.seq_len


def preview(cfg: Config, cache_dir: Path) -> str:
    """--dry_run: a prompt as the model reads it, and each reward function called on the first prompt with an empty
    completion (a function that fails or returns the wrong count is refused here, before any GPU hour)."""
    first = prompts.first_prompt(cfg, cache_dir)
    shown = prompts.preview(cfg, first)
    scoring = _scoring(cfg)
    made = sampling.Completions(torch.tensor([[scoring.how.pad]]), torch.zeros(1, 1, dtype=torch.long),
                                torch.tensor([True]))
    values, _, _ = _score(scoring, {"columns": [first["columns"]]}, made, 0, cfg.max_steps)
    said = ", ".join(f"{r.name} {'None' if math.isnan(v) else f'{v:g}'}"
                     for r, v in zip(scoring.rewards, values[:, 0].tolist(), strict=True))
    return f"{shown}\nthe reward functions on an empty completion of it: {said}" if said else shown


def export(model: GRPOModel, state_dict: dict, cfg: Config, cache_dir: Path, out_dir: Path) -> None:
    """final/: the policy as causal_lm exports it (trainkit/models/finetune.py), without the reference."""
    from transformers import AutoModelForCausalLM

    policy = {key.removeprefix("policy."): value for key, value in state_dict.items() if key.startswith("policy.")}
    finetune.export(model.policy, policy, cfg, out_dir, AutoModelForCausalLM)
