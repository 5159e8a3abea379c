"""Preference tuning (recipes/dpo.py, trainkit/data/preference.py): each loss against its formula computed by hand,
pairs in TRL's layouts as the model reads them, the first step's exact loss, TRL's metric names, the eval loss of the
exported model against its base, mistakes named; launched (slow): the one-process curve under the shipped configs,
LoRA and full fine-tuning, on architectures the recipe was not written for, and an exact resume."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest
import torch

from conftest import PARITY_BOUND, ROOT, architecture, assert_refused, launch, max_rel_diff
from trainkit.data import preference
from trainkit.losses import dpo as dpo_loss
from trainkit.recipes import load_recipe


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


@pytest.mark.parametrize("loss_type, beta, smoothing, gamma", [
    ("sigmoid", 0.1, 0.0, 0.0), ("sigmoid", 0.5, 0.2, 0.0), ("ipo", 0.1, 0.0, 0.0), ("hinge", 0.1, 0.0, 0.0),
    ("simpo", 2.0, 0.0, 0.5), ("orpo", 0.1, 0.0, 0.0)])
def test_each_loss_is_its_papers_formula(loss_type, beta, smoothing, gamma):
    """Two pairs of made-up log-probs: each loss and reward computed here by hand with math, from the formulas of
    trainkit/losses/dpo.py's docstring (DPO eq. 7 with cDPO, IPO eq. 17 on token averages, SLiC's hinge, SimPO eq.
    6,
    ORPO eqs. 4-7)."""
    pc, pr, rc, rr = [-12.0, -30.0], [-15.0, -28.0], [-13.0, -29.0], [-14.0, -27.5]
    nc, nr = [4.0, 10.0], [5.0, 8.0]

    def seq(c: list[float], r: list[float]) -> dpo_loss.Sequences:
        return dpo_loss.Sequences(torch.tensor(c), torch.tensor(r), torch.tensor(nc), torch.tensor(nr))

    losses, metrics = dpo_loss.pair_losses(loss_type, beta, seq(pc, pr), seq(rc, rr), smoothing, gamma)
    for i in range(2):
        d = (pc[i] - rc[i]) - (pr[i] - rr[i])
        ac, ar = pc[i] / nc[i], pr[i] / nr[i]
        expected = {
            "sigmoid": -(1 - smoothing) * logsig(beta * d) - smoothing * logsig(-beta * d),
            "ipo": ((pc[i] - rc[i]) / nc[i] - (pr[i] - rr[i]) / nr[i] - 1 / (2 * beta)) ** 2,
            "hinge": max(0.0, 1 - beta * d),
            "simpo": -logsig(beta * (ac - ar) - gamma),
            "orpo": -ac - beta * logsig((ac - ar) - (math.log(1 - math.exp(ac)) - math.log(1 - math.exp(ar)))),
        }[loss_type]
        assert losses[i].item() == pytest.approx(expected, rel=1e-6)
        free = loss_type in dpo_loss.REFERENCE_FREE
        reward_c, reward_r = (beta * ac, beta * ar) if free else (beta * (pc[i] - rc[i]), beta * (pr[i] - rr[i]))
        assert metrics["rewards/chosen"][i].item() == pytest.approx(reward_c, rel=1e-6)
        assert metrics["rewards/margins"][i].item() == pytest.approx(reward_c - reward_r, rel=1e-6)
        assert metrics["rewards/accuracies"][i].item() == float(reward_c > reward_r)
        assert metrics["logps/rejected"][i].item() == pr[i]
    assert tuple(metrics) == dpo_loss.METRICS


def test_pairs_in_trls_layouts_are_what_the_model_reads(chat):
    """Standard pairs: prompt then completion, the completion ending with EOS; conversational pairs: the completion
    exactly what the chat template adds for the assistant turn, nothing appended; a conversational pair without a
    prompt (implicit) is the same pair; the completion mask covers the completion only; a prompt that fills seq_len
    drops the pair."""
    from transformers import PreTrainedTokenizerFast

    from trainkit.data import sft

    tokenizer = PreTrainedTokenizerFast.from_pretrained(chat[0])
    template, pad = sft.TEMPLATES["chatml"], sft.pad_id(tokenizer)
    standard = preference.encode_pair({"prompt": "What is 2 plus 3? ", "chosen": "5.", "rejected": "6."},
                                      tokenizer, template, 32, pad)
    real = sum(standard["chosen_attention"])
    chosen = [t for t, m in zip(standard["chosen_ids"], standard["chosen_mask"], strict=True) if m]
    # the prompt's last space merges with the answer into one token (" 5"): the completion starts there, TRL's rule
    assert tokenizer.decode(chosen) == " 5." + tokenizer.eos_token
    assert tokenizer.decode(standard["chosen_ids"][:real]) == "What is 2 plus 3? 5." + tokenizer.eos_token
    assert standard["chosen_ids"][real:] == [pad] * (32 - real) and len(standard["rejected_ids"]) == 32
    prompt = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 2 plus 3?"}]
    answer = {"chosen": [{"role": "assistant", "content": "5."}], "rejected": [{"role": "assistant", "content": "6."}]}
    conversational = preference.encode_pair({"prompt": prompt, **answer}, tokenizer, template, 64, pad)
    completion = [t for t, m in zip(conversational["chosen_ids"], conversational["chosen_mask"], strict=True) if m]
    opened = tokenizer.apply_chat_template(prompt, chat_template=template, tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template(prompt + answer["chosen"], chat_template=template, tokenize=False)
    assert tokenizer.decode(completion) == whole[len(opened):] == "5.<|im_end|>\n"
    implicit = preference.encode_pair({"chosen": prompt + answer["chosen"], "rejected": prompt + answer["rejected"]},
                                      tokenizer, template, 64, pad)
    assert implicit == conversational
    assert preference.encode_pair({"prompt": prompt, **answer}, tokenizer, template, 8, pad) == "prompt"


@pytest.fixture(scope="module")
def pairs(chat, tmp_path_factory):
    """pairs.jsonl: the calculator chats, each with the right sum chosen and a wrong one rejected (conversational);
    held.jsonl: 16 more of them, the held-out file."""
    root = tmp_path_factory.mktemp("pairs")

    def pair(i: int) -> dict:
        a, b = i % 7 + 2, i % 5 + 3
        return {"prompt": [{"role": "system", "content": "You add numbers."},
                           {"role": "user", "content": f"What is {a} plus {b}?"}],
                "chosen": [{"role": "assistant", "content": f"{a} plus {b} is {a + b}."}],
                "rejected": [{"role": "assistant", "content": f"{a} plus {b} is {a + b + 1 + i % 3}."}]}

    (root / "pairs.jsonl").write_text("".join(json.dumps(pair(i)) + "\n" for i in range(96)))
    (root / "held.jsonl").write_text("".join(json.dumps(pair(i)) + "\n" for i in range(100, 116)))
    for name, numbers in (("answers.jsonl", range(48)), ("held_answers.jsonl", range(100, 108))):
        # KTO's unpaired layout: each pair's two answers apart, one desirable and one not, in a shuffled order (an
        # answer's KL row takes the completion of the record before it: another prompt's)
        answers = [{"prompt": pair(i)["prompt"], "completion": pair(i)[side], "label": side == "chosen"}
                   for i in numbers for side in ("chosen", "rejected")]
        random.Random(0).shuffle(answers)
        (root / name).write_text("".join(json.dumps(a) + "\n" for a in answers))
    return root


def dpo_args(chat, pairs, *extra: str, recipe: str = "dpo") -> list[str]:
    return ["--recipe", recipe, "--model_name_or_path", str(chat[0]), "--tokenizer", "saved", "--chat_template",
            "chatml", "--data", str(pairs / "pairs.jsonl"), "--eval_data", str(pairs / "held.jsonl"), "--seq_len",
            "64", "--warmup_steps", "1", "--save_every", "0", *extra]


@pytest.mark.parametrize("loss_type, lora, first", [
    ("sigmoid", False, math.log(2)), ("sigmoid", True, math.log(2)), ("ipo", False, (1 / (2 * 0.1)) ** 2),
    ("hinge", True, 1.0)])
def test_the_first_step_is_exact_when_the_policy_starts_as_the_reference(check_only, chat, pairs, tmp_path,
                                                                          loss_type, lora, first):
    """Every d = 0 at the first step (its loss is computed before any update), whatever the data: ln 2 for DPO,
    (1 / (2 beta))^2 for IPO, 1 for the hinge; TRL's eval loss there was 0.693132 (its two passes differ by 1.5e-5).
    The metrics carry TRL's names."""
    run = check_only(tmp_path / "out", *dpo_args(chat, pairs, "--loss_type", loss_type, "--max_steps", "1",
                                                  *(["--lora_r", "8"] if lora else [])))
    assert run.returncode == 0, run.stderr
    record = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["loss"] == pytest.approx(first, rel=1e-7)
    assert record["rewards/chosen"] == record["rewards/margins"] == 0.0
    assert {*dpo_loss.METRICS, *(f"eval_{name}" for name in dpo_loss.METRICS)} <= set(record)


