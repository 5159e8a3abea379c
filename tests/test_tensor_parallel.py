"""Tensor parallelism, FSDP2 + TP and HSDP from Accelerate's parallelism_config (trainkit/strategies/fsdp.py).

Launched (slow): each shipped mesh YAML trains the tiny transformer like one process at the same global batch, with
its gradient norms, resumes exactly, and holds its share of the model (final/ is checked with every other config's in
tests/test_strategies.py, which launches the same runs: conftest's lm_runs); a tensor-parallel checkpoint resumes
under DDP; an MLP whose recipe declares a plan trains like one process. In process (quick): the
launch reads the sizes as `accelerate launch` passes them, the registry picks the strategy, the gradient clip and
AdamW over parameters on different meshes equal torch's, and what cannot run is refused before start, naming the fix.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import LM, PARITY_BOUND, ROOT, architecture, assert_refused, entry, launch, max_rel_diff, write_yaml
from trainkit.launch.launcher import Launch, shipped_configs
from trainkit.recipes import load_recipe
from trainkit.strategies.fsdp import FSDP
from trainkit.strategies.parallel_dims import ParallelDims
from trainkit.strategies.registry import for_launch

# config -> (dp_replicate, dp_shard, tp). The runs are the strategy matrix's (conftest's lm_runs: the transformer with
# its real defaults, global batch 8, a checkpoint at step 5), shared with tests/test_strategies.py.
MESHES = {"tp": (1, 1, 2), "fsdp_tp": (1, 2, 2), "hsdp": (2, 2, 1), "hsdp_tp": (2, 2, 2)}
# The share of one process's model state a rank holds (tiny transformer, hidden 64, 2 layers): tp cuts the layers'
# two thirds of the parameters in half; fsdp_tp and hsdp_tp shard that over 2; hsdp halves everything.
SHARES = {"tp": 0.67, "fsdp_tp": 0.34, "hsdp": 0.5, "hsdp_tp": 0.34}


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(MESHES))
def test_trains_like_one_process_and_holds_its_share(lm_runs, lm_reference, config):
    run, reference = lm_runs(config), lm_reference
    resolved = run.resolved
    replicate, shard, tp = MESHES[config]
    assert (resolved["dp_replicate"], resolved["dp_shard"], resolved["tp"]) == MESHES[config]
    assert resolved["strategy"] == ("tp" if tp > 1 else "hsdp") and resolved["world_size"] == replicate * shard * tp
    assert resolved["global_batch_size"] == 8 and resolved["data_parallel_size"] == replicate * shard
    assert resolved["weight_decay"] == 0.01 and resolved["arch"] == "llama" and resolved["tie_embeddings"]
    assert len(set(reference.losses)) == 8 and max_rel_diff(run.losses, reference.losses) <= PARITY_BOUND
    norms, reference_norms = [m["grad_norm"] for m in run.metrics], [m["grad_norm"] for m in reference.metrics]
    assert max_rel_diff(norms, reference_norms) <= PARITY_BOUND  # the norm over slices and shards, made whole
    estimated, held = resolved["estimated_state_bytes"], run.metrics[-1]["state_bytes"]
    assert abs(estimated - held) <= 0.1 * held, (estimated, held)
    assert held == pytest.approx(SHARES[config] * reference.metrics[-1]["state_bytes"], rel=0.1)
    assert "redistributing" not in run.stderr  # trainkit/launch/library_noise.py: DTensor's two-step gather note


# hsdp.yaml resumes in tests/test_strategies.py with every other data-parallel config (the MLP, the zoo).
@pytest.mark.slow
@pytest.mark.parametrize("config", ["tp", "fsdp_tp", "hsdp_tp"])
def test_resumes_exactly(lm_runs, config, tmp_path):
    run = lm_runs(config)
    resumed = launch(tmp_path / "out", *LM, *entry(config, 8)[1], "--resume",
                     str(run.output_dir / "checkpoints" / "step_5"), config=config).check()
    assert [m["step"] for m in resumed.metrics] == [6, 7, 8]
    assert resumed.losses == run.losses[5:]


@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_resumes_under_ddp(lm_runs, tmp_path):
    """torch.distributed.checkpoint gathers the slices into DDP's whole parameters: model and optimizer state."""
    run = lm_runs("tp")
    resumed = launch(tmp_path / "out", *LM, *entry("ddp", 8)[1], "--resume",
                     str(run.output_dir / "checkpoints" / "step_5"), config="ddp").check()
    assert resumed.resolved["strategy"] == "ddp" and "resumed from" in resumed.stderr
    assert "optimizer state starts fresh" not in resumed.stderr
    assert max_rel_diff(resumed.losses, run.losses[5:]) <= PARITY_BOUND


