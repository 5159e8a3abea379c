"""The distill recipe (recipes/distill.py): the divergences against their formulas computed by hand (the teacher
whole or as its top K), the chunked divergence against the whole logits', the tokenizer check, the refusals, and
launched runs of three student/teacher pairs of other architectures and depths (a Qwen2 taught by a Llama with tied
embeddings, a tied Llama with LoRA by a GPT-NeoX, a GPT-NeoX by a Qwen2; none written for this project) under every
data-parallel config, offload included, off-policy and on-policy, against one process; and the teacher precomputed
under ZeRO-3."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import sys

import pytest
import torch
from torch.nn import functional as F  # noqa: N812

from conftest import PARITY_BOUND, architecture, assert_refused, launch, max_rel_diff
from trainkit.losses import distill as distill_loss
from trainkit.recipes import load_recipe


def test_each_divergence_is_its_formula():
    """Computed by hand at a few positions of a 5-token vocabulary: beta 0 the forward KL (torch's kl_div of the
    teacher against the student), 1 the reverse KL, 0.5 the JSD with the half-and-half mixture, 0.3 the generalized
    JSD with the mixture 0.3 teacher + 0.7 student; identical distributions give 0 at every beta."""
    torch.manual_seed(0)
    student, teacher = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    p_s, p_t = student.softmax(-1), teacher.softmax(-1)

    def kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return (p * (p / q).log()).sum(-1)

    forward = distill_loss.generalized_jsd(student, teacher, 0.0)
    assert torch.allclose(forward, kl(p_t, p_s).float(), rtol=1e-5)
    assert torch.allclose(forward, F.kl_div(student.log_softmax(-1), teacher.log_softmax(-1), reduction="none",
                                            log_target=True).sum(-1).float(), rtol=1e-6)
    assert torch.allclose(distill_loss.generalized_jsd(student, teacher, 1.0), kl(p_s, p_t).float(), rtol=1e-5)
    half = (p_s + p_t) / 2
    assert torch.allclose(distill_loss.generalized_jsd(student, teacher, 0.5),
                          (0.5 * kl(p_t, half) + 0.5 * kl(p_s, half)).float(), rtol=1e-5)
    mixture = 0.3 * p_t + 0.7 * p_s
    assert torch.allclose(distill_loss.generalized_jsd(student, teacher, 0.3),
                          (0.3 * kl(p_t, mixture) + 0.7 * kl(p_s, mixture)).float(), rtol=1e-5)
    assert (forward > 0).all() and (distill_loss.generalized_jsd(student, teacher, 0.5) <= math.log(2)).all()
    for beta in (0.0, 0.3, 0.5, 1.0):
        assert distill_loss.generalized_jsd(student, student.clone(), beta).abs().max() < 1e-6


def test_a_teacher_as_its_top_k_is_both_distributions_coarsened_alike():
    """K the whole vocabulary: every beta's divergence is the full one, the empty rest held finite; K = 2: by hand,
    both distributions as the teacher's 2 likeliest tokens and one outcome for all the others."""
    torch.manual_seed(0)
    student, teacher = torch.randn(4, 6), torch.randn(4, 6)
    whole = distill_loss.teacher_topk(teacher, 6, 1.0)
    assert (whole.logps.exp().sum(-1) - 1).abs().max() < 1e-6 and (whole.rest == distill_loss.REST_FLOOR).all()
    for beta in (0.0, 0.5, 1.0):
        assert torch.allclose(distill_loss.topk_jsd(student, whole, beta),
                              distill_loss.generalized_jsd(student, teacher, beta), atol=1e-6)
    p_s, p_t = student.double().softmax(-1), teacher.double().softmax(-1)
    top = p_t.topk(2, dim=-1).indices

    def coarse(p: torch.Tensor) -> torch.Tensor:
        kept = p.gather(-1, top)
        return torch.cat([kept, 1 - kept.sum(-1, keepdim=True)], -1)

    c_s, c_t = coarse(p_s), coarse(p_t)
    two = distill_loss.teacher_topk(teacher, 2, 1.0)
    assert torch.equal(two.ids.long(), top) and torch.allclose(two.rest.double().exp(), c_t[:, -1], rtol=1e-5)
    assert torch.allclose(distill_loss.topk_jsd(student, two, 0.0).double(), (c_t * (c_t / c_s).log()).sum(-1),
                          rtol=1e-5)
    assert torch.allclose(distill_loss.topk_jsd(student, two, 1.0).double(), (c_s * (c_s / c_t).log()).sum(-1),
                          rtol=1e-5)
    # at temperature 2 the tables are the teacher's softmax of logits / 2
    halved = distill_loss.teacher_topk(teacher, 2, 2.0)
    assert torch.allclose(halved.logps, (teacher / 2).log_softmax(-1).topk(2).values)


