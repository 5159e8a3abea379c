"""The grpo recipe: its formulas against values computed by hand, a step's loss whatever its split, completions that
depend on their seed and not on their batch, the user's reward functions checked before the first step, the first
step's loss recomputed from rollouts.jsonl alone, and every data-parallel config at the one-process curve."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import PARITY_BOUND, architecture, assert_refused, launch, max_rel_diff
from trainkit.losses import grpo
from trainkit.rl import sampling

REWARDS = "tests.helpers.rl_rewards"


# --- the formulas ---------------------------------------------------------------------------------------------------

def test_advantages_are_the_papers():
    """GRPO's group baseline and RLOO's leave-one-out, scaled by the group's std, the batch's or not at all; a group
    whose rewards are all equal has advantage 0 and is counted."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    std = math.sqrt(1 / 3)  # the unbiased std of (1, 0, 0, 1)
    got, zero = grpo.advantages(rewards, 4, "group", "group")
    a = 0.5 / (std + 1e-4)
    assert got[:4].tolist() == pytest.approx([a, -a, -a, a])
    assert got[4:].tolist() == [0.0] * 4 and zero.tolist() == [False] * 4 + [True] * 4
    loo, _ = grpo.advantages(rewards, 4, "none", "rloo")
    assert loo[:4].tolist() == pytest.approx([1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3])  # r - mean(the other 3)
    batch, _ = grpo.advantages(rewards, 4, "batch", "group")
    assert batch[0].item() == pytest.approx(0.5 / (rewards.std().item() + 1e-4))
    plain, _ = grpo.advantages(rewards, 4, "none", "group")
    assert plain[:4].tolist() == [0.5, -0.5, -0.5, 0.5]


def by_hand(loss_type, level, beta, logps, old, ref, advantage, mask, eps=0.2, eps_high=0.28, length=4) -> float:
    """The loss in plain Python, loop by loop (trainkit/losses/grpo.py's docstring)."""
    per_row, total, tokens = [], 0.0, 0
    for i, row in enumerate(mask):
        kept = [t for t, m in enumerate(row) if m]
        if level == "sequence":
            mean = sum(logps[i][t] - old[i][t] for t in kept) / max(1, len(kept))
            ratios = {t: math.exp(mean) for t in kept}
        else:
            ratios = {t: math.exp(logps[i][t] - old[i][t]) for t in kept}
        losses = []
        for t in kept:
            r, a = ratios[t], advantage[i]
            value = -min(r * a, min(max(r, 1 - eps), 1 + eps_high) * a)
            if beta:
                d = ref[i][t] - logps[i][t]
                value += beta * (math.exp(d) - d - 1)
            losses.append(value)
        per_row.append(sum(losses) / max(1, len(kept)))
        total, tokens = total + sum(losses), tokens + len(kept)
    if loss_type == "grpo":
        return sum(per_row) / len(mask)
    if loss_type == "dr_grpo":
        return total / (len(mask) * length)
    return total / tokens


