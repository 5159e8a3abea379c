"""The distributed strategies, one module each, and the registry that picks one for a launch.

    base.py       the interface (Strategy)
    ddp.py        one process, and DDP
    deepspeed.py  DeepSpeed ZeRO-1/2/3, with or without CPU offload
    fsdp.py       FSDP2 (fully_shard), with or without CPU offload
    mesh.py       tensor parallelism and HSDP: FSDP2 on a (dp_replicate, dp_shard, tp) device mesh
    pipeline.py   pipeline stages (torch.distributed.pipelining), optionally x data parallelism
"""

from __future__ import annotations

from collections.abc import Mapping

from trainkit.config import TrainConfig
from trainkit.errors import ConfigError, Problem
from trainkit.launch import Launch, shipped_configs
from trainkit.recipes import Recipe
from trainkit.strategies.base import StepResult, Strategy
from trainkit.strategies.ddp import DDP, Single
from trainkit.strategies.deepspeed import DeepSpeed
from trainkit.strategies.fsdp import FSDP2
from trainkit.strategies.mesh import HybridShard, TensorParallel
from trainkit.strategies.pipeline import Pipeline

# Asked in this order, the most specific first: a pipeline runs on a data-parallel launch (ddp.yaml + flags), tensor
# parallelism and HSDP on an FSDP launch with a parallelism_config.
REGISTRY: tuple[type[Strategy], ...] = (Pipeline, DeepSpeed, TensorParallel, HybridShard, FSDP2, DDP, Single)

__all__ = ["REGISTRY", "StepResult", "Strategy", "for_format", "for_launch", "shipped_strategies"]


def for_launch(launch: Launch, cfg: TrainConfig, sources: Mapping[str, str], recipe: Recipe | None = None) -> Strategy:
    """The strategy that runs `launch` with this config, made for it (plan time: nothing is built yet)."""
    for cls in REGISTRY:
        if cls.selects(launch, cfg):
            return cls(launch, cfg, sources, recipe)
    raise ConfigError([Problem(f"no strategy runs distributed_type {launch.distributed_type}", launch.source,
                               "use a config from accelerate_configs/")])


def for_format(checkpoint_format: str) -> type[Strategy]:
    """The strategy class that writes checkpoints in this format (to read another strategy's weights)."""
    return next(cls for cls in REGISTRY if cls.checkpoint_format == checkpoint_format)


def shipped_strategies() -> dict[str, Launch]:
    """The shipped configs that run several processes on one machine, by name: every strategy and variant the
    project ships, what --estimate's table and the test matrix (tests/test_strategies.py) cover."""
    return {name: launch for name, launch in shipped_configs().items()
            if launch.num_machines == 1 and launch.world_size > 1}