def test_the_eval_loss_is_the_exported_models_against_its_base(check_only, chat, pairs, tmp_path):
    """The run's last eval loss is the DPO loss of final/ (loaded as any user would) against the base model, on the
    held-out file, computed here with the models' own forward passes."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    run = check_only(out, *dpo_args(chat, pairs, "--max_steps", "4", "--lr", "1e-2", "--lora_r", "8",
                                    "--eval_every", "0"))
    assert run.returncode == 0, run.stderr
    eval_loss = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["eval_loss"]
    recipe = load_recipe("dpo")
    cfg = recipe.Config(model_name_or_path=str(chat[0]), tokenizer="saved", chat_template="chatml",
                        data=str(pairs / "pairs.jsonl"), eval_data=str(pairs / "held.jsonl"), seq_len=64)
    _, held = recipe.make_datasets(cfg, tmp_path / "cache")
    batch = {key: torch.stack([pair[key] for pair in held]) for key in preference.PAIR_COLUMNS}
    scores = sys.modules["recipe_dpo"].Preference._scores
    with torch.no_grad():
        ids = torch.cat([batch["chosen_ids"], batch["rejected_ids"]])
        attention = torch.cat([batch["chosen_attention"], batch["rejected_attention"]])
        mask = torch.cat([batch["chosen_mask"], batch["rejected_mask"]])
        policy, base = (scores(AutoModelForCausalLM.from_pretrained(path).eval(), ids, attention, mask)
                        for path in (out / "final", chat[0]))
        losses, _ = dpo_loss.pair_losses("sigmoid", 0.1, policy, base)
    assert losses.mean().item() == pytest.approx(eval_loss, rel=1e-5)
    assert abs(eval_loss - math.log(2)) > 1e-4  # it trained


def test_precomputed_reference_logps_train_as_the_reference_does(check_only, chat, pairs, tmp_path):
    """--precompute_ref_logps in a full fine-tune: the reference's log-probs of every pair computed once, before the
    first step, from the model as it starts. The curve and the eval losses are the reference forward's at every step,
    with no reference copy held (state_bytes less by exactly its weights). Every checkpoint holds the values; a run
    stopped and resumed reads them back (the model has moved by then) and goes on along the same curve; a checkpoint
    without them is refused naming the file."""
    from transformers import AutoModelForCausalLM

    args = dpo_args(chat, pairs, "--max_steps", "6", "--eval_every", "3", "--lr", "1e-3", "--batch_size", "8")
    inline = check_only(tmp_path / "inline", *args)
    assert inline.returncode == 0, inline.stderr
    out = tmp_path / "pre"
    launch(out, *args, "--precompute_ref_logps", "--stop_at", "3", "--save_every", "3").check()
    assert (out / "checkpoints" / "step_3" / "precomputed.safetensors").is_file()
    launch(out, *args, "--precompute_ref_logps", "--resume", "latest").check()
    expected, got = (read_metrics(folder) for folder in (tmp_path / "inline", out))
    assert [m["step"] for m in got] == list(range(1, 7))
    for key in ("loss", "rewards/margins", "logps/chosen"):
        assert [m[key] for m in got] == pytest.approx([m[key] for m in expected], rel=1e-6, abs=1e-9), key
    evaluated = {m["step"]: m["eval_loss"] for m in expected if "eval_loss" in m}
    assert {m["step"]: m["eval_loss"] for m in got if "eval_loss" in m} == pytest.approx(evaluated, rel=1e-6)
    reference_bytes = 4 * AutoModelForCausalLM.from_pretrained(chat[0]).num_parameters()
    assert expected[0]["state_bytes"] - got[0]["state_bytes"] == reference_bytes
    (out / "checkpoints" / "step_3" / "precomputed.safetensors").unlink()
    refused = launch(out, *args, "--precompute_ref_logps", "--resume", str(out / "checkpoints" / "step_3"))
    assert refused.returncode != 0 and "precomputed.safetensors" in refused.stderr, refused.stderr


def read_metrics(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_reward_model_ranks_and_exports(check_only, chat, pairs, tmp_path, lora):
    """Bradley-Terry's loss and TRL's RewardTrainer metrics: final/ loads with AutoModelForSequenceClassification,
    and its scores of the held-out pairs give the run's last eval loss (the mean of -log sigmoid(r_chosen -
    r_rejected)), accuracy and margin. Under LoRA, final/adapter loads with docs/recipes.md's call
    (AutoPeftModelForSequenceClassification with one output and the run's pad token: the base has no scoring head,
    and without num_labels=1 transformers makes one of two) and scores as final/ does."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    out = tmp_path / "out"
    run = check_only(out, *dpo_args(chat, pairs, "--max_steps", "6", "--lr", "3e-3", "--eval_every", "0",
                                    *(["--lora_r", "8"] if lora else []), recipe="reward"))
    assert run.returncode == 0, run.stderr
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"accuracy", "margin", "mean_reward", "eval_accuracy", "eval_margin", "eval_mean_reward"} <= set(last)
    recipe = load_recipe("reward")
    cfg = recipe.Config(model_name_or_path=str(chat[0]), tokenizer="saved", chat_template="chatml",
                        data=str(pairs / "pairs.jsonl"), eval_data=str(pairs / "held.jsonl"), seq_len=64)
    _, held = recipe.make_datasets(cfg, tmp_path / "cache")
    model = AutoModelForSequenceClassification.from_pretrained(out / "final").eval()
    with torch.no_grad():
        chosen, rejected = (model(input_ids=torch.stack([p[f"{side}_ids"] for p in held]),
                                  attention_mask=torch.stack([p[f"{side}_attention"] for p in held])).logits.squeeze(-1)
                            for side in ("chosen", "rejected"))
    margin = chosen - rejected
    assert (-torch.nn.functional.logsigmoid(margin)).mean().item() == pytest.approx(last["eval_loss"], rel=1e-5)
    assert (margin > 0).float().mean().item() == pytest.approx(last["eval_accuracy"])
    assert margin.mean().item() == pytest.approx(last["eval_margin"], rel=1e-4, abs=1e-6)
    if lora:
        from peft import AutoPeftModelForSequenceClassification

        adapter = AutoPeftModelForSequenceClassification.from_pretrained(
            out / "final" / "adapter", num_labels=1,
            pad_token_id=AutoConfig.from_pretrained(out / "final").pad_token_id).eval()
        ids, mask = torch.stack([p["chosen_ids"] for p in held]), torch.stack([p["chosen_attention"] for p in held])
        with torch.no_grad():
            assert torch.allclose(adapter(input_ids=ids, attention_mask=mask).logits.squeeze(-1), chosen, atol=1e-5)


