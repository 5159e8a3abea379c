"""The memory estimator's table and advice (its numbers are checked against measurements in test_strategies.py)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from conftest import ROOT
from trainkit.command_line import parse_bytes
from trainkit.estimate import Estimate, ModelShape, model_shape
from trainkit.recipes import load_recipe
from trainkit.strategies.registry import for_launch, shipped_strategies

STRATEGIES = shipped_strategies()


def estimate(shape: ModelShape, config: str, world_size: int, precision: str, optimizer: str) -> Estimate:
    """The estimate of a shipped config's strategy for another world size and precision."""
    launch = dataclasses.replace(STRATEGIES[config], world_size=world_size, mixed_precision=precision)
    recipe = load_recipe("mlp")
    return for_launch(launch, recipe.Config(optimizer=optimizer), {}).estimate(shape, world_size, 0)

# A 7B-class transformer at 4 sequences of 2048 tokens, with gradient checkpointing.
BIG = ["--hidden", "4096", "--layers", "32", "--heads", "32", "--seq_len", "2048", "--vocab_size", "32000",
       "--batch_size", "4", "--gradient_checkpointing"]


def test_table_names_the_cheapest_strategy_that_fits(check_only, run_dir):
    run = check_only(run_dir("x"), "--recipe", "tiny_transformer", "--estimate", "--num_processes", "8",
                     "--device_memory", "80GB", *BIG).check()
    rows = {line.split()[0] for line in run.stdout.splitlines()}
    assert set(STRATEGIES) <= rows
    assert ("--device_memory 74.506 GiB: a strategy fits when its device peak is at most 66.055 GiB (90% less 1 "
            "GiB: the rest goes to the CUDA context") in run.stdout
    assert "cheapest strategy that fits: deepspeed_zero2 (device peak " in run.stdout
    small = check_only(run_dir("y"), "--recipe", "tiny_transformer", "--estimate", "--num_processes", "8",
                       "--device_memory", "24GB", *BIG).check()
    assert "cheapest strategy that fits: fsdp_offload" in small.stdout
    none = check_only(run_dir("z"), "--recipe", "tiny_transformer", "--estimate", "--num_processes", "1",
                      "--device_memory", "1GB", *BIG).check()
    assert "nothing fits" in none.stdout
    assert not run_dir("x").exists()


def test_estimate_follows_the_launch_yaml(check_only, run_dir):
    run = check_only(run_dir("x"), "--recipe", "mlp", "--estimate",
                     "--accelerate_config", str(ROOT / "accelerate_configs" / "deepspeed_zero3.yaml")).check()
    assert "this launch (deepspeed_zero3, 2 process(es))" in run.stdout


