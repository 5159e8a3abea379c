"""The one place that knows the distributed strategies (single, DDP, DeepSpeed, FSDP) and their CPU quirks.

`Launch` is what the launcher asked for: read from the environment that `accelerate launch` (or torchrun, or the
DeepSpeed launcher) sets up, or from an Accelerate YAML for a dry run. `build_accelerator` turns it into an
Accelerator that does exactly that on this machine, and `verify_accelerator` refuses to train when Accelerate
ended up doing something else. The traps handled here are listed in ../shared/PITFALLS.md; each is named where it
is handled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from trainkit.config import ConfigError, TrainConfig, problem

PRECISIONS = ("no", "bf16", "fp16")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


@dataclass(frozen=True, slots=True)
class Launch:
    """What the launcher asked for, before any process group exists."""

    kind: str  # single | ddp | deepspeed | fsdp
    world_size: int
    num_machines: int
    rank: int
    mixed_precision: str  # no | bf16 | fp16
    source: str  # where these values came from, for messages

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> Launch:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
        if _env_flag("ACCELERATE_USE_DEEPSPEED"):
            kind = "deepspeed"
        elif _env_flag("ACCELERATE_USE_FSDP"):
            kind = "fsdp"
        else:
            kind = "ddp" if world_size > 1 else "single"
        return cls(kind=kind, world_size=world_size, num_machines=max(1, world_size // max(1, local_world)),
                   rank=int(os.environ.get("RANK", "0")),
                   mixed_precision=os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower(),
                   source="the launcher's environment" if "ACCELERATE_MIXED_PRECISION" in os.environ
                   else "no launcher")

    @classmethod
    def from_yaml(cls, path: str) -> Launch:
        """What `accelerate launch --config_file PATH` would ask for (for --dry_run outside a launcher)."""
        where = f"--accelerate_config {path}"
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError([problem(f"{path} does not exist", where,
                                       "pass a file from accelerate_configs/")]) from None
        except yaml.YAMLError as e:
            raise ConfigError([problem(f"{path} is not valid YAML: {e}", where, "fix the file")]) from None
        kinds = {"NO": "single", "MULTI_GPU": "ddp", "MULTI_CPU": "ddp", "DEEPSPEED": "deepspeed", "FSDP": "fsdp"}
        distributed_type = str(data.get("distributed_type", "NO"))
        if distributed_type not in kinds:
            raise ConfigError([problem(f"distributed_type {distributed_type} is not supported", where,
                                       f"use one of {', '.join(kinds)}")])
        world_size = int(data.get("num_processes", 1))
        kind = kinds[distributed_type]
        if kind == "ddp" and world_size == 1:
            kind = "single"
        return cls(kind=kind, world_size=world_size, num_machines=int(data.get("num_machines", 1)), rank=0,
                   mixed_precision=str(data.get("mixed_precision", "no")).lower(), source=path)


def check_launch(launch: Launch, cfg: TrainConfig) -> list[str]:
    """Problems with this launch on this machine, found before anything is built."""
    problems = []
    on_gpu = torch.cuda.is_available()
    where = f"mixed_precision from {launch.source}"
    if launch.mixed_precision not in PRECISIONS:
        problems.append(problem(f"unknown precision {launch.mixed_precision!r}", where,
                                f"use one of {', '.join(PRECISIONS)}"))
    if launch.mixed_precision == "fp16" and not on_gpu:
        # Accelerate on CPU gives fp16 neither autocast nor a loss scaler: the run would silently be fp32.
        problems.append(problem("fp16 needs a GPU; this machine has none", where,
                                "use --mixed_precision bf16 (or no) on CPU"))
    if launch.kind in ("deepspeed", "fsdp"):
        problems.append(problem(f"the {launch.kind} strategy is not available yet in this runner",
                                f"distributed_type from {launch.source}", "use single.yaml or ddp.yaml"))
    return problems


def build_accelerator(launch: Launch, cfg: TrainConfig, output_dir: Path, report_to: list[str]):
    """An Accelerator that does what `launch` asked for on this machine, verified before it is returned."""
    from accelerate import Accelerator

    on_gpu = torch.cuda.is_available()
    accelerator = Accelerator(
        # A MULTI_GPU launch on a machine without GPUs only becomes MULTI_CPU over gloo when the script asks for
        # the CPU; otherwise every process runs alone as DistributedType.NO (PITFALLS: unsynchronised copies).
        cpu=not on_gpu,
        gradient_accumulation_steps=cfg.grad_accum,
        # The schedule is defined in optimizer steps; a prepared scheduler otherwise steps once per process.
        step_scheduler_with_optimizer=False,
        log_with=report_to or None,
        project_dir=str(output_dir),
    )
    verify_accelerator(launch, accelerator)
    return accelerator


EXPECTED_TYPES = {
    ("single", False): "NO", ("single", True): "NO",
    ("ddp", False): "MULTI_CPU", ("ddp", True): "MULTI_GPU",
}


def verify_accelerator(launch: Launch, accelerator) -> None:
    """Refuse to train unless Accelerate does what the launch asked: N unsynchronised copies is the worst failure."""
    expected = EXPECTED_TYPES[(launch.kind, torch.cuda.is_available())]
    actual = accelerator.distributed_type.value
    problems = []
    if actual != expected:
        problems.append(problem(f"Accelerate runs as {actual}, but the launch asked for {launch.kind} "
                                f"({expected} on this machine)", launch.source,
                                "build the Accelerator with trainkit.strategy.build_accelerator"))
    if accelerator.num_processes != launch.world_size:
        problems.append(problem(f"Accelerate sees {accelerator.num_processes} process(es) but the launcher started "
                                f"{launch.world_size}: each would train alone on all the data", launch.source,
                                "build the Accelerator with trainkit.strategy.build_accelerator"))
    if accelerator.mixed_precision != launch.mixed_precision:
        problems.append(problem(f"Accelerate uses precision {accelerator.mixed_precision}, the launch asked for "
                                f"{launch.mixed_precision}", launch.source, "check mixed_precision in the YAML"))
    if problems:
        raise ConfigError(problems)


def prepare_model(model: torch.nn.Module, launch: Launch, device: torch.device) -> tuple[torch.nn.Module, str | None]:
    """Strategy-specific model changes before Accelerate wraps it; returns the model and a note for the user."""
    has_batchnorm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if not has_batchnorm or launch.world_size == 1:
        return model, None
    if device.type == "cpu":
        # torch's SyncBatchNorm raises on CPU tensors ("expected input tensor to be on GPU"): say so, keep BN local.
        return model, ("BatchNorm stays per-rank: torch's SyncBatchNorm supports only GPU/XPU devices, so on CPU "
                       "each rank normalises with its own micro-batch statistics (losses will differ from one "
                       "process)")
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model), "BatchNorm converted to SyncBatchNorm"
