"""Every shipped strategy config trains exactly like one process, resumes exactly, exports what it trained and holds
what the estimator predicts.

The configs come from the registry (trainkit.strategies.registry.shipped_strategies: every shipped YAML that runs
several processes on one machine, plus the strategies that flags select on a data-parallel YAML), so a new strategy's
YAML gets every check here without a line of this file changing. Strategies that cut the model itself (pipeline stages,
tensor parallelism) need a recipe that says where: they train the transformer here, and every other recipe is checked
to be refused with the fix. Batch sizes follow each config's data-parallel size, so that every run has the global
batch of its one-process reference. Each launched run is shared by the tests that read it (module-scoped fixtures,
one per config and recipe).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_model

from conftest import (
    FLAG_STRATEGIES,
    LAUNCHES,
    LM,
    PARITY_BOUND,
    ROOT,
    TEST_ENV,
    assert_refused,
    entry,
    error_lines,
    forked_run_config,
    launch,
    max_rel_diff,
    processes,
    strategy_of,
    write_yaml,
    yaml_of,
    zero2_json,
)
from trainkit.estimate import meta_model
from trainkit.launch.launcher import shipped_configs
from trainkit.recipes import load_recipe
from trainkit.strategies.registry import REGISTRY, shipped_strategies
from trainkit.tools.compare import main as compare_main

pytestmark = pytest.mark.slow

ZOO_PATHS = [str(ROOT / "tests" / "zoo" / f"{name}.py") for name in ("vision_moe", "tied_rnn_lm")]
# every model trains under these (expert parallelism trains mixtures of experts only: tests/test_moe.py)
CONFIGS = sorted(name for name in shipped_strategies() if not (strategy_of(name).splits_model or
                                                               strategy_of(name).needs_experts))
MODEL_SPLITTING = sorted(name for name in LAUNCHES if strategy_of(name).splits_model)  # the transformer only
# The recipes' real defaults (AdamW, the MLP's weight decay 0, the transformer's 0.01), fewer and smaller steps.
MLP = ["--recipe", "mlp", "--max_steps", "12", "--eval_every", "0", "--warmup_steps", "2"]
# GPT-2 style with dropout on: a resume must also restore every rank's RNG (no parity: each rank draws its own masks).
LM_DROPOUT = ["--recipe", "tiny_transformer", "--max_steps", "10", "--eval_every", "0", "--hidden", "64",
              "--layers", "2", "--seq_len", "64", "--arch", "gpt2", "--dropout", "0.1"]


def resumed_from_step_5(run, args: list[str], config: str, output_dir, extra_launch: tuple[str, ...] = ()):
    """The same command resumed from the run's step-5 checkpoint, in a fresh output directory."""
    return launch(output_dir, *args, "--resume", str(run.output_dir / "checkpoints" / "step_5"), config=config,
                  extra_launch=extra_launch).check()


@pytest.fixture(scope="module")
def mlp_reference(tmp_path_factory):
    """One process, micro-batch 16 = the launched runs' 2 processes x 4 x accumulation 2."""
    return launch(tmp_path_factory.mktemp("mlp") / "ref", *MLP, "--batch_size", "16").check()


@pytest.fixture(scope="module", params=CONFIGS)
def mlp_run(request, tmp_path_factory):
    """Global batch 16 as accumulation 2 (2 processes x micro-batch 4), a checkpoint every 5 steps."""
    out = tmp_path_factory.mktemp(f"mlp-{request.param}") / "out"
    yaml, flags = entry(request.param, 16, grad_accum=2)
    return request.param, launch(out, *MLP, *flags, "--save_every", "5", config=yaml).check()


@pytest.fixture(params=CONFIGS + MODEL_SPLITTING)
def lm_run(request, lm_runs):
    return request.param, lm_runs(request.param)


def most_demanding_of_each(key, names: list[str]) -> list[str]:
    """Per group of configs (by `key` of their strategy), the one that shards and offloads the most (speed_rank)."""
    best = {}
    for name in names:
        strategy = strategy_of(name)
        best[key(strategy)] = max(best.get(key(strategy), (-1, "")), (strategy.speed_rank, name))
    return sorted(name for _, name in best.values())