@pytest.fixture(scope="module")
def teacher(chat, tmp_path_factory):
    """A Llama of 3 layers with tied embeddings on the chat fixture's tokenizer: another architecture than the
    Qwen2 student, and deeper."""
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("teacher") / "llama"
    torch.manual_seed(1)
    architecture("llama", layers=3).save_pretrained(folder)
    PreTrainedTokenizerFast.from_pretrained(chat[0]).save_pretrained(folder)
    return folder


def settings(chat, teacher=None, **more):
    """The recipe's fields for the chat fixture's Qwen2 (or `model_name_or_path`) taught by `teacher`."""
    return {"model_name_or_path": str(chat[0]), "tokenizer": "saved", "data": str(chat[1]), "chat_template": "chatml",
            "seq_len": 96, **({"teacher_model_name_or_path": str(teacher)} if teacher else {}),
            **more}


def batch_of(train, rows: int = 4) -> dict[str, torch.Tensor]:
    return {k: torch.stack([train[i][k] for i in range(rows)]) for k in train[0]}


@pytest.mark.parametrize("topk", [0, 5], ids=["live-teacher", "top-5-tables"])
def test_the_chunked_divergence_is_the_whole_logits_one(chat, teacher, tmp_path, topk):
    """The learned positions a few at a time through both heads (or the student's and the teacher's tables), under
    checkpoint, against the whole logits at once: the loss and the student's gradients agree to float32 rounding; the
    teacher gets no gradient."""
    recipe = load_recipe("distill")
    cfg = recipe.Config(**settings(chat, teacher, beta=0.5, sft_weight=0.5, precompute_teacher_topk=topk))
    train, _ = recipe.make_datasets(cfg, tmp_path)
    batch = batch_of(train)
    if topk:  # the precompute pass's columns, from the teacher
        precompute = recipe.precompute(cfg)
        batch.update(precompute.fn(precompute.build(), batch))
    found = []
    for chunk in (0, 7):
        torch.manual_seed(0)
        model = recipe.build_model(cfg)
        assert (model.teacher is None) == bool(topk)
        model.chunk = chunk
        loss, sums = model(**batch)
        loss.backward()
        found.append((loss.item(), sums["divergence per _tokens"].item(),
                      {n: p.grad.clone() for n, p in model.student.named_parameters()}))
        assert all(p.grad is None for p in model.teacher.parameters()) if model.teacher else True
    (whole, whole_sum, whole_grads), (cut, cut_sum, cut_grads) = found
    # the sums are float32 over every learned position, in another order: 2.1e-6 apart measured on an AVX2-only CPU
    assert cut == pytest.approx(whole, rel=1e-5) and cut_sum == pytest.approx(whole_sum, rel=1e-5)
    assert all(torch.allclose(cut_grads[n], whole_grads[n], rtol=1e-4, atol=1e-7) for n in whole_grads)


