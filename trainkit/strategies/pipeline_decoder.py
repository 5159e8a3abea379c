"""Pipeline stages of transformers decoders, found from the layout rather than from a list of names, so that a recipe
of a transformers causal LM trains under --pipeline_stages with three lines (recipes/tiny_transformer.py and
recipes/causal_lm.py: pipeline_layers, pipeline_stage and pipeline_loss from here).

The layout: input embeddings, a ModuleList of decoder layers (the ModuleList whose items are one class and hold the
most parameters), what the model's forward runs before its loop over them (position embeddings, a projection in) and
after it (a final norm, a projection out), and the output head. Which is before and which after is read from where
the forward of the module holding the layers names each of its modules, before or after the loop (`self.layers`,
`self.h`, ...): Llama, Mistral, Qwen2/3, Gemma, Phi-3, OLMo, Granite, StarCoder2, GPT-NeoX, GPT-2 and OPT have one
such layout (tests/test_pipeline.py cuts each).

A stage runs the model's own forward (so whatever the architecture does around its layers, Gemma's scaled embeddings,
Granite's multipliers and logit scaling, OPT's learned positions, is done as the model does it) with the layers of
other stages skipped: before its range the hidden states it receives stand in for theirs, and after its range the
forward stops with the hidden states to send on. A stage holds only its own modules (the first the embeddings and
what runs before the loop, the last what runs after it and the head; modules with buffers and no weights, such as
rotary embeddings, every stage), so a checkpoint and final/ keep the model's parameter names, a tied input and output
embedding stays one parameter that the first and last stage share (the pipeline sums its two gradients), and the
weights of other stages can be released (trainkit/strategies/pipeline_stages.py): their modules are stood in for while a
later stage runs the forward. A model without this layout is refused before anything is built, naming its class.

A mixture of experts that balances its router (its config's output_router_logits) needs every layer's router logits
for the balance, and a stage holds some of the layers: each stage catches its layers' router logits (from the modules
the model declares to record them, transformers' `_can_record_outputs`) and passes them on beside the hidden states,
with those it received; the last stage's loss (`Balanced`) adds the balance as trainkit/losses/router.py does in one
process, and the gradients of the router logits go back through the stages with the hidden states'.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from trainkit.errors import ConfigError, Problem
from trainkit.losses import router


def layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers, in order: stages are cut between them."""
    holder, name = _layout(_decoder(model))
    return getattr(holder, name)


def stage(model: torch.nn.Module, layer_range: range, first: bool, last: bool) -> torch.nn.Module:
    """The stage that runs layers `layer_range` (and the embeddings if first, the head if last)."""
    return DecoderStage(_decoder(model), layer_range, first, last)


