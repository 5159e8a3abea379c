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

from conftest import FLAG_STRATEGIES, LM, PARITY_BOUND, ROOT, architecture, entry, launch, max_rel_diff, processes
from trainkit.errors import ConfigError
from trainkit.strategies.parallel_dims import ParallelDims
from trainkit.strategies.pipeline_stages import balanced_cuts

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
def test_a_pipeline_checkpoint_and_a_ddp_one_resume_under_each_other_with_their_optimizer_state(pipeline_run, lm_runs,
                                                                                                tmp_path):
    """Both are torch.distributed.checkpoint under the whole model's names, the optimizer's state per parameter
    (trainkit/strategies/dcp_format.py): a pipeline's step-5 checkpoint goes on as one process, a DDP one as a
    pipeline, each with the curve it left (Adam's moments restored, not a warm start)."""
    _, run = pipeline_run
    single = launch(tmp_path / "single", *LM, "--batch_size", "8", "--grad_accum", "1", "--pipeline_stages", "1",
                    "--resume", str(run.output_dir / "checkpoints" / "step_5")).check()
    ddp = lm_runs("ddp")
    staged = launch(tmp_path / "staged", *LM, *SCHEDULES["1f1b"][1], "--resume",
                    str(ddp.output_dir / "checkpoints" / "step_5"), config=DDP).check()
    for resumed, saved in ((single, run), (staged, ddp)):
        assert "optimizer state starts fresh" not in resumed.stderr and "resumed from" in resumed.stderr
        assert max_rel_diff(resumed.losses, saved.losses[5:]) <= PARITY_BOUND


# The pipeline's products with an FSDP launch's mesh (conftest's FLAG_STRATEGIES): (pp, dp_replicate, dp_shard, cp, tp),
# and the most a stage may hold of what the same stage holds in the plain pipeline (lm_runs("pipeline")): FSDP2
# halves every parameter, tensor parallelism halves the cut layers (the tied embedding and the norms stay whole).
PRODUCTS = {"pipeline_fsdp": ((2, 1, 2, 1, 1), 0.55), "pipeline_tp": ((2, 1, 1, 1, 2), 0.8),
            "pipeline_fsdp_tp": ((2, 1, 2, 1, 2), 0.42)}


@pytest.mark.slow
@pytest.mark.parametrize("name", PRODUCTS)
def test_a_pipeline_of_sharded_or_cut_stages_trains_like_one_process_and_resumes_exactly(lm_runs, lm_reference,
                                                                                        name, tmp_path):
    """Each stage parallelised by the rest of the mesh: the loss and the gradient norm of one process, each stage
    holding its share, and a bit-exact resume (final/ reloads in tests/test_strategies.py, the matrix's lm_run)."""
    run, (dims, share) = lm_runs(name), PRODUCTS[name]
    resolved = run.resolved
    assert tuple(resolved[d] for d in ParallelDims.names) == dims and resolved["strategy"] == "pipeline"
    assert resolved["world_size"] == FLAG_STRATEGIES[name][2] and resolved["global_batch_size"] == 8
    assert resolved["data_parallel_size"] == dims[1] * dims[2]
    assert max_rel_diff(run.losses, lm_reference.losses) <= PARITY_BOUND
    norms, reference_norms = [m["grad_norm"] for m in run.metrics], [m["grad_norm"] for m in lm_reference.metrics]
    assert max_rel_diff(norms, reference_norms) <= PARITY_BOUND  # over stages, shards and slices, made whole
    plain = lm_runs("pipeline").metrics[-1]["stage_state_bytes"]
    held = run.metrics[-1]["stage_state_bytes"]
    assert all(b < share * p for b, p in zip(held, plain, strict=True)), (held, plain)
    resumed = launch(tmp_path / "resumed", *LM, *entry(name, 8)[1], "--resume",
                     str(run.output_dir / "checkpoints" / "step_5"), config=entry(name, 8)[0],
                     extra_launch=processes(name)).check()
    assert [m["step"] for m in resumed.metrics] == [6, 7, 8] and resumed.losses == run.losses[5:]


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


