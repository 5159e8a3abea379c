"""Pipeline parallelism (trainkit/strategies/pipeline.py): every schedule trains like one process, a pipeline
composes with data parallelism, resumes exactly, reports its bubble and what each stage holds, and a model or launch it
cannot split is refused before anything is built.

The strategy matrix's transformer (conftest's LM: the recipe's real defaults, Llama, tied embeddings, weight decay
0.01; global batch 8 as in its one-process reference); 1F1B is the matrix's own run (lm_runs("pipeline")). The
interleaved schedule puts two stages on each process, so it runs the same model with 4 layers, against its own
reference.
"""

from __future__ import annotations

import pytest
import torch

from conftest import LM, PARITY_BOUND, ROOT, entry, launch, max_rel_diff
from trainkit.strategies.pipeline import balanced_cuts

DDP = str(ROOT / "accelerate_configs" / "ddp.yaml")
LM4 = [*LM, "--layers", "4"]  # interleaved: 4 stages on 2 processes, a layer each

# name: (processes, flags, 4 layers); batch_size x grad_accum x replicas = 8
SCHEDULES = {
    "1f1b": (2, entry("pipeline", 8)[1], False),
    "interleaved": (2, ["--pipeline_stages", "2", "--pipeline_schedule", "interleaved", "--batch_size", "2",
                        "--grad_accum", "4"], True),
    "naive": (2, ["--pipeline_stages", "2", "--pipeline_schedule", "gpipe", "--batch_size", "8", "--grad_accum", "1"],
              False),
    "2x2_data_parallel": (4, ["--pipeline_stages", "2", "--batch_size", "2", "--grad_accum", "2"], False),
}


@pytest.fixture(scope="module")
def lm4_reference(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("pp") / "ref4", *LM4, "--batch_size", "8").check()


@pytest.fixture
def reference(request, lm_reference):
    """The one-process run for this test's pipeline run (4 layers only for the interleaved schedule)."""
    name = request.getfixturevalue("pipeline_run")[0]
    return request.getfixturevalue("lm4_reference") if SCHEDULES[name][2] else lm_reference


@pytest.fixture(scope="module", params=list(SCHEDULES))
def pipeline_run(request, tmp_path_factory, lm_runs):
    if request.param == "1f1b":  # the strategy matrix's run (tests/test_strategies.py), with its step-5 checkpoint
        return request.param, lm_runs("pipeline")
    processes, flags, four_layers = SCHEDULES[request.param]
    out = tmp_path_factory.mktemp(f"pp-{request.param}") / "out"
    return request.param, launch(out, *(LM4 if four_layers else LM), *flags, config=DDP,
                                 extra_launch=("--num_processes", str(processes)))



@pytest.mark.slow
def test_every_schedule_matches_one_process(pipeline_run, reference):
    name, run = pipeline_run
    run.check()
    assert run.resolved["strategy"] == "pipeline" and run.resolved["global_batch_size"] == 8
    assert run.resolved["data_parallel_size"] == SCHEDULES[name][0] // 2
    assert max_rel_diff(run.losses, reference.losses) <= PARITY_BOUND
    assert run.metrics[-1]["eval_loss"] == pytest.approx(reference.metrics[-1]["eval_loss"], rel=PARITY_BOUND)


@pytest.mark.slow
def test_the_bubble_is_measured_per_stage_next_to_its_theory(pipeline_run):
    name, run = pipeline_run
    p, m = 2, {"1f1b": 2, "interleaved": 4, "naive": 1, "2x2_data_parallel": 2}[name]
    v = 2 if name == "interleaved" else 1
    for record in run.metrics:
        assert len(record["pipeline_idle"]) == 2 and all(0 <= x < 1 for x in record["pipeline_idle"])
        assert record["pipeline_bubble_theory"] == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-4)
    # The naive split: one micro-batch, so while one stage computes the other waits.
    if name == "naive":
        assert min(sum(r["pipeline_idle"]) / 2 for r in run.metrics[1:]) > 0.3
    assert "pipeline bubble: each step's time idle per process: stage 0 " in run.stdout


@pytest.mark.slow
def test_each_stage_holds_its_share_of_the_model(pipeline_run):
    """state_bytes per stage: each about half of one process's (tied embeddings: both ends hold the matrix), and
    the estimate within 10 % of the larger one."""
    name, run = pipeline_run
    whole = 16 * sum(p.numel() for p in _model(run).parameters())  # fp32 weights, gradients, AdamW's two states
    stage_bytes = run.metrics[-1]["stage_state_bytes"]
    assert len(stage_bytes) == 2 and all(0.3 * whole < b < 0.7 * whole for b in stage_bytes), (stage_bytes, whole)
    assert run.resolved["estimated_state_bytes"] == pytest.approx(max(stage_bytes), rel=0.1)


