"""The interface every strategy implements: what can be decided and checked before a model exists.

A strategy is everything that differs between single/DDP, DeepSpeed, FSDP2, pipeline and tensor parallelism, in
three objects with one owner each: this plan-time description (what it refuses before anything is built, the fields
it resolves, its labels, its memory estimate), made by the registry and held by trainkit/plan.py's Plan; the engine
it names (strategies/engine.py: the Accelerator, prepare, the points of one optimizer step, evaluate, the export),
made by train.py's build; and the engine's checkpoint format (strategies/dcp_format.py), made by the Checkpointer.
train.py, checkpoint.py and metrics.py call these and never ask which strategy runs.

To add a strategy: a module with a subclass and its engine, listed in strategies/registry.py's REGISTRY, a YAML in
accelerate_configs/, and the tests that every shipped config gets (tests/test_strategies.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from trainkit.config import TrainConfig
from trainkit.errors import Problem
from trainkit.estimate import Estimate, ModelShape
from trainkit.launch.launcher import Launch
from trainkit.recipes import Recipe
from trainkit.strategies.engine import Engine


class Strategy:
    """One distributed strategy as planned: made before any process group or model exists, read-only after."""

    name: ClassVar[str]  # resolved_config.json's "strategy"
    engine: ClassVar[type[Engine]]  # what builds and runs it (strategies/engine.py)
    # Whether the strategy cuts the model itself between ranks (pipeline stages, tensor-parallel matrices): it then
    # needs the recipe to say where (a split the recipe declares), and refuses a model that declares none.
    splits_model: ClassVar[bool] = False
    # Whether it runs on GPUs only (its check refuses it on a machine without, saying why; the CPU test matrix leaves
    # it to tests/test_gpu.py).
    needs_gpu: ClassVar[bool] = False
    # Whether it trains only a mixture of experts (expert parallelism: it refuses a dense model; the test matrices of
    # dense models leave it to tests/test_moe.py).
    needs_experts: ClassVar[bool] = False

    def __init__(self, launch: Launch, cfg: TrainConfig, sources: Mapping[str, str],
                 recipe: Recipe | None = None) -> None:
        self.launch, self.cfg, self.sources, self.recipe = launch, cfg, dict(sources), recipe
        # what planning decided on the user's behalf, printed once before training (a subclass's __init__ adds its own)
        self.notes: tuple[str, ...] = ()

    @classmethod
    def selects(cls, launch: Launch, cfg: TrainConfig) -> bool:
        """Whether this strategy runs `launch` with this config (the registry asks each in turn)."""
        raise NotImplementedError

    def check(self, this_machine: bool = True) -> list[Problem]:
        """What this strategy refuses in the launch and the config, every problem at once (a subclass adds its own
        to these); `this_machine` False leaves out what only this machine refuses (--estimate sizes a launch for
        another machine)."""
        problems = []
        if self.cfg.compile and (refusal := self.compile_refusal()) is not None:
            problems.append(Problem(f"--compile does not work under {self.label}: {refusal}",
                                    f"--compile with {self.launch.source}",
                                    "drop --compile (it changes speed, not the numbers), or train under a config it "
                                    "works under: ddp.yaml, deepspeed_zero2.yaml, fsdp.yaml, ... "
                                    "(docs/strategies.md#torchcompile)"))
        if this_machine and self.cpu_fp16 and (refusal := self.cpu_fp16_refusal()) is not None:
            problems.append(Problem(f"fp16 on a CPU does not work under {self.label}: {refusal}",
                                    f"mixed_precision from {self.launch.source}",
                                    "on a CPU, test fp16's loss scaler under single.yaml, ddp.yaml or fsdp.yaml, and "
                                    "train in bf16 (--mixed_precision bf16) or fp32 (docs/strategies.md#precision)"))
        return problems

    def compile_refusal(self) -> str | None:
        """Why torch.compile does not work under this strategy (--compile is refused before anything is built), or
        None where it does."""
        return None

    @property
    def cpu_fp16(self) -> bool:
        """fp16 on a machine without GPUs: torch's CPU autocast and loss scaler, which the runner supplies
        (strategies/accelerator.py); a way to run the loss-scaler logic in CI, not a way to train faster."""
        return self.launch.mixed_precision == "fp16" and not torch.cuda.is_available()

    def cpu_fp16_refusal(self) -> str | None:
        """Why fp16 on a CPU does not work under this strategy (refused before anything is built), or None."""
        return None

    def check_model(self, model: torch.nn.Module) -> list[Problem]:
        """What this strategy refuses in the recipe's model, built on the meta device (structure only)."""
        return []

    @property
    def label(self) -> str:
        """The strategy with its variant (deepspeed_zero3_offload): --estimate's rows, benchmarks."""
        return self.name

    def resolved_fields(self) -> dict[str, Any]:
        """The strategy's entries in resolved_config.json."""
        return {"strategy": self.name, "zero_stage": None}

    @property
    def data_parallel_size(self) -> int:
        """How many ranks compute different parts of each global batch (the rest split the model, not the data): the
        world size for data parallelism; the global batch is batch_size x grad_accum x this."""
        return self.launch.world_size

    @property
    def sequence_parallel_size(self) -> int:
        """The ranks that share each sample's positions between them (a DeepSpeed YAML's parallelism_config_sp_size):
        activations per rank are those of 1/this of each sequence."""
        return 1

    @property
    def speed_rank(self) -> int:
        """Where --estimate tries this strategy when it looks for the fastest one that fits: less communication
        and no host traffic first (DDP 0 ... ZeRO-3 offload 7)."""
        return 0

    def estimate(self, shape: ModelShape, world_size: int, activations: int) -> Estimate:
        """Model-state bytes one rank holds under this strategy (what metrics.jsonl's state_bytes measures)."""
        raise NotImplementedError
