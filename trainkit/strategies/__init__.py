"""The distributed strategies, one module each, and the registry that picks one for a launch.

    base.py         the interface at plan time (Strategy): checks, resolved fields, labels, the estimate
    engine.py       what a strategy builds and runs (Engine): the Accelerator, prepare, the step's points
    dcp_format.py   the checkpoint format's interface, and torch.distributed.checkpoint's format
    dims.py         the one device mesh: the sizes of (pp, dp_replicate, dp_shard, cp, tp)
    parallelize.py  applying it to a model or a stage: tensor parallel, checkpointing, compile, FSDP2, in that order
    tp_plan.py      which layers tensor parallelism cuts
    ddp.py          one process, and DDP
    deepspeed.py    DeepSpeed ZeRO-1/2/3, with or without CPU offload (its own engine and step)
    mesh.py         an FSDP launch: FSDP2, HSDP, tensor parallelism, FSDP2 + TP (sizes of the mesh, one class)
    pipeline.py     pipeline stages (torch.distributed.pipelining) x any data-parallel or FSDP launch
"""

from __future__ import annotations

from collections.abc import Mapping

from trainkit.config import TrainConfig
from trainkit.errors import ConfigError, Problem
from trainkit.launch import Launch, shipped_configs
from trainkit.recipes import Recipe
from trainkit.step import StepResult
from trainkit.strategies.base import Strategy
from trainkit.strategies.dcp_format import CheckpointFormat
from trainkit.strategies.ddp import DDP, Single
from trainkit.strategies.deepspeed import DeepSpeed
from trainkit.strategies.engine import Engine
from trainkit.strategies.mesh import Mesh
from trainkit.strategies.pipeline import Pipeline

# Asked in this order, the most specific first: a pipeline runs on a data-parallel or FSDP launch (a YAML + flags).
REGISTRY: tuple[type[Strategy], ...] = (Pipeline, DeepSpeed, Mesh, DDP, Single)

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
