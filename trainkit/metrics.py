"""What a run reports: metrics.jsonl, Accelerate's trackers, the progress bar, throughput, MFU and memory."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from trainkit.errors import Problem, TrainingError, write_failure

# Dense bf16/fp16 tensor-core peaks (FLOP/s) of GPUs we know; MFU is reported against these.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "V100": 125e12}


def peak_flops(device: torch.device, override: float | None) -> float | None:
    """The device's peak FLOP/s for MFU; None on CPUs (no meaningful peak) unless given with --peak_flops."""
    if override:
        return override
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)
    return None


def model_flops_per_token(num_params: int) -> float:
    """Training FLOPs per token ~ 6 N (forward 2N, backward 4N; attention's share is ignored at these sizes)."""
    return 6.0 * num_params


def state_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors` (Strategy.state_tensors: parameters, gradients, optimizer states,
    wherever they live), each storage once: a library's flat buffers and the parameters that view them count once;
    a DTensor counts its local shard; meta tensors hold no memory."""
    seen: set[tuple[int, str]] = set()
    total = 0
    for t in tensors:
        if t.device.type == "meta":  # DeepSpeed keeps meta tensors: shapes, no memory
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        key = (storage.data_ptr(), str(t.device))
        if storage.nbytes() and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def peak_memory_bytes(device: torch.device) -> int:
    """Peak device memory on GPUs; peak resident memory of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def check_trackers(report_to: list[str]) -> list[Problem]:
    """Trackers that cannot log here: Accelerate would drop them with only a warning, and the run would go unlogged."""
    import accelerate.utils as utils

    problems = []
    for name in report_to:
        available = getattr(utils, f"is_{name}_available", None)
        if available is None:
            problems.append(Problem(f"unknown tracker {name!r}", "--report_to",
                                    "use tensorboard, wandb, mlflow, trackio, comet_ml, aim, clearml, swanlab, "
                                    "dvclive or none"))
        elif not available():
            problems.append(Problem(f"the {name} tracker is not installed", "--report_to",
                                    f"pip install {name.replace('_', '-')}, or pass --report_to tensorboard"))
    return problems


class Throughput:
    """Samples and tokens per second over the steps since the last call."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def lap(self, samples: int) -> float:
        now = time.perf_counter()
        rate = samples / max(now - self.start, 1e-9)
        self.start = now
        return rate


class MetricsLog:
    """metrics.jsonl (a line per optimizer step, eval_loss on evaluation steps), trackers and a tqdm bar.

    All on the main process only: other ranks write nothing that the ranks share.
    """

    def __init__(self, accelerator, output_dir: Path, total_steps: int, initial_step: int):
        """initial_step > 0 (a resume) keeps the lines up to that step and drops those of steps that are redone."""
        self.accelerator = accelerator
        self.is_main = accelerator.is_main_process
        path = output_dir / "metrics.jsonl"
        self.file = None
        if self.is_main:
            kept = [line for line in path.read_text().splitlines(keepends=True)
                    if json.loads(line)["step"] <= initial_step] if initial_step and path.exists() else []
            self.file = open(path, "w")
            self.file.writelines(kept)
        self.bar = tqdm(total=total_steps, initial=initial_step, disable=not self.is_main, file=sys.stderr,
                        dynamic_ncols=True, desc="train")

    def step(self, record: dict[str, Any]) -> None:
        if self.file is not None:
            # A step that fp16's loss scaler skipped has an infinite gradient norm; JSON has no Infinity, so null.
            finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
            try:
                self.file.write(json.dumps(finite, allow_nan=False) + "\n")
                self.file.flush()
            except OSError as e:
                raise TrainingError(f"could not write {self.file.name}: {write_failure(e, Path(self.file.name))}",
                                    "free space and continue with --resume latest (the checkpoints written so far "
                                    "are whole), or start again (--overwrite) if there is none"
                                    ) from None
        self.accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"},
                             step=record["step"])
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", refresh=False)
        if "eval_loss" in record:
            extra = "".join(f", {k.removeprefix('eval_')} {v:.4f}" for k, v in record.items()
                            if k.startswith("eval_") and k != "eval_loss")
            self.bar.write(f"step {record['step']}: eval loss {record['eval_loss']:.4f}{extra}")

    def close(self) -> None:
        self.bar.close()
        if self.file is not None:
            self.file.close()


def summary_line(last: dict[str, Any], steps_run: int, seconds: float, extra: dict[str, float], final: Path) -> str:
    """The one line printed at the end: what was trained, how well, how fast, and where the outputs are."""
    if not last:
        return f"done: nothing left to train (already at max_steps); weights in {final}"
    parts = [f"done: {steps_run} steps (to step {last['step']}) in {seconds:.1f}s", f"train loss {last['loss']:.4f}"]
    if "eval_loss" in last:
        parts.append(f"eval loss {last['eval_loss']:.4f}")
        parts += [f"eval {k.removeprefix('eval_')} {v:.4f}" for k, v in last.items()
                  if k.startswith("eval_") and k != "eval_loss"]
    parts += [f"{name} {value:.4f}" for name, value in extra.items()]
    parts.append(f"{last['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in last
                 else f"{last['samples_per_s']:.0f} samples/s")
    parts.append(f"outputs in {final.parent} (weights: {final})")
    return " | ".join(parts)
