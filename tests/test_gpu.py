"""Checks that need a CUDA device: NCCL, fp16 with the loss scaler, real sharding of device memory.

Skipped with the reason on CPU-only machines (CI); run them where a GPU is lent: `python -m pytest -m gpu`.
On one GPU the multi-GPU checks skip too; every shipped config still runs there as one process.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from conftest import PARITY_BOUND, assert_refused, launch, max_rel_diff

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
MLP = ["--recipe", "mlp", "--max_steps", "20", "--eval_every", "0", "--warmup_steps", "2"]
LM = ["--recipe", "tiny_transformer", "--max_steps", "20", "--eval_every", "0", "--hidden", "256", "--layers", "4"]
# ~25M parameters at micro-batch 2: model state (~400 MB in fp32 with Adam) outweighs activations, so sharding shows.
BIG_LM = ["--recipe", "tiny_transformer", "--max_steps", "3", "--eval_every", "0", "--hidden", "512", "--layers", "8",
          "--batch_size", "2"]
ONE_PROCESS_CONFIGS = ["deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero2_offload", "deepspeed_zero3",
                       "deepspeed_zero3_offload", "fsdp", "fsdp_offload"]


@pytest.fixture(scope="module")
def mlp_reference(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("gpu") / "ref", *MLP, "--batch_size", "16", config="single").check()


def test_single_gpu_run_uses_the_device_and_reports_mfu(run_dir):
    run = launch(run_dir("out"), *LM, "--batch_size", "16", config="single",
                 extra_launch=("--mixed_precision", "bf16")).check()
    last = run.metrics[-1]
    assert last["mfu"] is not None and 0 < last["mfu"] < 1  # a known GPU: its peak is in trainkit.launch.hardware
    assert last["peak_mem_bytes"] > 0 and run.losses[-1] < run.losses[0]


@pytest.mark.parametrize("config", ONE_PROCESS_CONFIGS)
def test_every_config_runs_on_one_gpu_like_single(mlp_reference, run_dir, config):
    """DeepSpeed and FSDP2 on CUDA over NCCL (a world of one): the same math as the plain single-GPU run."""
    run = launch(run_dir(config), *MLP, "--batch_size", "16", config=config,
                 extra_launch=("--num_processes", "1")).check()
    assert run.resolved["world_size"] == 1 and run.resolved["strategy"] == config.split("_")[0]
    assert max_rel_diff(run.losses, mlp_reference.losses) <= PARITY_BOUND


# With 256 input features the MLP's initial gradients reach 10-17 (measured in fp32 on the first batches): times the
# initial loss scale 2**16 they overflow fp16 (max 65504), so the first step is always skipped.
@pytest.mark.parametrize("config", ["single", "deepspeed_zero2"])  # torch's GradScaler; DeepSpeed's own loss scaler
def test_fp16_skips_overflowing_steps_and_counts_them(run_dir, config):
    run = launch(run_dir("out"), *MLP, "--features", "256", "--batch_size", "16", config=config,
                 extra_launch=("--mixed_precision", "fp16", "--num_processes", "1")).check()
    metrics = run.metrics
    skipped = [m["skipped_steps"] for m in metrics]
    assert skipped[0] == 1 and metrics[0]["grad_norm"] is None  # overflowed: skipped, counted, not fatal
    assert skipped == sorted(skipped) and skipped[-1] < len(metrics) - 5  # cumulative; the scale came down
    assert all(m["grad_norm"] is not None  # a step not skipped has a norm
               for m, before in zip(metrics[1:], skipped[:-1], strict=True) if m["skipped_steps"] == before)
    assert run.losses[-1] < run.losses[0]


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs for NCCL between processes")
@pytest.mark.parametrize("config", ["ddp", "deepspeed_zero2", "deepspeed_zero3", "fsdp"])
def test_nccl_strategies_match_one_gpu(mlp_reference, run_dir, config):
    run = launch(run_dir(config), *MLP, "--batch_size", "8", config=config).check()
    assert max_rel_diff(run.losses, mlp_reference.losses) <= 1e-5


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs for NCCL between processes")
@pytest.mark.parametrize(("config", "flags"), [
    ("tp", ["--batch_size", "16"]),  # one tensor-parallel pair: both processes see the whole batch
    ("ddp", ["--pipeline_stages", "2", "--grad_accum", "4", "--batch_size", "4"]),
    ("deepspeed_zero3_sp", ["--batch_size", "16"]),  # one sequence-parallel pair: Ulysses' all-to-alls over NCCL
    ("fsdp_cp", ["--batch_size", "16"]),  # one context-parallel pair: torch's ring attention (its CUDA kernels)
])
def test_model_parallel_strategies_over_nccl_match_one_gpu(run_dir, config, flags):
    """Tensor-parallel collectives, pipeline sends, sequence-parallel all-to-alls and the context-parallel ring over
    NCCL: the curve of one GPU (the transformer, fp32; the ring runs memory-efficient attention there)."""
    reference = launch(run_dir("ref"), *LM, "--batch_size", "16", config="single").check()
    run = launch(run_dir(config), *LM, *flags, config=config).check()
    assert max_rel_diff(run.losses, reference.losses) <= 1e-5


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs for NCCL between processes")
@pytest.mark.parametrize("config", ["fsdp_ep", "deepspeed_zero2_ep"])
@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_expert_parallelism_over_nccl_matches_one_gpu(chat, moe_folder, run_dir, config, mixed_precision):
    """fsdp_ep.yaml and DeepSpeed's AutoEP on 2 GPUs: the experts' all-to-alls over NCCL (uneven split sizes every
    layer; AutoEP's grouped matmuls on CUDA), a Qwen3-MoE with its balancing loss, at one GPU's curve; in bf16 within
    bf16's rounding of it."""
    args = ["--recipe", "causal_lm", "--model_name_or_path", str(moe_folder("qwen3_moe")), "--data", str(chat[1]),
            "--chat_template", "chatml", "--seq_len", "64", "--max_steps", "6", "--eval_every", "0", "--lr", "3e-3",
            "--router_aux_loss_coef", "1"]
    precision = ("--mixed_precision", mixed_precision)
    reference = launch(run_dir("ref"), *args, "--batch_size", "8", config="single", extra_launch=precision).check()
    run = launch(run_dir("ep"), *args, "--batch_size", "4", config=config, extra_launch=precision).check()
    assert run.resolved["ep"] == 2 and "this rank holds" in run.stderr
    assert max_rel_diff(run.losses, reference.losses) <= (PARITY_BOUND if mixed_precision == "no" else 2e-2)


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs for NCCL between processes")
@pytest.mark.parametrize(("config", "flags"), [
    ("fsdp_cp", ["--batch_size", "8"]),  # the router logits gathered in the real ring's chunk order
    ("tp", ["--batch_size", "8"]),  # the fused experts cut by transformers' styles, their sums over NCCL
    ("ddp", ["--pipeline_stages", "2", "--grad_accum", "2", "--batch_size", "4"]),  # router logits sent on
])
def test_a_mixture_of_experts_over_nccl_matches_one_gpu(chat, moe_folder, run_dir, config, flags):
    """Qwen3-MoE with its balancing loss under context parallelism (torch's ring attention, which the CPU tests stand
    in for), tensor parallelism and pipeline stages on 2 GPUs: one GPU's loss and aux_loss."""
    args = ["--recipe", "causal_lm", "--model_name_or_path", str(moe_folder("qwen3_moe")), "--data", str(chat[1]),
            "--chat_template", "chatml", "--seq_len", "64", "--max_steps", "6", "--eval_every", "0", "--lr", "3e-3",
            "--router_aux_loss_coef", "1"]
    reference = launch(run_dir("ref"), *args, "--batch_size", "8", config="single").check()
    run = launch(run_dir(config), *args, *flags, config=config).check()
    for key in ("loss", "aux_loss"):
        assert max_rel_diff([m[key] for m in run.metrics], [m[key] for m in reference.metrics]) <= 1e-5, key


def test_grpo_samples_on_the_gpu_as_one_process_does_under_zero3(chat, run_dir):
    """The grpo recipe on a GPU: each completion slot's generator lives on CUDA (trainkit/rl/sampling.py); in fp32
    ZeRO-3 (a world of one over NCCL, the policy gathered to generate) samples single's completions at its gradient
    norms; in bf16 the run trains (finite losses, every completion scored)."""
    prompts = run_dir("prompts.jsonl")
    prompts.parent.mkdir(parents=True, exist_ok=True)
    prompts.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i} plus 3?"}],
                                           "answer": i + 3}) + "\n" for i in range(32)))
    args = ["--recipe", "grpo", "--model_name_or_path", str(chat[0]), "--tokenizer", "saved", "--chat_template",
            "chatml", "--data", str(prompts), "--reward_funcs", "tests.helpers.rl_rewards.even_ids",
            "--num_generations", "4", "--max_completion_length", "16", "--seq_len", "64", "--batch_size", "8",
            "--max_steps", "4", "--lr", "3e-3", "--eval_every", "0"]
    fp32 = ("--mixed_precision", "no", "--num_processes", "1")
    single = launch(run_dir("single"), *args, config="single", extra_launch=fp32).check()
    zero3 = launch(run_dir("zero3"), *args, config="deepspeed_zero3", extra_launch=fp32).check()
    rollouts = [[(r["step"], r["generation"], r["completion"]) for r in map(json.loads, (
        run.output_dir / "rollouts.jsonl").read_text().splitlines())] for run in (single, zero3)]
    assert rollouts[0] == rollouts[1] and len(rollouts[0]) == 32
    norms = [m["grad_norm"] for m in zero3.metrics]
    assert max_rel_diff(norms, [m["grad_norm"] for m in single.metrics]) <= PARITY_BOUND, norms
    bf16 = launch(run_dir("bf16"), *args, config="single", extra_launch=("--mixed_precision", "bf16")).check()
    assert all(math.isfinite(m["loss"]) and m["generation_s"] > 0 for m in bf16.metrics)
    assert len((bf16.output_dir / "rollouts.jsonl").read_text().splitlines()) == 32


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_zero3_and_fsdp_shard_device_memory(run_dir):
    held = {c: launch(run_dir(c), *BIG_LM, config=c).check().metrics[-1] for c in ("ddp", "deepspeed_zero3", "fsdp")}
    for config in ("deepspeed_zero3", "fsdp"):
        assert held[config]["state_bytes"] <= 0.7 * held["ddp"]["state_bytes"], config  # 0.63 measured on CPU
        assert held[config]["peak_mem_bytes"] < held["ddp"]["peak_mem_bytes"], config


