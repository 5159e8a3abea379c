"""A mixture of experts' balancing loss is kept (trainkit/losses/router.py): the causal_lm and dpo recipes add the
model's own aux_loss times its config's router_aux_loss_coef to their objective, as transformers' loss does when
given labels, whole or in chunks, each sequence balanced alone (so the step's loss does not change with the split
of the global batch), and report it as aux_loss. Before, a coefficient of 10 and of 0.01 trained to the same losses
to every digit."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from conftest import architecture, assert_refused, launch, mixture_of_experts
from trainkit.losses import chunked_loss
from trainkit.recipes import load_recipe
from trainkit.run.metrics import means_of

MOE = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss")  # tests/conftest.py's mixture_of_experts


def moe(name: str, coefficient: float) -> torch.nn.Module:
    return mixture_of_experts(name, router_aux_loss_coef=coefficient)


@pytest.mark.parametrize("name", sorted(MOE))
@pytest.mark.parametrize("chunk_mib", [0.0, 0.002], ids=["whole", "chunks"])
def test_the_causal_lm_objective_is_transformers_own_loss_sequence_by_sequence(name, chunk_mib):
    """Plain text, every token learned: causal_lm's objective on a micro-batch of two sequences is the mean of
    model(sequence, labels=sequence).loss (the cross entropy + coefficient x aux_loss) over the two, to 1e-6, with the
    logits whole or 5 positions at a time: each sequence balanced alone, the model's own loss for a micro-batch of
    one; the reported aux_loss is the mean of theirs; the coefficient changes the objective by exactly its difference
    x aux_loss."""
    recipe = load_recipe("causal_lm")
    ids = torch.randint(1, 400, (2, 12), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    objectives = {}
    for coefficient in (10.0, 0.01):
        model = chunked_loss.configure(moe(name, coefficient), chunk_mib)
        assert model.loss_chunk_tokens == (1 if chunk_mib else 0)  # one position a chunk: 22 chunks
        objective, reported = recipe.loss(model, batch)
        means = means_of({k: v.item() for k, v in reported.items()}, 2)
        own = [model(input_ids=row[None], labels=row[None]) for row in ids]
        expected = sum(out.loss.item() for out in own) / 2
        assert abs(objective.item() - expected) <= 1e-6 * expected, (objective, expected)
        assert means["aux_loss"] == pytest.approx(sum(out.aux_loss.item() for out in own) / 2, rel=1e-6)
        objective.backward()  # the router's parameters get the balancing term's gradient
        router = next(p for n, p in model.named_parameters() if n.endswith(("mlp.gate.weight", "mlp.router.weight")))
        assert router.grad is not None and router.grad.abs().sum() > 0
        objectives[coefficient] = (objective.item(), means["aux_loss"])
        whole = model(**batch)  # the micro-batch's loads: each layer's busiest expert, counted by hand
        top_k, experts = model.config.num_experts_per_tok, whole.router_logits[0].shape[-1]
        for i, logits in enumerate(whole.router_logits):
            counts = torch.bincount(torch.topk(logits, top_k).indices.flatten(), minlength=experts)
            expected = counts.max().item() / counts.sum().item() * experts
            assert means[f"expert_load/layer_{i}"] == pytest.approx(expected, rel=1e-6)
            assert 1.0 <= expected <= experts
        assert set(means) == {"aux_loss", "expert_load/layer_0", "expert_load/layer_1"}  # the units' total hidden
    (high, aux), (low, _) = objectives[10.0], objectives[0.01]
    assert high - low == pytest.approx((10.0 - 0.01) * aux, rel=1e-5)


def test_the_balance_of_a_global_batch_is_the_same_however_it_is_split():
    """Sequences of different lengths (padding), each weighing its learned tokens: the objective summed over
    micro-batches as the runner weighs them (trainkit/step.py: each micro-batch's mean x its loss_weight / the
    global total) is the same for one micro-batch of 4, two of 2 and four of 1, to 1e-6; the model's own aux_loss,
    measured over each forward's batch, changes with the split (why the recipe balances each sequence alone)."""
    recipe = load_recipe("causal_lm")
    model = chunked_loss.configure(moe("qwen3_moe", 10.0), 0)
    ids = torch.randint(1, 400, (4, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    for row, length in enumerate((12, 7, 9, 4)):
        mask[row, length:] = 0
    total = float(mask[:, 1:].sum())
    objectives, own = {}, {}
    for size in (4, 2, 1):
        parts = [{"input_ids": ids[i:i + size], "attention_mask": mask[i:i + size]} for i in range(0, 4, size)]
        objectives[size] = sum(recipe.loss(model, part)[0].item() * recipe.loss_weight(None, part) / total
                               for part in parts)
        own[size] = sum(model(**part).aux_loss.item() for part in parts) / len(parts)
    assert objectives[2] == pytest.approx(objectives[4], rel=1e-6)
    assert objectives[1] == pytest.approx(objectives[4], rel=1e-6)
    assert abs(own[1] - own[4]) > 1e-3 * own[4], own


def test_a_dense_model_reports_no_aux_loss():
    """A model without experts: the loss is a plain scalar, as before (no aux_loss metric appears)."""
    model = architecture("qwen2")
    ids = torch.randint(1, 400, (2, 12))
    out = load_recipe("causal_lm").loss(chunked_loss.configure(model, 0), {"input_ids": ids,
                                                                            "attention_mask": torch.ones_like(ids)})
    assert torch.is_tensor(out) and out.dim() == 0


def test_the_dpo_objective_adds_the_policys_balancing_term(tmp_path):
    """dpo: the pair loss's mean + coefficient x the mean of the policy's aux_loss over the answers, each alone
    (chosen and rejected in one forward); the reference pass adds nothing."""
    from trainkit.losses import dpo as dpo_loss

    recipe = load_recipe("dpo")
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    cfg = recipe.Config(model_name_or_path=str(tmp_path), data=str(tmp_path / "pairs.jsonl"), loss_type="sigmoid")
    policy = chunked_loss.configure(moe("qwen3_moe", 10.0), 0)
    reference = chunked_loss.configure(moe("qwen3_moe", 10.0), 0).requires_grad_(False)
    preference = sys.modules["recipe_dpo"].Preference  # the recipe file's module, as load_recipe executed it
    model = preference(policy, reference, cfg)
    g = torch.Generator().manual_seed(2)
    ids = {k: torch.randint(1, 400, (2, 10), generator=g) for k in ("chosen_ids", "rejected_ids")}
    ones = torch.ones(2, 10, dtype=torch.long)
    mask = torch.zeros(2, 10, dtype=torch.long)
    mask[:, 5:] = 1
    batch = {**ids, "chosen_attention": ones, "rejected_attention": ones, "chosen_mask": mask, "rejected_mask": mask}
    objective, reported = recipe.loss(model, batch)
    both = torch.cat([batch["chosen_ids"], batch["rejected_ids"]])
    aux = sum(policy(input_ids=row[None]).aux_loss for row in both) / len(both)  # each answer balanced alone
    pair_mean = objective - 10.0 * aux
    scores = [preference._scores(m, both, torch.cat([ones, ones]), torch.cat([mask, mask]))
              for m in (policy, reference)]
    expected, _ = dpo_loss.pair_losses("sigmoid", cfg.beta, scores[0], scores[1])
    assert pair_mean.item() == pytest.approx(expected.mean().item(), rel=1e-5)
    assert means_of({k: v.item() for k, v in reported.items()}, 2)["aux_loss"] == pytest.approx(aux.item(), rel=1e-6)


@pytest.mark.slow
def test_a_moe_fine_tune_logs_aux_loss_and_its_coefficient_counts(tmp_path, chat):
    """causal_lm on a Qwen3-MoE saved with the chat fixture's tokenizer (its config's coefficient 0.01), one process,
    3 steps, as it is and with --router_aux_loss_coef 10: metrics.jsonl carries aux_loss and each layer's expert load
    on every step, and the run at 10 has a loss larger by about (10 - 0.01) x aux_loss at step 1 (the same weights and
    batch: only the coefficient differs)."""
    from transformers import AutoTokenizer

    folder, data = chat
    model_dir = tmp_path / "moe"
    moe("qwen3_moe", 0.01).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(folder).save_pretrained(model_dir)
    runs = {}
    for coefficient, flags in ((10.0, ("--router_aux_loss_coef", "10")), (0.01, ())):
        runs[coefficient] = launch(tmp_path / f"run_{coefficient}", "--recipe", "causal_lm", "--model_name_or_path",
                                   str(model_dir), "--data", str(data), "--chat_template", "chatml",
                                   "--max_steps", "3", "--eval_every", "0", "--batch_size", "4",
                                   "--seq_len", "64", *flags).check()
    high, low = ([json.loads(line) for line in (runs[c].output_dir / "metrics.jsonl").read_text().splitlines()]
                 for c in (10.0, 0.01))
    assert all("aux_loss" in m and m["aux_loss"] > 0 for m in high + low)
    assert all(1.0 <= m[f"expert_load/layer_{i}"] <= 4.0 for m in high + low for i in range(2))
    assert high[0]["aux_loss"] == pytest.approx(low[0]["aux_loss"], rel=1e-6)
    assert high[0]["loss"] - low[0]["loss"] == pytest.approx((10.0 - 0.01) * high[0]["aux_loss"], rel=1e-4)


def test_the_coefficient_flag_is_refused_for_a_model_without_a_router(check_only, chat, tmp_path):
    run = check_only(tmp_path / "out", "--recipe", "causal_lm", "--model_name_or_path", str(chat[0]), "--tokenizer",
                     "saved", "--data", str(chat[1]), "--chat_template", "chatml", "--router_aux_loss_coef", "0.1",
                     "--dry_run")
    assert_refused(run, "--router_aux_loss_coef 0.1: Qwen2ForCausalLM has no router with a balancing loss")