@pytest.mark.parametrize("args, message", [
    (["--loss_type", "kpo"], "unknown loss_type 'kpo' (config field loss_type): use one of sigmoid, ipo, hinge"),
    (["--loss_type", "ipo", "--label_smoothing", "0.1"], "label_smoothing is cDPO's, of the sigmoid loss, not of ipo"),
    (["--beta", "0"], "beta must be > 0, got 0.0"),
    (["--loss_type", "orpo", "--precompute_ref_logps"], "--loss_type orpo uses no reference model, so there are no "
                                                         "reference log-probabilities to precompute"),
])
def test_preference_mistakes_are_named_with_the_fix(check_only, chat, pairs, tmp_path, args, message):
    assert_refused(check_only(tmp_path / "out", *dpo_args(chat, pairs, *args), "--dry_run"), message)


def test_a_record_that_is_not_a_pair_is_named_at_its_line(check_only, chat, pairs, tmp_path):
    broken = tmp_path / "broken.jsonl"
    lines = (pairs / "pairs.jsonl").read_text().splitlines()
    record = json.loads(lines[2])
    del record["rejected"]
    broken.write_text("\n".join([*lines[:2], json.dumps(record), *lines[3:]]) + "\n")
    args = dpo_args(chat, pairs, "--dry_run")
    args[args.index("--data") + 1] = str(broken)
    assert_refused(check_only(tmp_path / "out", *args), f"{broken}:3 has no rejected field")