# Restoring every rank's RNG and data position is the checkpointer's work, the same for every strategy; what differs
# is the checkpoint format each strategy writes. Exact resume is checked under every config with the MLP (and the
# transformer for the model-splitting ones, tests/test_tensor_parallel.py, tests/test_pipeline.py); with dropout and
# with the zoo's models, once per checkpoint format, under its most demanding config.
PER_FORMAT = most_demanding_of_each(lambda s: s.engine.format.name, sorted(LAUNCHES))
ZOO_PER_FORMAT = most_demanding_of_each(lambda s: s.engine.format.name, CONFIGS)


def dropout_args(name: str) -> list[str]:
    """LM_DROPOUT and the config's flags; Llama's attention dropout where the strategy cannot cut GPT-2 (tensor
    parallelism: GPT-2 declares no plan)."""
    recipe = load_recipe("tiny_transformer")
    gpt2 = recipe.Config(arch="gpt2", hidden=64, layers=2, seq_len=64)
    cuts_gpt2 = not strategy_of(name).check_model(meta_model(recipe, gpt2))
    return [*LM_DROPOUT, *entry(name, 8)[1], *([] if cuts_gpt2 else ["--arch", "llama"])]


@pytest.fixture(scope="module", params=PER_FORMAT)
def lm_dropout_run(request, tmp_path_factory):
    """Every rank's RNG comes back with the checkpoint: once per checkpoint format."""
    out = tmp_path_factory.mktemp(f"lmd-{request.param}") / "out"
    return request.param, launch(out, *dropout_args(request.param), "--save_every", "5",
                                 config=entry(request.param, 8)[0], extra_launch=processes(request.param)).check()


def test_every_strategy_has_a_shipped_config_and_every_config_a_strategy():
    """The matrix below covers every registered strategy; every shipped YAML selects one."""
    selected = {name: type(strategy_of(name)) for name in [*shipped_configs(), *FLAG_STRATEGIES]}
    assert set(REGISTRY) == set(selected.values()), (REGISTRY, selected)
    assert {"ddp", "fsdp", "fsdp_offload", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero2_offload",
            "deepspeed_zero3", "deepspeed_zero3_offload"} <= set(CONFIGS)
    assert "pipeline" in MODEL_SPLITTING


@pytest.mark.parametrize("name", MODEL_SPLITTING)
@pytest.mark.parametrize("recipe", ["mlp", "image_classifier", *ZOO_PATHS], ids=lambda r: Path(r).stem)
def test_a_model_the_strategy_cannot_split_is_refused_with_the_fix(check_only, tmp_path, name, recipe):
    """Models that do not declare where they may be cut (every recipe here but the transformer): refused at plan
    time, naming what to declare or which config to use instead, before anything is built."""
    run = check_only(tmp_path / "out", "--recipe", recipe, *entry(name, 16)[1], "--dry_run", "--accelerate_config",
                     yaml_of(name, tmp_path))
    assert run.returncode == 2 and "error: " in run.stderr, run.stderr
    assert "recipe" in run.stderr and ("fsdp.yaml" in run.stderr or "hsdp.yaml" in run.stderr), run.stderr


def test_mlp_matches_one_process_with_accumulation(mlp_run, mlp_reference):
    config, run = mlp_run
    resolved = run.resolved
    assert (resolved["world_size"], resolved["global_batch_size"], resolved["grad_accum"]) == \
        (LAUNCHES[config].world_size, 16, 2)
    assert resolved["strategy"] == strategy_of(config).name
    assert resolved["zero_stage"] == (int(config[len("deepspeed_zero")]) if config.startswith("deepspeed") else None)
    assert len(run.losses) == 12 and len(set(mlp_reference.losses)) == 12  # a real curve, not a constant
    assert max_rel_diff(run.losses, mlp_reference.losses) <= PARITY_BOUND
    assert_estimate_within_10_percent(run)
    # trainkit/launch/library_noise.py's list: DeepSpeed's deprecated collectives (hundreds of lines a run), its CPU
    # notice in each rank (the launcher's own process, which the runner does not control, may still print it once)
    assert "is deprecated" not in run.stderr and run.stderr.count("Setting accelerator to CPU") <= 1


