"""Sequence parallelism (a DeepSpeed YAML's parallelism_config_sp_size, trainkit/strategies/sequence_parallel.py): each
sequence cut between the ranks of a group, the one-process curve whatever the architecture, packing or adapters.

The shipped configs (deepspeed_zero3_sp.yaml, deepspeed_zero2_sp.yaml) also run the strategy matrix of
tests/test_strategies.py with the tiny transformer (the one-process curve, the export, the estimate) and every other
recipe there is refused with the fix."""

from __future__ import annotations

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
from trainkit.recipes import load_recipe
from trainkit.strategies import sequence_parallel

SP = "deepspeed_zero3_sp"


def test_a_shard_holds_its_positions_and_the_targets_made_before_the_cut():
    """Each shard's last target is the next shard's first token (a shard that shifted its own labels would lose it),
    positions continue across the shards, rows pad to a multiple of the group with positions that learn nothing."""
    ids = torch.arange(10, 17).expand(2, 7)  # 7 tokens: padded to 8 for 2 shards
    labels = ids.clone()
    labels[1, :3] = sft.IGNORE  # a prompt that is not learned
    batch = {"input_ids": ids, "labels": labels, "weight": torch.full((2, 7), 0.5)}
    shards = [sequence_parallel.shard(batch, rank, 2) for rank in range(2)]
    joined = {key: torch.cat([s[key] for s in shards], dim=1) for key in shards[0]}
    assert joined["input_ids"][:, :7].equal(ids) and joined["input_ids"].shape == (2, 8)
    assert joined["shift_labels"][:, :6].equal(labels[:, 1:])
    assert (joined["shift_labels"][:, 6:] == sft.IGNORE).all()  # the last token predicts nothing, nor the padding
    assert shards[0]["shift_labels"][0, -1] == ids[0, 4] == shards[1]["input_ids"][0, 0]
    assert joined["position_ids"].equal(torch.arange(8).expand(2, 8))
    assert joined["shift_weight"].sum() == 0.5 * 12 and sequence_parallel.learned_tokens(shards[0]) == 0.5 * 8
    plain = {"input_ids": ids, "attention_mask": torch.tensor([[1] * 7, [1] * 5 + [0] * 2])}
    targets = torch.cat([sequence_parallel.shard(plain, r, 2)["shift_labels"] for r in range(2)], dim=1)
    assert targets[1, :4].equal(ids[1, 1:5]) and (targets[1, 4:] == sft.IGNORE).all()  # padding is not learned
    assert sum(sequence_parallel.learned_tokens(sequence_parallel.shard(plain, r, 2)) for r in range(2)) == 6 + 4