def with_data(args: list[str], path: Path) -> list[str]:
    args[args.index("--data") + 1] = str(path)
    return args


def written(tmp_path: Path, name: str, records: list) -> Path:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def chat_pair(i: int, chosen_role: str = "assistant", chosen: str | None = None, rejected: str | None = None):
    a, b = i % 7 + 2, i % 5 + 3
    return {"prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}],
            "chosen": [{"role": chosen_role, "content": f"{a + b}." if chosen is None else chosen}],
            "rejected": [{"role": "assistant", "content": f"{a + b + 1}." if rejected is None else rejected}]}


@pytest.mark.parametrize("bad, message", [
    (lambda: chat_pair(3, chosen_role="user"),
     ":3 has a chosen answer in the 'user' role: a completion is the "
                                               "assistant's turn"),
    (lambda: chat_pair(3, chosen=""), ":3 has an empty chosen answer"),
    (lambda: {"prompt": "What is 2 plus 3?", "chosen": " 5.", "rejected": " 6."},
     ":3 is a standard pair while the first record is a conversational one"),
    (lambda: "{not json", ":3 is not valid JSON"),
])
def test_a_pair_that_cannot_teach_is_named_at_its_line(check_only, chat, pairs, tmp_path, bad, message):
    """A chosen answer in the user's role, an empty answer, a file mixing layouts, a line that is not JSON: the dry
    run names the file and line, and the fix shows a pair (not the plain-text layout)."""
    path = written(tmp_path, "bad.jsonl", [chat_pair(1), chat_pair(2), bad(), chat_pair(4)])
    run = check_only(tmp_path / "out", *with_data(dpo_args(chat, pairs, "--dry_run"), path))
    assert_refused(run, f"{path}{message}")
    assert '{"text"' not in run.stderr and ("chosen" in run.stderr.split("): ", 1)[-1]), run.stderr


def test_deepspeeds_autoep_is_refused_for_the_dpo_recipe_which_wraps_its_models(check_only, moe_folder, pairs,
                                                                               tmp_path):
    """AutoEP finds the blocks by name from the root of the model handed to DeepSpeed: inside the dpo recipe's
    wrapper (a policy and its reference) it would split nothing, without a word. Refused before anything is built,
    with fsdp_ep.yaml as the way (its parity cell above); the reward model, handed over whole, trains under it."""
    run = check_only(tmp_path / "out", *dpo_args((moe_folder("qwen3_moe"), None), pairs), "--dry_run",
                     "--accelerate_config", str(ROOT / "accelerate_configs" / "deepspeed_zero2_ep.yaml"))
    assert_refused(run, "DeepSpeed's AutoEP finds no mixture-of-experts block to split in the recipe's Preference, "
                        "which holds its transformers model(s) inside")
    assert "accelerate_configs/fsdp_ep.yaml" in run.stderr


def test_an_empty_pairs_file_is_refused_showing_a_pair(check_only, chat, pairs, tmp_path):
    path = written(tmp_path, "empty.jsonl", ["", ""])
    run = check_only(tmp_path / "out", *with_data(dpo_args(chat, pairs, "--dry_run"), path))
    assert_refused(run, f"{path} holds only blank lines (--data {path}): pass a file of records such as "
                        '{"prompt": "...", "chosen": "...", "rejected": "..."}')


def test_pairs_with_nothing_to_learn_are_refused_or_counted(check_only, chat, pairs, tmp_path):
    """Every chosen answer equal to its rejected one: refused by the dry run (before: trained at ln 2 with accuracy 0
    while weight decay moved the weights). Some of them, and some prompts that fill --seq_len: the dry run (which
    encodes the pairs as the run does) and the run say how many were left out and the first record of each kind."""
    same = written(tmp_path, "same.jsonl", [chat_pair(i, rejected=f"{i % 7 + 2 + i % 5 + 3}.") for i in range(8)])
    assert_refused(check_only(tmp_path / "out", *with_data(dpo_args(chat, pairs, "--dry_run"), same)),
                   f"every pair of {same} has the same chosen and rejected answer: nothing to prefer")
    long_prompt = {**chat_pair(5), "prompt": [{"role": "user", "content": "What is 2 plus 3? " * 20}]}
    mixed = [chat_pair(i) for i in range(40)]
    mixed[3] = chat_pair(3, chosen="6.", rejected="6.")
    mixed[9] = chat_pair(9, chosen="7.", rejected="7.")
    mixed[6] = long_prompt
    path = written(tmp_path, "mixed.jsonl", mixed)
    run = check_only(tmp_path / "dry", *with_data(dpo_args(chat, pairs, "--dry_run", "--preview", "1"), path))
    assert run.returncode == 0, run.stderr
    assert (f"note: 3 of the 40 pairs of {path} are left out: 1 whose prompt fills --seq_len (pass a larger "
            "--seq_len), the first record 7; 2 whose chosen answer equals its rejected one (nothing to prefer), the "
            "first record 4") in run.stderr, run.stderr
    shown = run.stderr.split("pair 1 of 37 as the model reads it, between [[ and ]] what is compared:\n")[1]
    assert shown.startswith("chosen (") and "\nrejected (" in shown and "What is 3 plus 4?" in shown, shown
    assert "assistant\n[[7.<|im_end|>\n]]" in shown and "assistant\n[[8.<|im_end|>\n]]" in shown, shown
    every_long = written(tmp_path, "long.jsonl", [long_prompt] * 4)
    assert_refused(check_only(tmp_path / "out2", *with_data(dpo_args(chat, pairs, "--dry_run"), every_long)),
                   f"none of the 4 pairs of {every_long} has anything to learn: 4 whose prompt fills --seq_len")


