"""LoRA through peft for a transformers model (the fine-tuning recipes' --lora_r, trainkit/models/finetune.py): the
adapters on the model's linear layers, QLoRA's 4-bit base, and the merged model that final/ holds.

peft's get_peft_model freezes every base parameter and adds the adapters (B zero: the model unchanged at step 0);
the runner then leaves the frozen base out of checkpoints (strategies/dcp_format.py) and out of the estimate's
gradients and optimizer states.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from typing import Any

import torch
from torch import nn

from trainkit.errors import ConfigError, Problem


def problems(cfg: Any) -> list[Problem]:
    """The recipe's lora_* fields refused before anything loads: sizes out of range, QLoRA without its GPU or
    adapters, adapters beside --trainable."""
    problems = []
    if cfg.lora_r < 0 or cfg.lora_r and (cfg.lora_alpha <= 0 or not 0 <= cfg.lora_dropout < 1):
        problems.append(Problem(f"LoRA needs lora_r >= 0, lora_alpha > 0 and 0 <= lora_dropout < 1, got "
                                f"{cfg.lora_r}, {cfg.lora_alpha}, {cfg.lora_dropout}", "config field lora_r",
                                "use --lora_r 8 --lora_alpha 16 --lora_dropout 0.05"))
    if cfg.load_in_4bit and not cfg.lora_r:
        problems.append(Problem("QLoRA (--load_in_4bit) trains adapters over the 4-bit base, and got no --lora_r: a "
                                "quantised base cannot train itself", "config field load_in_4bit",
                                "pass --lora_r 8 with --load_in_4bit, or drop --load_in_4bit"))
    if cfg.load_in_4bit and importlib.util.find_spec("bitsandbytes") is None:
        problems.append(Problem("QLoRA (--load_in_4bit) quantises the base with bitsandbytes, which is not installed",
                                "config field load_in_4bit", "pip install -r requirements.txt (it pins bitsandbytes)"))
    if cfg.lora_r and cfg.trainable:
        problems.append(Problem("--trainable and --lora_r each choose what trains", "config field trainable",
                                "pass one: --lora_r trains adapters with the whole base frozen"))
    return problems


def quantised(cfg: Any, dtype: torch.dtype) -> dict:
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

    compute = dtype
    state = AcceleratorState() if AcceleratorState._shared_state else None
    sharded = state is not None and (state.distributed_type.value == "FSDP" or state.distributed_type.value ==
                                     "DEEPSPEED" and state.deepspeed_plugin.zero_stage == 3)
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=compute,
                                bnb_4bit_quant_storage=compute if sharded else torch.uint8)
    if is_deepspeed_zero3_enabled():
        return {"quantization_config": config}
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else "cpu"
    return {"quantization_config": config, "device_map": {"": device}}


NF4_BLOCK, NESTED_BLOCK = 64, 256  # bitsandbytes' defaults: weights per absmax, absmaxes per absmax of their own


def nf4_constant_bytes(numel: int) -> int:
    """The quantisation constants of one 4-bit weight of `numel` elements, which every rank holds whole (also where
    the packed weight is sharded): its blocks' absmax in 8 bits, their own fp32 absmax per NESTED_BLOCK, the two
    code tables (16 and 256 fp32) and the offset."""
    blocks = -(-numel // NF4_BLOCK)
    return blocks + 4 * -(-blocks // NESTED_BLOCK) + 4 * (16 + 256 + 1)


def four_bit_weights(model: nn.Module) -> set[int]:
    """The ids of the frozen weights held in 4 bits: those of the linear layers of each transformers model inside
    `model` loaded in 4 bits (is_loaded_in_4bit, which finetune.build sets on its meta-device build too: QLoRA's
    base, distill's --teacher_load_in_4bit), but for the ones transformers keeps whole (get_keys_to_not_convert: the
    output head, tied weights)."""
    from transformers import PreTrainedModel
    from transformers.quantizers.base import get_keys_to_not_convert

    bases: list[nn.Module] = []
    for module in model.modules():  # outer ones first: a model inside one already found is part of it
        if isinstance(module, PreTrainedModel) and not any(module is m for b in bases for m in b.modules()):
            bases.append(module)
    found = set()
    for base in [b for b in bases if getattr(b, "is_loaded_in_4bit", False)]:
        kept = tuple(get_keys_to_not_convert(base))
        found |= {id(module.weight) for name, module in base.named_modules()
                  if type(module) is nn.Linear and not module.weight.requires_grad
                  and not any(key in name.replace(".base_layer", "") for key in kept)}
    return found


# The entries a bitsandbytes 4-bit layer writes into a state dict beside its weight (<name>.weight.absmax, ...,
# <name>.weight.quant_state.bitsandbytes__nf4): the frozen base's, which build_model quantises again in every launch
QUANT_STATE_ENTRIES = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state")


def is_quant_constant(key: str) -> bool:
    """Whether a state dict's key is one of a 4-bit weight's quantisation constants (QUANT_STATE_ENTRIES)."""
    return ".weight." in key and key.rsplit(".weight.", 1)[1].split(".")[0] in QUANT_STATE_ENTRIES


def quant_state_tensors(model: nn.Module) -> list[torch.Tensor]:
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


def lora_config(cfg: Any, task_type: str = "CAUSAL_LM"):
    """peft's LoraConfig from the recipe's lora_* fields: all-linear, or comma-separated module names. task_type
    SEQ_CLS (a reward model) trains its new scoring head whole beside the adapters."""
    from peft import LoraConfig

    targets = cfg.lora_target_modules
    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, task_type=task_type,
                      target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",")])


def with_lora(model: nn.Module, cfg: Any, task_type: str = "CAUSAL_LM") -> nn.Module:
    """peft's PeftModel around the model, or a ConfigError naming the model's linear layers when the target modules
    are not among them."""
    from peft import get_peft_model

    try:
        return get_peft_model(model, lora_config(cfg, task_type))
    except ValueError as e:
        names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError([Problem(f"peft cannot put LoRA on this model: {' '.join(str(e).split())[:300]}",
                                   "--lora_target_modules", f"use all-linear, or names of its linear layers: "
                                   f"{', '.join(names)}")]) from None


def merged(model: nn.Module, state_dict: dict, auto_class: Any) -> nn.Module:
    """A plain transformers model with the adapters merged in (peft's merge_and_unload), built from the gathered
    state dict: the trained model may be sharded (ZeRO-3, FSDP2), so a copy is made on the meta device and takes
    the state dict's tensors as its own (no second copy of the weights)."""
    from peft import get_peft_model

    with torch.device("meta"):
        copy = get_peft_model(auto_class.from_config(model.get_base_model().config),
                              model.peft_config["default"])
    copy.load_state_dict(state_dict, strict=True, assign=True)
    plain = copy.merge_and_unload()
    plain.tie_weights()  # the tied output head names the embedding again after assign
    return plain


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
    base = auto_class.from_pretrained(path, config=config, dtype=dtype, **quantised(cfg, dtype), **kwargs)
    plain = base.dequantize(dtype=dtype)
    return PeftModel.from_pretrained(plain, adapter).merge_and_unload()
