"""What a run reports: metrics.jsonl, Accelerate's trackers, the progress bar, throughput, MFU and memory."""

from __future__ import annotations

import io
import json
import math
import os
import resource
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
from tqdm.auto import tqdm

from trainkit.errors import Problem, writing
from trainkit.models import pretrained, quantised
from trainkit.recipes import SAMPLES


@dataclass(frozen=True, slots=True)
class FlopCount:
    """Training FLOPs of one sample, as nanoGPT's `estimate_mfu` and the PaLM paper (appendix B) count them: per
    token 6 N (forward 2 N, backward 4 N: every parameter multiplies once per token) plus, for a transformer,
    12 x layers x hidden x seq_len (attention's scores and weighted sum over the sequence, forward and backward).

    N counts the parameters that multiply: all of them except input embedding tables (a lookup is not a matmul). As
    in nanoGPT, a token embedding tied to the output layer counts (it is the output layer's matmul) and a position
    embedding does not; an untied input embedding does not either. In a mixture of experts a token multiplies only
    the experts it is routed to: its routed experts count top_k / experts of theirs (the active parameters, as
    DeepSeek-V3's and Qwen3-MoE's reports count them; shared experts and routers count whole)."""

    params: int  # N
    per_token: float | None  # token recipes
    per_sample: float

    def resolved(self) -> dict[str, Any]:
        """resolved_config.json's keys: flops_param_count, flops_per_token (token recipes), flops_per_sample."""
        keys: dict[str, Any] = {"flops_param_count": self.params, "flops_per_sample": self.per_sample}
        if self.per_token is not None:
            keys["flops_per_token"] = self.per_token
        return keys


def count_flops(model: torch.nn.Module, tokens_per_sample: int | None) -> FlopCount:
    """The FLOP count of `model` (a meta-device build is enough). The attention term needs a transformer's
    `config.num_hidden_layers` and `hidden_size` and a sequence (`tokens_per_sample`); other models get 6 N per sample,
    or per token when they have tokens."""
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    lookups = {id(m.weight): m.weight.numel() for m in model.modules()
               if isinstance(m, torch.nn.Embedding) and id(m.weight) not in linear_weights}
    params = sum(p.numel() for p in model.parameters()) - sum(lookups.values()) - idle_expert_params(model)
    config = getattr(model, "config", None)
    layers, hidden = getattr(config, "num_hidden_layers", None), getattr(config, "hidden_size", None)
    if tokens_per_sample is None:
        return FlopCount(params, None, 6.0 * params)
    attention = 12.0 * layers * hidden * tokens_per_sample if layers and hidden else 0.0
    per_token = 6.0 * params + attention
    return FlopCount(params, per_token, per_token * tokens_per_sample)


def idle_expert_params(model: torch.nn.Module) -> int:
    """The routed experts' parameters that a token does not multiply: (1 - top_k / experts) of them, for each
    module that holds the routed experts (transformers' fused `experts` module, or a ModuleList of experts; under
    peft's adapters on them, the module they wrap), with top_k the config's num_experts_per_tok; 0 for a dense
    model."""
    config = getattr(model, "config", None)
    text = pretrained.text_config(config)
    top_k = getattr(text, "num_experts_per_tok", None)
    if not top_k:
        return 0
    idle = 0
    for module in model.modules():
        experts = getattr(module, "experts", None)
        while isinstance(getattr(experts, "base_layer", None), torch.nn.Module):  # peft's ParamWrapper, nested
            experts = experts.base_layer
        if isinstance(experts, torch.nn.ModuleList) and len(experts):
            count = len(experts)
        elif isinstance(experts, torch.nn.Module) and (params := list(experts.parameters(recurse=False))):
            count = getattr(experts, "num_experts", None) or params[0].shape[0]
        else:
            continue
        idle += round(sum(p.numel() for p in experts.parameters()) * (1 - min(top_k, count) / count))
    return idle


def process_seconds() -> float:
    """Seconds since this process started (its interpreter, imports included): the time a run takes to its first
    step is the first metrics line's value."""
    return time.time() - psutil.Process().create_time()


def model_state_tensors(model: torch.nn.Module, optimizer: Any) -> Iterator[torch.Tensor]:
    """Every tensor of model state a rank holds: parameters, gradients, optimizer states (state_bytes counts each
    storage once), through Accelerate's optimizer wrapper to the torch optimizer (or a library's own)."""
    for p in model.parameters():
        yield p
        if p.grad is not None:
            yield p.grad
    yield from quantised.constant_tensors(model)  # a quantised base's constants, which are no parameters
    inner = optimizer
    while inner is not None:
        for state in getattr(inner, "state", {}).values():
            yield from (v for v in (state.values() if isinstance(state, dict) else ()) if torch.is_tensor(v))
        for group in getattr(inner, "param_groups", []):
            for p in group["params"]:
                yield p
                if p.grad is not None:
                    yield p.grad
        inner = getattr(inner, "optimizer", None)