def test_trls_implicit_prompt_strings_are_the_standard_pair(chat):
    """{"chosen": "The sky is blue.", "rejected": "The sky is green."}: the prompt is what both begin with, cut at
    the space before the first difference (TRL's extract_prompt), and the pair is the standard one."""
    from transformers import PreTrainedTokenizerFast

    from trainkit.data import sft

    tokenizer = PreTrainedTokenizerFast.from_pretrained(chat[0])
    pad = sft.pad_id(tokenizer)
    implicit = {"chosen": "What is 2 plus 3? 5.", "rejected": "What is 2 plus 3? 6."}
    assert preference.split_pair(implicit) == {"prompt": "What is 2 plus 3?", "chosen": " 5.", "rejected": " 6."}
    assert preference.layout(implicit) == "implicit" and preference.record_problem(implicit) is None
    assert preference.encode_pair(implicit, tokenizer, None, 32, pad) == preference.encode_pair(
        {"prompt": "What is 2 plus 3?", "chosen": " 5.", "rejected": " 6."}, tokenizer, None, 32, pad)


# Launched: the one-process curve (10 steps) under the shipped configs, full fine-tuning (its reference a frozen copy
# held as the policy is) and LoRA (its reference the adapters off), on the chat fixture's Qwen2 (untied) and two
# architectures the recipe was not written for: Llama with tied embeddings and GPT-NeoX.
# The reward recipe: full under ZeRO-3 and FSDP2, LoRA (its new head trained whole) under ZeRO-2 and ZeRO-3 offload.
# --precompute_ref_logps (no reference copy; the values dealt to the ranks and gathered) under ZeRO-1 and ZeRO-2
# offload. Tensor parallelism cuts the policy and its frozen copy by the policy's plan (and the reward model by its
# own). Each other loss under one split: IPO full under ZeRO-1, the hinge with LoRA and accumulation under DDP, SimPO
# under FSDP2, ORPO under ZeRO-3.
PARITY = {"full-ddp": ("qwen2", "ddp", []), "full-zero3": ("qwen2", "deepspeed_zero3", []),
          "full-fsdp": ("qwen2", "fsdp", []), "lora-zero2": ("qwen2", "deepspeed_zero2", ["--lora_r", "8"]),
          "lora-zero3-offload": ("qwen2", "deepspeed_zero3_offload", ["--lora_r", "8"]),
          "lora-fsdp-offload": ("qwen2", "fsdp_offload", ["--lora_r", "8"]),
          "full-llama-tied-ddp": ("llama", "ddp", []), "lora-gpt-neox-ddp": ("gpt_neox", "ddp", ["--lora_r", "8"]),
          "reward-full-zero3": ("qwen2", "deepspeed_zero3", ["--recipe", "reward"]),
          "reward-full-fsdp": ("qwen2", "fsdp", ["--recipe", "reward"]),
          "reward-lora-zero2": ("qwen2", "deepspeed_zero2", ["--recipe", "reward", "--lora_r", "8"]),
          "lora-ddp": ("qwen2", "ddp", ["--lora_r", "8"]), "lora-fsdp": ("qwen2", "fsdp", ["--lora_r", "8"]),
          "full-precomputed-zero1": ("qwen2", "deepspeed_zero1", ["--precompute_ref_logps"]),
          "full-precomputed-zero2-offload": ("qwen2", "deepspeed_zero2_offload", ["--precompute_ref_logps"]),
          "reward-lora-zero3-offload": ("qwen2", "deepspeed_zero3_offload", ["--recipe", "reward", "--lora_r", "8"]),
          "full-tp": ("qwen2", "tp", []), "reward-full-tp": ("qwen2", "tp", ["--recipe", "reward"]),
          "ipo-full-zero1": ("qwen2", "deepspeed_zero1", ["--loss_type", "ipo"]),
          "hinge-lora-ddp-accum": ("qwen2", "ddp", ["--loss_type", "hinge", "--lora_r", "8", "--grad_accum", "2"]),
          "simpo-fsdp": ("qwen2", "fsdp", ["--loss_type", "simpo"]),
          "orpo-zero3": ("qwen2", "deepspeed_zero3", ["--loss_type", "orpo"]),
          # mixtures of experts, their balancing loss a hundred times the models' own (tests/test_moe.py)
          "moe-qwen3-zero3": ("qwen3_moe", "deepspeed_zero3", ["--router_aux_loss_coef", "1"]),
          "moe-mixtral-lora-fsdp": ("mixtral", "fsdp", ["--router_aux_loss_coef", "1", "--lora_r", "8"]),
          # expert parallelism: the policy's experts and the frozen reference's split over the 2 ranks
          "moe-qwen3-ep": ("qwen3_moe", "fsdp_ep", ["--router_aux_loss_coef", "1"]),
          # tensor parallelism: the policy's and the reference's fused experts cut by transformers' styles
          "moe-mixtral-tp": ("mixtral", "tp", ["--router_aux_loss_coef", "1"]),
          # a reward model: its sequence classifier's router logits caught for the balance, its experts split
          "reward-moe-qwen3-ep": ("qwen3_moe", "fsdp_ep", ["--recipe", "reward", "--router_aux_loss_coef", "1"]),
          # DeepSpeed's AutoEP on the classifier (its router logits caught from AutoEP's routers), final/ gathered
          "reward-moe-qwen3-autoep": ("qwen3_moe", "deepspeed_zero2_ep",
                                      ["--recipe", "reward", "--router_aux_loss_coef", "1"])}
