"""The Accelerator an engine runs under: built from what the engine adds (its kwargs, handlers, the CPU flag), and
refused unless Accelerate then does what the launch asked (N unsynchronised copies are the worst failure)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainkit.errors import ConfigError, Problem


def build(engine: Any, output_dir: Path, report_to: list[str]) -> tuple[Any, list[str]]:
    """(the verified Accelerator, notes to print) for `engine` (a strategies/engine.py Engine)."""
    from accelerate import Accelerator
    from accelerate.utils import GradScalerKwargs, InitProcessGroupKwargs

    cfg, launch = engine.cfg, engine.launch
    init = engine.process_group_kwargs()
    scaler = [GradScalerKwargs(init_scale=cfg.loss_scale)] if launch.mixed_precision == "fp16" else []
    accelerator = Accelerator(
        gradient_accumulation_steps=cfg.grad_accum,
        # The schedule is defined in optimizer steps; a prepared scheduler otherwise steps once per process.
        step_scheduler_with_optimizer=False,
        log_with=report_to or None,
        project_dir=str(output_dir),
        kwargs_handlers=([InitProcessGroupKwargs(**init)] if init else []) + engine.wrapper_kwargs() + scaler,
        **engine.accelerator_kwargs(),
    )
    verify(accelerator, engine)
    return accelerator, [use_cpu_fp16(accelerator, cfg.loss_scale)] if engine.strategy.cpu_fp16 else []


def use_cpu_fp16(accelerator: Any, loss_scale: float) -> str:
    """Give a CPU run what Accelerate gives a GPU run under fp16 and skips on a CPU (accelerator.py: fp16 "and
    self.device.type != 'cpu'"): native autocast, which prepare() then wraps the model's forward in
    (torch.autocast("cpu", dtype=float16)), and a loss scaler, which backward, clip_grad_norm_, the prepared
    optimizer's step and the checkpoint then use exactly as on a GPU. FSDP2 takes the same plain GradScaler there
    (Accelerate's get_fsdp2_grad_scaler): its DTensor gradients agree on an overflow across the mesh."""
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=loss_scale)
    return ("fp16 on a CPU: torch's CPU autocast and GradScaler('cpu'), which Accelerate gives only GPUs; it runs the "
            "loss scaler's logic (skipped steps, the scale, its checkpoint), slower than fp32 here: for tests, not "
            "for speed")


def verify(accelerator: Any, engine: Any) -> None:
    """Refuse to train unless Accelerate does what the launch asked."""
    launch = engine.launch
    expected, actual = engine.expected_distributed_type(), accelerator.distributed_type.value
    problems = []
    if actual != expected:
        problems.append(Problem(f"Accelerate runs as {actual}, but the launch asked for {engine.strategy.name} "
                                f"({expected} on this machine)", launch.source,
                                "build the Accelerator with the engine's build_accelerator"))
    if accelerator.num_processes != launch.world_size:
        problems.append(Problem(f"Accelerate sees {accelerator.num_processes} process(es) but the launcher started "
                                f"{launch.world_size}: each would train alone on all the data", launch.source,
                                "build the Accelerator with the engine's build_accelerator"))
    if accelerator.mixed_precision != launch.mixed_precision:
        problems.append(Problem(f"Accelerate uses precision {accelerator.mixed_precision}, the launch asked for "
                                f"{launch.mixed_precision}", launch.source, "check mixed_precision in the YAML"))
    if problems:
        raise ConfigError(problems)
