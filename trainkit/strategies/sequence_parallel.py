"""Sequence parallelism (DeepSpeed's Ulysses, selected by a DeepSpeed YAML's `parallelism_config_sp_size`): the ranks of
one group share a micro-batch, each holding 1/sp of its positions; each attention layer exchanges heads for
positions (all-to-all), attends over the whole sequence for its 1/sp of the heads, and exchanges back. Context
parallelism (torch's ring attention, an FSDP YAML's `parallelism_config_cp_size`, GPUs only: strategies/fsdp.py)
uses the same rows, cut by torch (`head_tail` is its cut), and `causal_sdpa`.

Accelerate builds the groups and registers DeepSpeed's `UlyssesSPAttentionHF` in place of the model's attention
implementation (transformers' attention interface) when it prepares the model; this module does what the runner must
for the numbers to stay one process's:

- `shard`: the micro-batch cut along the sequence, the next-token targets (`shift_labels`) made *before* the cut:
  a shard that shifted its own labels would lose the target of its last position (the next shard's first token).
  The positions are those of the whole row, so rotary embeddings and packed examples see their own.
- `packed_attention`: DeepSpeed's wrapper drops the attention mask (it was made for the shard's length) and relies on
  causal attention over the gathered positions; packed rows then attend across their examples. Under the wrapper,
  the core attention gets the whole row's position_ids; where they restart (packed examples) it builds the
  block-diagonal causal mask of the whole row from them.
- `learned_tokens`: what each shard's mean loss is over; the runner weighs every shard by it
  (trainkit/step.py's loss_weights), so a step's loss is the mean over every learned token of the global batch,
  never a mean of the shards' means.
- `balance_mask` in `rows`: the positions a mixture of experts' balance counts (the row's mask, not the padding to a
  multiple of the ranks), for the whole sequences its router logits are gathered into (trainkit/losses/router.py).

Evaluation and generation run with the model in eval mode, where the wrapper steps aside (Accelerate registers it
with `disable_in_eval`): each rank of a group evaluates the group's micro-batches whole, as its copies weigh the
same, the eval loss is one process's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainkit.data.sft import IGNORE
from trainkit.errors import Problem

# What DeepSpeed's Ulysses runs on: the attention implementations that take no materialised mask
SPLITTABLE_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def rows(batch: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """The whole rows of a collated micro-batch of token rows (input_ids; labels, else attention_mask, say what is
    learned; position_ids where rows are packed; a per-token `weight` where each example weighs the same) as the
    ranks of a sequence-parallel group cut them: input_ids, shift_labels (the next token where it is learned, else
    IGNORE; the last position has none), position_ids and shift_weight, padded to a multiple of `multiple` with
    positions that learn nothing."""
    ids = batch["input_ids"]
    count, length = ids.shape
    if "labels" in batch:
        targets = batch["labels"][:, 1:]
    elif "attention_mask" in batch:
        targets = ids[:, 1:].masked_fill(batch["attention_mask"][:, 1:] == 0, IGNORE)
    else:
        targets = ids[:, 1:]
    pad = -length % multiple
    parts = {
        "input_ids": _extend(ids, pad, 0),
        "shift_labels": _extend(targets, pad + 1, IGNORE),
        "position_ids": batch["position_ids"] if "position_ids" in batch
        else torch.arange(length, device=ids.device).expand(count, length),
    }
    if pad:  # positions that go on counting: causal attention keeps them out of every real token's view
        tail = parts["position_ids"][:, -1:] + torch.arange(1, pad + 1, device=ids.device)
        parts["position_ids"] = torch.cat([parts["position_ids"], tail], dim=1)
    if "weight" in batch:
        parts["shift_weight"] = _extend(batch["weight"][:, 1:], pad + 1, 0)
    # what a mixture of experts' balance counts (trainkit/losses/router.py): the row's mask, not the padding
    parts["balance_mask"] = _extend(batch["attention_mask"] if "attention_mask" in batch else torch.ones_like(ids),
                                    pad, 0)
    return parts


def shard(batch: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """This rank's part of a micro-batch under Ulysses: the positions [rank x L/size, (rank + 1) x L/size) of its
    rows (`rows`)."""
    parts = rows(batch, size)
    width = parts["input_ids"].shape[1] // size
    return {name: part[:, rank * width:(rank + 1) * width] for name, part in parts.items()}


def head_tail(parts: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """This rank's part of `rows` under torch's context parallelism with its causal load balancing: of 2 x size equal
    chunks, chunk `rank` and chunk 2 x size - 1 - rank (every rank then attends to as many earlier positions).
    torch cuts the buffers itself; the runner counts each rank's learned tokens on this (tests/test_context_parallel.py
    asserts it is torch's cut)."""
    width = parts["input_ids"].shape[1] // (2 * size)
    cut = [slice(rank * width, (rank + 1) * width), slice((2 * size - 1 - rank) * width, (2 * size - rank) * width)]
    return {name: torch.cat([part[:, c] for c in cut], dim=1) for name, part in parts.items()}


