"""The memory estimator's table and advice (its numbers are checked against measurements in test_strategies.py)."""

from __future__ import annotations

import pytest

from conftest import ROOT
from trainkit.config import parse_bytes
from trainkit.estimate import STRATEGIES, estimate, model_shape
from trainkit.recipes import load_recipe

# A 7B-class transformer at 4 sequences of 2048 tokens, with gradient checkpointing.
BIG = ["--hidden", "4096", "--layers", "32", "--heads", "32", "--seq_len", "2048", "--vocab_size", "32000",
       "--batch_size", "4", "--gradient_checkpointing"]


def test_table_names_the_cheapest_strategy_that_fits(check_only, run_dir):
    run = check_only(run_dir("x"), "--recipe", "tiny_transformer", "--estimate", "--num_processes", "8",
                     "--device_memory", "80GB", *BIG).check()
    rows = {line.split()[0] for line in run.stdout.splitlines()}
    assert set(STRATEGIES) <= rows
    assert "cheapest strategy that fits 74.506 GiB per device (with 10% headroom): deepspeed_zero2" in run.stdout
    small = check_only(run_dir("y"), "--recipe", "tiny_transformer", "--estimate", "--num_processes", "8",
                       "--device_memory", "24GB", *BIG).check()
    assert "per device (with 10% headroom): fsdp_offload" in small.stdout
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
                                         ("512", 512)])
def test_sizes_parse(text, value):
    assert parse_bytes(text) == value


def test_bad_size_is_refused(check_only, run_dir):
    run = check_only(run_dir("x"), "--recipe", "mlp", "--estimate", "--device_memory", "lots")
    assert run.returncode == 2 and "cannot read 'lots' as a size: write it like 80GB" in run.stderr