@pytest.mark.skipif(GPUS != 1, reason="checks the refusal on a one-GPU machine")
def test_more_processes_than_gpus_is_refused(run_dir):
    assert_refused(launch(run_dir("out"), *MLP, config="ddp"), "2 processes but 1 GPU(s) per machine")


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes (QLoRA's 4-bit base)")
def test_qlora_trains_adapters_over_a_4bit_base(chat, run_dir):
    """--load_in_4bit: the base quantised to NF4 (bitsandbytes), the adapters in bf16 learn, final/adapter loads
    over the full-precision base (the adapters do not depend on how the base was stored in training)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder, data = chat
    out = run_dir("qlora")
    run = launch(out, "--recipe", "causal_lm", "--model_name_or_path", str(folder), "--tokenizer", "saved", "--data",
                 str(data), "--chat_template", "chatml", "--seq_len", "96", "--max_steps", "10", "--lr", "3e-3",
                 "--lora_r", "8", "--load_in_4bit", "true", "--batch_size", "8", config="single",
                 extra_launch=("--mixed_precision", "bf16")).check()
    assert run.losses[-1] < run.losses[0]
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), str(out / "final" / "adapter"))


# A sequence whose logits dominate: 4 x 2048 tokens at a vocabulary of 8192 hold 256 MiB of fp32 logits.
LONG = ["--recipe", "tiny_transformer", "--max_steps", "5", "--eval_every", "0", "--vocab_size", "8192", "--seq_len",
        "2048", "--batch_size", "4", "--hidden", "256", "--layers", "4"]


def test_the_loss_in_chunks_cuts_the_peak_by_more_than_the_logits(run_dir):
    """trainkit/losses/chunked_loss.py on a GPU: the curve of the whole loss, the peak lower by more than the logits'
    size."""
    whole = launch(run_dir("whole"), *LONG, "--loss_chunk_mib", "0", config="single").check()
    chunked = launch(run_dir("chunked"), *LONG, "--loss_chunk_mib", "16", config="single").check()
    assert max_rel_diff(chunked.losses, whole.losses) <= PARITY_BOUND
    logits = 4 * 2048 * 8192 * 4
    assert chunked.metrics[-1]["peak_mem_bytes"] <= whole.metrics[-1]["peak_mem_bytes"] - logits


def test_activation_offload_cuts_the_peak_and_trains_the_same_curve(run_dir):
    """trainkit/models/activation_offload.py: the saved activations in host memory, the same curve, a lower peak (the
    logits' part of
    it stays: chunked here so that the layers' activations are what is left)."""
    flags = [*LONG, "--loss_chunk_mib", "16"]
    kept = launch(run_dir("kept"), *flags, config="single").check()
    offloaded = launch(run_dir("offloaded"), *flags, "--activation_offload", config="single").check()
    assert max_rel_diff(offloaded.losses, kept.losses) <= PARITY_BOUND  # GPU kernels: not bit-exact run to run
    assert offloaded.metrics[-1]["peak_mem_bytes"] <= 0.6 * kept.metrics[-1]["peak_mem_bytes"]