def test_deepspeed_holds_more_than_the_idealised_zero_paper():
    recipe = load_recipe("mlp")
    shape = model_shape(recipe, recipe.Config())
    n = shape.num_params
    zero2 = estimate(shape, "deepspeed_zero2", 4, "no", "adamw")
    assert zero2.state == 4 * n + 12 * -(-n // 4)  # full fp32 weights + (master 4 + Adam 8) / 4
    ddp, fsdp = estimate(shape, "ddp", 4, "no", "adamw"), estimate(shape, "fsdp", 4, "no", "adamw")
    assert ddp.state == 16 * n and fsdp.state <= 16 * n / 4 + 16 * len(shape.numels)
    bf16 = estimate(shape, "deepspeed_zero3", 4, "bf16", "adamw")
    assert bf16.params < estimate(shape, "deepspeed_zero3", 4, "no", "adamw").params


@pytest.mark.parametrize("text, value", [("80GB", 80 * 10 ** 9), ("24GiB", 24 * 2 ** 30), ("1.5 TB", 1.5e12),
                                         ("512B", 512)])
def test_sizes_parse(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("size", ["lots", "80"])
def test_a_size_without_its_unit_is_refused(check_only, run_dir, size):
    """80 could be bytes or GB: the unit is asked for, not guessed."""
    run = check_only(run_dir("x"), "--recipe", "mlp", "--estimate", "--device_memory", size)
    assert run.returncode == 2 and f"cannot read {size!r} as a size: write it with its unit, like 80GB" in run.stderr


def test_a_7b_llama_is_sized_as_published_and_the_verdict_is_readable(check_only, run_dir):
    """Llama-2-7B's shape through the recipe's flags gives its published 6,738,415,616 parameters; the precision is
    a flag, named as people name it; the launch's own line says whether it fits and by how much, in the table's
    unit."""
    llama_7b = ["--hidden", "4096", "--layers", "32", "--heads", "32", "--ffn", "11008", "--vocab_size", "32000",
                "--seq_len", "4096", "--tie_embeddings", "false", "--batch_size", "1", "--gradient_checkpointing"]
    zero3 = ["--accelerate_config", str(ROOT / "accelerate_configs" / "deepspeed_zero3.yaml")]
    run = check_only(run_dir("x"), "--recipe", "tiny_transformer", "--estimate", "--num_processes", "8",
                     "--device_memory", "80GB", "--precision", "bf16", *zero3, *llama_7b).check()
    assert run.stdout.startswith("6,738,415,616 parameters, 8 process(es), bf16, optimizer adamw; GiB per rank")
    assert re.search(r"this launch \(deepspeed_zero3, 8 process\(es\)\): [\d.]+ GiB of model state per rank, "
                     r"device peak [\d.]+ GiB; fits, [\d.]+ GiB to spare", run.stdout), run.stdout
    tight = check_only(run_dir("y"), "--recipe", "tiny_transformer", "--estimate", "--num_processes", "2",
                       "--device_memory", "24GB", *zero3, *llama_7b).check()
    assert ", fp32, optimizer adamw" in tight.stdout and re.search(r"; does not fit: [\d.]+ GiB over", tight.stdout)


def test_the_table_says_what_it_assumed_and_names_no_launch_when_none_was_chosen(check_only, run_dir):
    """The README's estimate gives no --batch_size or --seq_len: the recipe's 16 x 128 are said with the table, with
    the precision, the attention, checkpointing and the loss's logits (2,048 positions fit one chunk of 1 GiB);
    without a config "this launch" would be a launch nobody chose."""
    run = check_only(run_dir("x"), "--recipe", "tiny_transformer", "--estimate", "--num_processes", "8",
                     "--precision", "bf16", "--hidden", "512").check()
    assert "assumed per rank: micro-batch 16 x 128 tokens (--batch_size, --seq_len), bf16, attention sdpa (does not " \
           "keep the scores), gradient checkpointing off, the loss's logits whole: activations " in run.stdout
    assert "this launch" not in run.stdout and "no launch chosen: with --accelerate_config FILE" in run.stdout
    eager = check_only(run_dir("y"), "--recipe", "mlp", "--estimate").check()
    assert "micro-batch 32 (--batch_size), fp32, not a transformers decoder" in eager.stdout


def test_a_tiny_model_reads_in_a_unit_where_no_figure_is_0_and_sp_says_a_ranks_share(check_only, run_dir):
    """The MLP (6,337 parameters) in MiB, not a column of 0.000 GiB; under deepspeed_zero3_sp.yaml the header gives
    the whole sequences' activations and this launch's rank's share, as the row counts it (before: only the whole)."""
    mlp = check_only(run_dir("mlp"), "--recipe", "mlp", "--estimate").check()
    assert mlp.stdout.splitlines()[0].endswith("; MiB per rank"), mlp.stdout
    rows = [line.split() for line in mlp.stdout.splitlines() if line.startswith(("single ", "deepspeed_zero3 "))]
    assert rows and all(float(figure) > 0 for row in rows for figure in row[1:3]), rows
    sp = check_only(run_dir("sp"), "--recipe", "tiny_transformer", "--estimate", "--accelerate_config",
                    str(ROOT / "accelerate_configs" / "deepspeed_zero3_sp.yaml")).check()
    whole, share = map(float, re.search(r"activations ([\d.]+) GiB for whole sequences, ([\d.]+) GiB for this "
                                        r"launch's rank", sp.stdout).groups())
    assert share == pytest.approx(whole / 2, rel=0.05), sp.stdout


def test_7b_at_4096_tokens_without_checkpointing_fits_zero3_under_sdpa(check_only, run_dir):
    """sdpa keeps no attention scores: the 5as/h term of Korthikanti's formula (151.6 GiB here) is eager's alone."""
    llama_7b = ["--hidden", "4096", "--layers", "32", "--heads", "32", "--ffn", "11008", "--vocab_size", "32000",
                "--seq_len", "4096", "--tie_embeddings", "false", "--batch_size", "1"]
    run = check_only(run_dir("x"), "--recipe", "tiny_transformer", "--estimate", "--num_processes", "8",
                     "--device_memory", "80GB", "--precision", "bf16", *llama_7b, "--accelerate_config",
                     str(ROOT / "accelerate_configs" / "deepspeed_zero3.yaml")).check()
    activations = float(re.search(r"activations ([\d.]+) GiB", run.stdout).group(1))
    assert 15 < activations < 40 and "this launch (deepspeed_zero3, 8 process(es))" in run.stdout
    assert re.search(r"device peak [\d.]+ GiB; fits", run.stdout), run.stdout


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("micro_batch, seq_len", [(16, 128), (4, 512)])
def test_activation_estimate_matches_the_measured_peak(arch, attention, micro_batch, seq_len):
    """The estimate against what a training step of the tiny transformer (its real defaults, fp32) really holds on
    this machine: the peak of live tensor bytes over the loss and its backward (torch.profiler's memory timeline),
    within 15%, under eager and sdpa attention alike; and the estimate never counts eager's scores for sdpa."""
    import torch

    from trainkit.estimate import activation_bytes, measured_activations

    recipe = load_recipe("tiny_transformer")
    cfg = recipe.Config(arch=arch, batch_size=micro_batch, seq_len=seq_len)
    torch.manual_seed(0)
    model = recipe.make_model(cfg)
    model.config._attn_implementation = attention
    batch = {"input_ids": torch.randint(0, cfg.vocab_size, (micro_batch, seq_len))}
    saved, peak = measured_activations(model, lambda: recipe.loss(model, batch))
    shape = model_shape(recipe, cfg, model)
    estimated = activation_bytes(shape, micro_batch, seq_len, "no", False)
    assert shape.decoder.attention == attention and saved < peak
    assert abs(estimated - peak) <= 0.15 * peak, (estimated, peak)


@pytest.mark.slow
@pytest.mark.parametrize("vocab, hidden, micro_batch, seq_len", [(1024, 256, 4, 512), (32000, 256, 2, 512),
                                                                  (128256, 64, 2, 256)])
def test_the_bf16_activation_estimate_counts_the_logits_in_fp32(vocab, hidden, micro_batch, seq_len):
    """Under bf16 autocast the loss upcasts the logits: its logit-sized tensors are fp32 (Llama-3's vocabulary of
    128,256: 2 x 256 tokens hold 769 MiB at the peak, as in fp32; counted at 2 bytes they were estimated at 379).
    The estimate within 10% of the measured peak of the causal-LM recipe's loss on a Llama built from a config, at a
    small and at two large vocabularies."""
    import sys

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainkit.estimate import activation_bytes, measured_activations

    load_recipe("causal_lm")
    recipe = sys.modules["recipe_causal_lm"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                         tie_word_embeddings=False, attn_implementation="sdpa"))
    batch = {"input_ids": torch.randint(0, vocab, (micro_batch, seq_len)),
             "attention_mask": torch.ones(micro_batch, seq_len, dtype=torch.long)}

    def step() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return recipe.loss(model, batch)

    _, peak = measured_activations(model, step)
    from trainkit.estimate import ModelShape, decoder_shape

    names, params = zip(*model.named_parameters(), strict=True)
    shape = ModelShape(tuple(p.numel() for p in params), hidden, 2, names, (), decoder_shape(model))
    estimated = activation_bytes(shape, micro_batch, seq_len, "bf16", False)
    assert abs(estimated - peak) <= 0.1 * peak, (estimated, peak)


LLAMA_3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "tie_word_embeddings": False, "dtype": "bfloat16"}


