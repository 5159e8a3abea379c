"""LoRA through peft for a transformers model (the fine-tuning recipes' --lora_r, trainkit/models/finetune.py): the
adapters on the model's linear layers, QLoRA's 4-bit base, and the merged model that final/ holds.

peft's get_peft_model freezes every base parameter and adds the adapters (B zero: the model unchanged at step 0);
the runner then leaves the frozen base out of checkpoints (strategies/dcp_format.py) and out of the estimate's
gradients and optimizer states.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import nn

from trainkit.errors import ConfigError, Problem


def problems(cfg: Any) -> list[Problem]:
    """The recipe's lora_* fields refused before anything loads: sizes out of range, QLoRA without adapters or
    bitsandbytes, adapters beside --trainable."""
    problems = []
    if cfg.lora_r < 0 or cfg.lora_r and (cfg.lora_alpha <= 0 or not 0 <= cfg.lora_dropout < 1):
        problems.append(Problem(f"LoRA needs lora_r >= 0, lora_alpha > 0 and 0 <= lora_dropout < 1, got "
                                f"{cfg.lora_r}, {cfg.lora_alpha}, {cfg.lora_dropout}", "config field lora_r",
                                "use --lora_r 8 --lora_alpha 16 --lora_dropout 0.05"))
    bits = [b for b in (4, 8) if getattr(cfg, f"load_in_{b}bit", False)]
    if len(bits) == 2:
        problems.append(Problem("--load_in_4bit and --load_in_8bit each choose how the base is quantised",
                                "config field load_in_8bit", "pass one of them"))
    for b in bits[:1]:
        if not cfg.lora_r:
            problems.append(Problem(f"QLoRA (--load_in_{b}bit) trains adapters over the {b}-bit base, and got no "
                                    "--lora_r: a quantised base cannot train itself", f"config field load_in_{b}bit",
                                    f"pass --lora_r 8 with --load_in_{b}bit, or drop --load_in_{b}bit"))
        if importlib.util.find_spec("bitsandbytes") is None:
            problems.append(Problem(f"QLoRA (--load_in_{b}bit) quantises the base with bitsandbytes, which is not "
                                    "installed", f"config field load_in_{b}bit",
                                    "pip install -r requirements.txt (it pins bitsandbytes)"))
    if cfg.lora_r and cfg.trainable:
        problems.append(Problem("--trainable and --lora_r each choose what trains", "config field trainable",
                                "pass one: --lora_r trains adapters with the whole base frozen"))
    return problems


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