DATA_PARALLEL = {"tp": 1}  # the configs whose 2 processes are not 2 data-parallel ranks


@pytest.fixture(scope="module")
def one_process(chat, pairs, tmp_path_factory):
    """one_process(architecture, flags) -> (its model folder, the one-process run): each run once."""
    from transformers import PreTrainedTokenizerFast

    done = {}

    def run(name: str, flags: tuple[str, ...]):
        if (name, flags) not in done:
            folder = chat[0] if name == "qwen2" else tmp_path_factory.mktemp(name) / "model"
            if name != "qwen2":
                torch.manual_seed(0)
                architecture(name).save_pretrained(folder)
                PreTrainedTokenizerFast.from_pretrained(chat[0]).save_pretrained(folder)
            recipe = flags[flags.index("--recipe") + 1] if "--recipe" in flags else "dpo"
            args = [*dpo_args((folder, None), pairs, "--max_steps", "10", "--eval_every", "5", "--lr", "1e-3",
                              recipe=recipe), *(f for f in flags if f not in ("--recipe", recipe))]
            out = tmp_path_factory.mktemp("one") / "out"
            done[name, flags] = args, launch(out, *args, "--batch_size", str(8 // accumulation(flags))).check()
        return done[name, flags]

    return run


def accumulation(flags) -> int:
    return int(flags[flags.index("--grad_accum") + 1]) if "--grad_accum" in flags else 1


@pytest.mark.slow
@pytest.mark.parametrize("case", PARITY)
def test_dpo_trains_like_one_process_under_each_config(one_process, tmp_path, case):
    name, config, flags = PARITY[case]
    args, one = one_process(name, tuple(flags))
    micro = 8 // (DATA_PARALLEL.get(config, 2) * accumulation(flags))
    cut = launch(tmp_path / "out", *args, "--batch_size", str(micro), config=config).check()
    assert cut.resolved["global_batch_size"] == 8
    assert cut.resolved.get("ep", 1) == (2 if config.endswith("_ep") else 1)  # the experts split, not only sharded
    if config == "tp":  # the policy's and the reference's layers cut in two, not two whole copies
        assert cut.metrics[0]["state_bytes"] < 0.9 * one.metrics[0]["state_bytes"]
    reward = "reward" in flags
    balance = one.metrics[0].get("aux_loss", 0.0) if "--router_aux_loss_coef" in flags else 0.0  # coefficient 1
    assert "--loss_type" in flags or reward or one.losses[0] - balance == pytest.approx(math.log(2), rel=1e-7)
    assert max_rel_diff(cut.losses, one.losses) <= PARITY_BOUND, (cut.losses, one.losses)
    if "--router_aux_loss_coef" in flags:  # the balance is in the objective, one process's
        assert balance > 0.01 * one.losses[0]
        assert max_rel_diff([m["aux_loss"] for m in cut.metrics], [m["aux_loss"] for m in one.metrics]) <= PARITY_BOUND
    for name in ("eval_loss", *(("eval_accuracy", "eval_margin") if reward else
                                ("eval_rewards/accuracies", "eval_rewards/margins"))):
        assert cut.metrics[-1][name] == pytest.approx(one.metrics[-1][name], rel=1e-4, abs=1e-6), name
    assert (cut.output_dir / "final" / "config.json").is_file()
    assert (cut.output_dir / "final" / "adapter" / "adapter_config.json").is_file() == ("--lora_r" in flags)


@pytest.mark.slow
def test_a_dpo_run_resumes_exactly(one_process, tmp_path):
    """Stopped at step 5 under DDP and resumed (the reference comes back with the checkpoint, frozen): the steps after
    it are the one-process run's."""
    args, one = one_process("qwen2", ())
    out = tmp_path / "out"
    launch(out, *args, "--batch_size", "4", "--save_every", "5", "--stop_at", "5", config="ddp").check()
    resumed = launch(out, *args, "--batch_size", "4", "--resume", "latest", config="ddp").check()
    assert [m["step"] for m in resumed.metrics] == list(range(1, 11))
    assert max_rel_diff(resumed.losses, one.losses) <= PARITY_BOUND


@pytest.mark.slow
def test_precomputed_values_resume_under_another_config(one_process, tmp_path):
    """--precompute_ref_logps stopped at step 5 under FSDP2 and resumed in one process: the values come back from
    the checkpoint (the model that gave them has trained since), and the steps after it are the one-process run's."""
    args, one = one_process("qwen2", ("--precompute_ref_logps",))
    out = tmp_path / "out"
    launch(out, *args, "--batch_size", "4", "--save_every", "5", "--stop_at", "5", config="fsdp").check()
    resumed = launch(out, *args, "--batch_size", "8", "--resume", "latest").check()
    assert [m["step"] for m in resumed.metrics] == list(range(1, 11))
    assert max_rel_diff(resumed.losses, one.losses) <= PARITY_BOUND
    assert resumed.metrics[-1]["eval_loss"] == pytest.approx(one.metrics[-1]["eval_loss"], rel=1e-5)


@pytest.mark.slow
def test_log_probabilities_in_chunks_train_the_whole_logits_curve(one_process, tmp_path):
    """The policy's and the reference's log-probabilities from chunks of 6 positions (trainkit/losses/chunked_loss.py),
    a full fine-tune under ZeRO-3 (the reference copy gathered chunk by chunk too), against the whole logits in one
    process."""
    args, whole = one_process("qwen2", ())
    chunked = launch(tmp_path / "out", *args, "--batch_size", "4", "--loss_chunk_mib", "0.01",
                     config="deepspeed_zero3").check()
    assert max_rel_diff(chunked.losses, whole.losses) <= PARITY_BOUND
    for name in ("eval_loss", "eval_rewards/margins"):
        assert chunked.metrics[-1][name] == pytest.approx(whole.metrics[-1][name], rel=1e-4, abs=1e-6), name


# --- KTO: unpaired answers with a thumbs-up or down ------------------------------------------------------------------

def kto_args(chat, pairs, *extra: str) -> list[str]:
    return [*dpo_args(chat, pairs, "--loss_type", "kto"), "--data", str(pairs / "answers.jsonl"), "--eval_data",
            str(pairs / "held_answers.jsonl"), *extra]


def test_the_kto_loss_is_the_papers_formula():
    """KTO (Ethayarajh et al. 2024, eq. 8) as TRL computes it, by hand: a desirable answer's loss is
    w_d (1 - sigmoid(beta (r - z0))), an undesirable one's w_u (1 - sigmoid(beta (z0 - r))); r = 0 = z0 gives half
    the weight."""
    logps, ref = torch.tensor([-3.0, -5.0, -4.0, -4.0]), torch.tensor([-4.0, -4.5, -4.0, -4.0])
    label = torch.tensor([1, 0, 1, 0])
    losses, rewards = dpo_loss.kto_losses(0.5, logps, ref, torch.tensor(0.2), label, 2.0, 1.5)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = [2.0 * (1 - sig(0.5 * (1.0 - 0.2))), 1.5 * (1 - sig(0.5 * (0.2 + 0.5))), 2.0 * (1 - sig(-0.1)),
                1.5 * (1 - sig(0.1))]
    assert losses.tolist() == pytest.approx(expected, rel=1e-6)
    assert rewards.tolist() == pytest.approx([0.5, -0.25, 0.0, 0.0])
    zero, _ = dpo_loss.kto_losses(0.1, ref, ref, torch.tensor(0.0), label, 1.0, 1.0)
    assert zero.tolist() == [0.5] * 4


@pytest.mark.parametrize("weights, first", [((1.0, 1.0), 0.5), ((3.0, 3.0), 1.5)])
def test_kto_starts_at_half_its_weights_with_trls_metrics(check_only, chat, pairs, tmp_path, weights, first):
    """The policy starts as its reference: every r = 0 and z0 = 0, so the first step's loss is exactly 0.5 x the
    weights (equal), its rewards and KL 0; the metrics carry TRL's KTO names, eval_ prefixed on the held-out answers."""
    run = check_only(tmp_path / "out", *kto_args(chat, pairs, "--max_steps", "1", "--desirable_weight",
                                                 str(weights[0]), "--undesirable_weight", str(weights[1])))
    assert run.returncode == 0, run.stderr
    record = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["loss"] == pytest.approx(first, rel=1e-7) and record["eval_loss"] == pytest.approx(first, rel=1e-7)
    assert record["kl"] == 0.0 and record["rewards/chosen"] == 0.0 == record["rewards/rejected"]
    names = {"rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl"}
    assert names <= set(record) and {f"eval_{name}" for name in names} <= set(record)
    assert not any(name.startswith(("_", "eval__")) for name in record)


def test_kto_rows_pair_each_prompt_with_the_completion_before_it_in_the_batch():
    """KTO's KL rows as TRL rotates its batch's completions: row i is its prompt and the completion of row i - 1 (row
    0 the last row's), cut to the width, the mask on the borrowed completion."""
    ids = torch.tensor([[1, 2, 10, 11, 0, 0], [3, 20, 21, 22, 0, 0], [4, 5, 6, 30, 0, 0]])
    attention = (ids > 0).long()
    mask = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0], [0, 0, 0, 1, 0, 0]])
    kl_ids, kl_attention, kl_mask = dpo_loss.kl_rows(ids, attention, mask, pad=9)
    assert kl_ids.tolist() == [[1, 2, 30, 9, 9, 9], [3, 10, 11, 9, 9, 9], [4, 5, 6, 20, 21, 22]]
    assert kl_attention.tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1] * 6]
    assert kl_mask.tolist() == [[0, 0, 1, 0, 0, 0], [0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1]]


