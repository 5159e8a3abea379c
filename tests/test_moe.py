"""Mixtures of experts under every shipped config: the one-process curve with the router's balancing loss in it.

Five families transformers builds from a config, none written for this project (tests/conftest.py's
mixture_of_experts): Qwen3-MoE under every data-parallel config, Mixtral, gpt-oss and DeepSeek-V3 (no balancing loss:
its router is balanced by a bias) under ZeRO-3 and FSDP2, and the model-parallel configs (sequence, context and
tensor parallelism, pipeline stages, expert parallelism) each on one to three of them with OLMoE. The coefficient
is 1, a hundred times the models' own, so that a balance measured per micro-batch instead of per sequence would show
(trainkit/losses/router.py). ZeRO-3 is also run on a model that keeps one module per expert with each rank's tokens
routed to other experts than its peer's.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import (
    PARITY_BOUND,
    ROOT,
    assert_refused,
    entry,
    launch,
    max_rel_diff,
    mixture_of_experts,
    processes,
    write_yaml,
)

# Every config that trains a whole model on each rank or shards it (tests/test_strategies.py's CONFIGS), one process's
# global batch of 8 split as each config splits it
CONFIGS = ["ddp", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero2_offload", "deepspeed_zero3",
           "deepspeed_zero3_offload", "fsdp", "fsdp_offload", "hsdp"]
OTHERS = ["mixtral", "gpt_oss", "deepseek_v3"]
# their config has router_aux_loss_coef; DeepSeek-V3's has none
BALANCED = {"qwen3_moe", "mixtral", "gpt_oss", "olmoe", "ernie4_5_moe"}


@pytest.fixture(scope="module")
def moe_args(chat, moe_folder):
    """moe_args(name): causal_lm's flags that fine-tune the family `name` saved with the chat fixture's tokenizer."""

    def args(name: str) -> list[str]:
        model_dir = moe_folder(name)
        coefficient = ["--router_aux_loss_coef", "1"] if name in BALANCED else []
        return ["--recipe", "causal_lm", "--model_name_or_path", str(model_dir), "--data", str(chat[1]),
                "--chat_template", "chatml", "--seq_len", "64", "--max_steps", "6", "--eval_every", "0",
                "--lr", "3e-3", *coefficient]

    return args


@pytest.fixture(scope="module")
def references(moe_args, tmp_path_factory):
    """references(name): one process, the global batch of 8 in one micro-batch; launched once."""
    done = {}

    def reference(name: str):
        if name not in done:
            done[name] = launch(tmp_path_factory.mktemp(f"ref-{name}") / "out", *moe_args(name),
                                "--batch_size", "8").check()
        return done[name]

    return reference


def assert_one_process_curve(run, reference, balanced: bool) -> None:
    """loss, grad_norm and aux_loss at every step within PARITY_BOUND of one process's; the balancing term in the
    loss is not negligible (a balance per micro-batch would move it)."""
    for key in ("loss", "grad_norm", *(["aux_loss"] if balanced else [])):
        ours, theirs = [m[key] for m in run.metrics], [m[key] for m in reference.metrics]
        assert len(ours) == 6 and max_rel_diff(ours, theirs) < PARITY_BOUND, (key, ours, theirs)
    if balanced:
        assert all(m["aux_loss"] > 0.01 * m["loss"] for m in run.metrics)
        assert all(1.0 <= m[f"expert_load/layer_{i}"] <= 4.0 for m in run.metrics for i in range(2))
    else:
        assert not any("aux_loss" in m for m in run.metrics)


def assert_export_loads(run, reference, name: str) -> None:
    """final/ loads with from_pretrained as the family it was, its router logits on, and holds what one process
    trained: the same weights as one process's final/, in transformers' own layout (its experts one tensor each
    per expert on disk, fused when loaded)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run.output_dir / "final")
    assert type(model).__name__ == type(mixture_of_experts(name)).__name__ and model.config.output_router_logits
    saved, expected = (load_file(r.output_dir / "final" / "model.safetensors") for r in (run, reference))
    assert saved.keys() == expected.keys() and any(".experts." in key for key in saved)
    assert max((saved[k] - expected[k]).abs().max().item() for k in saved) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_qwen3_moe_trains_the_one_process_curve_under_every_config(moe_args, references, run_dir, config):
    yaml, flags = entry(config, 8)
    run = launch(run_dir("out"), *moe_args("qwen3_moe"), *flags, config=yaml).check()
    assert_one_process_curve(run, references("qwen3_moe"), balanced=True)
    if config in ("deepspeed_zero3", "fsdp"):
        assert_export_loads(run, references("qwen3_moe"), "qwen3_moe")


@pytest.mark.slow
def test_a_routing_bias_stays_frozen_and_a_sampling_router_is_said(moe_args, moe_folder, references, run_dir):
    """Ernie4.5-MoE's moe_statics.e_score_correction_bias takes no gradient by design: frozen, DDP trains the family
    at one process's curve (it refused the step, "a parameter took no part") and final/ holds the bias as loaded.
    PhiMoE's router samples in training: the run says so before training under DDP (its curve cannot be one
    process's), where Ernie's says nothing of the kind."""
    from safetensors.torch import load_file

    yaml, flags = entry("ddp", 8)
    run = launch(run_dir("ernie"), *moe_args("ernie4_5_moe"), *flags, config=yaml).check()
    assert_one_process_curve(run, references("ernie4_5_moe"), balanced=True)
    biases = {key: value for key, value in load_file(moe_folder("ernie4_5_moe") / "model.safetensors").items()
              if key.endswith("e_score_correction_bias")}
    saved = load_file(run.output_dir / "final" / "model.safetensors")
    assert len(biases) == 2 and all(torch.equal(saved[key], value) for key, value in biases.items())
    assert "draws random numbers" not in run.stderr
    sampled = launch(run_dir("phimoe"), *moe_args("phimoe"), *flags, "--max_steps", "1", config=yaml).check()
    assert "note: the model draws random numbers in training (PhiMoE's sparsemixer router; router_jitter_noise " \
           "0.01): each of the 2 data-parallel ranks draws its own" in sampled.stderr