@pytest.mark.parametrize("name", ["qwen2", "llama", "gpt_neox"])
def test_the_gathered_positions_of_packed_rows_isolate_their_examples(chat, tmp_path, name):
    """What Ulysses hands the attention: the whole row, its position_ids, and no mask (its wrapper drops the one the
    model made for the shard). packed_attention's mask from the restarting positions gives each learned token the
    loss the recipe's block-diagonal mask gives it, to 1e-6; causal attention alone (no packed_attention) does not."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    folder, data = chat
    torch.manual_seed(0)
    model = architecture(name).eval()
    recipe = load_recipe("causal_lm")
    cfg = recipe.Config(model_name_or_path=str(folder), tokenizer="saved", data=str(data), chat_template="chatml",
                        packing=True, seq_len=192)
    train, _ = recipe.make_datasets(cfg, tmp_path)
    batch = {key: torch.stack([train[i][key] for i in range(2)]) for key in train[0]}
    assert (batch["position_ids"][:, 1:] == 0).any()  # more than one example in a row
    token_losses = sys.modules["recipe_causal_lm"]._token_losses
    masked, learned, _, _ = token_losses(model, batch)
    gathered = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"],
                "shift_labels": sequence_parallel.shard(batch, 0, 1)["shift_labels"]}
    core = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        for attention, isolated in ((sequence_parallel.packed_attention(core), True), (core, False)):
            ALL_ATTENTION_FUNCTIONS["sdpa"] = lambda module, q, k, v, mask, *a, f=attention, **kw: f(
                module, q, k, v, None, *a, **kw)
            unmasked, _, _, _ = token_losses(model, gathered)
            gap = (unmasked[:, :-1][learned] - masked[learned]).abs().max()
            assert (gap <= 1e-6 * masked[learned].abs().max()) == isolated, gap
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = core


@pytest.mark.parametrize(("model", "message"), [
    (lambda: architecture("llama", attention="eager"), "uses 'eager' attention: sequence parallelism runs sdpa"),
    (lambda: architecture("mistral"), "has a sliding window of 6 tokens, shorter than the 192-token sequence"),
    (lambda: architecture("qwen2", layers=4), "has a sliding window of 6 tokens"),
    (lambda: torch.nn.Linear(2, 2), "Linear is not a transformers model"),
])
def test_a_model_ulysses_cannot_split_is_named(model, message):
    found = sequence_parallel.problems(model(), 2, "parallelism_config", 192)
    assert len(found) == 1 and message in found[0].what, found


def test_heads_that_do_not_divide_among_the_ranks_are_refused_at_plan_time(check_only, tmp_path):
    yaml = write_yaml(tmp_path, SP, **{"parallelism_config_sp_size:__2": "parallelism_config_sp_size: 3",
                                       "num_processes:__2": "num_processes: 3"})
    run = check_only(tmp_path / "out", *LM, "--dry_run", "--accelerate_config", str(yaml))
    assert_refused(run, "LlamaForCausalLM has 4 attention heads, which do not divide among 3 sequence-parallel ranks")
    assert "set parallelism_config_sp_size to a divisor of 4" in run.stderr


def test_the_attention_fix_can_be_followed(check_only, chat, tmp_path):
    """A model on another attention than Ulysses splits (--attn_implementation eager): the refusal's fix is one the
    command line can follow (--attn_implementation sdpa, and then the dry run passes); Gemma-2, which transformers
    builds on eager and refuses sdpa for, gets the fix it can follow here (sp size 1, or flash attention on GPUs), and
    --attn_implementation sdpa for it is transformers' refusal, said as such (before: `attn_implementation='sdpa'`,
    no flag for it, and the library's error reported as raised in recipes/causal_lm.py)."""
    import transformers
    from transformers import AutoTokenizer

    yaml = str(ROOT / "accelerate_configs" / f"{SP}.yaml")
    folders = {}
    for name, model in (("llama", architecture("llama")),
                        ("gemma2", transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
                            vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8)))):
        folders[name] = tmp_path / name
        model.save_pretrained(folders[name])
        AutoTokenizer.from_pretrained(chat[0]).save_pretrained(folders[name])

    def dry(name: str, *flags: str):
        return check_only(tmp_path / f"out-{name}-{len(flags)}", "--recipe", "causal_lm", "--model_name_or_path",
                          str(folders[name]), "--tokenizer", "saved", "--data", str(chat[1]), "--chat_template",
                          "chatml", "--seq_len", "64", *flags, "--dry_run", "--accelerate_config", yaml)

    eager = dry("llama", "--attn_implementation", "eager")
    assert_refused(eager, "LlamaForCausalLM uses 'eager' attention: sequence parallelism runs sdpa")
    assert "pass --attn_implementation sdpa (recipes/causal_lm.py" in eager.stderr, eager.stderr
    assert dry("llama", "--attn_implementation", "sdpa").returncode == 0
    gemma = dry("gemma2")
    assert_refused(gemma, "Gemma2ForCausalLM uses 'eager' attention: sequence parallelism runs sdpa")
    fix = "set parallelism_config_sp_size: 1" + ("" if torch.cuda.is_available() else
                                                 " here, or on GPUs pass --attn_implementation flash_attention_2")
    assert fix in gemma.stderr, gemma.stderr
    refused = dry("gemma2", "--attn_implementation", "sdpa")
    assert_refused(refused, "transformers cannot load the model: ValueError: Gemma2ForCausalLM does not support an "
                            "attention implementation through torch.nn.functional.scaled_dot_product_attention")
    assert "pass an --attn_implementation the model supports, or none" in refused.stderr
    assert "recipes/causal_lm.py" not in refused.stderr, refused.stderr