def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What the model's own loss computes from the last stage's logits: the mean next-token loss over the labels
    that are not -100 (transformers' ForCausalLMLoss; padding and prompts carry -100)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1])


class Balanced:
    """A mixture of experts' pipeline loss: `loss_fn` on the last stage's logits plus the router's balance over every
    layer's router logits, which the stages passed on beside the hidden states (DecoderStage), as
    trainkit/losses/router.py's `balanced` adds it in one process: each sequence's balance with the model's own
    function, weighed by its learned tokens. The target is the labels and then the balance mask (the rows' attention
    mask: padding is routed too, and left out), side by side (strategies/pipeline.py's _cut); what the balance
    reports of each call is appended to `reported`."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], model: torch.nn.Module,
                 reported: list[dict[str, torch.Tensor]]) -> None:
        self.loss_fn, self.model, self.reported = loss_fn, model, reported
        self.layers = len(router.routers(model, model))

    def __call__(self, output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        logits, routed = output
        rows, length = logits.shape[:2]
        labels, mask = target[:, :length], target[:, length:]
        per_layer = tuple(part.reshape(rows * length, -1) for part in routed.chunk(self.layers))
        learned = (labels[:, 1:] != -100).sum(dim=1)  # what each row weighs in loss_fn's mean
        total, reported = router.balanced(self.model, self.loss_fn(logits, labels), per_layer, mask, learned)
        self.reported.append({name: value.detach().float() for name, value in reported.items()})
        return total


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model (inside peft's wrapper, whose LoRA layers live in the model's own modules), or a
    ConfigError naming a model without the layout."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        _layout(inner)
    except LookupError as e:
        raise ConfigError([Problem(
            f"{type(inner).__name__} is not a decoder layout the runner can cut into pipeline stages ({e})",
            "--pipeline_stages",
            "train it without --pipeline_stages (fsdp.yaml or deepspeed_zero3.yaml shard a model that does not fit), "
            "or declare pipeline_layers, pipeline_stage and pipeline_loss in a recipe of your own "
            "(recipes/README.md; trainkit/strategies/pipeline_decoder.py shows how)")]) from None
    if router.balances(inner) and not router.routers(inner, inner):
        raise ConfigError([Problem(
            f"{type(inner).__name__} computes its router's balancing loss (output_router_logits) from every layer's "
            "router logits, and declares no module that outputs them (transformers' _can_record_outputs), which "
            "each stage would pass on", "--pipeline_stages",
            "train it without --pipeline_stages: deepspeed_zero3.yaml and fsdp.yaml shard a mixture of experts")])
    return inner


def _layout(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """(the module holding the decoder layers, the name it holds them under); LookupError says what is missing."""
    if not (hasattr(model, "get_input_embeddings") and hasattr(model, "get_output_embeddings")
            and model.get_input_embeddings() is not None and model.get_output_embeddings() is not None):
        raise LookupError("it has no input embeddings and output head (a transformers causal LM has both)")
    lists = [(sum(p.numel() for p in module.parameters()), holder, name)
             for holder in model.modules() for name, module in holder.named_children()
             if isinstance(module, torch.nn.ModuleList) and len(module) > 0
             and len({type(layer) for layer in module}) == 1]
    if not lists:
        raise LookupError("no ModuleList of decoder layers")
    _, holder, name = max(lists, key=lambda entry: entry[0])
    if _loop(holder, name) is None:
        raise LookupError(f"{type(holder).__name__}.forward does not loop over self.{name}")
    return holder, name


def _loop(holder: torch.nn.Module, name: str) -> tuple[str, int, int] | None:
    """(the source of holder's forward, where its loop over the layers starts, where the loop's body ends), or None."""
    try:
        source = inspect.getsource(type(holder).forward)
    except (OSError, TypeError):
        return None
    loop = re.search(rf"\n(\s*)for [^\n]*self\.{name}\b[^\n]*:\n", source)
    if loop is None:
        return None
    indent = len(loop.group(1))
    after = re.search(rf"\n {{0,{indent}}}\S", source[loop.end():])
    return source, loop.start(), loop.end() + (after.start() if after else len(source) - loop.end())


def _sides(model: torch.nn.Module) -> tuple[list[torch.nn.Module], list[torch.nn.Module], list[torch.nn.Module]]:
    """(what the first stage holds besides its layers, what the last stage holds, what every stage holds): the
    modules with weights that the forward uses before the loop over the layers (with the input embeddings) and after
    it (with the head), and those with buffers only (rotary embeddings)."""
    holder, name = _layout(model)
    source, begin, end = _loop(holder, name)
    before: list[torch.nn.Module] = [model.get_input_embeddings()]
    after: list[torch.nn.Module] = [model.get_output_embeddings()]
    shared: list[torch.nn.Module] = []
    for child_name, child in holder.named_children():
        if child_name == name or child is model.get_input_embeddings():
            continue
        used = [m.start() for m in re.finditer(rf"self\.{child_name}\b", source)]
        if not any(True for _ in child.parameters()):
            shared += [child] if any(True for _ in child.buffers()) else []
        elif used and min(used) < begin:
            before.append(child)
        elif used and min(used) > end:
            after.append(child)
    return before, after, shared


class _Skipped(torch.nn.Module):
    """A layer of another stage, in the forward of this one: returns the hidden states this stage received (`stand_in`,
    before the stage's range) or what it was given; after the range it ends the forward (_Handoff)."""

    def __init__(self, layer: torch.nn.Module, stand_in: torch.Tensor | None, stop: bool) -> None:
        super().__init__()
        object.__setattr__(self, "layer", layer)  # not a submodule: its weights stay the other stage's
        self.stand_in, self.stop = stand_in, stop

    def __getattr__(self, name: str) -> Any:  # what a forward reads of a layer (its attention type) is the layer's
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "layer"), name)

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.stop:
            raise _Handoff(hidden)
        return self.stand_in if self.stand_in is not None else hidden