def _extend(rows: torch.Tensor, count: int, value: float) -> torch.Tensor:
    return torch.cat([rows, rows.new_full((rows.shape[0], count), value)], dim=1) if count else rows


def learned_tokens(batch: dict[str, torch.Tensor]) -> float:
    """What a shard's mean loss is over: its learned targets, or their weights (a recipe's loss_average samples)."""
    if "shift_weight" in batch:
        return float(batch["shift_weight"].sum())
    return float((batch["shift_labels"] != IGNORE).sum())


def packed_attention(core: Callable[..., Any]) -> Callable[..., Any]:
    """`core` (an attention implementation of transformers' interface) with, where it gets no mask and the position_ids
    of its rows restart (packed examples, as Ulysses hands it the whole row), the block-diagonal causal mask of those
    examples: each token attends to the earlier tokens of its own example."""

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        positions = kwargs.get("position_ids")
        if attention_mask is None and positions is not None and positions.shape[-1] == query.shape[2] and \
                bool((positions[:, 1:] == 0).any()):
            example = (positions == 0).cumsum(dim=1)  # a new example where the positions start again
            length = positions.shape[1]
            causal = torch.ones(length, length, dtype=torch.bool, device=positions.device).tril()
            attention_mask = ((example[:, :, None] == example[:, None, :]) & causal)[:, None]
        return core(module, query, key, value, attention_mask, *args, **kwargs)

    return attention