@pytest.mark.slow
def test_the_routing_bias_moves_by_its_rule_at_one_process_curve_and_resumes_exactly(moe_args, moe_folder, run_dir):
    """--router_bias_update_rate (auxiliary-loss-free balancing) on Ernie4.5-MoE: under DDP with accumulation the
    loss and the gradient norm are one process's and final/'s biases one process's, moved from where they were
    loaded; a run stopped at step 3 and resumed ends with the uninterrupted run's biases and curve."""
    from safetensors.torch import load_file

    args = [*moe_args("ernie4_5_moe"), "--router_bias_update_rate", "0.01"]
    one = launch(run_dir("one"), *args, "--batch_size", "8").check()
    split = ["--batch_size", "2", "--grad_accum", "2"]
    whole = launch(run_dir("ddp"), *args, *split, config="ddp").check()
    out = run_dir("resumed")
    launch(out, *args, *split, "--save_every", "3", "--stop_at", "3", config="ddp").check()
    resumed = launch(out, *args, *split, "--resume", "latest", config="ddp").check()
    for key in ("loss", "grad_norm"):
        ours, theirs = [m[key] for m in whole.metrics], [m[key] for m in one.metrics]
        assert max_rel_diff(ours, theirs) < PARITY_BOUND, (key, ours, theirs)
        assert [m[key] for m in resumed.metrics] == ours, key
    loaded = {k: v for k, v in load_file(moe_folder("ernie4_5_moe") / "model.safetensors").items()
              if k.endswith("e_score_correction_bias")}
    finals = [load_file(r.output_dir / "final" / "model.safetensors") for r in (one, whole, resumed)]
    for key, start in loaded.items():
        moved = finals[0][key] - start
        assert 0 < moved.abs().max() <= 6 * 0.02 and abs(float(moved.sum())) < 1e-5  # steps of +-0.01, centred
        assert torch.allclose(finals[1][key], finals[0][key], atol=1e-7) and torch.equal(finals[2][key], finals[1][key])


@pytest.mark.parametrize("config, refused", [("ddp", False), ("deepspeed_zero2_offload", False), ("fsdp", True),
                                             ("deepspeed_zero3", True), ("tp", True)])
def test_the_routing_bias_update_is_refused_by_the_dry_run_where_a_strategy_shards_it(check_only, moe_args, tmp_path,
                                                                                       config, refused):
    run = check_only(tmp_path / "out", *moe_args("ernie4_5_moe"), "--router_bias_update_rate", "0.01", "--dry_run",
                     "--accelerate_config", str(ROOT / "accelerate_configs" / f"{config}.yaml"))
    if refused:
        assert_refused(run, "the update moves each rank's whole copy of a router's bias, which this strategy shards "
                            "or cuts (--router_bias_update_rate): use ddp.yaml")
    else:
        assert run.returncode == 0, run.stderr


def test_the_routing_bias_update_is_torchtitans_rule_on_the_counted_choices():
    """DeepSeek-V3 (its bias a buffer): two training forwards counted, none in evaluation or under no_grad; the
    update before the optimizer step is rate x sign(mean - load), centred, per router; a model whose routers are
    all frozen is refused."""
    from trainkit.models import expert_bias

    model = mixture_of_experts("deepseek_v3").train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    expert_bias.install(model, optimizer, 0.01)
    routers = {name.rpartition(".")[0]: module for name, module in model.named_modules()
               if hasattr(module, "e_score_correction_bias")}
    chosen = {name: [] for name in routers}
    for name, router in routers.items():
        router.register_forward_hook(lambda m, a, out, name=name: chosen[name].append(out[-1].reshape(-1)))
    ids = torch.randint(0, 400, (2, 16))
    for _ in range(2):
        model(ids).logits.sum().backward()
    model.eval()
    model(ids)
    model.train()
    with torch.no_grad():
        model(ids)
    loads = {name: torch.bincount(torch.cat(found[:2]), minlength=4).double() for name, found in chosen.items()}
    before = {name: router.e_score_correction_bias.clone() for name, router in routers.items()}
    optimizer.step()
    for name, router in routers.items():
        delta = 0.01 * torch.sign(loads[name].mean() - loads[name])
        assert torch.allclose(router.e_score_correction_bias - before[name], (delta - delta.mean()).float())
    model.requires_grad_(False)
    with pytest.raises(Exception, match="has no trained router with a routing bias"):
        expert_bias.install(model, optimizer, 0.01)