# One schedule proves the checkpoint format, which is the same for all.
@pytest.mark.slow
@pytest.mark.parametrize("pipeline_run", ["1f1b"], indirect=True)
def test_resumes_exactly_and_exports_the_whole_model(pipeline_run, tmp_path):
    from transformers import AutoModelForCausalLM

    name, run = pipeline_run
    resumed = launch(tmp_path / "resumed", *LM, *SCHEDULES[name][1], "--resume",
                     str(run.output_dir / "checkpoints" / "step_5"), config=DDP).check()
    assert [m["step"] for m in resumed.metrics] == [6, 7, 8] and resumed.losses == run.losses[5:]
    model = AutoModelForCausalLM.from_pretrained(run.output_dir / "final")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    trained = dict(model.named_parameters())
    assert all(trained[name].abs().sum() > 0 for name in trained)  # every stage's weights reached final/


@pytest.mark.slow
@pytest.mark.parametrize("pipeline_run", ["1f1b"], indirect=True)
def test_a_pipeline_checkpoint_warm_starts_another_strategy(pipeline_run, tmp_path):
    """Saved under the whole model's parameter names: one process loads its weights and continues from them."""
    _, run = pipeline_run
    single = launch(tmp_path / "single", *LM, "--batch_size", "8", "--grad_accum", "1", "--pipeline_stages", "1",
                    "--resume",
                    str(run.output_dir / "checkpoints" / "step_5")).check()
    assert "weights loaded, optimizer state starts fresh" in single.stderr
    assert abs(single.losses[0] - run.losses[5]) / run.losses[5] < 1e-2  # the trained weights, not a fresh model
    assert single.losses[0] < run.losses[0] - 0.05


def _model(run):
    from trainkit.recipes import load_recipe

    recipe = load_recipe("tiny_transformer")
    cfg = recipe.Config(**{k: run.resolved[k] for k in ("hidden", "layers", "seq_len")})
    with torch.device("meta"):
        return recipe.build_model(cfg)


# --- before anything is built (in process) -----------------------------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    (["--recipe", "mlp", "--grad_accum", "2"],
     "the recipe does not say where its model can be cut into pipeline stages"),
    (["--recipe", "tiny_transformer", "--grad_accum", "1"],
     "1F1B needs at least as many micro-batches per step as stages: grad_accum 1 < 2 stages"),
    (["--recipe", "tiny_transformer", "--grad_accum", "2", "--layers", "2", "--pipeline_schedule", "interleaved"],
     "the model has 2 layers, too few for 4 pipeline stages"),
    (["--recipe", "tiny_transformer", "--grad_accum", "2", "--pipeline_split", "5"],
     "--pipeline_split 5 does not cut 4 layers into 2 stages"),
    (["--recipe", "tiny_transformer", "--grad_accum", "5", "--pipeline_schedule", "interleaved"],
     "interleaved 1F1B runs the micro-batches in 2 round(s) (grad_accum // stages), so grad_accum must be a "
     "multiple of 2; got 5"),
])
def test_what_cannot_be_split_is_refused_before_training(check_only, tmp_path, args, message):
    run = check_only(tmp_path / "out", *args, "--pipeline_stages", "2", "--dry_run", "--accelerate_config", DDP)
    assert run.returncode == 2 and message in run.stderr, run.stderr
    assert not (tmp_path / "out").exists()



def test_a_pipeline_does_not_compose_with_sharding_launches(check_only, tmp_path):
    zero3 = str(ROOT / "accelerate_configs" / "deepspeed_zero3.yaml")
    run = check_only(tmp_path / "out", "--recipe", "tiny_transformer", "--grad_accum", "2", "--pipeline_stages", "2",
                     "--dry_run", "--accelerate_config", zero3)
    assert run.returncode == 2
    assert "pipeline stages compose with data parallelism only, not with DEEPSPEED" in run.stderr


def test_stages_are_balanced_by_parameter_count():
    # Equal layers, a heavy embedding on the first stage: the first stage takes fewer layers.
    assert balanced_cuts([10] * 6, 2, first_extra=40, last_extra=0) == [0, 1, 6]
    assert balanced_cuts([10] * 4, 2, first_extra=0, last_extra=0) == [0, 2, 4]
    assert balanced_cuts([10] * 8, 4, first_extra=5, last_extra=5) == [0, 2, 4, 6, 8]