def test_mlp_export_holds_the_trained_weights(mlp_run):
    """final/ reloads into a fresh model that predicts the held-out loss the run measured at its last step."""
    _, run = mlp_run
    recipe = load_recipe("mlp")
    cfg = recipe.Config()
    model = recipe.build_model(cfg)
    load_model(model, str(run.output_dir / "final" / "model.safetensors"))
    _, held_out = recipe.build_datasets(cfg, None)
    x, y = held_out[: run.resolved["eval_batches"] * run.resolved["global_batch_size"]]  # what evaluation saw
    with torch.no_grad():
        reloaded = torch.nn.functional.mse_loss(model(x), y).item()
    assert reloaded == pytest.approx(run.metrics[-1]["eval_loss"], rel=1e-5)


def test_mlp_resumes_exactly(mlp_run, tmp_path):
    """Resumed mid-epoch from step 5 (with accumulation): the losses equal the uninterrupted run's, bit for bit."""
    config, run = mlp_run
    yaml, flags = entry(config, 16, grad_accum=2)
    resumed = resumed_from_step_5(run, [*MLP, *flags], yaml, tmp_path / "out")
    assert "resumed from" in resumed.stderr
    assert [m["step"] for m in resumed.metrics] == list(range(6, 13))
    assert resumed.losses == run.losses[5:]


def test_transformer_matches_one_process(lm_run, lm_reference):
    config, run = lm_run
    assert run.resolved["weight_decay"] == 0.01 and run.resolved["arch"] == "llama"  # the recipe's defaults
    assert max_rel_diff(run.losses, lm_reference.losses) <= PARITY_BOUND
    assert lm_reference.losses[-1] < lm_reference.losses[0]
    assert_estimate_within_10_percent(run)
    # only the main process prints: the last step's evaluation and the summary, once each, as one process does
    assert run.stdout.count("eval loss") == lm_reference.stdout.count("eval loss") == 2, run.stdout
    # MFU counts every process, also those that split the model: the global batch's FLOPs over all their peaks
    peak_of_all = run.resolved["peak_flops"] * run.resolved["world_size"]
    assert all(m["mfu"] == pytest.approx(m["samples_per_s"] * run.resolved["flops_per_sample"] / peak_of_all)
               for m in run.metrics)


def test_transformer_export_loads_with_transformers(lm_run):
    """final/ is a transformers model whose held-out loss is the one the run measured at its last step."""
    from transformers import AutoModelForCausalLM

    _, run = lm_run
    model = AutoModelForCausalLM.from_pretrained(run.output_dir / "final")
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied, however the run cut the model
    recipe = load_recipe("tiny_transformer")
    cfg = recipe.Config(**{name: run.resolved[name] for name in ("hidden", "layers", "seq_len")})
    _, held_out = recipe.build_datasets(cfg, Path(TEST_ENV["TRAINKIT_CACHE"]))
    ids = held_out[: run.resolved["eval_batches"] * run.resolved["global_batch_size"]]["input_ids"]
    with torch.no_grad():
        reloaded = model(input_ids=ids, labels=ids).loss.item()
    assert reloaded == pytest.approx(run.metrics[-1]["eval_loss"], rel=1e-5)


def test_transformer_with_dropout_resumes_exactly(lm_dropout_run, tmp_path):
    """Every rank's RNG comes back with the checkpoint: dropout masks after the resume are those of the full run."""
    config, run = lm_dropout_run
    resumed = resumed_from_step_5(run, dropout_args(config), entry(config, 8)[0], tmp_path / "out",
                                  processes(config))
    assert [m["step"] for m in resumed.metrics] == list(range(6, 11))
    assert resumed.losses == run.losses[5:]


IMAGE = ["--recipe", "image_classifier", "--max_steps", "12", "--eval_every", "0", "--warmup_steps", "2"]


@pytest.fixture(scope="module")
def image_reference(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("image") / "ref", *IMAGE, "--batch_size", "32").check()


