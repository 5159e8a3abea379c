"""The one device mesh and its application, in process (milliseconds, no launch): the sizes every shipped config
and flag product gets (trainkit/strategies/parallel_dims.py), what they refuse naming the fields, the fixed order in
which trainkit/strategies/parallelize.py applies them, and the one training step's order (trainkit/step.py). The
launched runs that show the same at parity are in tests/test_pipeline.py, tests/test_tensor_parallel.py and
tests/test_strategies.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import LAUNCHES, strategy_of
from trainkit.launch.launcher import shipped_configs
from trainkit.recipes import load_recipe
from trainkit.strategies.parallel_dims import ParallelDims
from trainkit.strategies.registry import for_launch

# (pp, dp_replicate, dp_shard, cp, tp) of every shipped torch config and flag product (conftest's FLAG_STRATEGIES), its
# data-parallel size and the strategy's name and label.
EXPECTED = {
    "ddp": ((1, 2, 1, 1, 1), 2, "ddp", "ddp"),
    "fsdp": ((1, 1, 2, 1, 1), 2, "fsdp", "fsdp"),
    "fsdp_offload": ((1, 1, 2, 1, 1), 2, "fsdp", "fsdp_offload"),
    "tp": ((1, 1, 1, 1, 2), 1, "tp", "tp"),
    "fsdp_tp": ((1, 1, 2, 1, 2), 2, "tp", "fsdp_tp"),
    "hsdp": ((1, 2, 2, 1, 1), 4, "hsdp", "hsdp"),
    "hsdp_tp": ((1, 2, 2, 1, 2), 4, "tp", "hsdp_tp"),
    "fsdp_cp": ((1, 1, 1, 2, 1), 1, "fsdp", "fsdp_cp"),
    "fsdp_ep": ((1, 1, 2, 1, 1), 2, "fsdp_ep", "fsdp_ep"),  # ep 2: a regrouping of dp_shard, not a dimension
    "pipeline": ((2, 1, 1, 1, 1), 1, "pipeline", "pipeline_1f1b"),
    "pipeline_fsdp": ((2, 1, 2, 1, 1), 2, "pipeline", "pipeline_1f1b_fsdp"),
    "pipeline_tp": ((2, 1, 1, 1, 2), 1, "pipeline", "pipeline_1f1b_tp"),
    "pipeline_fsdp_tp": ((2, 1, 2, 1, 2), 2, "pipeline", "pipeline_1f1b_fsdp_tp"),
}


@pytest.mark.parametrize("name", EXPECTED)
def test_every_config_is_a_point_of_the_one_mesh(name):
    dims, data_parallel, strategy_name, label = EXPECTED[name]
    strategy = strategy_of(name)
    mesh = strategy.dims if hasattr(strategy, "dims") else ParallelDims.of(LAUNCHES[name])
    assert tuple(mesh.sizes().values()) == dims and mesh.world == LAUNCHES[name].world_size
    assert mesh.ep == (2 if name.endswith("_ep") else 1)
    assert (strategy.data_parallel_size, strategy.name, strategy.label) == (data_parallel, strategy_name, label)
    assert not mesh.problems(LAUNCHES[name])


def test_the_sizes_grow_where_machines_would_add_processes():
    """--estimate --num_processes N: the outermost data-parallel dimension in use takes what the others leave."""
    assert ParallelDims(dp_replicate=2).resized(8) == ParallelDims(dp_replicate=8)
    assert ParallelDims(dp_shard=2, tp=2).resized(16) == ParallelDims(dp_shard=8, tp=2)
    assert ParallelDims(dp_replicate=2, dp_shard=2, tp=2).resized(16) == ParallelDims(dp_replicate=4, dp_shard=2, tp=2)
    assert ParallelDims(tp=2).resized(4) == ParallelDims(tp=4)
    assert ParallelDims(pp=2, dp_shard=2).resized(8) == ParallelDims(pp=2, dp_shard=4)


def test_sizes_that_miss_the_process_count_are_refused_naming_the_fields():
    tp = shipped_configs()["tp"]
    four = dataclasses.replace(tp, world_size=4)
    [problem] = ParallelDims.of(four).problems(four)
    assert problem.where == f"parallelism_config in {tp.source}"
    assert "multiply to 2 (dp_replicate 1 x dp_shard 1 x tp 2) but 4 process(es)" in problem.what
    [problem] = ParallelDims.of(tp, pipeline_stages=2).problems(tp)  # 2 stages x tp 2 on 2 processes
    assert "multiply to 4 (pp 2 x dp_replicate 1 x dp_shard 1 x tp 2) but 2" in problem.what
    assert problem.fix.startswith("make --pipeline_stages x parallelism_config_dp_replicate_size")
    ddp = shipped_configs()["ddp"]
    [problem] = ParallelDims.of(ddp, pipeline_stages=4).problems(ddp)
    assert problem.where == "--pipeline_stages 4" and "--num_processes 4" in problem.fix


def test_parallelize_applies_tp_then_ep_then_checkpointing_then_compile_then_fsdp(monkeypatch):
    """The fixed order (torchtitan's parallelize_llama): each step is called once, in this order, on the model or
    stage it is given, with the blocks the model declares; the experts are sharded before the blocks that hold
    them."""
    import torch.distributed.tensor.parallel as tensor_parallel

    from trainkit.recipes import load_recipe
    from trainkit.strategies import expert_parallel
    from trainkit.strategies import parallelize as apply
    from trainkit.strategies.tp_plan import tp_layers

    calls = []
    experts = [torch.nn.Linear(2, 2)]
    monkeypatch.setattr(tensor_parallel, "parallelize_module", lambda model, mesh, plan: calls.append(("tp", plan)))
    monkeypatch.setattr(expert_parallel, "apply", lambda model, mesh, tp: calls.append(("ep", mesh)) or experts)
    monkeypatch.setattr(apply, "checkpoint_activations", lambda model, units: calls.append(("ac", units)) or "")
    monkeypatch.setattr(apply, "compile_forward", lambda model, units: calls.append(("compile", units)) or "")
    monkeypatch.setattr(apply, "shard_experts", lambda units, *args: calls.append(("fsdp experts", units)))
    monkeypatch.setattr(apply, "shard", lambda model, units, *args: calls.append(("fsdp", units)))
    recipe = load_recipe("tiny_transformer")
    model = recipe.build_model(recipe.Config(hidden=64, layers=2, seq_len=16))
    mesh = {"tp": "tp-mesh", "dp_shard": "dp-mesh"}
    apply.parallelize(model, ParallelDims(dp_shard=2, tp=2, ep=2), mesh,
                      apply.FSDPSettings(activation_checkpointing=True), mixed_precision="no", compile=True,
                      tp_layers=tp_layers(model),
                      classes=set(model._no_split_modules), experts_mesh="experts-mesh")
    assert [kind for kind, _ in calls] == ["tp", "ep", "ac", "compile", "fsdp experts", "fsdp"]
    assert set(calls[0][1]) == set(tp_layers(model)) and len(calls[0][1]) == 14  # 7 Linear layers x 2 layers
    assert calls[1][1] == "experts-mesh" and calls[4][1] == experts
    layers = list(model.model.layers)
    assert calls[2][1] == calls[3][1] == calls[5][1] == layers[::-1]  # the decoder layers, innermost first


def test_one_training_step_calls_the_engine_in_order(monkeypatch):
    """trainkit/step.py: gradients held, the rows split (under sequence or context parallelism), weights, forward and
    backward, the clip, one collective, the finite checks (before the optimizer step), the optimizer step, the
    engine's metrics; DeepSpeed's engine owns its step."""
    from trainkit import step as one_step
    from trainkit.run.stopping import FiniteCheck
    from trainkit.step import StepResult, train_step

    calls = []
    answers = {"split_sequences": [None], "loss_weights": [1.0], "forward_backward": ("loss", None),
               "clip_grad_norm": "norm", "agree": (2.0, False, float("nan"), []), "step_metrics": {},
               "optimizer_step": StepResult(2.0, 1.0, 0.1, False, False)}

    def recorded(name):
        return lambda *args: calls.append(name) or answers.get(name)

    for name in ("loss_weights", "agree", "optimizer_step"):
        monkeypatch.setattr(one_step, name, recorded(name))

    class Engine:
        owns_step = False

        def __getattr__(self, name):
            return recorded(name)

    with pytest.raises(Exception, match="non-finite gradient norm"):
        train_step(Engine(), 3, [None], None, FiniteCheck(fp16=False), False)
    assert calls == ["hold_gradients", "split_sequences", "loss_weights", "forward_backward", "clip_grad_norm",
                     "agree"]
    calls.clear()
    answers["agree"] = (2.0, False, 1.0, [])
    assert train_step(Engine(), 3, [None], None, FiniteCheck(fp16=False), False).loss == 2.0
    assert calls[-2:] == ["optimizer_step", "step_metrics"]
    assert strategy_of("deepspeed_zero2").engine.owns_step and not strategy_of("fsdp").engine.owns_step


def test_each_role_is_its_own_object_the_plan_builds_nothing():
    """docs/strategies.md#adding-a-strategy: a strategy (plan time) names its engine, the engine names its checkpoint
    format; the plan-time objects hold nothing built (no Accelerator, model or optimizer, notes they cannot grow)
    and none of the engine's methods, so a plan's checks cannot depend on what a build did."""
    from trainkit.strategies.dcp_format import CheckpointFormat
    from trainkit.strategies.registry import REGISTRY, Engine, Strategy

    built = {name for name in vars(Engine) if not name.startswith("__")} - {"data_parallel_size",
                                                                             "sequence_parallel_size"}
    assert {"prepare", "forward_backward", "clip_grad_norm", "evaluate", "full_state_dict"} <= built
    for cls in REGISTRY:
        assert issubclass(cls.engine, Engine) and issubclass(cls.engine.format, CheckpointFormat), cls
        assert not built & {name for klass in cls.__mro__[:-1] for name in vars(klass)}, cls
    for name in LAUNCHES:
        strategy = strategy_of(name)
        assert isinstance(strategy, Strategy) and isinstance(strategy.notes, tuple), name
        assert not {"accelerator", "model", "optimizer", "scheduler", "mesh"} & set(vars(strategy)), name


def test_context_parallelism_is_a_field_and_its_place_in_the_order():
    """docs/strategies.md#adding-a-strategy, as context parallelism was added: a field and its place in `names`
    (torchtitan's: between dp_shard and tp) give the sizes from the YAML, the product rule, the data-parallel size
    and the mesh; FSDP2 shards over dp_shard x cp flattened (strategies/parallel_dims.py's data_mesh)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainkit.strategies.parallel_dims import data_mesh

    fsdp_tp = shipped_configs()["fsdp_tp"]
    launch = dataclasses.replace(fsdp_tp, world_size=8, parallelism={"dp_shard": 2, "cp": 2, "tp": 2})
    dims = ParallelDims.of(launch)
    assert dims.sizes() == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 2}
    assert (dims.world, dims.data_parallel, dims.problems(launch)) == (8, 2, [])
    [problem] = dims.problems(dataclasses.replace(launch, world_size=4))
    assert "(dp_replicate 1 x dp_shard 2 x cp 2 x tp 2) but 4" in problem.what
    assert "parallelism_config_cp_size" in problem.fix
    assert ParallelDims.of(launch, pipeline_stages=2).resized(16).sizes() == \
        {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 2}  # the world asked for: 2 x 2 x 2 x 2
    # The mesh of 8 ranks, built in this one process on torch's fake process group (collectives do nothing)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        mesh = dims.build("cpu")
        assert mesh.mesh_dim_names == ParallelDims.names and mesh["cp"].size() == 2
        assert mesh["tp"].mesh.tolist() == [0, 1] and mesh["cp"].mesh.tolist() == [0, 2]  # tp innermost
        assert data_mesh(mesh, dims).mesh.tolist() == [0, 2, 4, 6]  # dp_shard x cp: rank 0's tensor-parallel slice
    finally:
        dist.destroy_process_group()
    # the runner splits sequences with dp_shard only (tests/test_context_parallel.py has the other refusals)
    strategy = for_launch(launch, load_recipe("tiny_transformer").Config(), {}, load_recipe("tiny_transformer"))
    assert strategy.label == "fsdp_cp_tp" and strategy.sequence_parallel_size == 2
    assert any("context parallelism with tp" in problem.what for problem in strategy.check(this_machine=False))
