"""The distributed strategies, one module each, and the registry that picks one for a launch.

    base.py       the interface (Strategy) and the registry
    ddp.py        one process, and DDP
    deepspeed.py  DeepSpeed ZeRO-1/2/3, with or without CPU offload
    fsdp.py       FSDP2 (fully_shard), with or without CPU offload
"""

from __future__ import annotations

from collections.abc import Mapping

from trainkit.config import TrainConfig
from trainkit.errors import ConfigError, Problem
from trainkit.launch import Launch, shipped_configs
from trainkit.strategies import ddp, deepspeed, fsdp  # noqa: F401  (each module registers its strategies)
from trainkit.strategies.base import REGISTRY, StepResult, Strategy

__all__ = ["REGISTRY", "StepResult", "Strategy", "for_format", "for_launch", "shipped_strategies"]


def for_launch(launch: Launch, cfg: TrainConfig, sources: Mapping[str, str]) -> Strategy:
    """The strategy that runs `launch`, made for this config (plan time: nothing is built yet)."""
    for cls in REGISTRY:
        if cls.selects(launch):
            return cls(launch, cfg, sources)
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
