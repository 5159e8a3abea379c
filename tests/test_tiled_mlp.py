"""--tiled_mlp (trainkit/models/tiled_mlp.py): each decoder layer's MLP a chunk of `hidden` positions at a time, the
numbers
those of the whole MLP, its intermediates never held for the whole sequence."""

from __future__ import annotations

import pytest
import torch

from conftest import LM, PARITY_BOUND, architecture, launch, max_rel_diff
from trainkit.errors import ConfigError
from trainkit.models import tiled_mlp

ARCHITECTURES = ["llama", "qwen2", "mistral", "gpt2", "gpt_neox", "phi3", "gemma", "olmo", "granite", "starcoder2"]


def loss_and_grads(model, ids):
    model.zero_grad()
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_the_tiled_mlp_computes_the_whole_ones_loss_and_gradients(name):
    """Two rows of 100 positions in chunks of 32 (the models' hidden size): the loss within 1e-6 and every
    parameter's gradient within 1e-6 of its norm, gated MLPs and GPT's, GPT-2's Conv1D, Phi-3's fused gate-up."""
    torch.manual_seed(0)
    model = architecture(name).eval()  # eval: GPT-2's default dropout would draw other masks in each run
    ids = torch.randint(0, 400, (2, 100))
    whole = loss_and_grads(model, ids)
    tiled = loss_and_grads(tiled_mlp.tile(model), ids)
    assert abs(tiled[0] - whole[0]) <= 1e-6 * whole[0]
    for param, grad in whole[1].items():
        assert (tiled[1][param] - grad).norm() <= 1e-6 * grad.norm() + 1e-9, param


def test_a_layer_without_an_mlp_module_is_refused():
    with pytest.raises(ConfigError) as refused:
        tiled_mlp.tile(architecture("opt"))
    assert "OPTDecoderLayer has no `mlp` module to compute in chunks" in str(refused.value)


@pytest.mark.slow
def test_the_estimate_counts_no_mlp_intermediates():
    """Measured on a Llama (hidden 64, ffn 256, 4 layers, vocabulary 1,024, 2 x 2,048 tokens): the peak falls by the
    MLP's 4 x ffn elements a token and layer (156 -> 92 MiB), and the estimate is within 10% of both."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainkit.estimate import ModelShape, activation_bytes, decoder_shape, measured_activations
    from trainkit.losses import chunked_loss

    peaks = {}
    for tiled in (False, True):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=256,
                                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                             tie_word_embeddings=False, attn_implementation="sdpa"))
        model = tiled_mlp.tile(model) if tiled else model
        ids = torch.randint(0, 1024, (2, 2048))
        _, peak = measured_activations(
            model, lambda m=model, x=ids: chunked_loss.next_token_losses(m, input_ids=x, use_cache=False)[0].mean())
        names, params = zip(*model.named_parameters(), strict=True)
        shape = ModelShape(tuple(p.numel() for p in params), 64, 4, names, (), decoder_shape(model))
        estimated = activation_bytes(shape, 2, 2048, "no", False, tiled_mlp=tiled)
        assert abs(estimated - peak) <= 0.1 * peak, (tiled, estimated, peak)
        peaks[tiled] = peak
    assert peaks[True] <= 0.65 * peaks[False]


# The tiny transformer at hidden 64 with rows of 160 tokens: three chunks a row
LONG_ROWS = [*LM, "--seq_len", "160", "--batch_size", "8"]


@pytest.fixture(scope="module")
def whole_mlp(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("whole_mlp") / "out", *LONG_ROWS).check()


def test_a_tiled_run_trains_the_whole_mlps_curve(whole_mlp, tmp_path):
    tiled = launch(tmp_path / "out", *LONG_ROWS, "--tiled_mlp").check()
    assert tiled.resolved["tiled_mlp"] is True
    assert max_rel_diff(tiled.losses, whole_mlp.losses) <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("config", ["ddp", "fsdp", "deepspeed_zero3", "deepspeed_zero2_offload"])
def test_a_tiled_run_under_each_sharding_trains_the_one_process_curve(whole_mlp, tmp_path, config):
    """The MLP's weights used once per chunk and again in backward, inside each layer's FSDP2 unit and ZeRO-3's
    gathers, at the whole MLP's one-process curve."""
    tiled = launch(tmp_path / "out", *LONG_ROWS[:-1], "4", "--tiled_mlp", config=config).check()
    assert max_rel_diff(tiled.losses, whole_mlp.losses) <= PARITY_BOUND
