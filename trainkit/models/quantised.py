"""A frozen base quantised by bitsandbytes: QLoRA's 4-bit NF4 base (--load_in_4bit), LLM.int8's 8-bit one
(--load_in_8bit) and distill's 4-bit teacher (--teacher_load_in_4bit); trainkit/models/finetune.py loads them.
from_pretrained's quantisation settings per strategy, the strategies that cannot hold an 8-bit base, the base kept
in the layout it was quantised to, what it holds (for the estimate and state_bytes), which of a state dict's entries
are its constants (left out of checkpoints: strategies/dcp_format.py), and final/'s merge into the dequantised base.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn

from trainkit.errors import Problem


def load_args(cfg: Any, dtype: torch.dtype) -> dict:
    """from_pretrained's arguments for a quantised base, none without --load_in_4bit or --load_in_8bit. 4 bits: NF4
    with double quantisation (as the QLoRA paper), computing in the base's dtype (--model_dtype; the checkpoint's under
    auto, fp32 when it has none), the packed weights stored as uint8 where each rank holds them whole (one process,
    DDP, ZeRO-1/2) and in the compute dtype where ZeRO-3 or FSDP2 shard them: both shard floating-point tensors, and
    FSDP2 over uint8 storage trains silently wrong (accelerate #3983). 8 bits: LLM.int8 with bitsandbytes' defaults.
    The base goes to this rank's device, except under ZeRO-3's zero.Init, which places it itself (transformers
    refuses a device_map there)."""
    if not (cfg.load_in_4bit or getattr(cfg, "load_in_8bit", False)):
        return {}
    from transformers import BitsAndBytesConfig
    from transformers.integrations import is_deepspeed_zero3_enabled

    config = BitsAndBytesConfig(load_in_8bit=True) if not cfg.load_in_4bit else BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype if _sharded() else torch.uint8)
    if is_deepspeed_zero3_enabled():
        return {"quantization_config": config}
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else "cpu"
    return {"quantization_config": config, "device_map": {"": device}}


def _sharded() -> bool:
    """Whether this launch's strategy shards the frozen weights (ZeRO-3, FSDP2), read from Accelerate's state."""
    from accelerate.state import AcceleratorState

    state = AcceleratorState() if AcceleratorState._shared_state else None
    return state is not None and (state.distributed_type.value == "FSDP" or state.distributed_type.value ==
                                  "DEEPSPEED" and state.deepspeed_plugin.zero_stage == 3)


def strategy_problems(cfg: Any, strategy: Any) -> list[Problem]:
    """--load_in_8bit where the strategy holds parameters as DTensors (FSDP2, HSDP, tensor parallelism): it shards
    bitsandbytes' Int8Params into plain parameters, and the 8-bit layer's first call fails ("'Parameter' object has no
    attribute 'CB'", measured under fsdp.yaml). ZeRO-3 partitions the int8 weights and gathers them back whole (each
    rank's dequantised weights are one process's: tests/test_qlora.py); a 4-bit base has a storage FSDP2 shards."""
    if not getattr(cfg, "load_in_8bit", False) or strategy.name in ("single", "ddp", "deepspeed"):
        return []
    return [Problem(f"--load_in_8bit under {strategy.label}: it shards bitsandbytes' 8-bit weights into plain "
                    "parameters, which lose their quantisation state (the first forward would fail: 'Parameter' "
                    "object has no attribute 'CB')", "config field load_in_8bit",
                    "use --load_in_4bit (QLoRA's 4-bit base shards under FSDP2), or the 8-bit base under ddp.yaml or "
                    "a DeepSpeed ZeRO config")]


NF4_BLOCK, NESTED_BLOCK = 64, 256  # bitsandbytes' defaults: weights per absmax, absmaxes per absmax of their own


def constant_bytes(shape: torch.Size, bits: int) -> int:
    """The quantisation constants of one quantised weight, which every rank holds whole (also where a 4-bit weight is
    sharded). 4 bits: its blocks' absmax in 8 bits, their own fp32 absmax per NESTED_BLOCK, the two code tables (16
    and 256 fp32) and the offset; 8 bits: an fp32 scale per output row (LLM.int8's SCB)."""
    if bits == 8:
        return 4 * shape[0]
    blocks = -(-shape.numel() // NF4_BLOCK)
    return blocks + 4 * -(-blocks // NESTED_BLOCK) + 4 * (16 + 256 + 1)


def weights_of(model: nn.Module) -> dict[int, int]:
    """The frozen weights held quantised, as {id: bits}: those of the linear layers of each transformers model inside
    `model` loaded in 4 or 8 bits (is_loaded_in_4bit / is_loaded_in_8bit, which finetune.build sets on its
    meta-device build too: QLoRA's base, distill's --teacher_load_in_4bit), but for the ones transformers keeps whole
    (get_keys_to_not_convert: the output head, tied weights). A model without one imports nothing (a plain module's
    run never imports transformers: tests/test_runs.py)."""
    bases = [(module, bits) for module in model.modules() for bits in (4, 8)
             if getattr(module, f"is_loaded_in_{bits}bit", False) is True]
    if not bases:
        return {}
    from transformers.quantizers.base import get_keys_to_not_convert

    found = {}
    for base, bits in bases:
        kept = tuple(get_keys_to_not_convert(base))
        found |= {id(module.weight): bits for name, module in base.named_modules()
                  if type(module) is nn.Linear and not module.weight.requires_grad
                  and not any(key in name.replace(".base_layer", "") for key in kept)}
    return found


# The entries a bitsandbytes layer writes into a state dict beside its weight: a 4-bit one's under the weight's name
# (<name>.weight.absmax, ..., <name>.weight.quant_state.bitsandbytes__nf4), an 8-bit one's beside it (<name>.SCB,
# <name>.weight_format). The frozen base's, which build_model quantises again in every launch
QUANT_STATE_ENTRIES = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state")
INT8_ENTRIES = (".SCB", ".weight_format")


def is_constant(key: str) -> bool:
    """Whether a state dict's key is one of a quantised weight's constants (QUANT_STATE_ENTRIES, INT8_ENTRIES)."""
    return key.endswith(INT8_ENTRIES) or \
        ".weight." in key and key.rsplit(".weight.", 1)[1].split(".")[0] in QUANT_STATE_ENTRIES


def constant_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The quantisation constants of the model's quantised layers (each layer holds them whole, also where a packed
    4-bit weight is sharded): 4 bits: absmax, the code table, and under double quantisation the absmaxes' own; 8
    bits: the row scales."""
    tensors = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        # an 8-bit layer's row scales: on its weight until its first call, in its state after it
        scales = getattr(weight, "SCB", None) if getattr(weight, "SCB", None) is not None else \
            getattr(getattr(module, "state", None), "SCB", None)
        if isinstance(scales, torch.Tensor):
            tensors.append(scales)
        state = getattr(module, "quant_state", None) or getattr(weight, "quant_state", None)
        for part in [state, getattr(state, "state2", None)] if state is not None else []:
            tensors += [t for t in (getattr(part, "absmax", None), getattr(part, "code", None),
                                    getattr(part, "offset", None)) if isinstance(t, torch.Tensor)]
    return tensors


def kept_as_quantised(model: nn.Module) -> nn.Module:
    """The quantised base held in the layout it was quantised to, and checkpointable. bitsandbytes repacks a 4-bit
    `Linear4bit` the first time it computes without gradients on a CPU with AVX512-BF16 (an evaluation, a
    generation): its constants rounded to bf16 and the weight re-laid, after which the training forward reads other
    numbers (3.1e-3 apart in the logits), so an evaluation in the middle of a run would change every later step. The
    fast path is switched off per layer. An 8-bit `Linear8bitLt` keeps its layout (its weight and row scales
    compared bit for bit after training steps and an evaluation: tests/test_qlora.py), but writes two state-dict
    entries beside its weight (SCB, weight_format) that are no attributes, and torch.distributed.checkpoint's
    get_state_dict looks every key up as one ("'Linear8bitLt' object has no attribute 'SCB'"): they are named."""
    from bitsandbytes.nn import Linear4bit, Linear8bitLt

    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False
        elif isinstance(module, Linear8bitLt):
            module.__dict__.update(SCB=module.weight.SCB, weight_format=0)  # not a buffer: the state dict is as it was
    return model


def merged_into_dequantised(trained: nn.Module, auto_class: Any, path: str, adapter: str, cfg: Any,
                            dtype: torch.dtype, **kwargs: Any) -> nn.Module:
    """QLoRA's final/: the base quantised again from its folder as the run quantised it (NF4 and LLM.int8 are
    functions of the weights alone), dequantised to `dtype` (transformers' dequantize), and the adapters merged into
    it (peft's merge_and_unload). The model that trained, to the merge's rounding; the full-precision base with the
    adapters would be another one (its logits 0.06 apart on the tests' Qwen2: the adapters learned to correct the
    4-bit base)."""
    from peft import PeftModel

    config = copy.deepcopy(trained.get_base_model().config)  # the trained head's size (a reward model's 1 label)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    base = auto_class.from_pretrained(path, config=config, dtype=dtype, **load_args(cfg, dtype), **kwargs)
    plain = base.dequantize(dtype=dtype)
    return PeftModel.from_pretrained(plain, adapter).merge_and_unload()
