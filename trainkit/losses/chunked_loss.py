"""The next-token loss of a causal LM without the whole logits: the head and the cross entropy a chunk of positions
at a time.

The logits are the largest tensors of a long sequence's step: micro-batch x tokens x vocabulary, in fp32 since the
loss upcasts them, and the cross entropy's backward makes two more of that size (the softmax and the logits'
gradient; trainkit/estimate.py's loss_bytes). Here the model runs as it always does (through the strategy's wrapper,
so DDP, FSDP2 and ZeRO-3 see their forward), except that its head computes only the last position's logits; the
head's input, the final hidden states, is kept, and each chunk of positions goes through the head and the loss under
torch.utils.checkpoint: its logits are freed once its loss is known and made again in backward, one chunk at a time.
The head's weight is one parameter used by every chunk, so autograd sums its gradient before DDP or ZeRO see it.

What transformers' models do to the logits after the head, each chunk does too (after_head: Granite's and Cohere's
scaling, Gemma-2's soft-capping); and the model's own logits of the last position are compared with the chunks' way
on every call, so an architecture that does something else is refused rather than trained on other logits.

DeepSpeed's TiledFusedLogitsLoss (deepspeed.runtime.sequence_parallel.ulysses_sp) tiles the same way but runs its
backward inside the forward, where the scale the runner puts on the loss before backward (accumulation's weights,
fp16's loss scale) does not reach the head's gradient; so it is not used here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainkit.errors import ConfigError, Problem

CHUNK_MIB = 1024.0  # the default: 1 GiB of fp32 logits per chunk (DeepSpeed's ALST tiles its logits loss by 1 GiB)


def chunk_tokens(mib: float, vocab: int) -> int:
    """The positions whose fp32 logits take at most `mib` MiB (at least one); 0 (mib 0): all at once."""
    return max(1, int(mib * 2**20) // (4 * vocab)) if mib > 0 else 0


def problems(mib: float) -> list[Problem]:
    if mib < 0:
        return [Problem(f"loss_chunk_mib must be >= 0, got {mib}", "config field loss_chunk_mib",
                        f"use --loss_chunk_mib {CHUNK_MIB:g} (0: the whole logits at once)")]
    return []


def configure(model: nn.Module, mib: float) -> nn.Module:
    """The model, its loss to be computed in chunks of `mib` MiB of logits (a recipe's build_model)."""
    model.loss_chunk_tokens = chunk_tokens(mib, model.config.vocab_size)
    return model


class TokenLosses(NamedTuple):
    """What next_token_losses computes from one forward of the model."""

    losses: torch.Tensor  # the loss of predicting each position's next token, fp32, [batch, tokens - 1]
    guess: torch.Tensor | None  # the head's top guess there (asked for with top_guess), else None
    aux_loss: torch.Tensor | None  # the model's own auxiliary loss, unscaled (trainkit/losses/router.py), else None
    entropy: torch.Tensor | None = None  # the entropy of each position's next-token distribution (asked for), detached
    router_logits: tuple[torch.Tensor, ...] | None = None  # a mixture of experts' per layer, where it returns them


def next_token_losses(model: nn.Module, top_guess: bool = False, targets: torch.Tensor | None = None, *,
                      temperature: float = 1.0, entropy: bool = False, **inputs: Any) -> TokenLosses:
    """The loss of predicting input_ids[:, t + 1] at every position t: model(**inputs) whole when its positions fit
    in one chunk (configure), else a chunk of positions at a time. `targets` [batch, tokens]: the next token of every
    position instead, made before the sequence was cut (a sequence-parallel shard's shift_labels,
    trainkit/strategies/sequence_parallel.py; -100 where nothing is learned, whose loss is 0). `temperature`: the
    logits divided by it first (the distribution a sampler at that temperature draws from: recipes/grpo.py);
    `entropy`: each position's entropy too."""
    from accelerate.utils import extract_model_from_parallel

    inner = extract_model_from_parallel(model)
    chunk = getattr(inner, "loss_chunk_tokens", 0)
    predicting = slice(None, -1) if targets is None else slice(None)  # the positions whose next token is known
    targets = inputs["input_ids"][:, 1:] if targets is None else targets
    if not chunk or targets.numel() <= chunk:
        output = model(**inputs)
        logits = output.logits[:, predicting].float() / temperature
        return TokenLosses(_cross_entropy(logits, targets), logits.argmax(dim=-1) if top_guess else None,
                           getattr(output, "aux_loss", None), _entropy(logits) if entropy else None,
                           getattr(output, "router_logits", None))
    project, hidden, last, output = head_and_hidden(model, inner, inputs)
    rows = hidden[:, predicting].reshape(-1, hidden.shape[-1])
    losses, guesses, entropies = [], [], []
    for part, wanted in zip(rows.split(chunk), targets.reshape(-1).split(chunk), strict=True):
        loss, guess, spread = (checkpoint(_chunk, project, part, wanted, top_guess, temperature, entropy,
                                          use_reentrant=False)
                               if torch.is_grad_enabled() else _chunk(project, part, wanted, top_guess, temperature,
                                                                      entropy))
        losses.append(loss)
        guesses.append(guess)
        entropies.append(spread)
    # + 0 x the model's own output: backward passes through it, where FSDP2 hooks its gradients' reduction
    loss = torch.cat(losses).view_as(targets) + 0 * last.sum()
    return TokenLosses(loss, torch.cat(guesses).view_as(targets) if top_guess else None,
                       getattr(output, "aux_loss", None), torch.cat(entropies).view_as(targets) if entropy else None,
                       getattr(output, "router_logits", None))


def _chunk(project: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, targets: torch.Tensor,
           top_guess: bool, temperature: float = 1.0,
           entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    logits = project(rows).float() / temperature
    return (_cross_entropy(logits, targets), logits.argmax(dim=-1) if top_guess else None,
            _entropy(logits) if entropy else None)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """-sum p log p of softmax(logits) along the vocabulary, detached (a metric, never a loss)."""
    with torch.no_grad():
        logps = torch.log_softmax(logits, dim=-1)
        return -(logps.exp() * logps).sum(-1)


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                       reduction="none").view_as(targets)


def after_head(config: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """What transformers' models of this config do to the head's output (their forward, after `self.lm_head`)."""
    scale = 1 / config.logits_scaling if getattr(config, "logits_scaling", None) else 1.0  # Granite
    scale *= getattr(config, "logit_scale", None) or 1.0  # Cohere
    scale *= getattr(config, "lm_head_multiplier", None) or 1.0  # Falcon-H1
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma-2 and 3

    def logits(out: torch.Tensor) -> torch.Tensor:
        out = out * scale if scale != 1.0 else out
        return torch.tanh(out / cap) * cap if cap else out

    return logits


Projection = Callable[[torch.Tensor], torch.Tensor]


def head_and_hidden(model: nn.Module, inner: nn.Module, inputs: dict[str, Any]
                     ) -> tuple[Projection, torch.Tensor, torch.Tensor, Any]:
    """The logits of given hidden states (the output head, then after_head); the head's input at every position
    from model(**inputs) (`inner`: the model out of its strategy's wrapper), run with a head that projects only the
    last position; the model's logits there (checked against the chunks' way); and the model's output (its
    auxiliary loss and router logits, if any)."""
    head, then = inner.get_output_embeddings(), after_head(inner.config)
    project = head.forward
    seen: list[torch.Tensor] = []

    def last_only(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(hidden)
        return project(hidden[:, -1:])

    head.forward = last_only
    try:
        output = model(**inputs)
        last = output.logits[:, -1]
    finally:
        del head.forward  # the class's own again
    hidden = seen[0]
    with torch.no_grad():
        own = then(head(hidden[:, -1:]))[:, -1]
    if not torch.allclose(last.detach().float(), own.float(), rtol=1e-3, atol=1e-4):
        raise ConfigError([Problem(f"{type(inner).__name__} changes its logits after its output head in a way the "
                                   "loss computed in chunks does not know (trainkit/losses/chunked_loss.py's "
                                   "after_head)",
                                   "--loss_chunk_mib", "pass --loss_chunk_mib 0 (the whole logits at once, as the "
                                   "model computes them)")])
    return lambda rows: then(head(rows)), hidden, last, output