def heads_kept(ulysses: Callable[..., Any]) -> Callable[..., Any]:
    """DeepSpeed's Ulysses wrapper (as it registers itself), returning the attention output with its heads apart,
    (batch, positions, heads, head size), as transformers' attention functions do: it returns them joined (batch,
    positions, hidden), which models that reshape by `[:-2]` (GPT-2) then folded into (batch, positions x hidden)
    (measured: "mat1 and mat2 shapes cannot be multiplied (8x2048 and 64x64)"). Models that reshape to the input's
    shape (Llama) take either."""

    def attention(module: nn.Module, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out, weights = ulysses(module, query, *args, **kwargs)
        return (out.reshape(*out.shape[:2], -1, query.shape[-1]) if out.dim() == 3 else out), weights

    return attention


def causal_sdpa(core: Callable[..., Any]) -> Callable[..., Any]:
    """What torch's context parallelism replaces, for a model in training: causal attention as one call of
    `F.scaled_dot_product_attention` (which its ring attention takes over inside `context_parallel`), without a mask
    (the model's was made for the rank's part; causal attention over the positions is what it meant for rows that
    are not packed and are padded on the right) and with the key/value heads repeated to the query heads (the ring
    kernels take no `enable_gqa`). In eval mode (outside the context) `core`, the model's own attention."""

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> Any:
        if not module.training:
            return core(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        out = nn.functional.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True,
                                                         scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    return attention


def recipe_problems(recipe: Any, where: str, whole: str) -> list[Problem]:
    """A recipe (trainkit/recipes.py's Recipe, or None before one is loaded) whose loss would read a part of each row
    as if it were the row: it does not declare sequence_parallel. `whole` names a config that trains whole rows."""
    if recipe is None or recipe.sequence_parallel:
        return []
    return [Problem(f"recipe {recipe.path.name} does not declare sequence_parallel: its loss would read a part of "
                    f"each row as if it were the row", where,
                    f"train it under {whole} (whole sequences), or declare sequence_parallel with a loss that reads "
                    f"the parts as recipes/causal_lm.py does (recipes/README.md)")]


def problems(model: nn.Module, size: int, where: str, seq_len: int | None, key: str = "sp") -> list[Problem]:
    """What keeps `model` (built on the meta device) from being split over `size` ranks by Ulysses (`key` "sp") or by
    torch's context parallelism ("cp"): no transformers config, an attention outside transformers' attention
    interface or one that the split does not run (eager's materialised mask; under cp all but sdpa), layers that
    are not plain causal attention over the sequence (both drop the mask that would narrow them: a sliding
    window shorter than `seq_len`, linear attention's state), and under Ulysses heads that do not divide among the
    ranks."""
    inner = getattr(model, "get_base_model", lambda: model)()
    config = getattr(inner, "config", None)
    name = type(inner).__name__
    setting = f"parallelism_config_{key}_size"
    what, splitter = ("sequence parallelism", "DeepSpeed's Ulysses") if key == "sp" else \
        ("context parallelism", "torch's ring attention")
    fix = f"set {setting}: 1, or train a transformers decoder (recipes/causal_lm.py)"
    if config is None or not hasattr(config, "get_text_config"):
        return [Problem(f"{name} is not a transformers model: {what} replaces the attention of transformers' attention "
                        "interface", where, fix)]
    if not getattr(inner, "_supports_attention_backend", False):
        return [Problem(f"{name}'s attention does not go through transformers' attention interface, where {what} "
                        f"replaces it", where, fix)]
    attention = getattr(config, "_attn_implementation", None)
    runs = SPLITTABLE_ATTENTION if key == "sp" else ("sdpa",)
    if attention not in runs:
        supported = [kind for kind in runs if _supports(inner, kind)]
        here = [kind for kind in supported if kind == "sdpa" or torch.cuda.is_available()]  # flash, flex: CUDA
        fix = (f"pass --attn_implementation {here[0]} (recipes/causal_lm.py, dpo.py, reward.py; a recipe of your own "
               f"builds the model with attn_implementation={here[0]!r})" if here else
               f"set {setting}: 1" + (f" here, or on GPUs pass --attn_implementation {supported[0]}" if supported
                                      else f" ({name} supports none of them)"))
        return [Problem(f"{name} uses {attention!r} attention: {what} runs {', '.join(runs)}", where, fix)]
    text = config.get_text_config()
    kinds = set(getattr(text, "layer_types", None) or ()) - {"full_attention"}
    window = getattr(text, "sliding_window", None) if kinds <= {"sliding_attention"} else None
    if kinds - {"sliding_attention"} or (window or kinds) and (seq_len is None or (window or 0) < seq_len):
        layers = f"layers of type {', '.join(sorted(kinds))}" if kinds - {"sliding_attention"} else \
            f"a sliding window of {window} tokens, shorter than the {seq_len}-token sequence"
        return [Problem(f"{name} has {layers}: under {what} every layer would attend causally over the whole "
                        f"sequence ({splitter} drops the mask that narrows them)", where,
                        f"set {setting}: 1, or a seq_len within the window")]
    if key != "sp":  # the ring passes keys and values around whole: any head count
        return []
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    found = []
    if heads % size:
        found.append(Problem(f"{name} has {heads} attention heads, which do not divide among {size} sequence-"
                             f"parallel ranks (each attends with 1/{size} of the heads)", where,
                             f"set parallelism_config_sp_size to a divisor of {heads}"))
    elif kv_heads % size and size % kv_heads:
        found.append(Problem(f"{name} has {kv_heads} key/value heads: neither a multiple nor a divisor of sp size "
                             f"{size}", where, f"set parallelism_config_sp_size to a divisor of {kv_heads}"))
    return found


def _supports(model: Any, attention: str) -> bool:
    """Whether transformers would build `model`'s class with this attention implementation (its _supports_* flags;
    flex and flash need CUDA to train, which the caller weighs)."""
    flag = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn",
            "flash_attention_2": "_supports_flash_attn", "flash_attention_3": "_supports_flash_attn"}.get(attention)
    return bool(flag and getattr(type(model), flag, False))