@pytest.mark.parametrize("split", [(8, 1), (4, 2), (2, 4)], ids=["whole", "2-micro-batches", "4-micro-batches"])
def test_the_kto_reference_point_is_trls_one_process_value_for_the_global_batch(chat, pairs, tmp_path, split):
    """A global batch of 8 answers out of 96, a reference moved off the policy: the reference point the rollout
    hook gives is TRL's for that batch on one process, computed here by hand as KTOTrainer does it (each prompt's
    tokens followed by the previous answer's completion tokens, the batch's first by its last; the mean over the
    batch of the summed completion log-ratio, clamped at 0), above the clamp, and the same however the batch is
    split into micro-batches (a rank's micro-batches are a contiguous part of it, as on any world size)."""
    from transformers import AutoModelForCausalLM

    from trainkit.data.batches import epoch_order

    recipe = load_recipe("dpo")
    cfg = recipe.Config(model_name_or_path=str(chat[0]), tokenizer="saved", chat_template="chatml", seq_len=64,
                        loss_type="kto", data=str(pairs / "answers.jsonl"),
                        eval_data=str(pairs / "held_answers.jsonl"))
    train, _ = recipe.make_datasets(cfg, tmp_path)
    batch = [train[int(i)] for i in epoch_order(len(train), 0, 0)[:8]]
    model = recipe.make_model(cfg)
    torch.manual_seed(3)
    with torch.no_grad():  # the two apart: a reference moved at random finds every answer less likely than the policy
        for p in model.reference.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model.eval()
    size, count = split
    micro = [{key: torch.stack([row[key] for row in batch[i * size:(i + 1) * size]]) for key in batch[0]}
             for i in range(count)]
    given = recipe.rollout(model, cfg, 1, micro).micro_batches
    policy = AutoModelForCausalLM.from_pretrained(chat[0]).eval()  # the policy is the untouched model

    def summed_logp(net, tokens: list[int], start: int) -> float:
        with torch.no_grad():
            logits = net(torch.tensor([tokens])).logits[0, :-1].log_softmax(-1)
        return float(logits[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])][start - 1:].sum())

    ratios = []
    for i, row in enumerate(batch):
        prompt = row["completion_ids"][:int(row["completion_mask"].nonzero()[0])].tolist()
        before = batch[i - 1]
        tokens = (prompt + before["completion_ids"][before["completion_mask"].bool()].tolist())[:64]
        ratios.append(summed_logp(policy, tokens, len(prompt)) - summed_logp(model.reference, tokens, len(prompt)))
    by_hand = max(0.0, sum(ratios) / len(ratios))
    assert by_hand > 0.05, ratios
    assert [float(m["kto_kl"][0]) for m in given] == pytest.approx([by_hand] * count, rel=1e-5)