def test_what_draws_random_numbers_in_training_is_found_and_a_ddp_refusal_names_the_parameter():
    """random_draws: PhiMoE's router, Mixtral's jitter, dropout modules and rates; nothing for a model without any.
    DDP's "did not receive grad" error names parameters by index: the refusal names them."""
    from conftest import architecture
    from trainkit.strategies.ddp import DDPEngine
    from trainkit.strategies.engine import random_draws

    assert random_draws(mixture_of_experts("phimoe")) == ["PhiMoE's sparsemixer router", "router_jitter_noise 0.01"]
    assert random_draws(mixture_of_experts("mixtral", router_jitter_noise=0.1)) == ["router_jitter_noise 0.1"]
    assert random_draws(mixture_of_experts("qwen3_moe")) == [] == random_draws(torch.nn.Linear(2, 2))
    assert random_draws(torch.nn.Sequential(torch.nn.Dropout(0.2), torch.nn.Dropout(0.0))) == \
        ["1 dropout module of p up to 0.2"]
    model = architecture("llama")

    class Wrapped(DDPEngine):
        unwrapped_model = model

    engine = Wrapped.__new__(Wrapped)
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    said = "... Parameter indices which did not receive grad for rank 1: 3 7\n In addition, ..."
    assert engine.unused(said) == f"parameters {trained[3]}, {trained[7]}"
    assert engine.unused("find_unused_parameters=True ...") == "a parameter of the model"


@pytest.mark.slow
@pytest.mark.parametrize("config", ["deepspeed_zero3", "fsdp"])
@pytest.mark.parametrize("name", OTHERS)
def test_other_families_train_the_one_process_curve_sharded(moe_args, references, run_dir, name, config):
    yaml, flags = entry(config, 8)
    run = launch(run_dir("out"), *moe_args(name), *flags, config=yaml).check()
    assert_one_process_curve(run, references(name), balanced=name in BALANCED)
    assert_export_loads(run, references(name), name)


@pytest.mark.slow
def test_lora_on_a_mixture_of_experts_adapts_attention_experts_and_router_under_zero3(moe_args, run_dir):
    """LoRA (peft's all-linear default) on Qwen3-MoE: peft 0.21 adapts the attention's projections (target_modules)
    and, through its parameter adapters (target_parameters), the fused experts of every layer and the router. ZeRO-3
    trains the one-process curve, the balancing loss included."""
    args = [*moe_args("qwen3_moe"), "--lora_r", "8", "--lora_alpha", "16"]
    one = launch(run_dir("one"), *args, "--batch_size", "8").check()
    yaml, flags = entry("deepspeed_zero3", 8)
    zero3 = launch(run_dir("zero3"), *args, *flags, config=yaml).check()
    assert_one_process_curve(zero3, one, balanced=True)
    adapter = json.loads((one.output_dir / "final" / "adapter" / "adapter_config.json").read_text())
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(adapter["target_modules"]), adapter
    assert set(adapter["target_parameters"]) == {"gate_up_proj", "down_proj", "gate.weight"}, adapter


@pytest.mark.slow
def test_packed_examples_train_a_mixture_of_experts_like_one_process(moe_args, run_dir):
    """--packing: each example attends to itself through transformers' own mask from the restarting positions (the
    model's balance reads a 2-D mask only: the block mask the recipe makes for dense models failed it); DDP with
    accumulation trains one process's curve."""
    args = [*moe_args("qwen3_moe"), "--packing", "--seq_len", "128", "--max_steps", "3"]
    one = launch(run_dir("one"), *args, "--batch_size", "4").check()
    ddp = launch(run_dir("ddp"), *args, "--batch_size", "1", "--grad_accum", "2", config="ddp").check()
    assert one.resolved["packing"] and max_rel_diff(ddp.losses, one.losses) < PARITY_BOUND
    assert all(m["aux_loss"] > 0 for m in one.metrics)


@pytest.mark.slow
def test_the_experts_loop_and_grouped_matmuls_train_one_curve(moe_args, references, run_dir):
    """--experts_implementation eager (a Python loop over the experts tokens picked) trains the curve of
    transformers' default, grouped_mm (the reference), to 1e-6: the kernel changes the speed (bench/moe.py), not the
    numbers."""
    loop = launch(run_dir("loop"), *moe_args("qwen3_moe"), "--experts_implementation", "eager",
                  "--batch_size", "8").check()
    reference = references("qwen3_moe")
    assert loop.resolved["experts_implementation"] == "eager" and reference.resolved["experts_implementation"] == ""
    for key in ("loss", "grad_norm", "aux_loss"):
        assert max_rel_diff([m[key] for m in loop.metrics], [m[key] for m in reference.metrics]) < 1e-6, key


def test_an_experts_kernel_for_a_model_without_experts_is_refused(check_only, chat, tmp_path):
    run = check_only(tmp_path / "out", "--recipe", "causal_lm", "--model_name_or_path", str(chat[0]), "--data",
                     str(chat[1]), "--chat_template", "chatml", "--experts_implementation", "eager", "--dry_run")
    assert_refused(run, "--experts_implementation eager: a qwen2 model has no routed experts")


@pytest.mark.slow
@pytest.mark.parametrize("config, name", [("deepspeed_zero3_sp", "qwen3_moe"), ("deepspeed_zero2_sp", "mixtral"),
                                          ("fsdp_cp", "qwen3_moe")])
def test_sequence_parallelism_gathers_the_router_logits_of_whole_sequences(moe_args, references, run_dir, config,
                                                                          name):
    """Under DeepSpeed's Ulysses each rank holds half of every sequence, under torch's context parallelism two
    chunks of it (tests/helpers/context_parallel_on_cpu.py on a CPU); the balance needs each whole sequence's router
    logits, which the ranks of a group gather (trainkit/losses/router.py: the gradient back to each rank's
    positions): loss, gradient norm and aux_loss are one process's, and where one group computes the whole micro-batch
    the expert load too (zero2_sp: 4 processes, 2 groups of sp 2, 2 data-parallel ranks; Mixtral's config has no
    head_dim, which DeepSpeed reads: the runner fills in the one its attention uses)."""
    yaml, flags = entry(config, 8)
    run = launch(run_dir("out"), *moe_args(name), *flags, config=yaml).check()
    split = "context parallelism: each sequence cut in 4" if config == "fsdp_cp" else \
        "sequence parallelism: each sequence cut in 2"
    assert split in run.stderr
    assert_one_process_curve(run, references(name), balanced=True)
    for i in range(0 if config == "deepspeed_zero2_sp" else 2):
        # a statistic of each micro-batch's whole sequences: one process's where a group computes its micro-batch (one
        # group of the 8 rows here; zero2_sp's 2 groups compute 4 rows each, a split the statistic depends on)
        key = f"expert_load/layer_{i}"
        assert max_rel_diff([m[key] for m in run.metrics], [m[key] for m in references(name).metrics]) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("config, name", [("pipeline", "qwen3_moe"), ("pipeline_fsdp", "mixtral"),
                                          ("pipeline_tp", "olmoe")])
