"""Pipeline stages of transformers decoders: where the layouts the runner knows are cut, and each stage's part of the
model's forward, so that a recipe of a transformers causal LM trains under --pipeline_stages with three lines
(recipes/tiny_transformer.py and recipes/causal_lm.py: pipeline_layers, pipeline_stage, pipeline_loss from here).

    the Llama family   (llama, mistral, qwen2, qwen3)  model.embed_tokens, model.layers, model.norm, model.rotary_emb,
                                                      lm_head
    GPT-NeoX           (gpt_neox: Pythia)              gpt_neox.embed_in, .emb_dropout, .layers, .final_layer_norm,
                                                      .rotary_emb, lm_head
    GPT-2              (gpt2)                          transformer.wte, .wpe, .drop, .h, .ln_f, lm_head

Each stage repeats its model class's forward (transformers 5: LlamaModel.forward and its copies, GPTNeoXModel.forward,
GPT2Model.forward) for a range of layers, the first stage from the token ids, the last to the logits. A stage holds
the model's own submodules, so a checkpoint and final/ keep the model's parameter names, and tied input and output
embeddings stay one parameter that the first and last stage share (the pipeline sums its two gradients). Another
architecture is refused before anything is built, naming its class and what a recipe declares instead: an
architecture whose forward differs (Gemma scales its embeddings, Phi-3 fuses its projections) would otherwise train
a different model without a word.
"""

from __future__ import annotations

import torch

from trainkit.errors import ConfigError, Problem

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
KNOWN = (*LLAMA_FAMILY, "gpt_neox", "gpt2")


def layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers, in order: stages are cut between them."""
    model = _decoder(model)
    kind = model.config.model_type
    return model.model.layers if kind in LLAMA_FAMILY else model.gpt_neox.layers if kind == "gpt_neox" \
        else model.transformer.h


def stage(model: torch.nn.Module, layer_range: range, first: bool, last: bool) -> torch.nn.Module:
    """The stage that runs layers `layer_range` (and the embeddings if first, the head if last)."""
    model = _decoder(model)
    kind = model.config.model_type
    return (LlamaStage if kind in LLAMA_FAMILY else NeoXStage if kind == "gpt_neox" else GPT2Stage)(
        model, layer_range, first, last)


def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What the model's own loss computes from the last stage's logits: the mean next-token loss over the labels
    that are not -100 (transformers' ForCausalLMLoss; padding and prompts carry -100)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1])


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model (inside peft's wrapper, whose LoRA layers live in the model's own modules), or a
    ConfigError naming what the runner cannot cut."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    kind = getattr(getattr(inner, "config", None), "model_type", None)
    if kind not in KNOWN:
        raise ConfigError([Problem(
            f"{type(inner).__name__} is not a decoder layout the runner can cut into pipeline stages (it knows "
            f"model_type {', '.join(KNOWN)})", "--pipeline_stages",
            "train it without --pipeline_stages (fsdp.yaml or deepspeed_zero3.yaml shard a model that does not fit), "
            "or declare pipeline_layers, pipeline_stage and pipeline_loss in a recipe of your own "
            "(recipes/README.md; trainkit/decoder_stages.py shows three)")])
    return inner


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


class LlamaStage(torch.nn.Module):
    """Token ids (first stage) or hidden states -> hidden states, or logits on the last stage: LlamaModel.forward's
    steps (and Mistral's, Qwen2's, Qwen3's) for a range of layers, each layer with its kind of mask (sliding-window
    layers: the config's layer_types, or Mistral's sliding_window)."""

    def __init__(self, model: torch.nn.Module, layer_range: range, first: bool, last: bool) -> None:
        super().__init__()
        body, config = model.model, model.config
        self.config = config
        self.embed_tokens = body.embed_tokens if first else None
        self.rotary_emb = body.rotary_emb
        self.layers = torch.nn.ModuleList(body.layers[i] for i in layer_range)
        kinds = getattr(config, "layer_types", None) or [
            "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
        ] * config.num_hidden_layers
        self.kinds = [kinds[i] for i in layer_range]
        self.norm = body.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        position_ids = _positions(hidden)
        make = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        masks = {kind: make[kind](config=self.config, inputs_embeds=hidden, attention_mask=None,
                                  past_key_values=None, position_ids=position_ids) for kind in set(self.kinds)}
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        for layer, kind in zip(self.layers, self.kinds, strict=True):
            hidden = layer(hidden, attention_mask=masks[kind], position_embeddings=position_embeddings,
                           position_ids=position_ids)
        return self.lm_head(self.norm(hidden)) if self.lm_head is not None else hidden


class NeoXStage(torch.nn.Module):
    """GPTNeoXModel.forward's steps for a range of layers."""

    def __init__(self, model: torch.nn.Module, layer_range: range, first: bool, last: bool) -> None:
        super().__init__()
        body = model.gpt_neox
        self.config = model.config
        self.embed_in, self.emb_dropout = (body.embed_in, body.emb_dropout) if first else (None, None)
        self.rotary_emb = body.rotary_emb
        self.layers = torch.nn.ModuleList(body.layers[i] for i in layer_range)
        self.final_layer_norm = body.final_layer_norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        hidden = self.emb_dropout(self.embed_in(x)) if self.embed_in is not None else x
        position_ids = _positions(hidden)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, past_key_values=None,
                                  position_ids=position_ids)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=position_ids,
                           position_embeddings=position_embeddings)
        return self.lm_head(self.final_layer_norm(hidden)) if self.lm_head is not None else hidden


class GPT2Stage(torch.nn.Module):
    """GPT2Model.forward's steps for a range of blocks."""

    def __init__(self, model: torch.nn.Module, layer_range: range, first: bool, last: bool) -> None:
        super().__init__()
        body = model.transformer
        self.config = model.config
        self.wte, self.wpe, self.drop = (body.wte, body.wpe, body.drop) if first else (None, None, None)
        self.h = torch.nn.ModuleList(body.h[i] for i in layer_range)
        self.ln_f = body.ln_f if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        position_ids = _positions(x)
        hidden = self.drop(self.wte(x) + self.wpe(position_ids)) if self.wte is not None else x
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                  past_key_values=None, position_ids=position_ids)
        for block in self.h:
            hidden = block(hidden, None, mask, position_ids=position_ids)
        return self.lm_head(self.ln_f(hidden)) if self.lm_head is not None else hidden
