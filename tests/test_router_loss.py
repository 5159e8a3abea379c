"""A mixture of experts' balancing loss is kept (trainkit/losses/router.py): the causal_lm and dpo recipes add the
model's own aux_loss times its config's router_aux_loss_coef to their objective, as transformers' loss does when
given labels, whole or in chunks, and report it as aux_loss. Before, a coefficient of 10 and of 0.01 trained to the
same losses to every digit."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import transformers

from conftest import assert_refused, launch
from trainkit.losses import chunked_loss
from trainkit.recipes import load_recipe

# Four MoE families transformers builds from a config, none written for this project: fused experts (Qwen3-MoE,
# Mixtral, OLMoE) and a shared expert beside the routed ones (Qwen2-MoE).
SIZES = {"vocab_size": 400, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "output_router_logits": True, "pad_token_id": 0, "eos_token_id": 0}
MOE = {
    "qwen3_moe": lambda **c: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SIZES, **c, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8,
        num_key_value_heads=2)),
    "mixtral": lambda **c: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SIZES, **c, num_local_experts=4, num_experts_per_tok=2, num_key_value_heads=2)),
    "olmoe": lambda **c: transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        **SIZES, **c, num_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": lambda **c: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **SIZES, **c, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_key_value_heads=2)),
}


def moe(name: str, coefficient: float) -> torch.nn.Module:
    torch.manual_seed(0)
    return MOE[name](router_aux_loss_coef=coefficient)


@pytest.mark.parametrize("name", sorted(MOE))
@pytest.mark.parametrize("chunk_mib", [0.0, 0.002], ids=["whole", "chunks"])
def test_the_causal_lm_objective_is_transformers_own_loss_with_its_balancing_term(name, chunk_mib):
    """Plain text, every token learned: causal_lm's objective equals model(..., labels=ids).loss (the cross entropy
    + coefficient x aux_loss) to 1e-6, with the logits whole or 5 positions at a time; the reported aux_loss is the
    model's, summed over the rows; the coefficient changes the objective by exactly its difference x aux_loss."""
    recipe = load_recipe("causal_lm")
    ids = torch.randint(1, 400, (2, 12), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    objectives = {}
    for coefficient in (10.0, 0.01):
        model = chunked_loss.configure(moe(name, coefficient), chunk_mib)
        assert model.loss_chunk_tokens == (1 if chunk_mib else 0)  # one position a chunk: 22 chunks
        objective, reported = recipe.loss(model, batch)
        own = model(**batch, labels=ids)
        assert abs(objective.item() - own.loss.item()) <= 1e-6 * own.loss.item(), (objective, own.loss)
        assert reported["aux_loss"].item() == pytest.approx(2 * own.aux_loss.item(), rel=1e-6)
        objective.backward()  # the router's parameters get the balancing term's gradient
        router = next(p for n, p in model.named_parameters() if "gate.weight" in n and "gate_proj" not in n)
        assert router.grad is not None and router.grad.abs().sum() > 0
        objectives[coefficient] = (objective.item(), own.aux_loss.item())
        top_k, experts = model.config.num_experts_per_tok, own.router_logits[0].shape[-1]
        for i, logits in enumerate(own.router_logits):  # each layer's busiest expert, counted by hand
            counts = torch.bincount(torch.topk(logits, top_k).indices.flatten(), minlength=experts)
            expected = counts.max().item() / counts.sum().item() * experts
            assert reported[f"expert_load/layer_{i}"].item() == pytest.approx(2 * expected, rel=1e-6)
            assert 1.0 <= expected <= experts
    (high, aux), (low, _) = objectives[10.0], objectives[0.01]
    assert high - low == pytest.approx((10.0 - 0.01) * aux, rel=1e-5)


def test_a_dense_model_reports_no_aux_loss():
    """A model without experts: the loss is a plain scalar, as before (no aux_loss metric appears)."""
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{k: v for k, v in SIZES.items()
                                                                       if k != "output_router_logits"},
                                                                    num_key_value_heads=2))
    ids = torch.randint(1, 400, (2, 12))
    out = load_recipe("causal_lm").loss(chunked_loss.configure(model, 0), {"input_ids": ids,
                                                                            "attention_mask": torch.ones_like(ids)})
    assert torch.is_tensor(out) and out.dim() == 0


def test_the_dpo_objective_adds_the_policys_balancing_term(tmp_path):
    """dpo: the pair loss's mean + coefficient x the policy forward's aux_loss (chosen and rejected in one forward);
    the reference pass adds nothing."""
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
    aux = policy(input_ids=both, attention_mask=torch.cat([ones, ones])).aux_loss
    pair_mean = objective - 10.0 * aux
    scores = [preference._scores(m, both, torch.cat([ones, ones]), torch.cat([mask, mask]))
              for m in (policy, reference)]
    expected, _ = dpo_loss.pair_losses("sigmoid", cfg.beta, scores[0], scores[1])
    assert pair_mean.item() == pytest.approx(expected.mean().item(), rel=1e-5)
    assert reported["aux_loss"].item() == pytest.approx(2 * aux.item(), rel=1e-6)


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
    assert_refused(run, "--router_aux_loss_coef 0.1: Qwen2ForCausalLM has no router")
