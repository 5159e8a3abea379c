"""The registry that picks the strategy of a launch, and the names the rest of the package takes from strategies/."""


from __future__ import annotations

from collections.abc import Mapping

from trainkit.config import TrainConfig
from trainkit.errors import ConfigError, Problem
from trainkit.launch.launcher import Launch, shipped_configs
from trainkit.recipes import Recipe
from trainkit.step import StepResult
from trainkit.strategies.base import Strategy
from trainkit.strategies.dcp_format import CheckpointFormat
from trainkit.strategies.ddp import DDP, Single
from trainkit.strategies.deepspeed import DeepSpeed
from trainkit.strategies.engine import Engine
from trainkit.strategies.fsdp import FSDP
from trainkit.strategies.pipeline import Pipeline

# Asked in this order, the most specific first: a pipeline runs on a data-parallel or FSDP launch (a YAML + flags).
REGISTRY: tuple[type[Strategy], ...] = (Pipeline, DeepSpeed, FSDP, DDP, Single)

__all__ = ["REGISTRY", "Engine", "StepResult", "Strategy", "for_format", "for_launch", "shipped_strategies"]


def for_launch(launch: Launch, cfg: TrainConfig, sources: Mapping[str, str], recipe: Recipe | None = None) -> Strategy:
    """The strategy that runs `launch` with this config, made for it (plan time: nothing is built yet)."""
    for cls in REGISTRY:
        if cls.selects(launch, cfg):
            return cls(launch, cfg, sources, recipe)
    raise ConfigError([Problem(f"no strategy runs distributed_type {launch.distributed_type}", launch.source,
                               "use a config from accelerate_configs/")])


def for_format(name: str) -> type[CheckpointFormat]:
    """The checkpoint format of this name (trainer_state.json's "format"), to read another strategy's weights."""
    return next(cls.engine.format for cls in REGISTRY if name in (cls.engine.format.name, *cls.engine.format.older))


def shipped_strategies() -> dict[str, Launch]:
    """The shipped configs that run several processes on one machine, by name: every strategy and variant the
    project ships, what --estimate's table and the test matrix (tests/test_strategies.py) cover."""
    return {name: launch for name, launch in shipped_configs().items()
            if launch.num_machines == 1 and launch.world_size > 1}