def test_the_top_k_tables_are_the_teachers_distribution_coarsened(chat, teacher, tmp_path):
    """The recipe's loss on a batch with the precompute pass's top-4 tables is the divergence by hand of the
    student's and the live teacher's softmax, both coarsened to the teacher's 4 likeliest tokens and the rest, at
    every learned position; with K the vocabulary it is the live teacher's loss."""
    recipe = load_recipe("distill")
    cfg = recipe.Config(**settings(chat, teacher, beta=0.0, temperature=2.0, precompute_teacher_topk=4))
    train, _ = recipe.make_datasets(cfg, tmp_path)
    batch = batch_of(train)
    precompute = recipe.precompute(cfg)
    live = precompute.build()
    tables = precompute.fn(live, batch)
    assert tables["teacher_topk_logps"].shape == (4, cfg.seq_len - 1, 4)
    torch.manual_seed(0)
    student = recipe.build_model(cfg)
    loss, sums = student(**batch, **tables)
    learned = batch["labels"][:, 1:] != -100
    with torch.no_grad():
        p_s = (student.student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
               / 2).double().softmax(-1)[learned]
        p_t = (live(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
               / 2).double().softmax(-1)[learned]
    top = tables["teacher_topk_ids"][learned].long()
    c_s, c_t = (torch.cat([p.gather(-1, top), 1 - p.gather(-1, top).sum(-1, keepdim=True)], -1) for p in (p_s, p_t))
    assert loss.item() == pytest.approx((c_t * (c_t / c_s).log()).sum(-1).mean().item(), rel=1e-5)
    whole = recipe.Config(**settings(chat, teacher, beta=0.0, temperature=2.0,
                                     precompute_teacher_topk=sys.modules["recipe_distill"].vocab_of(cfg)))
    torch.manual_seed(0)
    online = recipe.build_model(dataclasses.replace(whole, precompute_teacher_topk=0))
    assert student(**batch, **recipe.precompute(whole).fn(live, batch))[0].item() == \
        pytest.approx(online(**batch)[0].item(), rel=1e-5)


def test_a_teacher_that_is_the_student_teaches_nothing(chat, tmp_path):
    """The student as its own teacher: every divergence is 0, so the loss is (sft_weight 0)."""
    recipe = load_recipe("distill")
    cfg = recipe.Config(**settings(chat, chat[0]))
    train, _ = recipe.make_datasets(cfg, tmp_path)
    loss, sums = recipe.build_model(cfg)(**batch_of(train))
    assert loss.item() == 0.0 and sums["_tokens"] > 0 and sums["cross_entropy per _tokens"] > 0


def other_tokenizer_teacher(chat, folder):
    """The teacher model with a tokenizer trained on other text: other merges, other ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(["What is the sum of two numbers? It is their total."] * 20, trainer=trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    torch.manual_seed(0)
    architecture("llama").save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


@pytest.mark.parametrize("flags, message", [
    ([], "the teacher's tokenizer differs from the student's: "),
    (["--beta", "1.5"], "beta must be in [0, 1] (0 forward KL, 0.5 JSD, 1 reverse KL), got 1.5"),
    (["--lmbda", "0.5", "--packing"], "--lmbda > 0 samples completions of the data's prompts: it needs instruction "
                                      "or chat examples one per row (packed rows hold none)"),
    (["--precompute_teacher_topk", "8", "--lmbda", "0.5"], "--precompute_teacher_topk 8 with --lmbda 0.5: the "
                                                            "teacher's tables cover the data's tokens, not the "
                                                            "completions the student will sample"),
], ids=["other-tokenizer", "beta", "on-policy-packed", "tables-on-policy"])
def test_what_cannot_be_distilled_is_refused_before_training(chat, teacher, check_only, tmp_path, flags, message):
    folder = other_tokenizer_teacher(chat, tmp_path / "other") if flags == [] else teacher
    run = check_only(tmp_path / "out", "--recipe", "distill", "--model_name_or_path", str(chat[0]), "--tokenizer",
                     "saved", "--teacher_model_name_or_path", str(folder), "--data", str(chat[1]), "--chat_template",
                     "chatml", *flags)
    assert_refused(run, message)
    if flags == []:  # the first id that differs, named with both tokenizers' sizes
        assert re.search(r"is id (\d+|None) to the student and (\d+|None) to the teacher \(\d+ and \d+ tokens\)",
                         run.stderr), run.stderr


@pytest.mark.parametrize("data", ["csv", "json-array", "jsonl"])
def test_a_teacher_whose_tokenizer_lowercases_is_refused_whatever_the_datas_format(chat, teacher, check_only,
                                                                                    tmp_path, data):
    """The same vocabulary, a Lowercase normaliser: the check encodes the data's first records with both tokenizers,
    read from every format --data takes (it read .jsonl and .txt only: .csv and .json passed)."""
    import csv

    from tokenizers import Tokenizer, normalizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "lower"
    shutil.copytree(teacher, folder)
    bpe = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bpe.normalizer = normalizers.Lowercase()
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(folder)
    records = [json.loads(line) for line in chat[1].read_text().splitlines()][:4]
    path = tmp_path / {"csv": "chat.csv", "json-array": "chat.json", "jsonl": "chat.jsonl"}[data]
    if data == "csv":
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["prompt", "completion"])
            writer.writerows([r["messages"][0]["content"], " " + r["messages"][1]["content"]] for r in records)
    else:
        path.write_text(json.dumps(records) if data == "json-array" else
                        "".join(json.dumps(r) + "\n" for r in records))
    run = check_only(tmp_path / "out", "--recipe", "distill", *sum(([f"--{k}", str(v)] for k, v in settings(
        chat, folder, data=str(path)).items()), []), "--dry_run")
    assert_refused(run, f"the two tokenizers encode record 0 of {path} differently from token ")
    assert "their normalisers or pre-tokenisers differ" in run.stderr


@pytest.mark.parametrize("flags, message", [
    (["--precompute_teacher_topk", "-1"], "precompute_teacher_topk must be >= 0, got -1 (--precompute_teacher_topk): "
                                          "pass a K > 0"),
    (["--precompute_teacher_topk", "401"], "--precompute_teacher_topk 401 is more than the 400 tokens the models share "
                                           "(--precompute_teacher_topk): pass --precompute_teacher_topk 400 for the "
                                           "whole distribution, or fewer"),
    (["no-tokenizer"], "holds no tokenizer (none of tokenizer.json, tokenizer_config.json"),
], ids=["negative-k", "k-above-the-vocabulary", "teacher-without-tokenizer"])
def test_the_teachers_settings_are_checked_with_their_own_message(chat, teacher, check_only, tmp_path, flags,
                                                                  message):
    folder = teacher
    if flags == ["no-tokenizer"]:  # the model's files alone: transformers asked for sentencepiece
        folder, flags = tmp_path / "bare", []
        folder.mkdir()
        for name in ("config.json", "model.safetensors", "generation_config.json"):
            if (teacher / name).exists():
                shutil.copy(teacher / name, folder / name)
    run = check_only(tmp_path / "out", "--recipe", "distill", *sum(([f"--{k}", str(v)] for k, v in settings(
        chat, folder).items()), []), "--dry_run", *flags)
    assert_refused(run, message)
    assert "sentencepiece" not in run.stderr and "--lmbda" not in run.stderr


def test_tensor_parallelism_is_refused_with_the_configs_that_work(chat, teacher, check_only, tmp_path):
    run = check_only(tmp_path / "out", "--recipe", "distill", *sum(([f"--{k}", str(v)] for k, v in settings(
        chat, teacher).items()), []), "--dry_run", "--accelerate_config", "accelerate_configs/tp.yaml")
    assert_refused(run, "the distill recipe runs the student and a teacher (of any architecture) whole on each "
                        "rank's data")


def test_on_policy_steps_are_drawn_from_the_seed_and_the_step():
    load_recipe("distill")
    on_policy = sys.modules["recipe_distill"].on_policy
    half = [on_policy(0.5, 0, step) for step in range(1, 201)]
    assert 80 < sum(half) < 120 and half[:6] == [True, False, True, True, False, False]
    assert half != [on_policy(0.5, 1, step) for step in range(1, 201)]  # another seed, other steps
    assert not any(on_policy(0.0, 0, step) for step in range(1, 50))
    assert all(on_policy(1.0, 0, step) for step in range(1, 50))


# --- launched: every config against one process ---------------------------------------------------------------------

PARITY = {"reverse-kl-ddp-accum": ("qwen2", "llama", "ddp", ["--grad_accum", "2"]),
          # the other data-parallel configs on the same pair and flags: the same one-process run
          "reverse-kl-zero1": ("qwen2", "llama", "deepspeed_zero1", []),
          "reverse-kl-zero2": ("qwen2", "llama", "deepspeed_zero2", []),
          "reverse-kl-hsdp": ("qwen2", "llama", "hsdp", []),
          # --loss_chunk_mib 0.02: both heads 6 positions at a time (chunked = whole: the test above), under sharding
          "jsd-half-on-policy-chunked-zero3": ("qwen2", "llama", "deepspeed_zero3", ["--beta", "0.5", "--lmbda", "0.5",
                                                                                     "--loss_chunk_mib", "0.02"]),
          # held out: another file (EVAL, the chat fixture's uneven.jsonl), its loss recomputed from final/
          "forward-kl-sft-packed-fsdp": ("qwen2", "llama", "fsdp", ["--beta", "0", "--sft_weight", "0.5",
                                                                    "--packing", "--eval_data", "EVAL"]),
          "on-policy-zero2-offload": ("qwen2", "llama", "deepspeed_zero2_offload", ["--lmbda", "1"]),
          # a tied student with LoRA taught by a GPT-NeoX, and a GPT-NeoX student taught by an untied Qwen2
          "lora-tied-student-zero3-offload": ("llama", "gpt_neox", "deepspeed_zero3_offload", ["--lora_r", "8"]),
          "gpt-neox-student-on-policy-chunked-fsdp-offload": ("gpt_neox", "qwen2", "fsdp_offload",
                                                              ["--lmbda", "0.5", "--beta", "0", "--loss_chunk_mib",
                                                               "0.02"])}


@pytest.fixture(scope="module")
def models(chat, tmp_path_factory):
    """models(name, depth) -> a folder: conftest.architecture's model with the chat fixture's tokenizer, saved once."""
    from transformers import PreTrainedTokenizerFast

    made = {}

    def folder(name: str, layers: int):
        if (name, layers) not in made:
            path = tmp_path_factory.mktemp(f"{name}{layers}") / "model"
            torch.manual_seed(layers)
            architecture(name, layers=layers).save_pretrained(path)
            PreTrainedTokenizerFast.from_pretrained(chat[0]).save_pretrained(path)
            made[name, layers] = path
        return made[name, layers]

    return folder


@pytest.fixture(scope="module")
def one_process(chat, models, tmp_path_factory):
    """one_process(student, teacher, flags) -> (the common flags, the run of global batch 8 in one process, without
    accumulation): each once."""
    done = {}

    def run(student: str, teacher: str, flags: tuple[str, ...]):
        if (student, teacher, flags) not in done:
            folders = {"model_name_or_path": str(models(student, 2)),
                       "teacher_model_name_or_path": str(models(teacher, 3))}
            args = ["--recipe", "distill", *sum(([f"--{k}", str(v)] for k, v in settings(chat, **folders).items()),
                                                []), "--max_steps", "6", "--eval_every", "3", "--lr", "3e-3", *flags]
            one = launch(tmp_path_factory.mktemp("one") / "out", *args, "--batch_size", "8").check()
            done[student, teacher, flags] = args, folders, one
        return done[student, teacher, flags]

    return run


def answers(run) -> list[dict]:
    return [json.loads(line) for line in (run.output_dir / "generations.jsonl").read_text().splitlines()]


def rollouts(run) -> list[dict]:
    path = run.output_dir / "rollouts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("case", PARITY)
def test_distillation_trains_like_one_process_under_each_config(chat, one_process, tmp_path, case):
    """6 steps of global batch 8 (lr 3e-3), students of 2 layers, teachers of 3: the loss within 1e-5 of one
    process's, every on-policy completion the one-process run's, the teacher held as the student is (ZeRO-3 and
    FSDP2: half of it per rank, counted by the estimate), and final/ the student alone, loadable with
    from_pretrained. The DDP run also stops at step 3 and resumes to the same losses, bit for bit."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    student, teacher, config, flags = PARITY[case]
    flags = [str(chat[1].parent / "uneven.jsonl") if f == "EVAL" else f for f in flags]
    at = flags.index("--grad_accum") if "--grad_accum" in flags else len(flags)
    accumulation = int(flags[at + 1]) if at < len(flags) else 1
    args, folders, one = one_process(student, teacher, tuple(flags[:at] + flags[at + 2:]))
    args = [*args, *flags[at:at + 2]]
    batch = 8 // (accumulation * (4 if config == "hsdp" else 2))  # hsdp.yaml: 4 processes
    cut = launch(tmp_path / "cut", *args, "--batch_size", str(batch), "--save_every", "3", config=config).check()
    assert cut.resolved["global_batch_size"] == 8
    assert max_rel_diff(cut.losses, one.losses) <= PARITY_BOUND, (cut.losses, one.losses)
    assert cut.metrics[-1]["eval_loss"] == pytest.approx(one.metrics[-1]["eval_loss"], rel=1e-5)
    assert answers(cut) == answers(one) and len(answers(one)) == 4  # the student's greedy answers at steps 3 and 6
    divergences = [m["divergence"] for m in one.metrics]
    assert divergences[-1] < divergences[0]  # the student moves toward the teacher
    policy = [m.get("on_policy", 0.0) for m in one.metrics]
    assert policy == [m.get("on_policy", 0.0) for m in cut.metrics]
    if "--lmbda" in flags:  # on-policy steps, their completions the same on 2 processes as on 1
        assert sum(policy) >= 3 and rollouts(cut) == rollouts(one) and len(rollouts(one)) == 8 * sum(policy)
        assert all(r["completion"] for r in rollouts(one))
        lengths = [[m["completions/mean_length"] for m in r.metrics if "on_policy" in m] for r in (cut, one)]
        assert lengths[0] == pytest.approx(lengths[1]) and len(lengths[0]) == sum(policy)
    else:
        assert sum(policy) == 0 and not rollouts(one)
    if config.startswith(("deepspeed_zero3", "fsdp")):  # each rank holds half of the student and the teacher, and
        held = cut.metrics[0]["state_bytes"]  # the engine's own buffers (ZeRO-3: 60% of one process's bytes)
        assert held < 0.65 * one.metrics[0]["state_bytes"]
        assert abs(cut.resolved["estimated_state_bytes"] - held) <= 0.1 * held, (cut.resolved, held)
    weights = load_file(cut.output_dir / "final" / "model.safetensors")
    exported, started = (AutoModelForCausalLM.from_pretrained(path) for path in (cut.output_dir / "final",
                                                                                folders["model_name_or_path"]))
    assert type(exported) is type(started) and not any(k.startswith(("teacher", "student")) for k in weights)
    assert sum(p.numel() for p in exported.parameters()) == sum(p.numel() for p in started.parameters())
    assert (cut.output_dir / "final" / "adapter" / "adapter_config.json").is_file() == ("--lora_r" in flags)
    if config == "ddp":  # the same folder, from step 3: metrics.jsonl cut back there, the same losses after it
        whole = list(cut.losses)
        resumed = launch(tmp_path / "cut", *args, "--batch_size", str(batch), "--resume",
                         str(cut.output_dir / "checkpoints" / "step_3"), config=config).check()
        assert [m["step"] for m in resumed.metrics] == list(range(1, 7)) and resumed.losses == whole
    if case == "forward-kl-sft-packed-fsdp":
        assert evaluated(chat, folders, cut, beta=0.0, sft_weight=0.5, packing=True, eval_data=flags[-1]) == \
            pytest.approx(cut.metrics[-1]["eval_loss"], rel=1e-5)


def evaluated(chat, folders, run, **flags) -> float:
    """The eval loss recomputed here from final/ and the teacher: the mean over the held-out rows' learned tokens
    (--eval_data's) of the divergence plus sft_weight x the cross entropy, in one batch."""
    recipe = load_recipe("distill")
    cfg = recipe.Config(**settings(chat, **{**folders, "model_name_or_path": str(run.output_dir / "final")}),
                        **flags)
    _, held_out = recipe.make_datasets(cfg, run.output_dir.parent / "cache")
    evaluated_rows = run.resolved["eval_batches"] * 8 or len(held_out)  # the global batches it evaluated (0: all)
    rows = [held_out[i] for i in range(min(len(held_out), evaluated_rows))]
    batch = {k: torch.stack([row[k] for row in rows]) for k in rows[0]}
    with torch.no_grad():
        loss, _ = recipe.build_model(cfg).eval()(**batch)
    return loss.item()


@pytest.mark.slow
def test_a_precomputed_teacher_trains_like_the_live_one_and_is_never_held(one_process, tmp_path):
    """--precompute_teacher_topk with K the whole vocabulary under ZeRO-3 (the student sharded, the teacher's pass
    a share of the rows per rank): the loss within 1e-5 of one process with the live teacher, its held-out loss and
    answers the same; the run holds the student's state alone; every checkpoint carries the tables, and a resume
    reads them there (the teacher's folder then holds other weights) to the same losses."""
    import shutil

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    args, folders, live = one_process("qwen2", "llama", ())
    taught_by = tmp_path / "teacher"
    shutil.copytree(folders["teacher_model_name_or_path"], taught_by)
    args = [str(taught_by) if a == folders["teacher_model_name_or_path"] else a for a in args]
    tables = ["--precompute_teacher_topk", "400", "--batch_size", "4"]
    offline = launch(tmp_path / "offline", *args, *tables, "--save_every", "3", config="deepspeed_zero3").check()
    assert max_rel_diff(offline.losses, live.losses) <= PARITY_BOUND, (offline.losses, live.losses)
    assert offline.metrics[-1]["eval_loss"] == pytest.approx(live.metrics[-1]["eval_loss"], rel=1e-5)
    assert answers(offline) == answers(live)
    student = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(folders["model_name_or_path"]).parameters())
    # half of the student's weights, gradients and Adam moments (16 bytes a parameter) and ZeRO-3's own buffers;
    # a teacher held beside it would add more than a third
    assert offline.metrics[0]["state_bytes"] < 0.65 * 16 * student
    with safe_open(offline.output_dir / "checkpoints" / "step_3" / "precomputed.safetensors", "pt") as saved:
        assert saved.get_slice("train/teacher_topk_logps").get_shape()[1:] == [95, 400]
        assert saved.get_slice("eval/teacher_topk_ids").get_shape()[1:] == [95, 400]
    torch.manual_seed(99)  # another teacher in its folder: a resume that ran the teacher again would train on it
    architecture("llama", layers=3).save_pretrained(taught_by)
    resumed = launch(tmp_path / "offline", *args, *tables, "--resume", "latest", config="deepspeed_zero3").check()
    assert resumed.losses == offline.losses


@pytest.mark.slow
def test_top_k_tables_train_one_process_curve_under_fsdp_with_accumulation(one_process, tmp_path):
    """K = 8 of the 400 tokens (the divergence of the coarsened distributions): FSDP2 with accumulation, every
    micro-batch's tables dealt with its rows, trains the one-process curve of the same tables; they differ from the
    live teacher's."""
    args, _, live = one_process("qwen2", "llama", ())
    tables = one_process("qwen2", "llama", ("--precompute_teacher_topk", "8"))[2]
    cut = launch(tmp_path / "cut", *args, "--precompute_teacher_topk", "8", "--batch_size", "2", "--grad_accum", "2",
                 config="fsdp").check()
    assert max_rel_diff(cut.losses, tables.losses) <= PARITY_BOUND, (cut.losses, tables.losses)
    assert cut.metrics[-1]["eval_loss"] == pytest.approx(tables.metrics[-1]["eval_loss"], rel=1e-5)
    assert max_rel_diff(tables.losses, live.losses) > 1e-3  # the coarsening shows
