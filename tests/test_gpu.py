"""Checks that need a CUDA device: NCCL, fp16 with the loss scaler, real sharding of device memory.

Skipped with the reason on CPU-only machines (CI); run them where a GPU is lent: `python -m pytest -m gpu`.
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_refused, launch, max_rel_diff

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
MLP = ["--recipe", "mlp", "--max_steps", "20", "--eval_every", "0", "--warmup_steps", "2"]
LM = ["--recipe", "tiny_transformer", "--max_steps", "20", "--eval_every", "0", "--hidden", "256", "--layers", "4"]


def test_single_gpu_run_uses_the_device_and_reports_mfu(run_dir):
    run = launch(run_dir("out"), *LM, "--batch_size", "16", config="single",
                 extra_launch=("--mixed_precision", "bf16")).check()
    last = run.metrics[-1]
    assert last["mfu"] is not None and 0 < last["mfu"] < 1  # a known GPU: its peak is in trainkit.metrics
    assert last["peak_mem_bytes"] > 0 and run.losses[-1] < run.losses[0]


def test_fp16_trains_and_counts_skipped_steps(run_dir):
    """The GradScaler starts at 2**16: its first steps usually overflow and are skipped, counted, not fatal."""
    run = launch(run_dir("out"), *MLP, "--batch_size", "16", config="single",
                 extra_launch=("--mixed_precision", "fp16")).check()
    skipped = [m["skipped_steps"] for m in run.metrics]
    assert skipped == sorted(skipped)  # cumulative
    assert run.losses[-1] < run.losses[0]


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs for NCCL between processes")
@pytest.mark.parametrize("config", ["ddp", "deepspeed_zero2", "deepspeed_zero3", "fsdp"])
def test_nccl_strategies_match_one_gpu(run_dir, config):
    reference = launch(run_dir("ref"), *MLP, "--batch_size", "16", config="single").check()
    run = launch(run_dir(config), *MLP, "--batch_size", "8", config=config).check()
    assert max_rel_diff(run.losses, reference.losses) <= 1e-5


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_zero3_and_fsdp_shard_device_memory(run_dir):
    held = {c: launch(run_dir(c), *LM, "--batch_size", "8", "--max_steps", "3", config=c).check().metrics[-1]
            for c in ("ddp", "deepspeed_zero3", "fsdp")}
    assert held["fsdp"]["state_bytes"] <= 0.6 * held["ddp"]["state_bytes"]
    assert held["deepspeed_zero3"]["peak_mem_bytes"] < held["ddp"]["peak_mem_bytes"]


@pytest.mark.skipif(GPUS != 1, reason="checks the refusal on a one-GPU machine")
def test_more_processes_than_gpus_is_refused(run_dir):
    assert_refused(launch(run_dir("out"), *MLP, config="ddp"), "2 processes but 1 GPU(s) per machine")
