"""Context parallelism (an FSDP YAML's parallelism_config_cp_size, accelerate_configs/fsdp_cp.yaml; torch's
`context_parallel` with FSDP2, trainkit/strategies/fsdp.py): each sequence cut between the ranks of a cp group.

Its ring attention has CUDA kernels only, so on a CPU the plan refuses it with the reason; tests/test_gpu.py runs
fsdp_cp.yaml on GPUs. Here, the launched runs go through tests/helpers/context_parallel_on_cpu.py: the runner's
context parallelism whole (torch's own cut of the rows, the mesh's cp dimension, FSDP2 over dp_shard x cp, the parts'
weights, the gradient correction, evaluation, checkpoints) with the ring's kernels replaced by the same mathematics
(all-gathered keys and values), the one-process curve to 1e-5. The strategy matrix of tests/test_strategies.py runs
fsdp_cp.yaml the same way (conftest.CPU_STAND_INS)."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from conftest import (
    LM,
    PARITY_BOUND,
    ROOT,
    architecture,
    assert_refused,
    launch,
    max_rel_diff,
    write_yaml,
)
from trainkit.data import sft
from trainkit.launch.launcher import shipped_configs
from trainkit.launch.train_process import run_config
from trainkit.recipes import load_recipe
from trainkit.strategies import sequence_parallel
from trainkit.strategies.registry import for_launch

CP = "fsdp_cp"


@pytest.mark.parametrize(("length", "size"), [(8, 2), (24, 3), (16, 4)])
def test_head_tail_is_the_cut_torch_makes(length, size):
    """The runner counts each rank's learned tokens on head_tail (torch cuts the buffers itself, inside the context):
    rank r's part of torch's load-balanced order is head_tail's, and torch balances only rows whose length divides
    into 2 x cp chunks, which `rows` pads them to."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _create_default_load_balancer,
    )

    order = _create_default_load_balancer(length, size, "cpu")._generate_indices()[0]
    for rank in range(size):
        mine = sequence_parallel.head_tail({"input_ids": torch.arange(length)[None]}, rank, size)["input_ids"][0]
        assert mine.equal(order[rank * length // size:(rank + 1) * length // size])
    assert _create_default_load_balancer(length + 1, size, "cpu") is None
    parts = sequence_parallel.rows({"input_ids": torch.arange(7)[None].expand(2, 7)}, 2 * size)
    assert parts["input_ids"].shape[1] % (2 * size) == 0 and (parts["shift_labels"][:, 6:] == sft.IGNORE).all()


@pytest.mark.parametrize("name", ["qwen2", "llama", "gpt_neox"])
def test_the_attention_the_ring_replaces_is_the_models_own_on_rows_padded_on_the_right(chat, tmp_path, name):
    """causal_sdpa (one causal F.scaled_dot_product_attention call, the mask dropped, key/value heads repeated) gives
    every learned token of right-padded rows the loss of the model's own masked attention, to 1e-6: grouped-query
    (Qwen2, Llama: 2 key/value heads of 4) and multi-head (GPT-NeoX); in eval mode the model's own attention runs."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    folder, data = chat
    torch.manual_seed(0)
    model = architecture(name)
    recipe = load_recipe("causal_lm")
    cfg = recipe.Config(model_name_or_path=str(folder), tokenizer="saved", data=str(data), chat_template="chatml",
                        seq_len=96)
    train, _ = recipe.make_datasets(cfg, tmp_path)
    batch = {key: torch.stack([train[i][key] for i in range(4)]) for key in train[0]}
    assert (batch["attention_mask"] == 0).any()  # rows padded on the right
    token_losses = sys.modules["recipe_causal_lm"]._token_losses
    masked, learned, _, _ = token_losses(model.eval(), batch)
    whole = sequence_parallel.rows(batch, 1)
    core = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sequence_parallel.causal_sdpa(core)
        in_eval, _, _, _ = token_losses(model, whole)
        in_training, _, _, _ = token_losses(model.train(), whole)
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = core
    for losses in (in_eval, in_training):
        gap = (losses[:, :-1][learned] - masked[learned]).abs().max()
        assert gap <= 1e-6 * masked[learned].abs().max(), gap


def test_on_a_cpu_the_config_is_refused_with_the_reason(tmp_path):
    """The real command (not the tests' stand-in): refused before anything is built, naming the kernels and the
    config that does split sequences here."""
    run = run_config(CP, tmp_path, [*LM, "--batch_size", "8"], timeout=120)
    if torch.cuda.is_available():
        pytest.skip("a GPU machine runs it (tests/test_gpu.py)")
    assert_refused(run, "parallelism_config_cp_size 2: torch's context parallelism runs its ring attention on CUDA's "
                        "attention kernels only")
    assert "deepspeed_zero3_sp.yaml" in run.stderr and not (tmp_path / "checkpoints").exists()


def plan_problems(recipe: str, yaml_changes: dict | None = None, **fields) -> list[str]:
    """What the plan refuses under fsdp_cp.yaml on any machine (check(this_machine=False)), with the recipe's model
    built on the meta device."""
    from trainkit.estimate import meta_model

    launch_ = shipped_configs()[CP]
    if yaml_changes:
        launch_ = dataclasses.replace(launch_, **yaml_changes)
    loaded = load_recipe(recipe)
    cfg = loaded.Config(**fields)
    strategy = for_launch(launch_, cfg, {}, loaded)
    found = strategy.check(this_machine=False)
    if not found and recipe != "mlp":
        found = strategy.check_model(meta_model(loaded, cfg))
    return [problem.what for problem in found]


@pytest.mark.parametrize(("recipe", "changes", "fields", "message"), [
    ("mlp", None, {}, "recipe mlp.py does not declare sequence_parallel"),
    ("tiny_transformer", {"world_size": 4, "parallelism": {"cp": 2, "tp": 2}}, {},
     "context parallelism with tp: the runner splits sequences only together with FSDP2's dp_shard"),
    ("tiny_transformer", None, {"pipeline_stages": 2}, "context parallelism with --pipeline_stages"),
])
def test_what_context_parallelism_cannot_split_is_refused_at_plan_time(recipe, changes, fields, message):
    found = plan_problems(recipe, changes, **fields)
    assert any(message in what for what in found), found


def test_packed_rows_sliding_windows_and_other_attentions_are_refused(chat):
    """The ring takes no mask: packed examples would attend to each other, a sliding window would be global; it
    replaces F.scaled_dot_product_attention, which only sdpa attention calls."""
    folder, data = chat
    fields = {"model_name_or_path": str(folder), "tokenizer": "saved", "data": str(data), "chat_template": "chatml"}
    assert any("--packing with context parallelism" in what
               for what in plan_problems("causal_lm", None, **fields, packing=True, seq_len=192))
    found = sequence_parallel.problems(architecture("mistral"), 2, "parallelism_config", 192, key="cp")
    assert len(found) == 1 and "under context parallelism every layer would attend causally" in found[0].what
    found = sequence_parallel.problems(architecture("llama", attention="flex_attention"), 2, "parallelism_config",
                                       192, key="cp")  # which Ulysses runs
    assert len(found) == 1 and "uses 'flex_attention' attention: context parallelism runs sdpa" in found[0].what
    assert not sequence_parallel.problems(architecture("llama"), 3, "parallelism_config", 192, key="cp")  # any heads


def test_the_dry_run_and_the_estimate_show_the_sequence_split(tmp_path):
    """fsdp_cp on 4 processes (dp_shard 2 x cp 2): global batch batch_size x grad_accum x 2, each rank's state
    FSDP2's over all 4, its activations those of half the sequence."""
    from trainkit.command_line import parse_command_line
    from trainkit.plan import make_plan

    def plan(config: str, processes: int, *changes: str):
        yaml = write_yaml(tmp_path, config, **{"num_processes:__2": f"num_processes: {processes}",
                                              **dict(zip(changes[::2], changes[1::2], strict=True))})
        return make_plan(*parse_command_line([*LM, "--batch_size", "4", "--estimate", "--accelerate_config",
                                              str(yaml), "--output_dir", str(tmp_path / config)]))

    split = plan(CP, 4, "parallelism_config_dp_shard_size:__1", "parallelism_config_dp_shard_size: 2")
    whole = plan("fsdp", 4)
    assert (split.resolved["cp"], split.resolved["data_parallel_size"], split.resolved["global_batch_size"]) == \
        (2, 2, 8)
    assert whole.resolved["global_batch_size"] == 16 and split.estimate.state == whole.estimate.state
    assert 0.4 * whole.estimate.activations <= split.estimate.activations <= 0.6 * whole.estimate.activations


# --- launched (the ring's kernels stood in for: tests/helpers/context_parallel_on_cpu.py) ---------------------------

CHAT = ["--recipe", "causal_lm", "--tokenizer", "saved", "--chat_template", "chatml", "--max_steps", "10",
        "--eval_every", "5", "--lr", "3e-3"]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "flags"), [
    ("qwen2", ["--seq_len", "96"]),  # untied, grouped-query attention, padded rows
    ("llama", ["--seq_len", "95", "--lora_r", "8", "--loss_average", "samples"]),  # tied, adapters, odd length
    ("gpt_neox", ["--seq_len", "96"]),  # multi-head, rotary on part of each head
], ids=["qwen2", "llama-lora-samples", "gpt_neox"])
def test_a_split_sequence_trains_the_one_process_curve(chat, tmp_path, name, flags):
    """10 steps of global batch 8 against one process: the loss (the mean over every learned token), the gradient
    norm (FSDP2's average over cp undone) and the eval loss within 1e-5."""
    from test_sequence_parallel import saved_model

    model = saved_model(chat, tmp_path / name, name)
    args = [*CHAT, "--model_name_or_path", str(model), "--data", str(chat[1]), *flags]
    one = launch(tmp_path / "one", *args, "--batch_size", "8").check()
    split = launch(tmp_path / "cp", *args, "--batch_size", "8", config=CP).check()
    assert split.resolved["cp"] == 2 and "context parallelism: each sequence cut in 4 chunks" in split.stderr
    assert max_rel_diff(split.losses, one.losses) <= PARITY_BOUND and one.losses[-1] < one.losses[0]
    assert max_rel_diff([m["grad_norm"] for m in split.metrics], [m["grad_norm"] for m in one.metrics]) <= \
        PARITY_BOUND
    assert max_rel_diff([m["eval_loss"] for m in split.metrics if "eval_loss" in m],
                        [m["eval_loss"] for m in one.metrics if "eval_loss" in m]) <= PARITY_BOUND


@pytest.mark.slow
def test_a_split_run_resumes_exactly_and_into_a_config_without_the_split(lm_runs, tmp_path):
    """Stopped at step 5 under fsdp_cp.yaml: resumed there, the same losses bit for bit; resumed under fsdp.yaml (the
    same 2 processes as data parallelism, micro-batch 4), the uninterrupted curve."""
    run = lm_runs(CP)
    step_5 = str(run.output_dir / "checkpoints" / "step_5")
    again = launch(tmp_path / "again", *LM, "--batch_size", "8", "--resume", step_5, config=CP).check()
    assert again.losses == run.losses[5:]
    plain = launch(tmp_path / "plain", *LM, "--batch_size", "4", "--resume", step_5, config="fsdp").check()
    assert [m["step"] for m in plain.metrics] == list(range(6, 9)) and plain.resolved["cp"] == 1
    assert max_rel_diff(plain.losses, run.losses[5:]) <= PARITY_BOUND


def test_the_stand_in_is_what_the_tests_launch_for_the_config_on_a_cpu():
    from conftest import CPU_STAND_INS, GPU_ONLY

    assert GPU_ONLY == {CP} and (ROOT / CPU_STAND_INS[CP]).exists()
