"""The loss in chunks (trainkit/losses/chunked_loss.py): the whole logits never held, the numbers those of the whole
loss.

In process: every architecture of the fine-tuning tests, LoRA and bf16 autocast, chunked against whole, the loss
and every parameter's gradient. Launched: the causal-LM recipe (chat data, packed) and the tiny transformer chunked
in one process and under the sharding configs, against the whole loss in one process. DPO's log-probabilities in
chunks: tests/test_preference.py.
"""

from __future__ import annotations

import pytest
import torch

from conftest import LM, PARITY_BOUND, architecture, launch, max_rel_diff
from trainkit.errors import ConfigError
from trainkit.losses import chunked_loss

ARCHITECTURES = ["llama", "qwen2", "mistral", "gpt2", "gpt_neox", "phi3", "gemma", "olmo", "granite", "starcoder2",
                 "opt"]


def losses_and_grads(model, ids, chunk, autocast=False):
    model.zero_grad()
    model.loss_chunk_tokens = chunk
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = chunked_loss.next_token_losses(model, True, input_ids=ids, use_cache=False)
        losses, guesses = out.losses, out.guess
        losses.mean().backward()
    return losses.detach(), guesses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(whole, chunked, bound=1e-6):
    assert ((chunked[0] - whole[0]).abs().max() / whole[0].abs().max()).item() <= bound
    assert torch.equal(chunked[1], whole[1])  # the top guesses (eval's token accuracy)
    assert whole[2].keys() == chunked[2].keys() and whole[2]
    for name, grad in whole[2].items():  # relative to the parameter's gradient as a whole; a key's bias has none in
        # exact arithmetic (softmax ignores a shift), and its 1e-12 of rounding is compared absolutely
        assert (chunked[2][name] - grad).norm() <= bound * grad.norm() + 1e-9, name


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_the_chunked_loss_and_its_gradients_are_the_whole_ones(name):
    """49 positions a row in chunks of 7 (rows cut mid-row): the per-token losses within 1e-6, the same top guesses,
    and every parameter's gradient within 1e-6 of its norm, on tied and untied heads, Granite's divided logits,
    Gemma's scaled embeddings, OPT's projection before its head."""
    torch.manual_seed(0)
    model = architecture(name).eval()  # eval: GPT-2's default dropout would draw other masks in each run
    ids = torch.randint(0, 400, (3, 50))
    assert_same(losses_and_grads(model, ids, 0), losses_and_grads(model, ids, 7))