@pytest.mark.parametrize("config", CONFIGS)
def test_image_classifier_in_bf16_follows_one_process_and_its_accuracy(image_reference, run_dir, config):
    """The third shipped recipe under every config, in bf16: 8 mantissa bits, so against the fp32 one-process curve
    (measured up to 7.0e-3 relative over its 12 steps under DDP, ZeRO-2, ZeRO-3 offload and FSDP; the bound is
    5e-2), and eval_accuracy summed over every rank's held-out samples (bf16 may flip a borderline prediction: one
    of the 128 measured, three allowed). fp32 parity of convolutions is the zoo's vision_moe below."""
    yaml, flags = entry(config, 32)
    run = launch(run_dir(config), *IMAGE, *flags, config=yaml, extra_launch=("--mixed_precision", "bf16")).check()
    assert run.resolved["mixed_precision"] == "bf16"
    assert run.losses != image_reference.losses  # really ran in bf16
    assert max_rel_diff(run.losses, image_reference.losses) <= 5e-2
    assert run.metrics[-1]["eval_accuracy"] == pytest.approx(image_reference.metrics[-1]["eval_accuracy"],
                                                             abs=3.01 / 128)


def assert_estimate_within_10_percent(run) -> None:
    """trainkit.estimate's prediction (resolved_config.json) against what rank 0 really held (metrics.jsonl)."""
    estimated, measured = run.resolved["estimated_state_bytes"], run.metrics[-1]["state_bytes"]
    assert abs(estimated - measured) <= 0.1 * measured, (estimated, measured)


@pytest.mark.parametrize("config", ["deepspeed_zero3_offload", "fsdp"])
def test_one_process_runs_a_sharded_config_like_single(mlp_reference, run_dir, config):
    """One GPU, a model too big for it: ZeRO-3 offload (or FSDP) as a world of one, the config unchanged."""
    run = launch(run_dir(config), *MLP, "--batch_size", "16", config=config,
                 extra_launch=("--num_processes", "1")).check()
    assert run.resolved["world_size"] == 1 and run.resolved["strategy"] == config.split("_")[0]
    assert max_rel_diff(run.losses, mlp_reference.losses) <= PARITY_BOUND


def test_sharded_strategies_hold_less_state(lm_runs):
    """What rank 0 held, measured on the matrix's transformer runs (2 processes): FSDP2 half of DDP's model state,
    ZeRO-3 0.625 of it (its fp32 master partition comes on top of 16 bytes/param / 2), each within 5 % of that."""
    held = {config: lm_runs(config).metrics[-1]["state_bytes"] for config in ("ddp", "fsdp", "deepspeed_zero3")}
    assert held["fsdp"] <= 0.525 * held["ddp"] and held["deepspeed_zero3"] <= 0.66 * held["ddp"], held


def test_deepspeed_without_a_gradient_norm_trains(run_dir, tmp_path):
    """zero_optimization.compute_grad_norm: false (allowed with clipping off) leaves the engine no norm to report:
    metrics say null, and the run must not mistake the missing norm for a non-finite one."""
    ds = json.loads(zero2_json())
    ds["zero_optimization"]["compute_grad_norm"] = False
    yaml_path = write_yaml(tmp_path, "deepspeed_zero2", json.dumps(ds))
    run = launch(run_dir("out"), *MLP, "--max_steps", "8", "--max_grad_norm", "0", config=str(yaml_path)).check()
    assert [m["grad_norm"] for m in run.metrics] == [None] * 8 and run.losses[-1] < run.losses[0]


def test_compare_tool_reports_and_plots(tmp_path, capsys, test_env, monkeypatch):
    import trainkit.tools.compare

    png = tmp_path / "curves.png"
    mine = write_yaml(tmp_path, "fsdp")  # a user's own YAML, by path
    plotted, plot = [], trainkit.tools.compare.plot

    def plot_and_look(curves, path, title):  # what the figure holds, while the runs' files are still there
        figure = plot(curves, path, title)
        plotted.extend((list(line.get_ydata()), curve.losses) for line, curve in zip(figure.axes[0].lines, curves,
                                                                                     strict=True))
        return figure

    monkeypatch.setattr(trainkit.tools.compare, "plot", plot_and_look)
    monkeypatch.setattr(trainkit.tools.compare, "run_config", forked_run_config)
    assert compare_main(["--recipe", "mlp", "--configs", f"ddp,{mine}", "--max_steps", "5", "--png", str(png)]) == 0
    assert len(plotted) == 3 and all(len(ys) == 5 and ys == losses for ys, losses in plotted)  # not a blank plot
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.startswith(("ddp", str(mine)))}
    assert set(rows) == {"ddp", str(mine)} and all(float(v) <= 1e-5 for v in rows.values())
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