def test_pipeline_stages_pass_the_router_logits_on_to_the_last(moe_args, references, run_dir, config, name):
    """Each stage holds some of the layers, and the balance needs every layer's router logits: each stage passes on
    those it received and its own beside the hidden states, the last adds the balance to the loss (pipeline_decoder.
    Balanced), the gradients go back the same way: loss, gradient norm and aux_loss are one process's (pipeline_fsdp:
    4 processes, 2 stages x 2 FSDP2 shards; pipeline_tp: 2 stages x tp 2, each stage's experts cut)."""
    yaml, flags = entry(config, 8)
    run = launch(run_dir("out"), *moe_args(name), *flags, config=yaml, extra_launch=processes(config)).check()
    assert (run.resolved["pipeline_stages"], run.resolved["world_size"]) == (2, 2 if config == "pipeline" else 4)
    assert_one_process_curve(run, references(name), balanced=True)


def test_pipeline_stages_of_a_recipe_of_your_own_that_drop_the_router_logits_are_refused(check_only, moe_args,
                                                                                        tmp_path):
    """A recipe that cuts a balancing mixture of experts with a pipeline_stage of its own passes on hidden states
    alone: the last stage's loss would silently lose the balance. Refused at plan time, naming the stage that passes
    the router logits on."""
    own = tmp_path / "own_stages.py"
    own.write_text("from trainkit.recipes import load_recipe\n\n"
                   "_shipped = load_recipe('causal_lm')\n"
                   "Config, build_model, build_datasets, loss = (_shipped.Config, _shipped.build_model, "
                   "_shipped.build_datasets, _shipped.loss)\n"
                   "pipeline_layers, pipeline_loss = _shipped.pipeline_layers, _shipped.pipeline_loss\n\n\n"
                   "def pipeline_stage(model, layers, first, last):\n"
                   "    return _shipped.pipeline_stage(model, layers, first, last)\n")
    args = moe_args("qwen3_moe")
    args[args.index("causal_lm")] = str(own)
    yaml, flags = entry("pipeline", 8)
    run = check_only(tmp_path / "out", *args, *flags, "--dry_run", "--accelerate_config",
                     str(ROOT / "accelerate_configs" / f"{yaml}.yaml"), "--num_processes", "2")
    assert_refused(run, "Qwen3MoeForCausalLM computes its router's balancing loss from every layer's router logits, "
                        "which the stages of own_stages.py's pipeline_stage do not pass on")
    assert "(trainkit.strategies.pipeline_decoder's stage and loss), which pass them on" in run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("config, name, grad_accum", [("tp", "mixtral", 1), ("tp", "olmoe", 1),
                                                     ("fsdp_tp", "deepseek_v3", 1), ("tp", "qwen3_moe", 2)])
def test_tensor_parallelism_cuts_every_expert_with_transformers_styles(moe_args, references, run_dir, config, name,
                                                                       grad_accum):
    """transformers' plan cuts each fused expert over the tp ranks (moe_tp_experts, packed_colwise, rowwise; applied
    by transformers itself: strategies/tp_plan.py) beside the attention's Linear layers (OLMoE's gathered styles;
    DeepSeek-V3's shared experts and dense first layer; Qwen3's per-head norms, whose gradients are summed over the
    ranks at each micro-batch): every rank routes alike and computes its slice of every expert, so the loss, gradient
    norm and aux_loss are one process's, each rank holding less (fsdp_tp: 4 processes, 2 FSDP2 shards x tp 2).
    Qwen3-MoE accumulates 2 micro-batches: its norms' gradients are a small part of the norm, which a sum of the
    accumulated gradient at each micro-batch moved by 5.6e-6 (transformers' own style), no sum at all by 2.9e-5: held
    to 2e-6 here. Mixtral stops at step 3 (the packed shards written as plain ones) and resumes under fsdp.yaml on the
    same curve; its final/ is one process's."""
    yaml, flags = entry(config, 8, grad_accum)
    run = launch(run_dir("out"), *moe_args(name), *flags, "--save_every", "3", config=yaml).check()
    reference = references(name)
    assert "tensor parallelism: the fused experts of 2 layers cut over 2 ranks" in run.stderr \
        if name != "deepseek_v3" else "the fused experts of 1 layers" in run.stderr
    assert_one_process_curve(run, reference, balanced=name in BALANCED)
    assert max_rel_diff([m["grad_norm"] for m in run.metrics], [m["grad_norm"] for m in reference.metrics]) < 2e-6
    # each rank holds its slice of every expert and cut layer (the embeddings whole): less than one process, as
    # the estimate says (strategies/tp_plan.py's split_parameters counts the fused experts' weights as cut)
    held, estimated = run.metrics[-1]["state_bytes"], run.resolved["estimated_state_bytes"]
    assert held < 0.85 * reference.metrics[-1]["state_bytes"] and abs(held - estimated) < 0.1 * estimated
    if name == "mixtral":
        assert_export_loads(run, reference, name)
        step_3 = str(run.output_dir / "checkpoints" / "step_3")
        plain = launch(run_dir("plain"), *moe_args(name), *entry("fsdp", 8)[1], "--resume", step_3,
                       config="fsdp").check()
        assert max_rel_diff(plain.losses, run.losses[3:]) < PARITY_BOUND and len(plain.losses) == 3