def random_batch(rows=6, length=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(rows, length, generator=g) * 3
    old = logps + (torch.rand(rows, length, generator=g) - 0.5) * 2  # ratios on both sides of the clip range
    ref = logps + (torch.rand(rows, length, generator=g) - 0.5)
    advantage = torch.randn(rows, generator=g)
    lengths = torch.tensor([4, 1, 3, 2, 4, 0][:rows])  # uneven, one completion masked out whole
    mask = (torch.arange(length)[None] < lengths[:, None]).long()
    return logps, old, ref, advantage, mask


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
@pytest.mark.parametrize("level", grpo.LEVELS)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_loss_is_its_formula_by_hand(loss_type, level, beta):
    logps, old, ref, advantage, mask = random_batch()
    objective = grpo.Objective(loss_type, beta, 0.2, 0.28, level, 4)
    got = grpo.token_loss(objective, logps, old, ref if beta else None, advantage, mask)
    expected = by_hand(loss_type, level, beta, logps.tolist(), old.tolist(), ref.tolist(), advantage.tolist(),
                       mask.tolist())
    assert got.loss.item() == pytest.approx(expected, rel=1e-6)
    assert got.sums["clip_ratio/region_mean"] > 0  # the batch has clipped tokens: the clip was exercised


def test_on_the_sampling_step_the_ratio_is_1_and_the_kl_0():
    """No old log-probs (the step sampled them): the policy term is -A on every token, and the KL of a policy that
    is its reference is exactly 0, not merely small."""
    logps, _, _, advantage, mask = random_batch()
    got = grpo.token_loss(grpo.Objective("grpo", 0.1, 0.2, 0.2, "token", 4), logps, None, logps.clone(), advantage,
                          mask)
    kept = mask.sum(-1) > 0
    assert got.loss.item() == pytest.approx(-(advantage * kept).sum().item() / len(mask), rel=1e-6)
    assert got.sums["kl"].item() == 0.0 and got.sums["clip_ratio/region_mean"].item() == 0.0


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_a_steps_loss_and_gradient_do_not_depend_on_its_split(loss_type):
    """The runner weighs each micro-batch's mean by its units (loss_weight: trainkit/step.py's loss_weights); for
    every loss type the weighted loss and gradient of any split of 6 uneven completions (one masked out whole) are
    those of the whole."""
    logps, old, ref, advantage, mask = random_batch(seed=1)
    objective = grpo.Objective(loss_type, 0.04, 0.2, 0.28, "token", 4)

    def weighted(sizes):
        leaf = logps.clone().requires_grad_(True)
        total = 0.0
        parts = list(zip(*(t.split(sizes) for t in (leaf, old, ref, advantage, mask)), strict=True))
        weights = [grpo.unit_count(loss_type, part[4]) for part in parts]
        for (lp, o, r, a, m), w in zip(parts, weights, strict=True):
            total = total + w * grpo.token_loss(objective, lp, o, r, a, m).loss
        total = total / sum(weights)
        total.backward()
        return total.item(), leaf.grad

    whole, grad = weighted([6])
    for sizes in ([3, 3], [2, 2, 2], [1] * 6, [4, 2]):
        loss, split_grad = weighted(sizes)
        assert loss == pytest.approx(whole, rel=1e-6), sizes
        assert torch.allclose(split_grad, grad, rtol=1e-5, atol=1e-8), sizes


# --- sampling -------------------------------------------------------------------------------------------------------

def test_a_completion_depends_on_its_seed_not_on_its_batch(chat):
    """The same slot seed gives the same completion alone or beside other prompts of other lengths; another seed
    another one; greedy is top_k 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(chat[0]).eval()
    prompts = torch.tensor([[5, 6, 7, 8, 9, 0, 0], [11, 12, 0, 0, 0, 0, 0], [13, 14, 15, 16, 17, 18, 19]])
    lengths = torch.tensor([5, 2, 7])
    how = sampling.Sampling(12, temperature=1.0, top_p=0.95, top_k=50, stop=(0,), pad=0)
    seeds = [sampling.slot_seed(3, 1, p, 0) for p in range(3)]
    with torch.no_grad():
        together = sampling.sample(model, prompts, lengths, seeds, how, synced=False)
        alone = [sampling.sample(model, prompts[i:i + 1], lengths[i:i + 1], seeds[i:i + 1], how, synced=False)
                 for i in range(3)]
        other = sampling.sample(model, prompts[:1], lengths[:1], [seeds[0] + 1], how, synced=False)
        greedy = sampling.sample(model, prompts, lengths, None, how, synced=False)
        top1 = sampling.sample(model, prompts, lengths, seeds, sampling.Sampling(12, top_k=1, stop=(0,)), False)
    for i in range(3):
        assert torch.equal(together.ids[i], alone[i].ids[0]), i
        assert torch.equal(together.mask[i], alone[i].mask[0]), i
    assert not torch.equal(other.ids[0], together.ids[0])
    assert torch.equal(greedy.ids, top1.ids)
    assert together.ids.shape == (3, 12) and (together.mask.sum(-1) > 0).all()


def test_left_padding_keeps_each_prompts_positions():
    ids, attention = sampling.left_padded(torch.tensor([[4, 5, 0], [6, 7, 8]]), torch.tensor([2, 3]), pad=0)
    assert ids.tolist() == [[0, 4, 5], [6, 7, 8]] and attention.tolist() == [[0, 1, 1], [1, 1, 1]]
    assert sampling.positions(attention).tolist() == [[0, 0, 1], [0, 1, 2]]


# --- runs -----------------------------------------------------------------------------------------------------------

def prompt_record(i: int) -> dict:
    a, b = i % 7 + 2, i % 5 + 3
    return {"prompt": [{"role": "system", "content": "You add numbers."},
                       {"role": "user", "content": f"What is {a} plus {b}?"}], "answer": a + b}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(prompt_record(i)) + "\n" for i in range(48)))
    return path


@pytest.fixture(scope="module")
def scorer(chat, tmp_path_factory):
    """A reward model as the reward recipe exports it: a Qwen2 with one output (untrained: its scores differ from
    completion to completion), padded with the chat fixture's pad token, and its tokenizer."""
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForSequenceClassification

    folder = tmp_path_factory.mktemp("scorer") / "final"
    torch.manual_seed(1)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(chat[0])
    config = Qwen2Config(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tokenizer.eos_token_id)
    Qwen2ForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def grpo_args(model, prompts, *extra: str) -> list[str]:
    return ["--recipe", "grpo", "--model_name_or_path", str(model), "--tokenizer", "saved", "--chat_template",
            "chatml", "--data", str(prompts), "--reward_funcs", f"{REWARDS}.even_ids,{REWARDS}.short",
            "--num_generations", "4", "--max_completion_length", "8", "--seq_len", "64", "--eval_every", "0",
            "--lr", "3e-3", "--warmup_steps", "0", *extra]


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_the_first_steps_loss_is_computed_from_rollouts_jsonl_alone(check_only, chat, prompts, tmp_path, loss_type):
    """Step 1: the advantages from the logged rewards (GRPO's group formula), the loss type's normalisation over the
    logged token counts, the ratio 1: the logged loss. With beta > 0 the KL is exactly 0 there. A third function
    returns None for some completions (TRL's "does not apply"): logged as null, it adds nothing to their reward, and
    its metrics are over the completions it scored."""
    out = tmp_path / "out"
    args = grpo_args(chat[0], prompts, "--loss_type", loss_type, "--beta", "0.04", "--max_steps", "2",
                     "--batch_size", "8", "--eval_data", str(prompts), "--eval_every", "2")
    args[args.index("--reward_funcs") + 1] += f",{REWARDS}.partial"
    run = check_only(out, *args)
    assert run.returncode == 0, run.stderr
    metrics, rows = read_jsonl(out / "metrics.jsonl"), read_jsonl(out / "rollouts.jsonl")
    first = [row for row in rows if row["step"] == 1]
    assert len(first) == 8 and [row["generation"] for row in first] == [0, 1, 2, 3] * 2
    assert {"prompt", "completion", "rewards/even_ids", "rewards/short", "advantage", "tokens"} <= set(first[0])
    partial = [row["rewards/partial"] for row in first]
    assert {p is None for p in partial} == {True, False}, partial  # the step has completions of both kinds
    assert metrics[0]["rewards/partial/mean"] == 1.0 and metrics[0]["rewards/partial/std"] == 0.0
    assert metrics[1]["eval_rewards/partial/mean"] == 1.0  # over the held-out completions it scored
    rewards = [row["rewards/even_ids"] + row["rewards/short"] + (row["rewards/partial"] or 0) for row in first]
    advantages = []
    for g in range(0, 8, 4):
        group = rewards[g:g + 4]
        mean = sum(group) / 4
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / 3)
        advantages += [(r - mean) / (std + 1e-4) for r in group]
    assert [row["advantage"] for row in first] == pytest.approx(advantages, rel=1e-5, abs=1e-6)
    tokens = [row["tokens"] for row in first]
    if loss_type == "grpo":
        expected = -sum(a for a, n in zip(advantages, tokens, strict=True) if n) / 8
    elif loss_type == "dr_grpo":
        expected = -sum(a * n for a, n in zip(advantages, tokens, strict=True)) / (8 * 8)
    else:
        expected = -sum(a * n for a, n in zip(advantages, tokens, strict=True)) / sum(tokens)
    assert metrics[0]["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert metrics[0]["kl"] == 0.0 and metrics[1]["kl"] > 0
    assert metrics[0]["reward"] == pytest.approx(sum(rewards) / 8, rel=1e-6)
    assert metrics[0]["completions/mean_length"] == pytest.approx(sum(tokens) / 8)


def test_reward_functions_get_trls_extras_and_may_be_async(check_only, chat, prompts, tmp_path):
    """TRL's kwargs: trainer_state (the optimizer steps done), log_metric (into metrics.jsonl) and log_extra (a column
    of rollouts.jsonl); an async function is awaited (the same values as its plain twin)."""
    out = tmp_path / "out"
    args = grpo_args(chat[0], prompts, "--max_steps", "3", "--batch_size", "8", "--eval_data", str(prompts),
                     "--eval_every", "3")
    args[args.index("--reward_funcs") + 1] = f"{REWARDS}.even_ids,{REWARDS}.even_ids_async,{REWARDS}.curriculum"
    run = check_only(out, *args)
    assert run.returncode == 0, run.stderr
    metrics, rows = read_jsonl(out / "metrics.jsonl"), read_jsonl(out / "rollouts.jsonl")
    assert [row["rewards/even_ids_async"] for row in rows] == [row["rewards/even_ids"] for row in rows]
    for step, m in enumerate(metrics, start=1):
        mine = [row for row in rows if row["step"] == step]
        assert m["curriculum/steps_done"] == step - 1
        assert m["curriculum/even_first"] == pytest.approx(sum(r["first_id"] % 2 == 0 for r in mine) / len(mine))
        assert [r["rewards/curriculum"] for r in mine] == [float(r["tokens"] > step - 1) for r in mine]
    assert "eval_rewards/curriculum/mean" in metrics[-1]


@pytest.mark.parametrize("reward, message", [
    ("nowhere.score", "module nowhere cannot be imported"),
    (f"{REWARDS}.missing", "has no function missing"),
    (f"{REWARDS}.raises", f"reward function {REWARDS}.raises raised KeyError: 'label'"),
    (f"{REWARDS}.too_few", f"reward function {REWARDS}.too_few returned [] for 1 completions (the first "),
    (f"{REWARDS}.not_numbers", "completion 0's value 'high' (str) is not a finite real number; it must return one "
                               "finite real number (or None) per completion"),
    (f"{REWARDS}.numbers_as_strings", f"reward function {REWARDS}.numbers_as_strings returned ['0.5'] for 1 "
                                      "completions"),
    (f"{REWARDS}.raises_async", f"reward function {REWARDS}.raises_async raised TimeoutError: the judge did not "
                                "answer"),
    (f"{REWARDS}.logs_a_set", "the reward functions logged values of column 'seen' that JSON cannot hold: Object of "
                              "type set is not JSON serializable"),
    (f"{REWARDS}.logs_the_loss", "a reward function logged log_metric 'loss': a name metrics.jsonl or rollouts.jsonl "
                                 "fills itself"),
    (f"{REWARDS}.logs_an_advantage", "a reward function logged log_extra 'advantage': a name metrics.jsonl or "
                                     "rollouts.jsonl fills itself"),
])
def test_a_broken_reward_function_is_named_by_the_dry_run(check_only, chat, prompts, tmp_path, reward, message):
    args = grpo_args(chat[0], prompts, "--dry_run")
    args[args.index("--reward_funcs") + 1] = reward
    assert_refused(check_only(tmp_path / "out", *args), message)


def test_reward_values_must_be_real_numbers_and_any_librarys_number_is_one():
    from helpers import rl_rewards

    from trainkit.errors import ConfigError
    from trainkit.rl import rewards

    def scored(function):
        reward = rewards.Reward(function.__name__, f"rl_rewards.{function.__name__}", function)
        return rewards.score([reward], ["p"] * 4, ["c"] * 4, [[1]] * 4, {"answer": [1] * 4}, 0, 1)[0][0]

    import numpy
    import torch

    for value, expected in [(numpy.float32(0.25), 0.25), (torch.tensor([1.5]), 1.5), (numpy.int64(2), 2.0),
                            (True, 1.0), (numpy.bool_(True), 1.0), (None, None)]:
        got = scored(lambda prompts, completions, completion_ids, v=value, **kw: [v] * len(completions))
        assert got == [expected] * 4 if expected is not None else all(x != x for x in got)
    assert scored(lambda prompts, completions, completion_ids, **kw: torch.tensor([0.0, 1, 2, 3])) == [0, 1, 2, 3]
    assert scored(lambda prompts, completions, completion_ids, **kw: numpy.arange(4.0)) == [0, 1, 2, 3]
    for bad, said in [(["0.5"] * 4, "completion 0's value '0.5' (str)"),
                      ([1.0, 2.0, b"3", 4.0], "completion 2's value b'3' (bytes)"),
                      ([1.0, float("inf"), 0, 0], "completion 1's value inf (float)"),
                      ([1.0, 1j, 0, 0], "completion 1's value 1j (complex)"),
                      ("1234", "that is a str, not a list"), (torch.tensor(1.0), "that is a Tensor with no values")]:
        with pytest.raises(ConfigError) as refused:
            scored(lambda prompts, completions, completion_ids, b=bad, **kw: b)
        assert said in refused.value.problems[0].what
    # a signature without **kwargs is refused when the run is planned, unless it names all it is given
    found = [rewards.Reward(f.__name__, f.__name__, f) for f in (rl_rewards.no_kwargs, rl_rewards.names_everything)]
    problems = rewards.signature_problems(found, ["answer"])
    assert [p.what.split(" (")[0] for p in problems] == ["reward function no_kwargs cannot be called as the run calls "
                                                         "it"]
    assert "got an unexpected keyword argument 'answer'" in problems[0].what
    assert [p.what.split(" (")[0] for p in rewards.signature_problems(found[1:], ["answer", "level"])] == \
        ["reward function names_everything cannot be called as the run calls it"]


def test_a_reward_function_that_cannot_take_the_columns_is_refused_before_the_run(check_only, chat, prompts,
                                                                                   tmp_path):
    args = grpo_args(chat[0], prompts)  # no --dry_run: refused while planning, before a model is built
    args[args.index("--reward_funcs") + 1] = f"{REWARDS}.no_kwargs"
    assert_refused(check_only(tmp_path / "out", *args), f"reward function {REWARDS}.no_kwargs cannot be called as "
                                                        "the run calls it")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.parametrize("args, message", [
    (["--batch_size", "6"], "the global batch holds 6 completions"),
    (["--num_generations", "1"], "num_generations must be >= 2"),
    (["--loss_type", "ppo"], "--loss_type must be one of grpo, dr_grpo, dapo, bnpo"),
    (["--max_completion_length", "64"], "max_completion_length must be between 1 and seq_len - 1"),
    (["--reward_weights", "1,2,3"], "2 reward(s) (even_ids, short) need as many numbers"),
])
def test_grpo_mistakes_are_named_with_the_fix(check_only, chat, prompts, tmp_path, args, message):
    assert_refused(check_only(tmp_path / "out", *grpo_args(chat[0], prompts, "--dry_run", *args)), message)


def test_a_split_model_is_refused_with_the_reason(check_only, chat, prompts, tmp_path):
    from conftest import ROOT

    run = check_only(tmp_path / "out", *grpo_args(chat[0], prompts, "--dry_run", "--accelerate_config",
                                                    str(ROOT / "accelerate_configs" / "tp.yaml")))
    assert_refused(run, "the grpo recipe samples its completions with the whole model on every rank")


def test_the_dry_run_shows_a_prompt_and_calls_every_reward_function(check_only, chat, prompts, tmp_path):
    run = check_only(tmp_path / "out", *grpo_args(chat[0], prompts, "--dry_run"))
    assert run.returncode == 0, run.stderr
    assert "prompt 0 of" in run.stderr and "<|im_start|>assistant" in run.stderr
    assert "the reward functions on an empty completion of it: even_ids 0, short 1" in run.stderr


def test_the_dry_run_of_streamed_prompts_shows_the_first_and_names_a_source_without_prompts(check_only, chat, prompts,
                                                                                          tmp_path):
    streamed = grpo_args(chat[0], prompts, "--dry_run", "--streaming", "true")
    run = check_only(tmp_path / "out", *streamed)
    assert run.returncode == 0, run.stderr
    assert "the first prompt of the stream as the model reads it" in run.stderr and "What is 2 plus 3?" in run.stderr
    assert "the reward functions on an empty completion of it: even_ids 0, short 1" in run.stderr
    texts = tmp_path / "texts.jsonl"
    texts.write_text('{"text": "no prompt here"}\n')
    mixed = grpo_args(chat[0], f"{prompts}:0.5,{texts}:0.5", "--dry_run")
    assert_refused(check_only(tmp_path / "out2", *mixed), f"{texts}:1: no field 'prompt' (its fields: text)")


@pytest.mark.parametrize("streaming", ["false", "true"])
def test_chat_prompts_without_a_template_are_refused_with_the_fix(check_only, chat, prompts, tmp_path, streaming):
    args = grpo_args(chat[0], prompts, "--dry_run", "--streaming", streaming)
    del args[args.index("--chat_template"):args.index("--chat_template") + 2]  # the fixture's tokenizer has none
    assert_refused(check_only(tmp_path / "out", *args), "the tokenizer has no chat template to render "
                                                         "conversational prompts with")


def test_a_model_built_from_scratch_learns_a_programmatic_reward(check_only, chat, prompts, tmp_path):
    """A Llama (tied embeddings) built from its config, rewarded for the share of its completions' tokens among the
    vocabulary's first tenth: from chance (about 0.1) to at least 0.9, its greedy held-out answers too."""
    from transformers import PreTrainedTokenizerFast

    torch.manual_seed(0)
    folder = tmp_path / "llama"
    architecture("llama").save_pretrained(folder)
    PreTrainedTokenizerFast.from_pretrained(chat[0]).save_pretrained(folder)
    args = grpo_args(folder, prompts, "--num_generations", "8", "--batch_size", "16", "--lr", "3e-2",
                     "--max_steps", "30", "--seq_len", "96")
    args[args.index("--reward_funcs") + 1] = f"{REWARDS}.share_of_low_ids"
    run = check_only(tmp_path / "out", *args)
    assert run.returncode == 0, run.stderr
    rewards = [m["reward"] for m in read_jsonl(tmp_path / "out" / "metrics.jsonl")]
    assert rewards[0] < 0.2 and min(rewards[-5:]) >= 0.9, rewards
    assert read_jsonl(tmp_path / "out" / "metrics.jsonl")[-1]["eval_reward"] >= 0.9


# Every data-parallel config at the one-process curve, full and with LoRA, the reference (beta > 0) and a reward model
# held as the policy is, on the chat fixture's Qwen2 (untied) and two architectures the recipe was not written for:
# Llama with tied embeddings and GPT-NeoX; each loss type and the sequence-level ratio under one split.
PARITY = {"full-ddp": ("qwen2", "ddp", ["--reward_funcs", f"{REWARDS}.even_ids,{REWARDS}.short,{REWARDS}.curriculum"]),
          "full-zero3-beta": ("qwen2", "deepspeed_zero3", ["--beta", "0.04"]),
          "full-fsdp-beta": ("qwen2", "fsdp", ["--beta", "0.04"]),
          "lora-zero2-beta": ("qwen2", "deepspeed_zero2", ["--lora_r", "8", "--beta", "0.04"]),
          "lora-zero3-offload": ("qwen2", "deepspeed_zero3_offload", ["--lora_r", "8"]),
          "full-fsdp-offload": ("qwen2", "fsdp_offload", []),
          "lora-hsdp-beta": ("qwen2", "hsdp", ["--lora_r", "8", "--beta", "0.04"]),  # 4 processes: 2 x 2
          "grpo-llama-tied-zero1": ("llama", "deepspeed_zero1", ["--loss_type", "grpo"]),
          "dr-grpo-lora-gpt-neox-ddp-accum": ("gpt_neox", "ddp", ["--lora_r", "8", "--grad_accum", "2",
                                                                  "--loss_type", "dr_grpo"]),
          "bnpo-sequence-zero2-offload": ("qwen2", "deepspeed_zero2_offload",
                                          ["--loss_type", "bnpo", "--importance_sampling_level", "sequence"]),
          "reward-model-zero3": ("qwen2", "deepspeed_zero3", ["--reward_model", "SCORER", "--beta", "0.04"]),
          # mixtures of experts, their balancing loss a hundred times the models' own (tests/test_moe.py)
          "moe-qwen3-zero3-beta": ("qwen3_moe", "deepspeed_zero3", ["--router_aux_loss_coef", "1", "--beta", "0.04"]),
          "moe-mixtral-ddp-accum": ("mixtral", "ddp", ["--router_aux_loss_coef", "1", "--grad_accum", "2"]),
          # expert parallelism: the policy generates with its experts split over the 2 ranks, the reference too
          "moe-qwen3-ep-beta": ("qwen3_moe", "fsdp_ep", ["--router_aux_loss_coef", "1", "--beta", "0.04"])}


@pytest.fixture(scope="module")
def one_process(chat, prompts, scorer, tmp_path_factory):
    """one_process(architecture, flags) -> (its arguments, the one-process run): each run once; SCORER in the
    flags stands for the scorer fixture's folder."""
    from transformers import PreTrainedTokenizerFast

    done = {}

    def run(name: str, flags: tuple[str, ...]):
        if (name, flags) not in done:
            folder = chat[0] if name == "qwen2" else tmp_path_factory.mktemp(name) / "model"
            if name != "qwen2":
                torch.manual_seed(0)
                architecture(name).save_pretrained(folder)
                PreTrainedTokenizerFast.from_pretrained(chat[0]).save_pretrained(folder)
            args = [*grpo_args(folder, prompts, "--max_steps", "6", "--eval_every", "3"),
                    *(str(scorer) if flag == "SCORER" else flag for flag in flags)]
            out = tmp_path_factory.mktemp("one") / "out"
            done[name, flags] = args, launch(out, *args, "--batch_size", str(8 // accumulation(flags))).check()
        return done[name, flags]

    return run


def accumulation(flags) -> int:
    return int(flags[flags.index("--grad_accum") + 1]) if "--grad_accum" in flags else 1


def completions(run) -> list[tuple]:
    return [(row["step"], row["generation"], row["completion"]) for row in read_jsonl(run.output_dir /
                                                                                       "rollouts.jsonl")]


@pytest.mark.slow
@pytest.mark.parametrize("case", PARITY)
def test_grpo_trains_like_one_process_under_each_config(one_process, tmp_path, case):
    """The same completions (rollouts.jsonl, every step), rewards and advantages, and the one-process curve: the loss
    and the gradient norm within PARITY_BOUND over 6 steps, the held-out reward alike."""
    name, config, flags = PARITY[case]
    args, one = one_process(name, tuple(flags))
    processes = 4 if config == "hsdp" else 2  # hsdp.yaml: 2 replicas of 2 shards
    cut = launch(tmp_path / "out", *args, "--batch_size", str(8 // (processes * accumulation(flags))),
                 config=config).check()
    assert cut.resolved["global_batch_size"] == 8 and cut.resolved["world_size"] == processes
    assert cut.resolved.get("ep", 1) == (2 if config.endswith("_ep") else 1)  # the experts split, not only sharded
    assert completions(cut) == completions(one)
    assert [m["reward"] for m in cut.metrics] == pytest.approx([m["reward"] for m in one.metrics], rel=1e-6)
    norms = [m["grad_norm"] for m in cut.metrics]
    assert max_rel_diff(norms, [m["grad_norm"] for m in one.metrics]) <= PARITY_BOUND, norms
    # the loss is a nearly cancelling sum of terms of size ~1 (the advantages sum to 0 per group): its float32
    # summation error is absolute, ~1e-7, and a relative bound on a value near 0 would measure nothing but that
    assert cut.losses == pytest.approx(one.losses, rel=PARITY_BOUND, abs=1e-6)
    assert cut.metrics[-1]["eval_reward"] == pytest.approx(one.metrics[-1]["eval_reward"], rel=1e-6)
    if f"{REWARDS}.curriculum" in " ".join(flags):  # what the functions logged, gathered from both ranks
        assert [m["curriculum/even_first"] for m in cut.metrics] == [m["curriculum/even_first"] for m in one.metrics]
        assert [r["first_id"] for r in read_jsonl(cut.output_dir / "rollouts.jsonl")] == \
            [r["first_id"] for r in read_jsonl(one.output_dir / "rollouts.jsonl")]
    assert min(norms) > 0  # the rewards differ within groups: every step moved the model
    assert (cut.output_dir / "final" / "config.json").is_file()
    assert (cut.output_dir / "final" / "adapter" / "adapter_config.json").is_file() == ("--lora_r" in flags)


@pytest.mark.slow
def test_the_memory_savers_sample_and_train_as_without_them(one_process, tmp_path):
    """Gradient checkpointing (which transformers pairs with use_cache=False in training: the sampling must still
    get its KV cache), activation offload and the log-probabilities in tiny chunks, under DDP: the completions and
    the curve of one process without them."""
    args, one = one_process("qwen2", ())
    saving = launch(tmp_path / "out", *args, "--batch_size", "4", "--gradient_checkpointing", "true",
                    "--activation_offload", "true", "--loss_chunk_mib", "0.001", config="ddp").check()
    assert saving.resolved["gradient_checkpointing"] is True and saving.resolved["activation_offload"] is True
    assert completions(saving) == completions(one)
    assert saving.losses == pytest.approx(one.losses, rel=PARITY_BOUND, abs=1e-6)
    norms = [m["grad_norm"] for m in saving.metrics]
    assert max_rel_diff(norms, [m["grad_norm"] for m in one.metrics]) <= PARITY_BOUND, norms


@pytest.mark.slow
@pytest.mark.parametrize("flags", [(), ("--num_iterations", "2", "--beta", "0.04")], ids=["on-policy", "iterations"])
def test_a_stopped_run_resumes_bit_exact(one_process, tmp_path, flags):
    """Stopped after step 3 under DDP and resumed: every later step's completions, loss and gradient norm are the
    uninterrupted run's to the bit. With --num_iterations 2, step 4 trains again on step 3's completions against their
    old log-probabilities, which only the checkpoint holds (rollout/rank_<r>.pt); its ratios are no longer 1."""
    args, one = one_process("qwen2", flags)
    whole = launch(tmp_path / "whole", *args, "--batch_size", "4", config="ddp").check()
    out = tmp_path / "out"
    launch(out, *args, "--batch_size", "4", "--save_every", "3", "--stop_at", "3", config="ddp").check()
    assert (out / "checkpoints" / "step_3" / "rollout").is_dir() == bool(flags)
    resumed = launch(out, *args, "--batch_size", "4", "--resume", "latest", config="ddp").check()
    assert [m["step"] for m in resumed.metrics] == list(range(1, 7))
    assert completions(resumed) == completions(whole) == completions(one)
    for key in ("loss", "grad_norm", "reward"):
        assert [m[key] for m in resumed.metrics] == [m[key] for m in whole.metrics], key
    assert max_rel_diff([m["grad_norm"] for m in whole.metrics], [m["grad_norm"] for m in one.metrics]) <= PARITY_BOUND
    if flags:
        assert [m["step"] for m in read_jsonl(out / "rollouts.jsonl")][::4] == [1, 1, 3, 3, 5, 5]
        step3, step4 = whole.metrics[2], whole.metrics[3]  # one batch of completions, the model moved between
        assert step4["reward"] == step3["reward"] and step4["loss"] != step3["loss"]


@pytest.mark.slow
def test_streamed_prompts_are_the_same_on_any_number_of_processes_and_resume_exactly(chat, tmp_path):
    """--data a mixture of two prompt files, streamed as every mixture is (trainkit/data/stream.py: a prompt per lane,
    each filling its 4 completion slots): one process, DDP on 2 with accumulation (its rows made in a data worker)
    and ZeRO-3 with offload (the policy gathered to generate) give the same prompts, completions and curve; a DDP run
    stopped at step 3 with --num_iterations 2, between a batch's two steps, resumes to the uninterrupted run's values
    bit for bit (the stream gives step 4 the batch of step 3 again)."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps(prompt_record(i)) + "\n" for i in range(160)))
    b.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i} times 3?"}], "answer": 3 * i})
                         + "\n" for i in range(120)))
    args = [*grpo_args(chat[0], f"{a}:0.6,{b}:0.4", "--max_steps", "5", "--num_iterations", "2", "--beta", "0.04")]
    one = launch(tmp_path / "one", *args, "--batch_size", "8").check()
    assert "--data streamed:" in one.stderr
    ddp = ["--batch_size", "2", "--grad_accum", "2"]
    whole = launch(tmp_path / "whole", *args, *ddp, "--data_workers", "1", config="ddp").check()  # a data worker
    offload = launch(tmp_path / "offload", *args, *ddp, config="deepspeed_zero3_offload").check()
    assert offload.resolved["zero_stage"] == 3
    out = tmp_path / "out"
    launch(out, *args, *ddp, "--save_every", "3", "--stop_at", "3", config="ddp").check()
    resumed = launch(out, *args, *ddp, "--resume", "latest", config="ddp").check()
    rows = read_jsonl(one.output_dir / "rollouts.jsonl")
    assert len(rows) == 3 * 8 and [r["step"] for r in rows[::8]] == [1, 3, 5]  # sampled every other step
    groups = [rows[i:i + 4] for i in range(0, len(rows), 4)]
    assert all(len({json.dumps(r["prompt"]) for r in group}) == 1 for group in groups)  # a prompt's 4 slots
    assert {len(group[0]["prompt"]) for group in groups} == {1, 2}  # prompts of both files (b's have no system turn)
    assert completions(resumed) == completions(whole) == completions(offload) == completions(one)
    assert [r["prompt"] for r in read_jsonl(out / "rollouts.jsonl")] == [r["prompt"] for r in rows]
    for key in ("loss", "grad_norm", "reward"):
        assert [m[key] for m in resumed.metrics] == [m[key] for m in whole.metrics], key
    for run in (whole, offload):
        norms = [m["grad_norm"] for m in run.metrics]
        assert max_rel_diff(norms, [m["grad_norm"] for m in one.metrics]) <= PARITY_BOUND, norms
        assert run.losses == pytest.approx(one.losses, rel=PARITY_BOUND, abs=1e-6)
        assert run.metrics[-1]["data_share"] == one.metrics[-1]["data_share"]


@pytest.mark.slow
def test_the_recipes_defaults_train_under_zero3_offload_like_one_process(chat, prompts, tmp_path):
    """The recipe's own defaults (8 completions of up to 64 tokens per prompt in 256, dapo, temperature 1, lr 1e-6,
    its warmup): 2 steps of one prompt on one process, and of the same global batch under ZeRO-3 with offload, where
    every rank generates with the policy gathered: the same completions, rewards and gradient norms."""
    args = ["--recipe", "grpo", "--model_name_or_path", str(chat[0]), "--tokenizer", "saved", "--chat_template",
            "chatml", "--data", str(prompts), "--reward_funcs", f"{REWARDS}.even_ids", "--max_steps", "2"]
    one = launch(tmp_path / "one", *args).check()
    cut = launch(tmp_path / "cut", *args, "--batch_size", "4", config="deepspeed_zero3_offload").check()
    for key, value in {"num_generations": 8, "max_completion_length": 64, "seq_len": 256, "loss_type": "dapo",
                       "global_batch_size": 8}.items():
        assert one.resolved[key] == cut.resolved[key] == value, key
    assert completions(cut) == completions(one) and len(completions(one)) == 16
    assert max(row["tokens"] for row in read_jsonl(one.output_dir / "rollouts.jsonl")) > 8  # past the suite's 8
    assert [m["reward"] for m in cut.metrics] == pytest.approx([m["reward"] for m in one.metrics], rel=1e-6)
    norms = [m["grad_norm"] for m in cut.metrics]
    assert min(norms) > 0 and max_rel_diff(norms, [m["grad_norm"] for m in one.metrics]) <= PARITY_BOUND, norms


def test_the_estimate_counts_the_sampling_kv_cache_and_the_reference(check_only, chat, prompts, tmp_path):
    """--estimate: the KV cache of the rank's completion slots (where it is larger than the step's activations),
    and under --beta the frozen reference's weights beside the policy's."""
    import re

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(chat[0])
    rows, seq = 2 * 128, 64  # --batch_size 2 x --grad_accum 128 slots of --seq_len tokens
    kv = 4 * rows * seq * config.num_hidden_layers * 2 * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) + 4 * rows * config.vocab_size

    def activations(*flags):
        run = check_only(tmp_path / "out", *grpo_args(chat[0], prompts, "--estimate", "--batch_size", "2",
                                                      "--grad_accum", "128", *flags))
        assert run.returncode == 0, run.stderr
        found = re.search(r"activations ([\d.]+) (\w+)", run.stdout)
        return float(found.group(1)) * {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10}[found.group(2)], run.stdout

    sampled, plain = activations()
    assert sampled == pytest.approx(kv, rel=1e-3)
    with_reference = check_only(tmp_path / "out", *grpo_args(chat[0], prompts, "--estimate", "--beta", "0.04")).stdout
    params = [line for line in with_reference.splitlines() if "parameters" in line][0]
    alone = [line for line in plain.splitlines() if "parameters" in line][0]
    assert int(params.split()[0].replace(",", "")) == 2 * int(alone.split()[0].replace(",", ""))


def test_a_folder_that_is_no_reward_model_is_refused_before_the_run(check_only, chat, prompts, tmp_path):
    """A causal LM's folder would load as a sequence classifier with a head drawn at random (trained with exit 0):
    refused naming the missing head; so is a classifier of three outputs."""
    from transformers import AutoConfig, Qwen2ForSequenceClassification

    three = tmp_path / "three"
    config = AutoConfig.from_pretrained(chat[0], num_labels=3)
    Qwen2ForSequenceClassification(config).save_pretrained(three)
    for folder, said in [(chat[0], f"{chat[0]} is no reward model: its weights have no scoring head (score.weight; "
                                   "it holds a Qwen2ForCausalLM)"),
                         (three, f"{three} is no reward model: score.weight has 3 outputs, a reward model has one")]:
        run = check_only(tmp_path / "out", *grpo_args(chat[0], prompts, "--reward_model", str(folder)))
        assert_refused(run, said)
        assert "--recipe reward" in run.stderr and not (tmp_path / "out" / "metrics.jsonl").exists()


def test_a_reward_model_scores_each_completion_in_the_run(check_only, chat, prompts, scorer, tmp_path):
    """--reward_model: every completion scored by it (its own tokens, the prompt and completion rendered with the
    chat template, as TRL renders them), weighed with the functions; the score in rollouts.jsonl is the exported
    model's own on that text; --estimate counts its weights."""
    from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast

    from trainkit.data import sft

    out = tmp_path / "out"
    args = grpo_args(chat[0], prompts, "--reward_model", str(scorer), "--reward_weights", "1,0,2", "--max_steps", "2",
                     "--batch_size", "8")
    run = check_only(out, *args)
    assert run.returncode == 0, run.stderr
    rows, metrics = read_jsonl(out / "rollouts.jsonl"), read_jsonl(out / "metrics.jsonl")
    model = AutoModelForSequenceClassification.from_pretrained(scorer).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(scorer)
    for row in rows[:3]:
        text = tokenizer.apply_chat_template(row["prompt"] + [{"role": "assistant", "content": row["completion"]}],
                                             chat_template=sft.TEMPLATES["chatml"], tokenize=False)
        with torch.no_grad():
            score = model(**tokenizer(text, add_special_tokens=False, return_tensors="pt")).logits[0, 0].item()
        assert row["rewards/reward_model"] == pytest.approx(score, rel=1e-4, abs=1e-5)
    first = [row for row in rows if row["step"] == 1]
    weighted = [r["rewards/even_ids"] + 2 * r["rewards/reward_model"] for r in first]
    assert metrics[0]["reward"] == pytest.approx(sum(weighted) / len(weighted), rel=1e-5)
    assert "rewards/reward_model/mean" in metrics[0] and "eval_rewards/reward_model/mean" in metrics[-1]
    sizes = []
    for extra in ((), ("--reward_model", str(scorer))):
        shown = check_only(tmp_path / "est", *grpo_args(chat[0], prompts, "--estimate", *extra)).stdout
        sizes.append(int([line for line in shown.splitlines() if "parameters" in line][0].split()[0].replace(",", "")))
    assert sizes[1] - sizes[0] == sum(p.numel() for p in model.parameters())
