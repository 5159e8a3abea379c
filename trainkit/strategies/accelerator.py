"""The Accelerator an engine runs under: built from what the engine adds (its kwargs, handlers, the CPU flag), and
refused unless Accelerate then does what the launch asked (N unsynchronised copies are the worst failure)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from trainkit.errors import ConfigError, Problem

_JOINED = "trainkit/joined"  # the launch store's count of rank starts: join_restarted_group


def build(engine: Any, output_dir: Path, report_to: list[str]) -> tuple[Any, list[str]]:
    """(the verified Accelerator, notes to print) for `engine` (a strategies/engine.py Engine)."""
    from accelerate import Accelerator
    from accelerate.utils import GradScalerKwargs, InitProcessGroupKwargs

    cfg, launch = engine.cfg, engine.launch
    init = engine.process_group_kwargs()
    scaler = [GradScalerKwargs(init_scale=cfg.loss_scale)] if launch.mixed_precision == "fp16" else []
    notes = [note] if (note := join_restarted_group(init)) else []
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
    return accelerator, notes + ([use_cpu_fp16(accelerator, cfg.loss_scale)] if engine.strategy.cpu_fp16 else [])


def join_restarted_group(init: dict[str, Any]) -> str | None:
    """After a rank died and the launch started ranks again (torchrun's --max_restarts, or a machine's launch started
    anew), make the process group under a key prefix of this attempt; returns the note that says so, or None on a
    first start (Accelerate makes the group then).

    torchrun's static rendezvous (every `accelerate launch` on one machine, and multinode.yaml's launches) keeps its
    TCPStore across restarts, and the ranks' process group uses that store without a prefix per attempt (torch's
    rendezvous.py assumes a new store for every retry). The restarted ranks then find the keys of the attempt before:
    measured here, a rank read its dead peer's gloo address and failed ("Gloo connectFullMesh failed ... Connection
    refused"), so the restart failed too (pytorch/pytorch#135712 is the same trap under the c10d rendezvous).
    The attempt is counted in that store, not taken from TORCHELASTIC_RESTART_COUNT: the count is each machine's
    own, so a machine whose launch was killed and started again (count 0) would meet the others (count 1) under
    another prefix. Every rank of every attempt adds one at its start, so rank arrivals W*k+1..W*k+W are attempt k
    in whatever order the machines come back, and after any number of timed-out attempts of the ones that waited.
    Accelerate makes no group of its own once one exists."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    world_size, timeout = int(os.environ["WORLD_SIZE"]), init.get("timeout")  # None: torch's defaults, as at start
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          **({"timeout": timeout} if timeout else {}))
    attempt = (store.add(_JOINED, 1) - 1) // world_size
    if not attempt:
        return None
    backend = init.get("backend") or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, store=dist.PrefixStore(f"trainkit/attempt_{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=world_size, timeout=timeout)
    return f"attempt {attempt + 1} of this launch (a rank was started again): the ranks joined anew"


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