def test_a_tensor_parallel_size_that_does_not_divide_the_experts_is_refused():
    """Each rank computes a slice of every expert's intermediate features: tp must divide them (Mixtral's 64 here),
    found on the model built on the meta device, before anything runs."""
    from trainkit.strategies.tp_plan import plan_problems

    found = [p.what for p in plan_problems(mixture_of_experts("mixtral"), 3, "here", "sizes")]
    assert "parallelism_config_tp_size 3 does not divide the 64 features of each expert's gate_up_proj" in found
    assert "parallelism_config_tp_size 3 does not divide the 64 features of each expert's down_proj" in found


def test_a_mixture_without_a_plan_is_refused_by_tensor_parallelism(check_only, moe_args, tmp_path):
    """transformers 5.23 declares no tensor-parallel plan for gpt-oss: refused, naming the configs that train it."""
    run = check_only(tmp_path / "out", *moe_args("gpt_oss"), "--dry_run", "--accelerate_config",
                     str(ROOT / "accelerate_configs" / "tp.yaml"))
    assert_refused(run, "GptOssForCausalLM declares no tensor-parallel plan")
    assert "fsdp.yaml" in run.stderr


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_mfu_counts_the_active_parameters(name, lora):
    """The FLOPs of a token count its top 2 of the 4 routed experts (half their parameters, named by hand here),
    the shared experts, routers and attention whole, the input embedding not at all (trainkit/run/metrics.py). With
    peft's adapters (all-linear: the fused experts wrapped too) the experts still count half, the adapters whole."""
    from trainkit.run.metrics import count_flops

    model = mixture_of_experts(name)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    named = dict(model.named_parameters())
    routed = sum(p.numel() for n, p in named.items() if ".experts." in n and "lora_" not in n)
    assert routed > 0
    if lora and name in ("qwen3_moe", "mixtral"):  # peft 0.21 wraps these families' experts (not gpt-oss, Qwen2-MoE)
        assert any(".experts." in n and "lora_" in n for n in named)
    embed = next(n for n in named if n.endswith("embed_tokens.weight"))
    lookup = named[embed].numel() if any(n.endswith("lm_head.weight") for n in named) else 0  # untied: a lookup
    expected = sum(p.numel() for p in named.values()) - lookup - routed // 2
    assert count_flops(model, 64).params == expected


EXPERT_LIST = str(ROOT / "tests" / "zoo" / "expert_list_moe.py")


@pytest.mark.slow
def test_zero3_gathers_a_block_of_expert_modules_whole_so_routing_apart_never_hangs(run_dir):
    """A user's MoE with one module per expert (tests/zoo/expert_list_moe.py): under ZeRO-3 each rank gathers an
    expert when a token picks it, so ranks that pick different experts ask for different gathers (without the mark
    below, DeepSpeed stops at the first step with "RuntimeError: rank1: [0, 1, 2, 3, 8, ...]", the modules each rank
    ran differing). The runner marks the block a DeepSpeed leaf module (gathered whole, said in a note): with every
    rank's tokens forced to its own experts at every step the run ends; with the model's own routing it trains one
    process's curve."""
    one = launch(run_dir("one"), "--recipe", EXPERT_LIST, "--batch_size", "8").check()
    yaml, flags = entry("deepspeed_zero3", 8)
    zero3 = launch(run_dir("zero3"), "--recipe", EXPERT_LIST, *flags, config=yaml).check()
    assert "ZeRO-3: each MoEBlock is gathered whole (a DeepSpeed leaf module)" in zero3.stderr
    assert max_rel_diff(zero3.losses, one.losses) < PARITY_BOUND
    apart = launch(run_dir("apart"), "--recipe", EXPERT_LIST, *flags, "--set", "apart=true", config=yaml,
                   env={"TRAINKIT_DIST_TIMEOUT": "60"}).check()  # a hang fails in a minute
    assert len(apart.losses) == 6