def test_soft_capped_logits_lora_and_bf16_are_chunked_as_the_model_computes_them():
    """Gemma-2 caps its logits after the head (tanh); under LoRA only the adapters have gradients; under bf16
    autocast the head computes in bf16 and the loss in fp32, chunk by chunk as whole."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    gemma2 = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, final_logit_softcapping=0.5, attn_implementation="eager")).eval()
    ids = torch.randint(0, 400, (2, 40))
    assert_same(losses_and_grads(gemma2, ids, 0), losses_and_grads(gemma2, ids, 9))
    lora = get_peft_model(architecture("qwen2"), LoraConfig(r=4, target_modules="all-linear"))
    whole, chunked = losses_and_grads(lora, ids, 0), losses_and_grads(lora, ids, 9)
    assert all("lora_" in name for name in whole[2])
    assert_same(whole, chunked)
    assert_same(losses_and_grads(lora, ids, 0, autocast=True), losses_and_grads(lora, ids, 9, autocast=True), 1e-5)


def test_a_model_that_changes_its_logits_otherwise_is_refused():
    """A change after the head that chunked_loss.after_head does not know: refused with the fix, never trained."""
    from transformers import LlamaForCausalLM

    class Doubled(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    model = Doubled(architecture("llama").config)
    model.loss_chunk_tokens = 5
    with pytest.raises(ConfigError) as refused:
        chunked_loss.next_token_losses(model, input_ids=torch.randint(0, 400, (1, 20)))
    assert "Doubled changes its logits after its output head" in str(refused.value)
    assert "--loss_chunk_mib 0" in str(refused.value)


def test_the_chunk_is_the_positions_whose_logits_fit():
    assert chunked_loss.chunk_tokens(1024, 32000) == 8388  # 1 GiB of fp32 logits
    assert chunked_loss.chunk_tokens(1024, 128256) == 2092
    assert chunked_loss.chunk_tokens(0, 32000) == 0 and chunked_loss.chunk_tokens(1e-9, 32000) == 1


def test_a_negative_chunk_is_refused_with_the_fix(check_only, tmp_path):
    run = check_only(tmp_path / "out", "--recipe", "tiny_transformer", "--loss_chunk_mib", "-1", "--dry_run")
    assert run.returncode == 2, run.stderr
    assert "loss_chunk_mib must be >= 0, got -1.0" in run.stderr and "--loss_chunk_mib 1024" in run.stderr


# --- launched ---------------------------------------------------------------------------------------------------

# 0.01 MiB of logits at the chat fixture's vocabulary of 400: 6 positions a chunk
CHAT = ["--recipe", "causal_lm", "--tokenizer", "saved", "--chat_template", "chatml", "--packing", "--seq_len", "96",
        "--max_steps", "6", "--eval_every", "3", "--lr", "3e-3"]
CHUNKED = ["--loss_chunk_mib", "0.01"]


@pytest.fixture(scope="module")
def chat_whole(chat, tmp_path_factory):
    args = [*CHAT, "--model_name_or_path", str(chat[0]), "--data", str(chat[1])]
    return args, launch(tmp_path_factory.mktemp("whole") / "out", *args, "--batch_size", "8",
                        "--loss_chunk_mib", "0").check()


def test_a_chunked_run_trains_the_whole_loss_curve(chat_whole, tmp_path):
    """Packed chat rows (positions restart per example) in one process: the curve, the eval loss and the token
    accuracy of a chunked run are the whole loss's."""
    args, whole = chat_whole
    chunked = launch(tmp_path / "out", *args, "--batch_size", "8", *CHUNKED).check()
    assert chunked.resolved["loss_chunk_mib"] == 0.01
    assert max_rel_diff(chunked.losses, whole.losses) <= 1e-6, (chunked.losses, whole.losses)
    for name in ("eval_loss", "eval_token_accuracy"):
        assert chunked.metrics[-1][name] == pytest.approx(whole.metrics[-1][name], rel=1e-6), name


@pytest.mark.slow
@pytest.mark.parametrize("config, flags", [("ddp", []), ("deepspeed_zero3", []), ("fsdp", []),
                                           ("deepspeed_zero2_offload", ["--lora_r", "8"]), ("tp", [])])
def test_a_chunked_run_under_each_sharding_trains_the_one_process_curve(chat_whole, tmp_path, config, flags):
    """The head used once per chunk and again in backward: DDP's and ZeRO's gradient hooks, ZeRO-3's gathers and
    FSDP2's unsharded root, TP's whole head, each at the whole loss's one-process curve (LoRA against a whole LoRA
    run)."""
    args, whole = chat_whole
    if flags:
        whole = launch(tmp_path / "whole", *args, *flags, "--batch_size", "8", "--loss_chunk_mib", "0").check()
    micro = "8" if config == "tp" else "4"
    chunked = launch(tmp_path / "out", *args, *flags, "--batch_size", micro, *CHUNKED, config=config).check()
    assert max_rel_diff(chunked.losses, whole.losses) <= PARITY_BOUND, (chunked.losses, whole.losses)
    assert chunked.metrics[-1]["eval_loss"] == pytest.approx(whole.metrics[-1]["eval_loss"], rel=PARITY_BOUND)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["fsdp_offload", "deepspeed_zero3_offload"])
def test_the_tiny_transformer_chunked_under_offload_trains_the_one_process_curve(lm_reference, tmp_path, config):
    """The project's own model (tied embeddings) at 12 positions a chunk (0.05 MiB at vocabulary 1,024), offloaded."""
    chunked = launch(tmp_path / "out", *LM, "--batch_size", "4", "--loss_chunk_mib", "0.05", config=config).check()
    assert max_rel_diff(chunked.losses, lm_reference.losses) <= PARITY_BOUND

