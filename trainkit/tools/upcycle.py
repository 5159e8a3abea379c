"""Make a mixture of experts from a dense model (sparse upcycling, Komatsuzaki et al. 2022, arXiv:2212.05055): every
expert of a layer starts as a copy of that layer's MLP and the router at random, so the mixture computes what the
dense model computed until training pulls its experts apart.

    python -m trainkit.tools.upcycle runs/tiny_transformer/final /tmp/moe --experts 8 --top_k 2

The dense model is a Llama (or a Mistral without a sliding window: the same layout); the mixture is a Mixtral built
from a config with its sizes (transformers' MixtralForCausalLM: Llama's attention, a router and fused experts for the
MLP), the dense model's attention, norms and embeddings, and its tokenizer beside it. The router's top-k weights are
normalised to sum to 1, so identical experts give the dense MLP's output whichever the router picks. The config asks
for the router's logits: the fine-tuning recipes then add its balancing loss (--router_aux_loss_coef, 0.01 here as
in Mixtral's own config) and log the expert load (docs/recipes.md, "Mixtures of experts").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainkit.launch.library_noise import silence_library_noise

DENSE = ("llama", "mistral")


def upcycled(dense, experts: int, top_k: int, seed: int = 0):
    """The Mixtral whose every expert is `dense`'s MLP of the same layer, routing top_k of `experts`."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    c = dense.config
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
            "rope_parameters", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
    config = MixtralConfig(**{key: getattr(c, key) for key in keys}, num_local_experts=experts,
                           num_experts_per_tok=top_k, output_router_logits=True, router_aux_loss_coef=0.01)
    torch.manual_seed(seed)  # the router's initial weights
    moe = MixtralForCausalLM(config)
    state = moe.state_dict()
    for name, tensor in dense.state_dict().items():
        if ".mlp." not in name:
            state[name].copy_(tensor)
    for i, layer in enumerate(dense.model.layers):
        mlp, experts_of = layer.mlp, moe.model.layers[i].mlp.experts
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # Mixtral's fused layout: gate rows, then up
        experts_of.gate_up_proj.data.copy_(gate_up.expand_as(experts_of.gate_up_proj))
        experts_of.down_proj.data.copy_(mlp.down_proj.weight.expand_as(experts_of.down_proj))
    return moe


def problem(config, experts: int, top_k: int) -> str | None:
    """Why the dense model cannot be upcycled, or None."""
    if config.model_type not in DENSE:
        return (f"a {config.model_type} model: the upcycled mixture is a Mixtral, whose attention is Llama's; pass a "
                f"{' or '.join(DENSE)} model")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "a model with biases in its attention or MLP: Mixtral has none to copy them into"
    if getattr(config, "sliding_window", None):
        return "a sliding-window Mistral: the upcycled Mixtral would attend over the whole context"
    if not 1 <= top_k <= experts:
        return f"--top_k {top_k} of --experts {experts}: pick between 1 and the number of experts"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainkit.tools.upcycle", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dense", type=Path, help="the dense model's folder (a run's final/)")
    parser.add_argument("output", type=Path, help="where the mixture and the tokenizer are saved")
    parser.add_argument("--experts", type=int, default=8, help="experts per layer (default 8)")
    parser.add_argument("--top_k", type=int, default=2, help="experts each token is routed to (default 2)")
    args = parser.parse_args(argv)
    silence_library_noise()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not (args.dense / "config.json").is_file():
        print(f"error: {args.dense} holds no model (no config.json): pass a run's final/", file=sys.stderr)
        return 2
    if args.output.exists() and any(args.output.iterdir()):
        print(f"error: {args.output} is not empty: pass a new folder", file=sys.stderr)
        return 2
    if (why := problem(AutoConfig.from_pretrained(args.dense), args.experts, args.top_k)) is not None:
        print(f"error: {args.dense} cannot be upcycled: {why}", file=sys.stderr)
        return 2
    moe = upcycled(AutoModelForCausalLM.from_pretrained(args.dense), args.experts, args.top_k)
    moe.save_pretrained(args.output)
    AutoTokenizer.from_pretrained(args.dense).save_pretrained(args.output)
    total = sum(p.numel() for p in moe.parameters())
    print(f"{args.output}: a Mixtral of {total:,} parameters, {args.experts} experts per layer (each a copy of the "
          f"dense MLP), top {args.top_k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