class _StoodIn(torch.nn.Module):
    """A module of the first stage that a later stage's forward still calls before its loop (OPT's learned positions):
    its result is replaced by the hidden states the stage received, so it computes nothing (a weightless stand-in
    that keeps the shapes: hidden states given, as they are, else a zero that adds to anything)."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        given = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if given is not None and given.is_floating_point() and given.dim() == 3:
            return given
        return torch.zeros((), device=given.device if given is not None else None)


class _Handoff(Exception):
    """Raised by the first layer after a stage's range, carrying the hidden states the stage sends on."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


class DecoderStage(torch.nn.Module):
    """Layers `layer_range` of a transformers decoder and, on the first and last stage, what runs before and after
    them: token ids (first stage) or hidden states in, hidden states or logits (last stage) out, by the model's own
    forward (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, layer_range: range, first: bool, last: bool) -> None:
        super().__init__()
        before, after, shared = _sides(model)
        self.layers = torch.nn.ModuleList(layers(model)[i] for i in layer_range)
        self.held = torch.nn.ModuleList([*(before if first else []), *(after if last else []), *shared])
        # the whole model's forward, not its weights; where its layers are, and what a later stage stands in for,
        # found now: a strategy then wraps this stage's modules (FSDP2's classes), and releases the others' weights
        object.__setattr__(self, "model", model)
        stood_in = [(parent, child_name) for parent in model.modules() for child_name, child in parent.named_children()
                    if any(child is module for module in before)]
        object.__setattr__(self, "found", (*_layout(model), stood_in))
        self.layer_range, self.first, self.last = layer_range, first, last
        self.config = model.config
        self.routes = router.balances(model)  # a mixture of experts that balances its router

    def forward(self, x: torch.Tensor, routed: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Hidden states (or, on the last stage, logits); for a balancing mixture of experts also the router logits of
        every layer so far, [layers x rows, length, experts]: those received (`routed`) and this stage's."""
        model = object.__getattribute__(self, "model")
        given = {"input_ids": x} if self.first else {"inputs_embeds": x}
        # the router logits of this stage's layers (the others' are skipped); the model's own balance would be over
        # these layers alone: the last stage's loss adds the whole one
        with self._only_this_stage(None if self.first else x), router.caught(model) as caught:
            try:
                output = model(**given, use_cache=False, **router.generating(model)).logits
            except _Handoff as handoff:
                output = handoff.hidden
        if not self.routes:
            return output
        # layer after layer in the first dimension: the gradient each stage sends back is then a contiguous slice of
        # the next stage's (torch's pipeline sends and receives contiguous tensors only)
        rows, length = x.shape[:2]
        mine = [logits.view(rows, length, -1) for logits in caught]
        return output, torch.cat([*([] if routed is None else [routed]), *mine])

    @contextmanager
    def _only_this_stage(self, received: torch.Tensor | None) -> Iterator[None]:
        """For the forward: the layers outside the range skipped (the received hidden states standing in for those
        before it), and, on a later stage, the first stage's modules stood in for."""
        holder, name, stood_in = object.__getattribute__(self, "found")
        whole = getattr(holder, name)
        a, b = self.layer_range.start, self.layer_range.stop
        standing = [*(_Skipped(whole[i], received, stop=False) for i in range(a)), *(whole[i] for i in range(a, b)),
                    *(_Skipped(whole[i], None, stop=not self.last) for i in range(b, len(whole)))]
        swapped = {(holder, name): torch.nn.ModuleList(standing)}
        if not self.first:
            swapped.update({place: _StoodIn() for place in stood_in})
        kept = {key: key[0]._modules[key[1]] for key in swapped}
        try:
            for (parent, child_name), module in swapped.items():
                parent._modules[child_name] = module
            yield
        finally:
            for (parent, child_name), module in kept.items():
                parent._modules[child_name] = module
