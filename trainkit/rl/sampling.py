"""Completions sampled from the policy with its KV cache, the same on any number of processes.

Each completion slot (prompt p's generation j at step s) draws its tokens from a torch.Generator of its own, seeded
from (the run's seed, s, p, j): not from the global RNG, whose state depends on what else the rank computed. Every
prompt is left-padded to the same length whatever the batch it is in (its positions counted from its first real
token), so a completion's logits do not depend on which prompts share its batch or its rank; where they differ in the
last bits (a matmul's blocking changes with the batch's rows) a sampled token can flip only if its random draw falls
within that difference of a boundary between two tokens (tests/test_grpo.py counts it).

transformers' generate() is not used: it samples every row from the one global generator (no per-row seeds), and its
synced_gpus loop is what the step's own loop here does too: under ZeRO-3 and FSDP2 every forward is a collective, so
every rank goes on stepping (its finished rows padded) until every rank's rows have finished.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

MIX = 1_000_003  # a prime: (seed, step, prompt, generation) -> one 63-bit seed, distinct for distinct slots in practice


def slot_seed(seed: int, step: int, prompt: int, generation: int) -> int:
    return (((seed * MIX + step) * MIX + prompt) * MIX + generation) % (2**63 - 1)


@dataclass(frozen=True, slots=True)
class Sampling:
    """How tokens are drawn (transformers' order of its logits warpers: temperature, top-k, top-p)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: all
    stop: tuple[int, ...] = ()  # tokens that end a completion (kept in it): the tokenizer's end of text and of turn
    pad: int = 0


@dataclass(frozen=True, slots=True)
class Completions:
    ids: torch.Tensor  # [rows, max_new_tokens], `pad` past each completion's end
    mask: torch.Tensor  # [rows, max_new_tokens]: 1 on each completion's tokens, its stop token included
    truncated: torch.Tensor  # [rows] bool: no stop token within max_new_tokens


def left_padded(prompts: torch.Tensor, lengths: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of right-padded prompts [rows, P] moved to the right end: P columns whatever the
    batch."""
    width = prompts.shape[1]
    columns = torch.arange(width, device=prompts.device)
    shift = (width - lengths).unsqueeze(1)
    source = (columns - shift).clamp(min=0)
    ids = torch.where(columns >= shift, prompts.gather(1, source), torch.full_like(prompts, pad))
    return ids, (columns >= shift).long()


def positions(attention: torch.Tensor) -> torch.Tensor:
    """Each token's position counted from its row's first real token (left padding at 0)."""
    return (attention.cumsum(-1) - 1).clamp(min=0)


def pick(logits: torch.Tensor, generators: list[torch.Generator] | None, how: Sampling) -> torch.Tensor:
    """The next token of each row: argmax without generators (greedy), else drawn from its own generator."""
    if generators is None:
        return logits.argmax(-1)
    logits = logits / how.temperature
    if how.top_k and how.top_k < logits.shape[-1]:
        kth = torch.topk(logits, how.top_k).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if how.top_p < 1.0:
        ordered, order = torch.sort(logits, descending=False)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - how.top_p
        drop[:, -1] = False  # the likeliest token always stays
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return torch.cat([torch.multinomial(probs[r], 1, generator=g) for r, g in enumerate(generators)])


def sample(forward: Callable[..., Any], prompts: torch.Tensor, lengths: torch.Tensor, seeds: list[int] | None,
           how: Sampling, synced: bool, ended: Callable[[list[int]], bool] | None = None) -> Completions:
    """Completions of right-padded prompts [rows, P] (lengths [rows]) by `forward` (the model's, taking
    input_ids, attention_mask, position_ids, past_key_values, use_cache); seeds: one per row (None: greedy).
    synced: every process calls this as often, and they step together until all of them are done. ended: whether a
    completion's tokens so far end it (an end of turn that is no single token: a stop string), beside how.stop."""
    device = prompts.device
    ids, attention = left_padded(prompts, lengths, how.pad)
    generators = None if seeds is None else [torch.Generator(device=device).manual_seed(s) for s in seeds]
    out = forward(input_ids=ids, attention_mask=attention, position_ids=positions(attention), use_cache=True)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    stop = torch.tensor(how.stop, device=device)
    tokens, alive, rows = [], [], [[] for _ in range(len(prompts))]
    for t in range(how.max_new_tokens):
        token = pick(out.logits[:, -1].float(), generators, how)
        token = torch.where(done, torch.full_like(token, how.pad), token)
        tokens.append(token)
        alive.append(~done)
        if ended is not None:
            for r in (~done).nonzero().flatten().tolist():
                rows[r].append(int(token[r]))
                done[r] = done[r] or ended(rows[r])
        done = done | torch.isin(token, stop)
        if t == how.max_new_tokens - 1 or _all_done(done, synced):
            break
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
        out = forward(input_ids=token[:, None], attention_mask=attention,
                      position_ids=positions(attention)[:, -1:], past_key_values=out.past_key_values, use_cache=True)
    made = torch.stack(tokens, dim=1)
    mask = torch.stack(alive, dim=1).long()
    width = how.max_new_tokens - made.shape[1]  # every batch as wide as the longest completion allowed
    return Completions(torch.nn.functional.pad(made, (0, width), value=how.pad),
                       torch.nn.functional.pad(mask, (0, width)), ~done)


def processes() -> int:
    """The processes of the run (1 outside a distributed launch): with more than one, every one samples its share and
    they step together (sample's synced)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def _all_done(done: torch.Tensor, synced: bool) -> bool:
    """Whether this rank's rows, and with synced every rank's, have finished."""
    finished = torch.tensor([float(bool(done.all()))], device=done.device)
    if synced:
        import torch.distributed as dist

        dist.all_reduce(finished, op=dist.ReduceOp.MIN)
    return bool(finished.item())