@pytest.mark.parametrize(("changes", "message"), [
    ({"num_processes:__2": "num_processes: 3"}, "parallelism_config_sp_size 2 does not divide the 3 process(es)"),
    ({"parallelism_config_sp_backend": "parallelism_config_tp_size: 2\n  parallelism_config_sp_backend"},
     "parallelism_config_tp_size is 2: under DeepSpeed only the sequence-parallel size applies"),
])
def test_a_deepspeed_parallelism_config_that_cannot_run_is_refused(check_only, tmp_path, changes, message):
    yaml = write_yaml(tmp_path, SP, **changes)
    assert_refused(check_only(tmp_path / "out", *LM, "--dry_run", "--accelerate_config", str(yaml)), message)


def test_sequence_parallelism_on_an_fsdp_yaml_names_the_deepspeed_one(check_only, tmp_path):
    yaml = write_yaml(tmp_path, "tp", **{"parallelism_config_tp_size:__2": "parallelism_config_sp_size: 2"})
    run = check_only(tmp_path / "out", *LM, "--dry_run", "--accelerate_config", str(yaml))
    assert_refused(run, "parallelism_config_sp_size is 2: sequence parallelism runs under DeepSpeed")
    assert "deepspeed_zero3_sp.yaml" in run.stderr


def test_the_dry_run_and_the_estimate_show_the_sequence_split(check_only, tmp_path):
    """The global batch is batch_size x grad_accum x the data-parallel size (the groups); each rank's activations
    are those of half the sequence, its model state ZeRO-3's over every rank."""
    from trainkit.command_line import parse_command_line
    from trainkit.plan import make_plan

    def plan(config: str, processes: int):
        yaml = write_yaml(tmp_path, config, **{"num_processes:__2": f"num_processes: {processes}"})
        return make_plan(*parse_command_line([*LM, "--batch_size", "4", "--estimate", "--accelerate_config",
                                              str(yaml), "--output_dir", str(tmp_path / config)]))

    split, whole = plan(SP, 4), plan("deepspeed_zero3", 4)
    assert (split.resolved["sp"], split.resolved["data_parallel_size"], split.resolved["global_batch_size"]) == \
        (2, 2, 8)
    assert whole.resolved["global_batch_size"] == 16
    assert split.estimate.state == whole.estimate.state
    assert 0.4 * whole.estimate.activations <= split.estimate.activations <= 0.6 * whole.estimate.activations
    run = check_only(tmp_path / "est", *LM, "--estimate", "--accelerate_config", str(ROOT / "accelerate_configs" /
                                                                                        f"{SP}.yaml"))
    assert run.returncode == 0 and "deepspeed_zero3_sp" in run.stdout, run.stdout


# --- launched: the one-process curve ------------------------------------------------------------------------------

CHAT = ["--recipe", "causal_lm", "--tokenizer", "saved", "--chat_template", "chatml", "--max_steps", "10",
        "--eval_every", "5", "--lr", "3e-3"]


def saved_model(chat, folder, name: str):
    """One of conftest.architecture's models, untrained, saved with the chat fixture's tokenizer."""
    torch.manual_seed(0)
    architecture(name).save_pretrained(folder)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (folder / file).write_bytes((chat[0] / file).read_bytes())
    return folder