def state_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors` (Engine.state_tensors: parameters, gradients, optimizer states,
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


def reported_means(accelerator, reported: dict[str, torch.Tensor], every_rank_reports: bool,
                   sample_copies: int = 1) -> dict[str, float]:
    """The means over the step's global batch of what the recipe's loss reported beside itself
    (Recipe.take_reported: sums, and the samples they are over), with one all-reduce. Where only some ranks compute
    the loss (a pipeline's last stage) nothing is reported: the ranks would not meet in the collective. Where
    `sample_copies` ranks compute parts of the same samples (sequence parallelism), each counts them: their sums are
    of their parts, their samples counted once."""
    if not reported or not every_rank_reports:
        return {}
    names = sorted(reported)
    totals = accelerator.reduce(torch.stack([reported[name].to(accelerator.device) for name in names]), "sum")
    by_name = dict(zip(names, totals.tolist(), strict=True))
    samples = by_name.pop(SAMPLES) / sample_copies
    return means_of(by_name, samples)


def means_of(totals: dict[str, float], samples: float) -> dict[str, float]:
    """Each reported total over the samples, or a name "<name> per <other>" over the other's total (a token-weighted
    mean), left out where the other's total is 0 (KTO's rewards of undesirable answers in a batch of desirable ones
    alone: a mean of nothing is no 0.0); a name that starts with HIDDEN is only a total others are over."""
    means = {}
    for name, total in totals.items():
        numerator, _, over = name.partition(PER)
        count = totals[over] if over else samples
        if not numerator.startswith(HIDDEN) and count:
            means[numerator] = total / count
    return means


PER = " per "  # a reported name "kl per completion_tokens": its global sum over completion_tokens' global sum
HIDDEN = "_"  # a reported name that starts so is only a total that others are over, not a metric


TRACKED_RUN = "train"  # the trackers' run name: TensorBoard writes under <output_dir>/train


def start_trackers(accelerator, output_dir: Path, resolved: dict[str, Any]) -> None:
    """The trackers (--report_to), given the run's settings; a failed write named (trainkit/errors.py's writing)."""
    with writing(output_dir / TRACKED_RUN):
        accelerator.init_trackers(TRACKED_RUN, config={k: v for k, v in resolved.items()
                                                       if isinstance(v, (int, float, str))})


def end_trackers(accelerator, output_dir: Path) -> None:
    """accelerator.end_training: the trackers write what they still hold; a failed write named."""
    with writing(output_dir / TRACKED_RUN):
        accelerator.end_training()


class MetricsLog:
    """metrics.jsonl (a line per optimizer step, eval_loss on evaluation steps), trackers and a tqdm bar.

    All on the main process only: other ranks write nothing that the ranks share.
    """

    def __init__(self, accelerator, output_dir: Path, total_steps: int, initial_step: int):
        """initial_step > 0 (a resume) keeps the lines up to that step and drops those of steps that are redone."""
        self.accelerator = accelerator
        self.is_main = accelerator.is_main_process
        self.file = _continued(output_dir / "metrics.jsonl", initial_step) if self.is_main else None
        self.tracker_dir = output_dir / TRACKED_RUN
        # the recipe's generated answers at each evaluation (Recipe.generate), opened at the first
        self.generations_path, self.initial_step = output_dir / "generations.jsonl", initial_step
        self.generations = None
        # an online-RL recipe's completions of every step (Recipe.rollout), opened at the first
        self.rollouts_path, self.rollouts = output_dir / "rollouts.jsonl", None
        self.bar = tqdm(total=total_steps, initial=initial_step, disable=not self.is_main, file=sys.stderr,
                        dynamic_ncols=True, desc="train")

    def step(self, record: dict[str, Any]) -> None:
        if self.file is not None:
            # A step that fp16's loss scaler skipped has an infinite gradient norm; JSON has no Infinity, so null.
            _write(self.file, [{k: None if isinstance(v, float) and not math.isfinite(v) else v
                                for k, v in record.items()}])
        # TensorBoard's writer raises its thread's failure here (trainkit/launch/library_noise.py)
        with writing(self.tracker_dir):
            self.accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"},
                                 step=record["step"])
        # the postfix first: update() draws the bar, which then shows this step's loss and lr, not the step before's
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", refresh=False)
        self.bar.update(1)
        if "eval_loss" in record and self.is_main:  # tqdm.write is a class method: a disabled bar writes too
            extra = "".join(f", {k.removeprefix('eval_')} {v:.4f}" for k, v in record.items()
                            if k.startswith("eval_") and k != "eval_loss")
            self.bar.write(f"step {record['step']}: eval loss {record['eval_loss']:.4f}{extra}")

    def answers(self, step: int, answers: list[dict[str, str]]) -> None:
        """generations.jsonl: a line per answer, with the step; printed too (the first of them)."""
        if not (self.is_main and answers):
            return
        if self.generations is None:
            self.generations = _continued(self.generations_path, self.initial_step)
        _write(self.generations, [{"step": step, **answer} for answer in answers])
        self.bar.write(f"step {step}: {' | '.join(f'{k}: {v!r}' for k, v in answers[0].items())}"[:300])

    def rollout_rows(self, step: int, rows: list[dict[str, Any]]) -> None:
        """rollouts.jsonl: every rank's rows of this step (a collective), written by rank 0 in rank order."""
        from accelerate.utils import gather_object

        everyone = gather_object(rows) if self.accelerator.num_processes > 1 else rows
        if not (self.is_main and everyone):
            return
        if self.rollouts is None:
            self.rollouts = _continued(self.rollouts_path, self.initial_step)
        _write(self.rollouts, [{"step": step, **row} for row in everyone])

    def close(self) -> None:
        self.bar.close()
        for file in (self.file, self.generations, self.rollouts):
            if file is not None:
                file.close()


def _continued(path: Path, initial_step: int) -> io.FileIO:
    """path opened for writing: after a resume (initial_step > 0) to append to its lines up to that step, those of
    the steps that are redone (and a line a kill cut short) cut off in place. Truncating never takes a kept line off
    the disk: the file rewritten instead held them only in memory until the first new step was flushed, and a launch
    killed before then lost them all."""
    if not (initial_step and path.exists()):
        return open(path, "wb", buffering=0)
    keep = 0
    with open(path, "rb") as lines:  # written in step order: the kept lines come first
        for line in lines:
            try:
                if not line.endswith(b"\n") or json.loads(line)["step"] > initial_step:
                    break
            except (json.JSONDecodeError, KeyError):
                break
            keep += len(line)
    os.truncate(path, keep)
    return open(path, "ab", buffering=0)


def _write(file: io.FileIO, records: list[dict[str, Any]]) -> None:
    """Whole lines, or nothing: the part of a line a full disk took is cut off again before the run ends (unbuffered,
    so that no write is left pending to end the file with half a line at close)."""
    data = memoryview("".join(json.dumps(record, allow_nan=False) + "\n" for record in records).encode())
    whole = file.seek(0, os.SEEK_END)
    with writing(Path(file.name)):
        try:
            while data:
                data = data[file.write(data):]
        except OSError:
            file.truncate(whole)
            raise


def close_progress_bars() -> None:
    """End the line of any progress bar still drawn (a run that stops mid-loop), so that what is printed next starts
    a line of its own: `grep '^error:'` finds it."""
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def summary_line(last: dict[str, Any], steps_run: int, seconds: float, extra: dict[str, float], final: Path,
                 samples_per_step: int, tokens_per_sample: int | None) -> str:
    """The one line printed at the end: what was trained, how well, how fast (the launch's average over its loop,
    evaluations and saves included: the last step's own rate says little of a run), and where the outputs are."""
    if not last:
        return f"done: nothing left to train (already at max_steps); weights in {final}"
    parts = [f"done: {steps_run} steps (to step {last['step']}) in {seconds:.1f}s", f"train loss {last['loss']:.4f}"]
    if "eval_loss" in last:
        parts.append(f"eval loss {last['eval_loss']:.4f}")
        parts += [f"eval {k.removeprefix('eval_')} {v:.4f}" for k, v in last.items()
                  if k.startswith("eval_") and k != "eval_loss"]
    parts += [f"{name} {value:.4f}" for name, value in extra.items()]
    rate = steps_run * samples_per_step / seconds if seconds > 0 else 0.0
    parts.append(f"{rate * tokens_per_sample:.0f} tokens/s on average" if tokens_per_sample
                 else f"{rate:.0f} samples/s on average")
    parts.append(f"outputs in {final.parent} (weights: {final})")
    return " | ".join(parts)