# --- in process ---------------------------------------------------------------------------------------------------

def test_the_launch_reads_the_sizes_accelerate_launch_passes(monkeypatch):
    """Accelerate's own launcher code turns the YAML's block into the processes' environment; Launch.from_env reads
    back what Launch.from_yaml reads from the file."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_extend_env_parallelism_config

    for config, sizes in MESHES.items():
        path = ROOT / "accelerate_configs" / f"{config}.yaml"
        args, _, _ = _validate_launch_command(launch_command_parser().parse_args(
            ["--config_file", str(path), "train.py"]))
        env = prepare_extend_env_parallelism_config(args, {"WORLD_SIZE": str(args.num_processes),
                                                           "ACCELERATE_USE_FSDP": "true"})
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        from_env, from_yaml = Launch.from_env(), Launch.from_yaml(path)
        assert from_env.parallelism == from_yaml.parallelism
        assert tuple(from_yaml.parallelism_size(name) for name in ("dp_replicate", "dp_shard", "tp")) == sizes
        assert from_env.parallelism_size("cp") == from_env.parallelism_size("sp") == 1


def test_the_registry_picks_the_mesh_strategies_and_leaves_fsdp_as_it_was():
    cfg = load_recipe("tiny_transformer").Config()
    shipped = shipped_configs()
    picked = {name: for_launch(shipped[name], cfg, {}) for name in [*MESHES, "fsdp", "fsdp_offload"]}
    # One class: the mesh's sizes name the strategy and its label
    assert {name: (type(s), s.name, s.label, s.data_parallel_size) for name, s in picked.items()} == {
        "tp": (FSDP, "tp", "tp", 1), "fsdp_tp": (FSDP, "tp", "fsdp_tp", 2), "hsdp": (FSDP, "hsdp", "hsdp", 4),
        "hsdp_tp": (FSDP, "tp", "hsdp_tp", 4),
        "fsdp": (FSDP, "fsdp", "fsdp", 2), "fsdp_offload": (FSDP, "fsdp", "fsdp_offload", 2)}
    assert {name: s.splits_model for name, s in picked.items()} == {
        "tp": True, "fsdp_tp": True, "hsdp": False, "hsdp_tp": True, "fsdp": False, "fsdp_offload": False}
    hsdp_tp = dataclasses.replace(shipped["hsdp"], world_size=8, parallelism={"dp_replicate": 2, "dp_shard": 2,
                                                                                "tp": 2})
    assert for_launch(hsdp_tp, cfg, {}).label == "hsdp_tp"


@pytest.mark.parametrize("args, message", [
    (["--recipe", "mlp"], "Sequential declares no tensor-parallel plan (which Linear layers to cut) (model._tp_plan "
                          "of mlp.py's build_model): declare one in build_model: model._tp_plan = "),
    ([*LM, "--arch", "gpt2"], "GPT2LMHeadModel declares no tensor-parallel plan"),
    ([*LM, "--heads", "3", "--hidden", "96"], "num_attention_heads 3 and num_key_value_heads 3: not a multiple of "
                                              "parallelism_config_tp_size 2"),
    ([*LM, "--ffn", "255"], "parallelism_config_tp_size 2 does not divide model.layers.0.mlp.gate_proj (255 output "
                            "features)"),
])
def test_a_model_tensor_parallelism_cannot_cut_is_refused_before_start(check_only, tmp_path, args, message):
    run = check_only(tmp_path / "out", *args, "--dry_run", "--accelerate_config",
                     str(ROOT / "accelerate_configs" / "tp.yaml"))
    assert_refused(run, message)


MLP_WITH_A_PLAN = '''"""The MLP recipe with a tensor-parallel plan of its own (recipes/README.md's contract)."""
from trainkit.recipes import load_recipe

_mlp = load_recipe("mlp")
Config, build_datasets, loss = _mlp.Config, _mlp.build_datasets, _mlp.loss


def build_model(cfg):
    model = _mlp.build_model(cfg)  # Linear, ReLU, Linear, ReLU, Linear: "0" and "2" are Linear
    model._tp_plan = {"0": "colwise", "2": "rowwise"}  # output slices, through the ReLU, into input slices
    return model
'''


@pytest.fixture
def mlp_with_a_plan(tmp_path) -> str:
    path = tmp_path / "mlp_tp.py"
    path.write_text(MLP_WITH_A_PLAN)
    return str(path)


def test_a_recipe_declares_its_own_plan_on_its_model(check_only, tmp_path, mlp_with_a_plan):
    run = check_only(tmp_path / "out", "--recipe", mlp_with_a_plan, "--dry_run", "--accelerate_config",
                     str(ROOT / "accelerate_configs" / "tp.yaml"))
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["tp"] == 2


@pytest.mark.slow
def test_a_recipes_own_plan_trains_like_one_process(mlp_with_a_plan, tmp_path):
    """A plain nn.Sequential, its plan from the recipe, FSDP2's blocks every Linear: the curve of one process."""
    args = ["--recipe", mlp_with_a_plan, "--max_steps", "6", "--eval_every", "0", "--warmup_steps", "2",
            "--batch_size", "16"]
    one = launch(tmp_path / "one", *args).check()
    cut = launch(tmp_path / "tp", *args, config="tp").check()
    assert max_rel_diff(cut.losses, one.losses) <= PARITY_BOUND
    estimated, held = cut.resolved["estimated_state_bytes"], cut.metrics[-1]["state_bytes"]
    assert abs(estimated - held) <= 0.1 * held and held < 0.6 * one.metrics[-1]["state_bytes"], (estimated, held)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["phi3", "gemma", "granite"])
def test_the_plan_transformers_declares_cuts_other_architectures_like_one_process(chat, tmp_path, name):
    """The causal-LM recipe full fine-tunes Phi-3 (its fused query-key-value layer kept whole, as its plan says),
    Gemma (tied, scaled embeddings) and Granite (multipliers): tp.yaml cuts each by the plan transformers declares for
    it, with the curve, eval loss and final/ of one process. (Qwen3's per-head norms, whose gradients are summed over
    the ranks: tests/test_moe.py's Qwen3-MoE cell, which fails without the sum.)"""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    folder = tmp_path / name
    architecture(name).save_pretrained(folder)
    PreTrainedTokenizerFast.from_pretrained(chat[0]).save_pretrained(folder)
    args = ["--recipe", "causal_lm", "--model_name_or_path", str(folder), "--tokenizer", "saved", "--data",
            str(chat[1]), "--chat_template", "chatml", "--seq_len", "96", "--max_steps", "4", "--eval_every", "0",
            "--warmup_steps", "1", "--batch_size", "8", "--save_every", "0", "--eval_batches", "1"]
    one = launch(tmp_path / "one", *args).check()
    cut = launch(tmp_path / "tp", *args, config="tp").check()
    assert cut.resolved["strategy"] == "tp" and cut.resolved["tp"] == 2
    assert max_rel_diff(cut.losses, one.losses) <= PARITY_BOUND, (cut.losses, one.losses)
    assert cut.metrics[-1]["eval_loss"] == pytest.approx(one.metrics[-1]["eval_loss"], rel=PARITY_BOUND)
    held, estimated = cut.metrics[-1]["state_bytes"], cut.resolved["estimated_state_bytes"]
    assert held < 0.9 * one.metrics[-1]["state_bytes"]  # the cut layers' halves
    assert abs(estimated - held) <= 0.1 * held, (estimated, held)  # the estimate cuts what the run cuts
    exported = AutoModelForCausalLM.from_pretrained(cut.output_dir / "final").state_dict()
    reference = AutoModelForCausalLM.from_pretrained(one.output_dir / "final").state_dict()
    assert exported.keys() == reference.keys()
    assert all(torch.allclose(exported[key], reference[key], atol=1e-5) for key in exported)


@pytest.mark.parametrize("changes, message", [
    ({"num_processes: 2": "num_processes: 4"},
     "the parallelism sizes multiply to 2 (dp_replicate 1 x dp_shard 1 x tp 2) but 4 process(es) were launched "
     "(parallelism_config in {yaml}): make parallelism_config_dp_replicate_size x parallelism_config_dp_shard_size x "
     "parallelism_config_tp_size equal num_processes"),
    ({"parallelism_config_tp_size: 2": "parallelism_config_tp_size: 2\n  parallelism_config_cp_size: 2",
      "num_processes: 2": "num_processes: 4"},
     "context parallelism with tp: the runner splits sequences only together with FSDP2's dp_shard"),
    ({"parallelism_config_tp_size": "tp_size"}, "unknown key 'tp_size' in parallelism_config (parallelism_config in "
                                                "{yaml}): did you mean parallelism_config_tp_size?"),
    ({"distributed_type: FSDP": "distributed_type: MULTI_GPU"}, "parallelism_config needs distributed_type: FSDP"),
])
def test_a_parallelism_config_that_cannot_run_is_refused(check_only, tmp_path, changes, message):
    path = write_yaml(tmp_path, "tp", **{old.replace(" ", "__"): new for old, new in changes.items()})
    run = check_only(tmp_path / "out", *LM, "--dry_run", "--accelerate_config", str(path))
    assert_refused(run, message.format(yaml=path))


def test_a_launch_whose_sizes_miss_its_process_count_is_refused(check_only, tmp_path, monkeypatch):
    """`accelerate launch --config_file tp.yaml --num_processes 4`: the environment every rank sees."""
    for name, value in {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "ACCELERATE_USE_FSDP": "true",
                        "FSDP_VERSION": "2", "ACCELERATE_MIXED_PRECISION": "no",
                        "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1",
                        "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1", "PARALLELISM_CONFIG_TP_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    run = check_only(tmp_path / "out", *LM)
    assert_refused(run, "the parallelism sizes multiply to 2 (dp_replicate 1 x dp_shard 1 x tp 2) but 4 process(es) "
                        "were launched (parallelism_config in the launcher's environment)")


def test_estimate_rows_cut_only_the_planned_layers(check_only, tmp_path):
    """--estimate lists the mesh configs; at 8 processes the outermost dimension each uses takes the rest."""
    run = check_only(tmp_path / "x", *LM, "--estimate", "--num_processes", "8").check()
    rows = {line.split()[0] for line in run.stdout.splitlines()}
    assert set(MESHES) <= rows
    recipe = load_recipe("tiny_transformer")
    cfg = recipe.Config(hidden=64, layers=2, seq_len=64)
    from trainkit.estimate import model_shape

    shape = model_shape(recipe, cfg)
    cut = sum(k for name, k in zip(shape.names, shape.numels, strict=True) if "_proj" in name)
    whole = shape.num_params - cut  # embeddings (tied: once) and norms
    for config, held in {"tp": whole + cut / 8, "fsdp_tp": (whole + cut / 2) / 4, "hsdp": shape.num_params / 2}.items():
        launch_8 = dataclasses.replace(shipped_configs()[config], world_size=8)
        estimate = for_launch(launch_8, cfg, {}).estimate(shape, 8, 0)
        assert estimate.params == pytest.approx(4 * held, rel=1e-3), config


def test_gradient_clipping_and_adamw_over_parameters_on_different_meshes():
    """Cut layers live on the (dp_shard, tp) mesh, the rest on dp_shard: torch's clip_grad_norm_ cannot stack their
    norms. The strategy's clip gives torch's norm and clipped gradients, computed on an uncut copy (a world of one
    process: the meshes differ all the same), and AdamW's foreach path (the GPU default) steps both alike."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from trainkit.strategies.parallelize import FSDPSettings, parallelize
    from trainkit.strategies.tp_plan import tp_layers

    recipe = load_recipe("tiny_transformer")
    cfg = recipe.Config(hidden=64, layers=2, seq_len=16, max_grad_norm=0.1)
    torch.manual_seed(0)
    model = recipe.build_model(cfg)
    plain = recipe.build_model(cfg)
    plain.load_state_dict(model.state_dict())
    one = dataclasses.replace(shipped_configs()["tp"], world_size=1, parallelism={"tp": 1})
    strategy = FSDP(one, cfg, {})
    strategy = strategy.engine(strategy)  # the engine, built by hand: a fake Accelerator, the model below
    strategy.accelerator = type("Accelerator", (), {"unscale_gradients": lambda self: None})()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1, 1, 1, 1), mesh_dim_names=ParallelDims.names)
        parallelize(model, ParallelDims(), mesh, FSDPSettings(), mixed_precision="no", compile=False,
                    tp_layers=tp_layers(model), classes=set(model._no_split_modules))  # cut, on a tp mesh of one
        strategy.model = model
        assert len({p.device_mesh for p in strategy.model.parameters()}) == 2
        ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        for m in (strategy.model, plain):
            m(input_ids=ids, labels=ids).loss.backward()
        norm = strategy.clip_grad_norm()
        expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
        assert norm.item() == pytest.approx(expected.item(), rel=1e-6) and norm.item() > 0.1  # it clipped
        for (name, p), q in zip(strategy.model.named_parameters(), plain.parameters(), strict=True):
            assert torch.allclose(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-8), name
        for m in (strategy.model, plain):
            torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01, foreach=True).step()
        for (name, p), q in zip(strategy.model.named_parameters(), plain.parameters(), strict=True):
            assert torch.allclose(p.full_tensor(), q, rtol=1e-5, atol=1e-7), name
    finally:
        dist.destroy_process_group()


def test_the_compare_tool_gives_each_mesh_the_reference_global_batch():
    """python -m trainkit.tools.compare: the micro-batch follows the data-parallel size, and a YAML whose parallelism
    sizes fix its process count runs with that count (not --num_processes)."""
    from trainkit.tools.compare import split_for

    assert {c: split_for(c, "tiny_transformer", 2, 16, 1) for c in ("ddp", "tp", "fsdp_tp", "hsdp")} == \
        {"ddp": (2, 8), "tp": (2, 16), "fsdp_tp": (4, 8), "hsdp": (4, 4)}
