"""train.py under a context-parallel YAML (accelerate_configs/fsdp_cp.yaml) on a CPU: the runner's context
parallelism whole, with only the ring attention's kernels, which are CUDA's, replaced by the same mathematics.

    accelerate launch --config_file accelerate_configs/fsdp_cp.yaml tests/helpers/context_parallel_on_cpu.py ARGS

torch's own `context_parallel` still runs (trainkit/strategies/fsdp.py's ring_context): it cuts the rows in place
with its load balancer and puts its ring in place of F.scaled_dot_product_attention. Inside it, F.scaled_dot_product_
attention is replaced once more, by `gathered_attention`: the keys and values of the cp group all-gathered (autograd's
all_gather, whose backward sums each gradient back to its rank), causal attention over the whole row by position
(trainkit/strategies/sequence_parallel.py's head_tail says which positions each rank holds;
tests/test_context_parallel.py checks it against torch's cut), the result of torch's CPU attention. That is what the
ring computes, in another order of additions. Everything else is the runner's: the mesh with its cp dimension, FSDP2
over dp_shard x cp, the parts' weights, the gradient correction, the loss reported, evaluation, checkpoints.
tests/test_gpu.py runs the real ring.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.nn.functional as distributed
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from trainkit.strategies import fsdp, sequence_parallel  # noqa: E402

CPU_ATTENTION = F.scaled_dot_product_attention  # before any context replaces it
# deprecated for torch.distributed._functional_collectives; kept for its backward over gloo (an all-to-all, as gloo
# has no reduce-scatter), which tests/test_context_parallel.py's curves check
warnings.filterwarnings("ignore", message="torch.distributed.nn.functional.all_gather is deprecated")
RING_CONTEXT = fsdp.ring_context


def gathered_attention(cp_mesh: Any) -> Callable[..., torch.Tensor]:
    """Causal attention of this rank's queries over the keys and values of the whole row, gathered from the group."""
    group, size, rank = cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank()

    def positions(holder: int, length: int) -> torch.Tensor:  # where a rank's `length` columns sit in the row
        return sequence_parallel.head_tail({"input_ids": torch.arange(length * size)[None]}, holder,
                                           size)["input_ids"][0]

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> torch.Tensor:
        assert attn_mask is None and is_causal and not enable_gqa, "the runner calls causal attention without a mask"
        # one collective for both: two would run their backward in whatever order autograd picks on each rank,
        # pairing one rank's keys with another's values (measured: wrong key and value gradients)
        keys, values = torch.cat(distributed.all_gather(torch.stack([key, value]).contiguous(), group=group), dim=3)
        length = query.shape[2]
        columns = torch.cat([positions(holder, length) for holder in range(size)])
        visible = positions(rank, length)[:, None] >= columns[None, :]
        return CPU_ATTENTION(query, keys, values, attn_mask=visible, dropout_p=dropout_p, scale=scale)

    return attention


@contextlib.contextmanager
def gathered_context(cp_mesh: Any, parts: list[torch.Tensor]) -> Iterator[None]:
    """torch's context (the cut, its ring in place), with gathered_attention in place of the ring."""
    with RING_CONTEXT(cp_mesh, parts):
        ring = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = gathered_attention(cp_mesh)
        try:
            yield
        finally:
            F.scaled_dot_product_attention = ring  # torch's exit restores the original from its ring


fsdp.context_parallel_refusal = lambda: None
fsdp.ring_context = gathered_context

if __name__ == "__main__":
    import train
    from trainkit.launch.rank_exit import end_process

    end_process(train.main(sys.argv[1:]))  # as train.py ends: a launched rank skips finalization (its docstring)