# --- what users bring: models of other kinds (tests/zoo/) and their own DeepSpeed configs -------------------------

ZOO = {Path(path).stem: Path(path) for path in ZOO_PATHS}


@pytest.fixture(scope="module")
def zoo_references(tmp_path_factory):
    """One process per zoo model, micro-batch 16 = 2 processes x 8, each recipe's own defaults (6 steps)."""
    return {name: launch(tmp_path_factory.mktemp(f"zoo-{name}") / "ref", "--recipe", str(path),
                         "--batch_size", "16").check() for name, path in ZOO.items()}


@pytest.fixture(scope="module", params=[(model, config) for model in ZOO for config in CONFIGS], ids="-".join)
def zoo_run(request, tmp_path_factory):
    model, config = request.param
    out = tmp_path_factory.mktemp(f"zoo-{model}-{config}") / "out"
    yaml, flags = entry(config, 16)
    return model, config, launch(out, "--recipe", str(ZOO[model]), *flags, "--save_every", "3", config=yaml).check()


def test_zoo_model_matches_one_process(zoo_run, zoo_references):
    """Convolutions with odd sizes, GroupNorm, buffers, a router whose experts sit out steps, tiny parameters; tied
    embeddings, a GRU, a frozen parameter, dict batches of token ids: one process's curve under every config."""
    model, config, run = zoo_run
    reference = zoo_references[model]
    assert len(set(reference.losses)) == 6  # a real curve, not a constant
    assert max_rel_diff(run.losses, reference.losses) <= PARITY_BOUND


@pytest.mark.parametrize("zoo_run", [(model, config) for model in ZOO for config in ZOO_PER_FORMAT], indirect=True,
                         ids="-".join)
def test_zoo_model_resumes_exactly(zoo_run, tmp_path):
    """Experts that sit out steps (optimizer state that starts late), tied and frozen parameters: once per checkpoint
    format (ZOO_PER_FORMAT; every config's own exact resume is the MLP's)."""
    model, config, run = zoo_run
    yaml, flags = entry(config, 16)
    resumed = launch(tmp_path / "out", "--recipe", str(ZOO[model]), *flags, "--resume",
                     str(run.output_dir / "checkpoints" / "step_3"), config=yaml).check()
    assert resumed.losses == run.losses[3:]


def test_zoo_model_export_holds_the_trained_weights(zoo_run):
    """final/model.safetensors reloads (tied and frozen parameters included) into the recipe's fresh model, whose
    held-out loss is the one the run measured at its last step."""
    model, _, run = zoo_run
    recipe = load_recipe(str(ZOO[model]))
    cfg = recipe.Config()
    fresh = recipe.build_model(cfg)
    load_model(fresh, str(run.output_dir / "final" / "model.safetensors"))
    _, held_out = recipe.build_datasets(cfg, None)
    batch = held_out[: run.resolved["eval_batches"] * run.resolved["global_batch_size"]]
    with torch.no_grad():
        reloaded = recipe.loss(fresh.eval(), batch).item()
    assert reloaded == pytest.approx(run.metrics[-1]["eval_loss"], rel=1e-5)


def test_a_parameter_that_sits_out_a_step_under_ddp_names_the_fix(run_dir):
    """Without find_unused_parameters DDP's reducer fails at the next step; the run says which flag fixes it."""
    run = launch(run_dir("out"), "--recipe", str(ZOO["vision_moe"]), "--find_unused_parameters", "false",
                 config="ddp")
    assert_refused(run, "took no part in step 1", code=1)
    assert "pass --find_unused_parameters true" in run.stderr


