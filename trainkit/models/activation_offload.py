"""--activation_offload: what autograd saves for backward kept in host memory from the forward to the backward.

Every tensor a forward saves for its backward (each layer's inputs, its attention's and MLP's intermediates) is copied
into pinned host memory as it is saved, and back to the device when backward needs it. Parameters stay where the
strategy keeps them (ZeRO-3 and FSDP2 gather them again for backward), and so does a tensor already in host memory:
on a CPU run nothing moves, and the run is the same. The copies run on the compute stream, so each waits for the
kernels before it: device memory for time (PCIe: about 25 GB/s each way). torch.autograd.graph.save_on_cpu does the
same for every saved tensor, the weights included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Packed = torch.Tensor | tuple[torch.device, torch.Tensor]


def _to_host(tensor: torch.Tensor) -> Packed:
    if tensor.device.type == "cpu" or isinstance(tensor, nn.Parameter):
        return tensor
    host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return tensor.device, host


def _back(packed: Packed) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    device, host = packed
    return host.to(device, non_blocking=True)


def offloading(loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> Callable[[nn.Module, Any], torch.Tensor]:
    """loss_fn with its forward's saved tensors in host memory."""

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(_to_host, _back):
            return loss_fn(model, batch)

    return loss
