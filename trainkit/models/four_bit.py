"""QLoRA's 4-bit base and distill's 4-bit teacher through bitsandbytes (--load_in_4bit, --teacher_load_in_4bit;
trainkit/models/finetune.py loads them): from_pretrained's quantisation settings per strategy, the base kept in the
layout it was quantised to, what it holds (for the estimate and state_bytes), which of a state dict's entries are its
constants (left out of checkpoints: strategies/dcp_format.py), and final/'s merge into the dequantised base.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn


def load_args(cfg: Any, dtype: torch.dtype) -> dict:
    """from_pretrained's arguments for QLoRA's 4-bit base (NF4 with double quantisation, as the QLoRA paper), none
    without --load_in_4bit. The compute dtype is the base's (--model_dtype; the checkpoint's under auto, fp32 when it
    has none). The packed 4-bit weights are stored as uint8 where each rank holds them whole (one process, DDP,
    ZeRO-1/2) and in the compute dtype where ZeRO-3 or FSDP2 shard them: both shard floating-point tensors, and FSDP2
    over uint8 storage trains silently wrong (accelerate #3983). The base goes to this rank's device, except under
    ZeRO-3's zero.Init, which places it itself (transformers refuses a device_map there)."""
    if not cfg.load_in_4bit:
        return {}
    from accelerate.state import AcceleratorState
    from transformers import BitsAndBytesConfig
    from transformers.integrations import is_deepspeed_zero3_enabled

    state = AcceleratorState() if AcceleratorState._shared_state else None
    sharded = state is not None and (state.distributed_type.value == "FSDP" or state.distributed_type.value ==
                                     "DEEPSPEED" and state.deepspeed_plugin.zero_stage == 3)
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=dtype,
                                bnb_4bit_quant_storage=dtype if sharded else torch.uint8)
    if is_deepspeed_zero3_enabled():
        return {"quantization_config": config}
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else "cpu"
    return {"quantization_config": config, "device_map": {"": device}}


NF4_BLOCK, NESTED_BLOCK = 64, 256  # bitsandbytes' defaults: weights per absmax, absmaxes per absmax of their own


def constant_bytes(numel: int) -> int:
    """The quantisation constants of one 4-bit weight of `numel` elements, which every rank holds whole (also where
    the packed weight is sharded): its blocks' absmax in 8 bits, their own fp32 absmax per NESTED_BLOCK, the two
    code tables (16 and 256 fp32) and the offset."""
    blocks = -(-numel // NF4_BLOCK)
    return blocks + 4 * -(-blocks // NESTED_BLOCK) + 4 * (16 + 256 + 1)


def weights_of(model: nn.Module) -> set[int]:
    """The ids of the frozen weights held in 4 bits: those of the linear layers of each transformers model inside
    `model` loaded in 4 bits (is_loaded_in_4bit, which finetune.build sets on its meta-device build too: QLoRA's
    base, distill's --teacher_load_in_4bit), but for the ones transformers keeps whole (get_keys_to_not_convert: the
    output head, tied weights). A model without one imports nothing (a plain module's run never imports
    transformers: tests/test_runs.py)."""
    bases = [module for module in model.modules() if getattr(module, "is_loaded_in_4bit", False) is True]
    if not bases:
        return set()
    from transformers.quantizers.base import get_keys_to_not_convert

    found = set()
    for base in bases:
        kept = tuple(get_keys_to_not_convert(base))
        found |= {id(module.weight) for name, module in base.named_modules()
                  if type(module) is nn.Linear and not module.weight.requires_grad
                  and not any(key in name.replace(".base_layer", "") for key in kept)}
    return found


# The entries a bitsandbytes 4-bit layer writes into a state dict beside its weight (<name>.weight.absmax, ...,
# <name>.weight.quant_state.bitsandbytes__nf4): the frozen base's, which build_model quantises again in every launch
QUANT_STATE_ENTRIES = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state")


def is_constant(key: str) -> bool:
    """Whether a state dict's key is one of a 4-bit weight's quantisation constants (QUANT_STATE_ENTRIES)."""
    return ".weight." in key and key.rsplit(".weight.", 1)[1].split(".")[0] in QUANT_STATE_ENTRIES


def constant_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The quantisation constants of the model's 4-bit layers (each layer holds them whole, also where its packed
    weight is sharded): absmax, the code table, and under double quantisation the absmaxes' own."""
    tensors = []
    for module in model.modules():
        state = getattr(module, "quant_state", None) or getattr(getattr(module, "weight", None), "quant_state", None)
        for part in [state, getattr(state, "state2", None)] if state is not None else []:
            tensors += [t for t in (getattr(part, "absmax", None), getattr(part, "code", None),
                                    getattr(part, "offset", None)) if isinstance(t, torch.Tensor)]
    return tensors


def kept_as_quantised(model: nn.Module) -> nn.Module:
    """The 4-bit base held in the layout it was quantised to. bitsandbytes repacks a `Linear4bit` the first time it
    computes without gradients on a CPU with AVX512-BF16 (an evaluation, a generation): its constants rounded to bf16
    and the weight re-laid, after which the training forward reads other numbers (3.1e-3 apart in the logits), so an
    evaluation in the middle of a run would change every later step. The fast path is switched off per layer."""
    from bitsandbytes.nn import Linear4bit

    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False
    return model


def merged_into_dequantised(trained: nn.Module, auto_class: Any, path: str, adapter: str, cfg: Any,
                            dtype: torch.dtype, **kwargs: Any) -> nn.Module:
    """QLoRA's final/: the base quantised again from its folder as the run quantised it (NF4 is a function of the
    weights alone), dequantised to `dtype` (transformers' dequantize), and the adapters merged into it (peft's
    merge_and_unload). The model that trained, to the merge's rounding; the full-precision base with the adapters would
    be another one (its logits 0.06 apart on the tests' Qwen2: the adapters learned to correct the 4-bit base)."""
    from peft import PeftModel

    config = copy.deepcopy(trained.get_base_model().config)  # the trained head's size (a reward model's 1 label)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    base = auto_class.from_pretrained(path, config=config, dtype=dtype, **load_args(cfg, dtype), **kwargs)
    plain = base.dequantize(dtype=dtype)
    return PeftModel.from_pretrained(plain, adapter).merge_and_unload()
