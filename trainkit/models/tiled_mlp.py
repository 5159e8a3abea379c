"""--tiled_mlp: each decoder layer's MLP computed a chunk of positions at a time, its intermediates made again in
backward.

A gated MLP keeps 4 x ffn elements a token for backward (the gate and up projections, the activation, their product;
trainkit/estimate.py's PER_TOKEN), more than the rest of its layer. Here the `mlp` module of every decoder layer (the
layers of trainkit/strategies/pipeline_decoder.py's layout) runs each chunk of positions under torch.utils.checkpoint:
the forward keeps only the chunks' inputs, and backward makes one chunk's intermediates at a time. A chunk is `hidden`
positions, DeepSpeed ALST's tile (sequence length / hidden shards). DeepSpeed's TiledMLP does the same with a backward
of its own that runs autograd inside autograd, which DDP's and FSDP2's gradient hooks do not expect (its source says
so); torch's checkpoint is a node of the one backward, so every strategy sees the usual gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainkit.errors import ConfigError, Problem
from trainkit.strategies import pipeline_decoder


def tile(model: nn.Module) -> nn.Module:
    """The model, each decoder layer's MLP computed `hidden` positions at a time (a recipe's build_model)."""
    chunk = model.config.hidden_size
    for layer in pipeline_decoder.layers(model):
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            raise ConfigError([Problem(f"{type(layer).__name__} has no `mlp` module to compute in chunks (its MLP "
                                       "is inline in the layer's forward)", "--tiled_mlp",
                                       "drop --tiled_mlp (--gradient_checkpointing also cuts the MLP's activations)")])
        mlp.forward = partial(_tiled, mlp.forward, chunk, type(mlp).__name__)
    return model


def _tiled(forward: Callable[[torch.Tensor], torch.Tensor], chunk: int, kind: str,
           hidden: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled() or hidden.shape[-2] <= chunk:
        return forward(hidden)
    # contiguous: a chunk of a batch of rows is a strided view, which some layers (GPT-2's Conv1D) cannot view flat
    parts = [checkpoint(forward, part.contiguous(), use_reentrant=False) for part in hidden.split(chunk, dim=-2)]
    if not all(isinstance(part, torch.Tensor) for part in parts):  # a mixture of experts' (output, router logits)
        raise ConfigError([Problem(f"{kind} returns more than its output (a mixture of experts' router logits), "
                                   "which --tiled_mlp does not put together", "--tiled_mlp", "drop --tiled_mlp")])
    return torch.cat(parts, dim=-2)