@pytest.mark.slow
@pytest.mark.parametrize(("name", "config", "flags"), [
    ("qwen2", SP, ["--packing", "--seq_len", "192"]),  # untied, grouped-query attention, packed rows
    ("llama", SP, ["--packing", "--seq_len", "192", "--lora_r", "8"]),  # tied embeddings, adapters
    ("gpt_neox", SP, ["--seq_len", "95"]),  # rotary on part of each head; padded rows of an odd length
    ("gpt_neox", "deepspeed_zero2_sp", ["--packing", "--seq_len", "192"]),  # 2 groups of 2 under ZeRO-2
], ids=["qwen2-packed", "llama-lora-packed", "gpt_neox-padded", "gpt_neox-sp_x_dp"])
def test_a_split_sequence_trains_the_one_process_curve(chat, tmp_path, name, config, flags):
    """10 steps of global batch 8 against one process: the loss (the mean over every learned token, not of the
    shards' means), the gradient norm (ZeRO-3's reduce-scatter corrected) and the eval loss within 1e-5."""
    model = saved_model(chat, tmp_path / name, name)
    args = [*CHAT, "--model_name_or_path", str(model), "--data", str(chat[1]), *flags]
    one = launch(tmp_path / "one", *args, "--batch_size", "8").check()
    split = launch(tmp_path / "sp", *args, "--batch_size", "8" if config == SP else "4", config=config).check()
    assert split.resolved["sp"] == 2 and "sequence parallelism: each sequence cut in 2" in split.stderr
    assert max_rel_diff(split.losses, one.losses) <= PARITY_BOUND and one.losses[-1] < one.losses[0]
    assert max_rel_diff([m["grad_norm"] for m in split.metrics], [m["grad_norm"] for m in one.metrics]) <= \
        PARITY_BOUND
    assert max_rel_diff([m["eval_loss"] for m in split.metrics if "eval_loss" in m],
                        [m["eval_loss"] for m in one.metrics if "eval_loss" in m]) <= PARITY_BOUND


@pytest.mark.slow
def test_a_split_run_resumes_exactly_and_into_a_config_without_the_split(lm_runs, tmp_path):
    """Stopped at step 5 under deepspeed_zero3_sp.yaml: resumed there, the same losses bit for bit; resumed under
    deepspeed_zero3.yaml (the same 2 processes as data parallelism, micro-batch 4), the uninterrupted curve."""
    run = lm_runs(SP)
    step_5 = str(run.output_dir / "checkpoints" / "step_5")
    again = launch(tmp_path / "again", *LM, "--batch_size", "8", "--resume", step_5, config=SP).check()
    assert again.losses == run.losses[5:]
    plain = launch(tmp_path / "plain", *LM, "--batch_size", "4", "--resume", step_5, config="deepspeed_zero3").check()
    assert [m["step"] for m in plain.metrics] == list(range(6, 9)) and plain.resolved["sp"] == 1
    assert max_rel_diff(plain.losses, run.losses[5:]) <= PARITY_BOUND



@pytest.mark.slow
@pytest.mark.parametrize(("json", "flags"), [
    ("zero1.json", ["--arch", "gpt2"]),  # GPT-2: tied, learned positions, Conv1D layers, reshapes by [:-2]
    ("zero3_offload.json", ["--tiled_mlp", "--loss_chunk_mib", "0.25"]),  # cpu_adam; the MLP and the loss in chunks
], ids=["zero1-gpt2", "zero3_offload-tiled_mlp-chunked_loss"])
def test_other_zero_stages_models_and_chunks_under_sequence_parallelism(tmp_path, json, flags):
    """The ZeRO stages the shipped sp YAMLs do not select (ZeRO-1; ZeRO-3 with its optimizer offloaded to cpu_adam),
    GPT-2 launched (it reshapes the attention output by [:-2]: sequence_parallel.heads_kept), the tiled MLP and the
    loss in chunks of a quarter MiB (4 chunks of each shard's logits: chunked_loss's branch with the shards'
    targets): the one-process curve of the same flags, losses and gradient norms within 1e-5."""
    yaml = write_yaml(tmp_path, SP, **{"ds_configs/zero3.json": f"ds_configs/{json}"})
    one = launch(tmp_path / "one", *LM, *flags, "--batch_size", "8").check()
    split = launch(tmp_path / "sp", *LM, *flags, "--batch_size", "8", config=str(yaml)).check()
    assert split.resolved["sp"] == 2 and split.resolved["zero_stage"] == int(json[4])
    assert max_rel_diff(split.losses, one.losses) <= PARITY_BOUND and one.losses[-1] < one.losses[0]
    assert max_rel_diff([m["grad_norm"] for m in split.metrics], [m["grad_norm"] for m in one.metrics]) <= \
        PARITY_BOUND