def expert_parameters(name: str) -> int:
    """The routed experts' parameters of the family `name` (every layer's fused experts; shared experts apart)."""
    return sum(p.numel() for n, p in mixture_of_experts(name).named_parameters() if ".experts." in n)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_expert_parallelism_trains_the_one_process_curve(moe_args, references, run_dir, tmp_path, name):
    """fsdp_ep.yaml: each of the 2 ranks holds half of every layer's experts (as counted by the run) and the tokens
    travel to them; dropless, so the routing and every step's loss, gradient norm and balance are one process's, on
    three families (DeepSeek-V3: a dense first layer, a shared expert, no balancing loss; its blocks recompute their
    forward in backward, all-to-all included: fsdp_activation_checkpointing); the state a rank holds is the
    estimate's, within 10%. Qwen3-MoE stops after step 3 and resumes from the checkpoint (the split experts and their
    optimizer state in it), and fsdp.yaml resumes it too; Mixtral's shards live in CPU memory (fsdp_offload_params);
    the export is whole."""
    from trainkit.launch.launcher import Launch
    from trainkit.recipes import load_recipe
    from trainkit.strategies.registry import for_launch

    yaml, flags = entry("fsdp_ep", 8)
    if name == "mixtral":
        yaml = str(write_yaml(tmp_path, yaml, **{"fsdp_offload_params:__false": "fsdp_offload_params: true"}))
        assert for_launch(Launch.from_yaml(yaml), load_recipe("mlp").Config(), {}).label == "fsdp_ep_offload"
    if name == "deepseek_v3":
        yaml = str(write_yaml(tmp_path, yaml, **{"fsdp_activation_checkpointing:__false":
                                                 "fsdp_activation_checkpointing: true"}))
    out = run_dir("out")
    stop = ["--stop_at", "3"] if name == "qwen3_moe" else []
    run = launch(out, *moe_args(name), *flags, *stop, config=yaml).check()
    assert run.resolved["ep"] == 2 and run.resolved["strategy"] == "fsdp_ep"
    assert ("activation checkpointing on each" in run.stderr) == (name == "deepseek_v3")
    total = expert_parameters(name)
    assert f"this rank holds {total // 2:,} of the {total:,} expert parameters" in run.stderr
    held, estimated = run.metrics[-1]["state_bytes"], run.resolved["estimated_state_bytes"]
    assert abs(estimated - held) <= 0.1 * held and held < 0.6 * references(name).metrics[-1]["state_bytes"]
    if stop:
        assert len(run.metrics) == 3
        # the checkpoint of the split experts resumed by fsdp.yaml, which shards every expert instead (DCP reshards)
        fsdp_yaml, fsdp_flags = entry("fsdp", 8)
        other = launch(run_dir("other"), *moe_args(name), *fsdp_flags, "--resume",
                       str(out / "checkpoints" / "step_3"), config=fsdp_yaml).check()
        assert [m["step"] for m in other.metrics] == [4, 5, 6]
        theirs = references(name).metrics[3:]
        assert max_rel_diff([m["loss"] for m in other.metrics], [m["loss"] for m in theirs]) < PARITY_BOUND
        run = launch(out, *moe_args(name), *flags, "--resume", "auto", config=yaml).check()
    assert_one_process_curve(run, references(name), balanced=name in BALANCED)
    assert_export_loads(run, references(name), name)


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 2], ids=["dp_shard_4", "hsdp_2x2"])
def test_expert_parallelism_over_4_processes_shares_each_expert_or_replicates_it(moe_args, references, tmp_path,
                                                                                 run_dir, replicas):
    """4 processes, ep 2: ranks 0,1 and 2,3 each split the experts. With dp_shard 4, each expert's two copies (ranks 0
    and 2, 1 and 3) are sharded between them by FSDP2, whose reduction sums the copies and divides by the 4
    data-parallel ranks (gloo has no PREMUL_SUM: summed, then divided); with 2 HSDP replicas of dp_shard 2 each
    replica holds a copy, all-reduced between them. With accumulation, one process's curve, the gradient norm
    included (AdamW would hide a gradient scaled by a constant from the loss)."""
    sizes = f"parallelism_config_dp_replicate_size: {replicas}\n  parallelism_config_dp_shard_size: {4 // replicas}"
    yaml = write_yaml(tmp_path, "fsdp_ep", **{"parallelism_config_dp_shard_size:__2": sizes,
                                              "\nnum_processes:__2": "\nnum_processes: 4"})
    run = launch(run_dir("out"), *moe_args("qwen3_moe"), "--batch_size", "1", "--grad_accum", "2",
                 config=str(yaml)).check()
    assert (run.resolved["dp_replicate"], run.resolved["dp_shard"], run.resolved["ep"]) == (replicas, 4 // replicas, 2)
    total = expert_parameters("qwen3_moe")
    assert f"this rank holds {total // (4 // replicas):,} of the {total:,} expert parameters" in run.stderr
    assert_one_process_curve(run, references("qwen3_moe"), balanced=True)


def ep_yaml(tmp_path, processes: int, ep: int, extra: str = "") -> str:
    """fsdp_ep.yaml for `processes` ranks (all of dp_shard) of which `ep` split the experts, with `extra` lines."""
    text = (ROOT / "accelerate_configs" / "fsdp_ep.yaml").read_text()
    text = text.replace("parallelism_config_dp_shard_size: 2", f"parallelism_config_dp_shard_size: {processes}")
    text = text.replace("parallelism_config_ep_size: 2", f"parallelism_config_ep_size: {ep}{extra}")
    path = tmp_path / "ep.yaml"
    path.write_text(text.replace("\nnum_processes: 2", f"\nnum_processes: {processes}"))
    return str(path)


@pytest.mark.parametrize("processes, ep, extra, flags, message", [
    (2, 2, "", ["DENSE"], "Qwen2ForCausalLM has no expert-parallel plan"),
    (3, 3, "", [], "parallelism_config_ep_size 3 does not divide the 4 experts of each layer"),
    (4, 3, "", [], "parallelism_config_ep_size 3 does not divide parallelism_config_dp_shard_size 4"),
    (4, 2, "\n  parallelism_config_tp_size: 2", [], "expert parallelism with tp: the runner splits experts only "
     "together with FSDP2's dp_shard"),
    (2, 2, "", ["--compile"], "--compile with expert parallelism: not tested"),
    (2, 2, "", ["--lora_r", "8"], "LoRA adapters on the experts with expert parallelism"),
], ids=["dense", "experts", "dp_shard", "tp", "compile", "lora-experts"])
def test_expert_parallelism_that_cannot_apply_is_refused(check_only, moe_args, chat, tmp_path, processes, ep, extra,
                                                        flags, message):
    """Before anything is built (the dry run, as each rank does at start-up), with the reason and the fix."""
    args = [*moe_args("qwen3_moe"), *flags]
    if flags == ["DENSE"]:  # the chat fixture's Qwen2, without the coefficient a model without a router refuses
        args = [*args[:args.index("--router_aux_loss_coef")], "--tokenizer", "saved"]
        args[args.index("--model_name_or_path") + 1] = str(chat[0])
    run = check_only(tmp_path / "out", *args, "--dry_run", "--accelerate_config",
                     ep_yaml(tmp_path, processes, ep, extra))
    assert_refused(run, message)


def autoep_yaml(tmp_path, processes: int = 2, stage: int = 2, offload: bool = False, sp: int = 1,
                **section) -> str:
    """deepspeed_zero2_ep.yaml for `processes` ranks (sequence-parallel groups of `sp`), its JSON at ZeRO `stage`
    (with the optimizer in CPU memory), its expert_parallel section updated with `section`."""
    ds = json.loads((ROOT / "ds_configs" / "zero2_ep.json").read_text())
    ds["zero_optimization"]["stage"] = stage
    ds["expert_parallel"].update(section)
    if offload:
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if stage == 3:
        ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    sizes = f"\nparallelism_config:\n  parallelism_config_sp_size: {sp}\n  parallelism_config_sp_backend: deepspeed"
    return str(write_yaml(tmp_path, "deepspeed_zero2_ep", json.dumps(ds),
                          **{"\nnum_processes:__2": f"{sizes if sp > 1 else ''}\nnum_processes: {processes}"}))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_deepspeeds_autoep_trains_the_one_process_curve(moe_args, references, run_dir, tmp_path, check_only, name):
    """deepspeed_zero2_ep.yaml: DeepSpeed's AutoEP replaces each block by its family's preset, half of the experts
    on each rank (as counted by the run in the replaced model), the optimizer state the estimate's within 10%;
    dropless, so every step's loss, gradient norm and balance are one process's. Mixtral stops after step 3 and
    resumes natively (bit for bit, the split experts and their optimizer state in the checkpoint), and is refused
    under deepspeed_zero2.yaml, which cannot read AutoEP's layout (nor AutoEP a ZeRO-2 checkpoint); Qwen3-MoE under
    ZeRO-1 with accumulation, its blocks recomputed in backward (all-to-alls included: --gradient_checkpointing);
    DeepSeek-V3 (a dense first layer, a shared expert, grouped routing with a bias) on 4 processes, each expert on
    2 of them, the optimizer in CPU memory (ZeRO-Offload's cpu_adam). final/ is the model's own layout, every expert
    gathered: one process's final/."""
    yaml, flags = entry("deepspeed_zero2_ep", 8)
    if name == "qwen3_moe":
        yaml, flags = autoep_yaml(tmp_path, stage=1), ["--batch_size", "2", "--grad_accum", "2",
                                                       "--gradient_checkpointing", "true"]
    if name == "deepseek_v3":
        yaml, flags = autoep_yaml(tmp_path, processes=4, offload=True), ["--batch_size", "2"]
    out = run_dir("out")
    stop = ["--stop_at", "3"] if name == "mixtral" else []
    run = launch(out, *moe_args(name), *flags, *stop, config=yaml).check()
    assert run.resolved["ep"] == 2 and run.resolved["strategy"] == "deepspeed"
    total = expert_parameters(name)
    assert f"this rank holds {total // 2:,} of the {total:,} expert parameters" in run.stderr
    held, estimated = run.metrics[-1]["state_bytes"], run.resolved["estimated_state_bytes"]
    shrink = 0.7 if name == "deepseek_v3" else 0.6  # with offload: host copies of the partition and its gradients
    assert abs(estimated - held) <= 0.1 * held and held < shrink * references(name).metrics[-1]["state_bytes"]
    if stop:
        assert len(run.metrics) == 3
        step_3 = str(out / "checkpoints" / "step_3")
        elsewhere = check_only(run_dir("zero2"), *moe_args(name), *flags, "--resume", step_3, "--dry_run",
                               "--accelerate_config", str(ROOT / "accelerate_configs" / "deepspeed_zero2.yaml"))
        assert_refused(elsewhere, "the checkpoint was saved under DeepSpeed's AutoEP (autoep_size 2, ZeRO-2, 2 "
                                  "processes): each rank's own experts in AutoEP's layout")
        plain = launch(run_dir("plain"), *moe_args(name), *entry("deepspeed_zero2", 8)[1], "--stop_at", "1",
                       config="deepspeed_zero2").check()
        into = check_only(run_dir("into"), *moe_args(name), *flags, "--resume", str(plain.output_dir / "checkpoints" /
                                                                                    "step_1"), "--dry_run",
                          "--accelerate_config", str(ROOT / "accelerate_configs" / f"{yaml}.yaml"))
        assert_refused(into, "the checkpoint was saved without DeepSpeed's AutoEP, which this run splits the experts "
                             "with (autoep_size 2)")
        uninterrupted = launch(run_dir("whole"), *moe_args(name), *flags, config=yaml).check()
        run = launch(out, *moe_args(name), *flags, "--resume", "auto", config=yaml).check()
        assert [m["loss"] for m in run.metrics] == [m["loss"] for m in uninterrupted.metrics]
    assert_one_process_curve(run, references(name), balanced=name in BALANCED)
    assert_export_loads(run, references(name), name)


@pytest.mark.parametrize("processes, changes, flags, message", [
    (2, {}, ["DENSE"], "DeepSpeed's AutoEP finds no mixture-of-experts block to split in model_type 'qwen2' "
     "(Qwen2ForCausalLM): AutoEP has presets for mixtral, qwen3_moe"),
    (2, {}, ["gpt_oss"], "finds no mixture-of-experts block to split in model_type 'gpt_oss'"),
    (2, {}, ["--lora_r", "8"], "LoRA with DeepSpeed's AutoEP: peft's wrapper renames the blocks"),
    (2, {"stage": 3}, [], "expert_parallel with ZeRO-3: DeepSpeed 0.19 cannot consolidate AutoEP's experts under "
     "ZeRO-3 for final/"),
    (4, {"sp": 2}, [], "expert_parallel with sequence parallelism: not tested"),
    (2, {"autoep_size": 3}, [], "expert_parallel.autoep_size 3 does not divide the 2 process(es)"),
    (2, {"autoep_size": "two"}, [], "expert_parallel.autoep_size 'two' does not divide the 2 process(es)"),
    (2, {}, ["--compile"], "--compile with DeepSpeed's AutoEP: not tested"),
    (3, {"autoep_size": 3}, [], "DeepSpeed's AutoEP rejects Qwen3MoeForCausalLM's experts: num_experts=4"),
], ids=["dense", "no-preset", "lora", "zero3", "sp", "processes", "not-a-number", "compile", "experts"])
def test_deepspeeds_autoep_where_it_cannot_apply_is_refused(check_only, moe_args, moe_folder, chat, tmp_path,
                                                            processes, changes, flags, message):
    """Before anything is built (the dry run, as each rank does at start-up), with the reason and the fix: AutoEP
    itself leaves a model it finds no block of unsplit without a word."""
    args = [*moe_args("qwen3_moe"), *flags]
    if flags == ["DENSE"]:  # the chat fixture's Qwen2, without the coefficient a model without a router refuses
        args = [*args[:args.index("--router_aux_loss_coef")], "--tokenizer", "saved"]
        args[args.index("--model_name_or_path") + 1] = str(chat[0])
    if flags == ["gpt_oss"]:
        args = moe_args("gpt_oss")
    run = check_only(tmp_path / "out", *args, "--dry_run", "--accelerate_config",
                     autoep_yaml(tmp_path, processes, **changes))
    assert_refused(run, message)


def test_deepspeeds_autoep_refuses_experts_kept_one_module_each():
    """AutoEP also splits experts kept as a ModuleList of one module per expert (an older layout its presets match),
    which the runner cannot write back into the model's final/: refused before the run, not after it."""
    import torch

    from trainkit.strategies.deepspeed_ep import model_problems

    model = mixture_of_experts("mixtral")
    hidden, ffn = model.config.hidden_size, model.config.intermediate_size
    for layer in model.model.layers:
        experts = torch.nn.ModuleList(torch.nn.Module() for _ in range(model.config.num_local_experts))
        for expert in experts:
            expert.gate_up_proj, expert.down_proj = torch.nn.Linear(hidden, 2 * ffn), torch.nn.Linear(ffn, hidden)
        layer.mlp.experts = experts
    config = json.loads((ROOT / "ds_configs" / "zero2_ep.json").read_text())
    (problem,) = model_problems(model, config, "here")
    assert "MixtralForCausalLM keeps one module per expert (model.layers.0.mlp...)" in problem.what


def dense_llama(folder, chat_folder) -> None:
    """A small Llama with tied embeddings (the tiny transformer's layout) and the chat fixture's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
                     ).save_pretrained(folder)
    AutoTokenizer.from_pretrained(chat_folder).save_pretrained(folder)


def test_an_upcycled_mixture_computes_what_the_dense_model_did(chat, tmp_path, capsys):
    """python -m trainkit.tools.upcycle: a Mixtral whose 4 experts per layer are copies of the dense MLP and whose
    router weighs its top 2 to a sum of 1 gives the dense model's logits (to float rounding) for any routing; the
    attention, norms and tied embeddings are the dense model's, the router's logits on (its balancing loss)."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainkit.tools import upcycle

    dense_llama(tmp_path / "dense", chat[0])
    assert upcycle.main([str(tmp_path / "dense"), str(tmp_path / "moe"), "--experts", "4", "--top_k", "2"]) == 0
    assert "a Mixtral of" in capsys.readouterr().out
    dense, moe = (AutoModelForCausalLM.from_pretrained(tmp_path / name) for name in ("dense", "moe"))
    assert type(moe).__name__ == "MixtralForCausalLM" and moe.config.output_router_logits
    assert moe.config.num_local_experts == 4 and moe.config.tie_word_embeddings
    ids = torch.randint(0, 400, (3, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = dense(ids).logits, moe(ids).logits
    assert (got - expected).abs().max() < 1e-5 * expected.abs().max()
    experts = moe.model.layers[1].mlp.experts
    assert torch.equal(experts.down_proj[3], dense.model.layers[1].mlp.down_proj.weight)


@pytest.mark.parametrize("case, message", [
    ("qwen2", "cannot be upcycled: a qwen2 model: the upcycled mixture is a Mixtral, whose attention is Llama's"),
    ("top_k", "--top_k 5 of --experts 4: pick between 1 and the number of experts"),
    ("not empty", "is not empty: pass a new folder"),
])
def test_what_cannot_be_upcycled_is_refused(chat, tmp_path, capsys, case, message):
    from trainkit.tools import upcycle

    dense_llama(tmp_path / "dense", chat[0])
    source = chat[0] if case == "qwen2" else tmp_path / "dense"
    (tmp_path / "moe").mkdir()
    if case == "not empty":
        (tmp_path / "moe" / "config.json").write_text("{}")
    top_k = "5" if case == "top_k" else "2"
    assert upcycle.main([str(source), str(tmp_path / "moe"), "--experts", "4", "--top_k", top_k]) == 2
    assert message in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "moe").iterdir()] == (["config.json"] if case == "not empty" else [])