def test_a_recipe_that_precomputes_from_the_whole_model_is_refused(check_only, tmp_path):
    """A precompute pass (recipes/dpo.py's --precompute_ref_logps) runs the whole model, which no stage holds."""
    recipe = tmp_path / "precomputing.py"
    recipe.write_text(f"from sys import path\npath.insert(0, {str(ROOT / 'recipes')!r})\n"
                      "from tiny_transformer import *  # noqa: F403\n\n\n"
                      "def precompute(cfg):\n    return lambda model, batch: {}\n")
    run = check_only(tmp_path / "out", "--recipe", str(recipe), "--grad_accum", "2", "--pipeline_stages", "2",
                     "--dry_run", "--accelerate_config", DDP)
    assert run.returncode == 2, run.stderr
    assert "the recipe precomputes values per sample from the whole model before the first step" in run.stderr


def test_a_pipeline_does_not_compose_with_deepspeed(check_only, tmp_path):
    zero3 = str(ROOT / "accelerate_configs" / "deepspeed_zero3.yaml")
    run = check_only(tmp_path / "out", "--recipe", "tiny_transformer", "--grad_accum", "2", "--pipeline_stages", "2",
                     "--dry_run", "--accelerate_config", zero3)
    assert run.returncode == 2
    assert "not with DEEPSPEED" in run.stderr  # DeepSpeed's engine owns its own step and groups


def test_stages_are_balanced_by_parameter_count():
    # Equal layers, a heavy embedding on the first stage: the first stage takes fewer layers.
    assert balanced_cuts([10] * 6, 2, first_extra=40, last_extra=0) == [0, 1, 6]
    assert balanced_cuts([10] * 4, 2, first_extra=0, last_extra=0) == [0, 2, 4]
    assert balanced_cuts([10] * 8, 4, first_extra=5, last_extra=5) == [0, 2, 4, 6, 8]


# --- any transformers decoder into stages (trainkit/strategies/pipeline_decoder.py)
# ---------------------------------------------

@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "gpt_neox", "gpt2", "phi3", "gemma", "olmo",
                                  "granite", "starcoder2", "opt"])
def test_a_transformers_decoder_cut_into_stages_computes_the_whole_model(name, stages):
    """The stages chained (each stage's output the next one's input, as the schedules send them) give the model's
    own logits and loss, whatever the cut; the stages hold the model's own modules, so each parameter keeps its
    name and tied embeddings stay one parameter held by the first and last stage."""
    from trainkit.strategies import pipeline_decoder

    torch.manual_seed(0)
    model = architecture(name, layers=4).eval()
    n = len(pipeline_decoder.layers(model))
    cuts = balanced_cuts([1] * n, stages, 0, 0)
    parts = [pipeline_decoder.stage(model, range(cuts[i], cuts[i + 1]), i == 0, i == stages - 1) for i in range(stages)]
    ids = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = ids
        for part in parts:
            hidden = part(hidden)
        whole = model(input_ids=ids, labels=ids)
    assert torch.allclose(hidden, whole.logits, rtol=0, atol=1e-6)
    assert pipeline_decoder.loss(hidden, ids).item() == pytest.approx(whole.loss.item(), rel=1e-6)
    held = {id(p) for part in parts for p in part.parameters()}
    assert held == {id(p) for p in model.parameters()}  # every parameter in some stage
    if model.config.tie_word_embeddings:
        assert set(map(id, parts[0].parameters())) & set(map(id, parts[-1].parameters()))


def test_a_model_without_the_layout_is_refused_naming_it():
    """A model whose layers are not a ModuleList its forward loops over (here an nn.Sequential): refused before
    anything is built, naming the class, what it lacks and what a recipe declares instead."""
    from trainkit.strategies import pipeline_decoder

    class Blocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.blocks, self.head = (torch.nn.Embedding(10, 4), torch.nn.Sequential(torch.nn.Linear(4, 4)),
                                                  torch.nn.Linear(4, 10))

        def get_input_embeddings(self) -> torch.nn.Module:
            return self.embed

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.head

    with pytest.raises(ConfigError) as refused:
        pipeline_decoder.layers(Blocks())
    assert "Blocks is not a decoder layout the runner can cut into pipeline stages (no ModuleList of decoder " \
           "layers)" in str(refused.value.problems[0])
    assert "declare pipeline_layers, pipeline_stage and pipeline_loss in a recipe of your own" in \
           str(refused.value.problems[0])
    with pytest.raises(ConfigError, match="Sequential is not a decoder layout .* no input embeddings and output head"):
        pipeline_decoder.layers(torch.nn.Sequential(torch.nn.Linear(4, 4)))