# The launch settings that `accelerate config` writes after the strategy's own (accelerate 1.15).
ACCELERATE_CONFIG_REST = """machine_rank: 0
main_training_function: main
mixed_precision: '{precision}'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""
# `accelerate config` without a DeepSpeed JSON writes the DeepSpeed settings into the YAML itself, like this.
ACCELERATE_CONFIG_YAML = """compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 1
  offload_optimizer_device: {offload}
  offload_param_device: {offload}
  zero3_init_flag: {zero3}
  zero_stage: {stage}{extra}
distributed_type: DEEPSPEED
downcast_bf16: 'no'
enable_cpu_affinity: false
""" + ACCELERATE_CONFIG_REST
# The ZeRO-3 JSON of the Hugging Face DeepSpeed integration docs: optimizer and scheduler sections of "auto" values.
HF_DOCS_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
        "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
USER_CONFIGS = {
    "zero2": dict(offload="none", zero3="false", stage=2, extra="", precision="no"),
    "zero3_bf16": dict(offload="none", zero3="true", stage=3, extra="\n  zero3_save_16bit_model: true",
                       precision="bf16"),
    "zero3_offload": dict(offload="cpu", zero3="true", stage=3,
                          extra="\n  zero3_save_16bit_model: true\n  gradient_clipping: 1.0", precision="no"),
}


@pytest.mark.parametrize("name", [*USER_CONFIGS, "hf_docs_zero3_json"])
def test_users_own_deepspeed_configs_train_like_one_process(lm_reference, tmp_path, name):
    """YAMLs as `accelerate config` writes them (DeepSpeed settings inline, no JSON), and the Hugging Face docs'
    ZeRO-3 JSON: translated into the same filled config as the shipped JSONs, the transformer's curve follows."""
    if name in USER_CONFIGS:
        path = tmp_path / f"{name}.yaml"
        path.write_text(ACCELERATE_CONFIG_YAML.format(**USER_CONFIGS[name]))
    else:
        path = write_yaml(tmp_path, "deepspeed_zero3", json.dumps(HF_DOCS_ZERO3))
    run = launch(tmp_path / "out", *LM, "--batch_size", "4", config=str(path)).check()
    assert run.resolved["zero_stage"] == (2 if name == "zero2" else 3)
    assert max_rel_diff(run.losses, lm_reference.losses) <= (5e-2 if name == "zero3_bf16" else PARITY_BOUND)
    if name == "hf_docs_zero3_json":
        assert "names the scheduler WarmupLR; the recipe's schedule runs instead" in run.stderr
        assert "(AdamW) is the recipe's AdamW: lr 0.003, weight decay 0.01" in run.stderr


# What `accelerate config` writes for FSDP2 (accelerate 1.15), with activation checkpointing and the FSDP1-era keys
# that FSDP2 makes moot.
ACCELERATE_FSDP_YAML = """compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_version: 2
""" + ACCELERATE_CONFIG_REST.format(precision="no")


def test_users_own_fsdp_config_checkpoints_activations_and_trains_like_one_process(lm_reference, tmp_path):
    """Each decoder layer keeps only its input and recomputes its forward in backward: the same curve."""
    path = tmp_path / "fsdp2.yaml"
    path.write_text(ACCELERATE_FSDP_YAML)
    run = launch(tmp_path / "out", *LM, "--batch_size", "4", config=str(path)).check()
    assert "note: activation checkpointing on each LlamaDecoderLayer (2)" in run.stderr
    assert run.resolved["strategy"] == "fsdp" and max_rel_diff(run.losses, lm_reference.losses) <= PARITY_BOUND


def test_a_yaml_typo_is_refused_at_launch_as_in_the_dry_run(run_dir, tmp_path):
    """Accelerate passes the ranks the values of the DeepSpeed keys it knows, and the names of all: the launch sees
    the typo that the dry run sees (before, it trained without a word)."""
    path = write_yaml(tmp_path, "deepspeed_zero2", **{"zero3_init_flag:__false": "zero3_init_flg: false"})
    run = launch(run_dir("out"), "--recipe", "mlp", config=str(path))
    assert_refused(run, "unknown key 'zero3_init_flg' in deepspeed_config (deepspeed_config in the launcher's "
                        "environment): did you mean zero3_init_flag?")
    assert len(error_lines(run.stderr)) == 1