@pytest.mark.parametrize("processes", [1, 2, 8])
def test_the_estimate_recommends_only_what_the_dry_run_accepts(check_only, chat, run_dir, tmp_path, processes):
    """Llama-3-8B from its config.json alone (no weights: an estimate needs none), LoRA r 16 at 4096 tokens in bf16
    with checkpointing on 24 GB devices: the rows the plan refuses (the mesh YAMLs' sizes against the process count,
    tensor parallelism under LoRA) are marked and never recommended, and the recommended YAML passes --dry_run at that
    process count (a folder with weights and a tokenizer, which the dry run asks for); the frozen bf16 base is counted
    at 2 bytes."""
    import json

    folder = tmp_path / "llama3-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_3_8B))
    args = ["--recipe", "causal_lm", "--model_name_or_path", str(folder), "--lora_r", "16", "--seq_len", "4096",
            "--batch_size", "1", "--gradient_checkpointing", "--num_processes", str(processes)]
    run = check_only(run_dir("x"), *args, "--estimate", "--device_memory", "24GB", "--precision", "bf16").check()
    # Llama-3-8B's published 8,030,261,248 and LoRA r 16's adapters on every linear layer but the head (41,943,040)
    assert run.stdout.startswith(f"8,072,204,288 parameters, {processes} process(es), bf16"), run.stdout[:80]
    refused = {line.split()[0] for line in run.stdout.splitlines() if line.endswith(" refused")}
    assert {"tp", "fsdp_tp", "hsdp_tp"} <= refused and ("hsdp" in refused) == (processes != 4)
    chosen = re.search(r"cheapest strategy that fits: (\w+) \(device peak", run.stdout)
    assert chosen, run.stdout
    assert chosen.group(1) not in refused
    (folder / "model.safetensors").write_bytes(b"")  # the dry run asks for weights (it reads none) and a tokenizer
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text((chat[0] / name).read_text())
    dry = check_only(run_dir("d"), *args, "--tokenizer", "saved", "--dry_run", "--accelerate_config",
                     str(ROOT / "accelerate_configs" / f"{chosen.group(1)}.yaml"))
    assert dry.returncode == 0, dry.stderr
    ddp = next(line.split() for line in run.stdout.splitlines() if line.split()[0] in ("ddp", "single"))
    params_gib = float(ddp[1])  # the frozen base in bf16 (2 bytes), the adapters in fp32
    assert 14.5 < params_gib < 15.5, ddp
    # host memory while loading, per machine: every process loads the whole base, but under ZeRO-3's zero.Init
    zero3 = next(line.split() for line in run.stdout.splitlines() if line.startswith("deepspeed_zero3 "))
    assert float(ddp[6]) == pytest.approx(processes * params_gib, rel=1e-3)
    assert float(zero3[6]) == pytest.approx(params_gib, rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("mib, head_trains", [(0.0, True), (16.0, True), (16.0, False)])
def test_the_estimate_counts_one_chunk_of_logits(mib, head_trains):
    """The loss in chunks (trainkit/losses/chunked_loss.py) holds one chunk's logit-sized tensors, not the sequence's,
    and (where the head trains) the buffer in which autograd sums the chunks' gradients of its weight: the estimate
    within 10% of the measured peak with the whole logits (750 MiB of them at the peak) and in chunks of 131 positions
    (16 MiB of fp32 logits each), with the head trained and frozen (LoRA's), a Llama at vocabulary 32,000, 2 x 512
    tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainkit.estimate import ModelShape, activation_bytes, decoder_shape, measured_activations
    from trainkit.losses import chunked_loss

    torch.manual_seed(0)
    model = chunked_loss.configure(LlamaForCausalLM(LlamaConfig(
        vocab_size=32000, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, tie_word_embeddings=False, attn_implementation="sdpa")), mib)
    model.lm_head.weight.requires_grad_(head_trains)
    ids = torch.randint(0, 32000, (2, 512))
    _, peak = measured_activations(
        model, lambda: chunked_loss.next_token_losses(model, input_ids=ids, use_cache=False)[0].mean())
    names, params = zip(*model.named_parameters(), strict=True)
    shape = ModelShape(tuple(p.numel() for p in params), 64, 2, names, (), decoder_shape(model))
    estimated = activation_bytes(shape, 2, 512, "no", False, model.loss_chunk_tokens)
    assert model.loss_chunk_tokens == (131 if mib else 0) and shape.decoder.head_trains == head_trains
    assert abs(estimated - peak) <= 0.1 * peak, (estimated, peak)