# Launched: the causal-LM recipe on architectures it was not written for (Qwen2 and Llama with tied embeddings on
# chats, GPT-NeoX on text), each cut into 2 and 4 stages under each schedule, and Llama's stages sharded by FSDP2,
# against one process at the same global batch (8). 8 layers: a layer per stage for interleaved 1F1B on 4 processes.
# Phi-3, Granite and OPT (whose learned positions a later stage stands in for, its weights released there) in 2
# stages under 1F1B.
ARCHITECTURES = {"qwen2": "chat", "gpt_neox": "text", "llama": "chat", "phi3": "chat", "granite": "chat", "opt": "text"}
FINE_TUNES = {f"{name}-{stages}-stages-{schedule}": (name, "ddp", stages, ["--pipeline_stages", str(stages),
                                                                           "--pipeline_schedule", schedule])
              for name in ARCHITECTURES for stages in (2, 4) for schedule in ("gpipe", "1f1b", "interleaved")
              if name in ("qwen2", "gpt_neox", "llama") or (stages, schedule) == (2, "1f1b")}
FINE_TUNES["llama-gpipe-x-fsdp"] = ("llama", "fsdp", 4, ["--pipeline_stages", "2", "--pipeline_schedule", "gpipe"])


@pytest.fixture(scope="module")
def fine_tune(chat, tmp_path_factory):
    """fine_tune(architecture) -> (the common flags, its one-process run): the model saved once, run once."""
    from transformers import PreTrainedTokenizerFast

    done = {}

    def run(name: str):
        if name not in done:
            folder = tmp_path_factory.mktemp(name) / "model"
            architecture(name, layers=8).save_pretrained(folder)
            PreTrainedTokenizerFast.from_pretrained(chat[0]).save_pretrained(folder)
            common = ["--recipe", "causal_lm", "--model_name_or_path", str(folder), "--tokenizer", "saved",
                      "--max_steps", "6", "--eval_every", "3", "--seq_len", "64", "--warmup_steps", "2",
                      "--save_every", "0",
                      "--eval_fraction", "0.2",  # two global batches held out: the same eval batches under every split
                      *(["--data", str(chat[1]), "--chat_template", "chatml"] if ARCHITECTURES[name] == "chat" else
                        ["--eval_batches", "2"])]  # pydoc's fifth is hundreds of batches: two, the same on any split
            done[name] = common, launch(folder.parent / "one", *common, "--batch_size", "8").check()
        return done[name]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("case", FINE_TUNES)
def test_the_causal_lm_recipe_pipelines_other_architectures_like_one_process(fine_tune, tmp_path, case):
    """Padded chats (the loss on the answers) or padded text, each micro-batch weighed by its learned tokens through
    the stages: the loss curve and eval loss of one process, and final/ the whole model."""
    from transformers import AutoModelForCausalLM

    name, yaml, count, flags = FINE_TUNES[case]
    common, one = fine_tune(name)
    batch = 2 if count // int(flags[1]) == 1 else 1  # global batch 8: 4 micro-batches on each data-parallel rank
    cut = launch(tmp_path / "cut", *common, *flags, "--grad_accum", "4", "--batch_size", str(batch), config=yaml,
                 extra_launch=("--num_processes", str(count))).check()
    assert cut.resolved["strategy"] == "pipeline" and cut.resolved["global_batch_size"] == 8
    assert max_rel_diff(cut.losses, one.losses) <= PARITY_BOUND, (cut.losses, one.losses)
    evals = [m["eval_loss"] for m in cut.metrics if "eval_loss" in m]
    assert len(evals) == 2
    assert max_rel_diff(evals, [m["eval_loss"] for m in one.metrics if "eval_loss" in m]) <= PARITY_BOUND
    assert "answers at each evaluation (generate) are not written" in cut.stderr
    exported = AutoModelForCausalLM.from_pretrained(cut.output_dir / "final").state_dict()
    reference = AutoModelForCausalLM.from_pretrained(one.output_dir / "final").state_dict()
    assert exported.keys() == reference.keys()
    assert all(torch.allclose(exported[key], reference[key], atol=1e-5) for key in exported)
