"""recipes/causal_lm.py with a witness on every rank that the frozen parameters never change (tests/test_lora.py).

At its first micro-batch each rank copies the part of every frozen parameter that it holds (a ZeRO-3 partition, an
FSDP2 shard, the whole tensor under DDP and ZeRO-1/2); at every later one it compares them bit for bit and writes
what it compared, and which differed, to --probe_dir/rank_<r>.json. Under QLoRA (--load_in_4bit, --load_in_8bit) it
also witnesses each quantised layer's weight as the layer computes with it (gathered, dequantised from its packed
bytes and quantisation constants): its checksum at the first call, and the layers whose weight differed at a later
call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from trainkit.recipes import load_recipe

causal_lm = load_recipe("causal_lm")
build_datasets, loss_weight, eval_metrics = causal_lm.build_datasets, causal_lm.loss_weight, causal_lm.eval_metrics
tokens_per_sample, export, preview = causal_lm.tokens_per_sample, causal_lm.export, causal_lm.preview
generate, summary = causal_lm.generate, causal_lm.summary


@dataclass(kw_only=True, slots=True)
class Config(causal_lm.Config):
    probe_dir: str = ""  # where each rank writes what it compared

    may_change_on_resume = causal_lm.Config.may_change_on_resume | {"probe_dir"}  # a resumed run writes its own


_probe: dict = {"dir": None, "first": None, "calls": 0, "dequantised": {}, "moved": set()}


def build_model(cfg: Config) -> torch.nn.Module:
    _probe["dir"] = Path(cfg.probe_dir) if cfg.probe_dir else None
    model = causal_lm.build_model(cfg)
    if cfg.load_in_4bit or cfg.load_in_8bit:
        from bitsandbytes.nn import Linear4bit, Linear8bitLt

        for name, module in model.named_modules():
            if isinstance(module, Linear4bit | Linear8bitLt):  # after its forward: gathered under ZeRO-3 and FSDP2
                module.register_forward_hook(lambda m, args, out, name=name: _witness(name, m))
    return model


def _witness(name: str, layer: torch.nn.Module) -> None:
    from bitsandbytes.functional import dequantize_4bit, int8_vectorwise_dequant

    if not torch.is_grad_enabled():  # generation and evaluation: witnessed by the training steps after them
        return
    if layer.weight.dtype == torch.int8:  # the row scales move from the weight to the layer's state at its first call
        weight = int8_vectorwise_dequant(layer.weight.data, layer.state.SCB).double()
    else:
        weight = dequantize_4bit(layer.weight.data, layer.weight.quant_state).double()
    first = _probe["dequantised"].setdefault(name, weight)
    if first is not weight and not torch.equal(first, weight):
        _probe["moved"].add(name)


def _held(param: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this rank holds."""
    if getattr(param, "ds_tensor", None) is not None:  # ZeRO-3: the partition (the parameter itself is empty)
        return param.ds_tensor
    return param.to_local() if hasattr(param, "to_local") else param.data  # FSDP2's DTensor: the shard


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: a 4-bit base stored in a float dtype (for ZeRO-3 and FSDP2 to shard) holds packed bytes
    that read as NaN here and there, which torch.equal never finds equal."""
    return tensor.detach().contiguous().view(torch.uint8)


def loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    frozen = {name: _held(p) for name, p in model.named_parameters() if not p.requires_grad}
    if _probe["first"] is None:
        _probe["first"] = {name: held.detach().clone() for name, held in frozen.items()}
    _probe["calls"] += 1
    changed = [name for name, held in frozen.items() if not torch.equal(_bits(held), _bits(_probe["first"][name]))]
    if _probe["dir"] is not None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        _probe["dir"].mkdir(parents=True, exist_ok=True)
        (_probe["dir"] / f"rank_{rank}.json").write_text(json.dumps({
            "calls": _probe["calls"], "tensors": len(frozen), "elements": sum(h.numel() for h in frozen.values()),
            "changed": changed, "moved": sorted(_probe["moved"]),
            "dequantised": {name: [w.sum().item(), w.square().sum().item(), w.numel()]
                            for name, w in _probe["dequantised"].items()}}))
    return causal_lm.loss(model, batch)