def test_answers_of_one_kind_are_said_and_the_other_kinds_metrics_left_out(check_only, chat, pairs, tmp_path):
    """Desirable answers alone: said before training; rewards/rejected and logps/rejected are no metric of such a
    run (they were 0.0), the desirable ones are."""
    answers = [json.loads(line) for line in (pairs / "answers.jsonl").read_text().splitlines()]
    liked = tmp_path / "liked.jsonl"
    liked.write_text("".join(json.dumps(a) + "\n" for a in answers if a["label"]))
    run = check_only(tmp_path / "out", *kto_args(chat, pairs, "--max_steps", "1"), "--data", str(liked),
                     "--eval_data", str(liked))
    assert run.returncode == 0, run.stderr
    assert f"note: every answer of {liked} is desirable (no undesirable one): KTO learns from them alone, and the " \
           "metrics of undesirable answers are left out" in run.stderr
    record = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert {"rewards/chosen", "logps/chosen", "eval_rewards/chosen"} <= set(record)
    assert not {"rewards/rejected", "logps/rejected", "eval_rewards/rejected"} & set(record)


@pytest.mark.parametrize("loss_type, data, message", [
    ("kto", "pairs.jsonl", "is a pair (prompt, chosen, rejected): --loss_type kto trains on unpaired answers"),
    ("sigmoid", "answers.jsonl", "is an unpaired answer (prompt, completion, label): --loss_type kto trains on those")])
def test_pairs_and_unpaired_answers_each_name_their_loss(check_only, chat, pairs, tmp_path, loss_type, data,
                                                         message):
    run = check_only(tmp_path / "out", *dpo_args(chat, pairs, "--loss_type", loss_type), "--data",
                     str(pairs / data), "--eval_data", str(pairs / data), "--dry_run")
    assert_refused(run, f"{pairs / data}:1 {message}")


def test_a_label_that_is_not_true_or_false_is_named(check_only, chat, pairs, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "2 plus 2?", "completion": "4", "label": "yes"}) + "\n")
    run = check_only(tmp_path / "out", *kto_args(chat, pairs), "--data", str(bad), "--dry_run")
    assert_refused(run, f"{bad}:1 has label 'yes': true (a desirable answer) or false (an undesirable one)")


@pytest.fixture(scope="module")
def kto_reference(chat, pairs, tmp_path_factory):
    """KTO on one process, the global batch of 8 answers in one micro-batch."""
    return launch(tmp_path_factory.mktemp("kto") / "one", *kto_args(chat, pairs, "--max_steps", "6", "--eval_every",
                                                                      "3", "--lr", "1e-3", "--batch_size", "8")).check()


@pytest.mark.slow
@pytest.mark.parametrize("config, flags", [("ddp", ["--batch_size", "2", "--grad_accum", "2"]),
                                           ("deepspeed_zero3", ["--batch_size", "4"]),
                                           ("fsdp", ["--batch_size", "4"])], ids=["ddp-accum", "zero3", "fsdp"])
def test_kto_trains_like_one_process_under_each_config(chat, pairs, kto_reference, tmp_path, config, flags):
    """The reference point is the whole global batch's (the rollout hook sums every rank's KL rows before the step),
    so the loss, the gradient norm and kl of every step are one process's under any split (TRL averages it per
    micro-batch: its curve changes with the split). A held-out micro-batch takes its own KL rows' mean, as TRL's
    evaluation does: the eval loss follows the evaluation's micro-batch size, within 1e-3 here."""
    run = launch(tmp_path / "out", *kto_args(chat, pairs, "--max_steps", "6", "--eval_every", "3", "--lr", "1e-3",
                                             *flags), config=config).check()
    for key in ("loss", "grad_norm", "kl"):
        ours, one = [m[key] for m in run.metrics], [m[key] for m in kto_reference.metrics]
        assert max_rel_diff(ours, one) < PARITY_BOUND, (key, ours, one)
    last = kto_reference.metrics[-1]  # it moved, and the held-out answers' loss fell below the first step's 0.5
    assert max(m["kl"] for m in kto_reference.metrics) > 0.01  # the reference point above its clamp, compared
    assert last["eval_loss"] < 0.5 and last["eval_rewards/chosen"] > last["eval_rewards/rejected"]
    evals = [[m["eval_loss"] for m in r.metrics if "eval_loss" in m] for r in (run, kto_reference)]
    assert max_rel_diff(*evals) < 1e-3
