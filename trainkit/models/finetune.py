"""What the recipes that fine-tune a pretrained transformers model share (recipes/causal_lm.py, recipes/dpo.py,
recipes/reward.py): the model's settings and their checks, loading it (--model_dtype, --trainable, LoRA, QLoRA,
gradient checkpointing), its tokenizer, and final/ as from_pretrained loads it (under LoRA, the adapters beside the
merged model). A recipe adds its data and its loss.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainkit.config import TrainConfig
from trainkit.data import sft
from trainkit.errors import ConfigError, Problem
from trainkit.models import expert_bias, lora, pretrained, quantised

# The attention kernels transformers' from_pretrained takes (what a model supports is its own: Gemma-2 no sdpa)
ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
# How a mixture of experts computes its experts (from_pretrained's experts_implementation): eager loops over the
# experts in Python; grouped_mm (transformers' default where torch can run it) and batched_mm take every expert in
# one call; deepgemm and sonicmoe are CUDA kernels
EXPERTS = ("eager", "grouped_mm", "batched_mm", "deepgemm", "sonicmoe")

@dataclass(kw_only=True, slots=True)
class FineTuneConfig(TrainConfig):
    # Model
    model_name_or_path: str = ""  # a local folder (from_pretrained's layout) or a Hub id
    trust_remote_code: bool = False  # run code shipped with the model (a Hub model's own modelling files)
    allow_pickle: bool = False  # accept pytorch_model.bin weights (unpickled) when there are no safetensors
    trainable: str = ""  # comma-separated parameter-name prefixes to train, the rest frozen; empty: all
    # What the pretrained weights load as (from_pretrained's dtype; auto: the dtype saved with them). It is what a
    # frozen base holds under LoRA (an 8B base: 15 GiB in bf16, 30 in fp32); every weight that trains (LoRA's
    # adapters, a full or --trainable fine-tune) is kept in fp32 with its optimizer state, as is --trainable's rest.
    model_dtype: str = "auto"
    # The attention kernel (from_pretrained's attn_implementation): "" the model's own default (sdpa for most, eager
    # for Gemma-2), or one of ATTENTION. Sequence and context parallelism need one they can split.
    attn_implementation: str = ""
    # A mixture of experts' kernel (EXPERTS): "" transformers' default (grouped_mm where torch runs it); the same
    # losses either way (tests/test_moe.py), the speed in bench/moe.py.
    experts_implementation: str = ""
    # Which tokenizer: "" (AutoTokenizer's, refused when it encodes text otherwise than the folder's tokenizer.json),
    # "saved" (that tokenizer.json as it is) or "auto" (AutoTokenizer's, unchecked). transformers picks some model
    # types' own class whatever tokenizer_config.json says (a Qwen2 folder loads as Qwen2Tokenizer).
    tokenizer: str = ""
    gradient_checkpointing: bool = False
    # A mixture of experts' load-balancing loss (trainkit/losses/router.py): its weight in the objective. -1 keeps the
    # model config's (router_aux_loss_coef, counted where its output_router_logits is on); 0 or more sets it and turns
    # the router's logits on. A model without a router refuses it.
    router_aux_loss_coef: float = -1.0
    # Auxiliary-loss-free balancing (trainkit/models/expert_bias.py): how far each step moves a router's expert bias
    # toward an even load (DeepSeek-V3 trained with 0.001); 0 leaves the bias as loaded. DeepSeek-V3, GLM-4-MoE and
    # Ernie4.5-MoE have one.
    router_bias_update_rate: float = 0.0
    # LoRA (peft): the base model frozen, low-rank adapters trained beside its linear layers; lora_r 0 trains the
    # model itself. The adapters add lora_alpha / lora_r times their product to each layer's output.
    lora_r: int = 0
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    # peft's "all-linear" (every linear layer but the output head), or comma-separated module names (q_proj,v_proj)
    lora_target_modules: str = "all-linear"
    load_in_4bit: bool = False  # QLoRA: the frozen base quantised to 4 bits (NF4) by bitsandbytes, adapters over it
    # The frozen base in 8 bits (bitsandbytes' LLM.int8), adapters over it: twice 4 bits' memory, closer to the base;
    # under one process, DDP and DeepSpeed (ZeRO-3 partitions it), not FSDP2
    load_in_8bit: bool = False
    chat_template: str = ""  # the tokenizer's own; chatml, or a Jinja file, for one that has none
    seq_len: int = 128
    # The training data: local files (comma-separated) or a Hub dataset (data_config: its configuration), in the
    # recipe's layout. The held-out data: eval_data's files (or a Hub dataset's eval_split) in the same layout; without
    # it, eval_fraction of --data (examples drawn from the seed)
    data: str = ""
    data_config: str = ""
    eval_data: str = ""
    eval_split: str = "test"
    eval_fraction: float = 0.05
    # Training (overrides of TrainConfig's defaults: fine-tuning takes small steps)
    batch_size: int = 8
    lr: float = 1e-4
    warmup_steps: int = 10
    max_steps: int = 100
    eval_every: int = 50
    eval_batches: int = 0  # the whole held-out split; N: its first N global batches

    may_change_on_resume = TrainConfig.may_change_on_resume | {"gradient_checkpointing"}

    def check(self) -> list[Problem]:
        """The model's settings (a recipe adds its data's: FineTuneConfig.check(self) first)."""
        problems = []
        if not self.model_name_or_path:
            problems.append(Problem("no model to fine-tune", "config field model_name_or_path",
                                    "pass --model_name_or_path with a folder from_pretrained reads (such as "
                                    "runs/tiny_transformer/final) or a Hub id"))
        if self.model_dtype not in MODEL_DTYPES:
            problems.append(Problem(f"model_dtype must be one of {', '.join(MODEL_DTYPES)}, got {self.model_dtype!r}",
                                    "config field model_dtype", "use --model_dtype auto"))
        if self.attn_implementation not in ("", *ATTENTION):
            problems.append(Problem(f"attn_implementation must be one of {', '.join(ATTENTION)} (or empty: the "
                                    f"model's own), got {self.attn_implementation!r}",
                                    "config field attn_implementation", "use --attn_implementation sdpa"))
        if self.experts_implementation not in ("", *EXPERTS):
            problems.append(Problem(f"experts_implementation must be one of {', '.join(EXPERTS)} (or empty: "
                                    f"transformers' default), got {self.experts_implementation!r}",
                                    "config field experts_implementation", "use --experts_implementation grouped_mm"))
        if self.tokenizer not in ("", "saved", "auto"):
            problems.append(Problem(f"tokenizer must be saved or auto (or empty), got {self.tokenizer!r}",
                                    "config field tokenizer", "use --tokenizer saved"))
        if self.seq_len < 2:
            problems.append(Problem(f"seq_len must be >= 2, got {self.seq_len}", "config field seq_len",
                                    "use --seq_len 128"))
        if self.router_bias_update_rate < 0 or self.router_bias_update_rate and self.lora_r:
            problems.append(Problem(f"router_bias_update_rate must be >= 0 and needs the routers trained (not LoRA's "
                                    f"adapters alone), got {self.router_bias_update_rate:g} with lora_r {self.lora_r}",
                                    "--router_bias_update_rate", "pass --router_bias_update_rate 0.001 without "
                                    "--lora_r, or drop it"))
        if not 0 < self.eval_fraction < 1:
            problems.append(Problem(f"eval_fraction must be in (0, 1), got {self.eval_fraction}",
                                    "config field eval_fraction", "use --eval_fraction 0.05"))
        return problems + pretrained.weights_problems(self.model_name_or_path, self.allow_pickle) + lora.problems(self)

    def flag_of(self, data: str) -> str:
        """The option that named `data` (--data or --eval_data), for its errors."""
        return "--eval_data" if data == self.eval_data and data != self.data else "--data"


# --model_dtype's names -> from_pretrained's dtype
MODEL_DTYPES = {"auto": "auto", "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build(cfg: FineTuneConfig, auto_class: Any, lora_task: str = "CAUSAL_LM", **kwargs: Any) -> nn.Module:
    """The pretrained model as `auto_class` (AutoModelForCausalLM, AutoModelForSequenceClassification) loads it with
    `kwargs` (num_labels), as the settings ask: its dtype, what trains, LoRA (peft's task type `lora_task`). On the
    meta device (--estimate and --dry_run) the shapes only, from the config."""
    from transformers import AutoConfig

    config = pretrained.load("model's config", cfg, AutoConfig.from_pretrained)
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if cfg.experts_implementation:
        _check_experts(config, cfg.experts_implementation)
        kwargs["experts_implementation"] = cfg.experts_implementation
    if torch.get_default_device().type == "meta":
        if not pretrained.sizes_only.get():  # the tokenizer the run trains with, checked as the run checks it
            tokenizer_of(cfg)
        dtype = MODEL_DTYPES[cfg.model_dtype]
        kernels = {key: kwargs.pop(key) for key in ("attn_implementation", "experts_implementation") if key in kwargs}
        for key, value in kwargs.items():
            setattr(config, key, value)
        model = pretrained.load("model", cfg, lambda path, **kw: auto_class.from_config(
            config, dtype=getattr(config, "dtype", None) if dtype == "auto" else dtype, **kernels, **kw))
        # as transformers marks a quantised load: the estimate counts it so
        model.is_loaded_in_4bit, model.is_loaded_in_8bit = cfg.load_in_4bit, cfg.load_in_8bit
        if (cfg.load_in_4bit or cfg.load_in_8bit) and (problem := _experts_left_whole(model, cfg)):
            raise ConfigError([problem])
        model = _router_weighed(model, cfg)
        return _trained_in_fp32(lora.with_lora(model, cfg, lora_task) if cfg.lora_r else model)
    model = pretrained.load("model", cfg, lambda path, **kw: auto_class.from_pretrained(
        path, dtype=MODEL_DTYPES[cfg.model_dtype], use_safetensors=None if cfg.allow_pickle else True,
        **quantised.load_args(cfg, base_dtype(cfg, config)), **kwargs, **kw))
    if cfg.load_in_4bit or cfg.load_in_8bit:  # adapters train over it (QLoRA), or a frozen model (distill's teacher)
        from peft import prepare_model_for_kbit_training

        model = quantised.kept_as_quantised(model)
        if cfg.lora_r:
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing)
    prefixes = [p.strip() for p in cfg.trainable.split(",") if p.strip()]
    if prefixes:
        chosen = {name for name, _ in model.named_parameters() if name.startswith(tuple(prefixes))}
        if not chosen:
            raise ConfigError([Problem(f"no parameter name starts with {', '.join(prefixes)}", "--trainable",
                                       f"names look like {next(iter(dict(model.named_parameters())))}")])
        for name, param in model.named_parameters():
            param.requires_grad_(name in chosen)
    for name, param in model.named_parameters():
        # from_pretrained made a routing bias trainable: no loss reaches it (by design: DeepSeek-V3 keeps its own as a
        # buffer), and DDP refused the step ("took no part"); --router_bias_update_rate moves it (expert_bias.py)
        if name.endswith(expert_bias.ROUTING_BIASES):
            param.requires_grad_(False)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = _router_weighed(model, cfg)
    return _trained_in_fp32(lora.with_lora(model, cfg, lora_task) if cfg.lora_r else model)


def base_dtype(cfg: FineTuneConfig, config: Any = None) -> torch.dtype:
    """The dtype the base computes in: --model_dtype's, or under auto the checkpoint's (fp32 where it names none)."""
    if cfg.model_dtype != "auto":
        return MODEL_DTYPES[cfg.model_dtype]
    if config is None:
        from transformers import AutoConfig

        config = pretrained.load("model's config", cfg, AutoConfig.from_pretrained)
    dtype = getattr(config, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _experts_left_whole(model: nn.Module, cfg: FineTuneConfig) -> Problem | None:
    """QLoRA over a mixture of experts whose experts bitsandbytes would leave in full precision: it quantises linear
    layers, and transformers holds a layer's experts as fused 3-D parameters (mlp.experts.gate_up_proj), which are
    most of such a model's weights; the run would hold them whole while the flag says 4 bits."""
    from trainkit.strategies.expert_parallel import expert_weights

    experts = expert_weights(model)
    if not experts:
        return None
    numel = sum(p.numel() for p in model.parameters() if id(p) in experts)
    share = numel / sum(p.numel() for p in model.parameters())
    flag = "load_in_4bit" if cfg.load_in_4bit else "load_in_8bit"
    return Problem(f"--{flag} quantises linear layers only (bitsandbytes), and this mixture of experts holds its "
                   f"experts as fused parameters: {numel:,} weights ({share:.0%} of the model) would stay in "
                   f"{str(next(iter(model.parameters())).dtype).removeprefix('torch.')}", f"config field {flag}",
                   f"drop --{flag} (LoRA over the base in --model_dtype bf16), or fine-tune a dense model in "
                   f"{flag[8]} bits")


def _check_experts(config: Any, implementation: str) -> None:
    """--experts_implementation refused for a model without routed experts (its config names no top-k)."""
    text = pretrained.text_config(config)
    if not getattr(text, "num_experts_per_tok", None):
        raise ConfigError([Problem(f"--experts_implementation {implementation}: a {config.model_type} model has no "
                                   "routed experts (its config has no num_experts_per_tok)",
                                   "--experts_implementation", "drop --experts_implementation")])


def _router_weighed(model: nn.Module, cfg: FineTuneConfig) -> nn.Module:
    """--router_aux_loss_coef set on the model's config (with its router logits on), or refused for a model that
    has no router."""
    if cfg.router_aux_loss_coef < 0:
        return model
    if not hasattr(model.config, "router_aux_loss_coef"):
        raise ConfigError([Problem(f"--router_aux_loss_coef {cfg.router_aux_loss_coef:g}: {type(model).__name__} has "
                                   "no router with a balancing loss (its config has no router_aux_loss_coef: not a "
                                   "mixture of experts, or one like DeepSeek-V3 balanced by its router's bias)",
                                   "--router_aux_loss_coef", "drop --router_aux_loss_coef")])
    model.config.router_aux_loss_coef, model.config.output_router_logits = cfg.router_aux_loss_coef, True
    return model


def _trained_in_fp32(model: nn.Module) -> nn.Module:
    """--model_dtype is the frozen base's: a model that trains more than adapters (peft keeps those in fp32 itself)
    is made fp32 whole, since layers of two dtypes in one forward fail without autocast; a QLoRA base stays 4-bit."""
    is_peft = hasattr(model, "peft_config")
    if not is_peft and any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters()):
        model.float()
    return model


def tokenizer_of(cfg: FineTuneConfig):
    """The model's tokenizer (--tokenizer): by default AutoTokenizer's, checked to be the one saved in its folder
    (pretrained.tokenizer_mismatch)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    load = PreTrainedTokenizerFast.from_pretrained if cfg.tokenizer == "saved" else AutoTokenizer.from_pretrained
    tokenizer = pretrained.load("tokenizer", cfg, load)
    folder = Path(cfg.model_name_or_path)
    if not cfg.tokenizer and folder.is_dir() and (problem := pretrained.tokenizer_mismatch(tokenizer, folder)):
        raise ConfigError([problem])
    return tokenizer


def export(model: nn.Module, state_dict: dict, cfg: FineTuneConfig, out_dir: Path, auto_class: Any,
           system: str | None = None) -> None:
    """final/: the model as from_pretrained loads it, with its tokenizer (and the run's --chat_template); under LoRA
    that model has the adapters merged into its weights, and final/adapter/ holds them alone in peft's layout
    (PeftModel.from_pretrained(base, "final/adapter") over the base model it was trained on). `system`: the system
    turn every training conversation opened with, kept in sft.CHAT_DEFAULTS beside each tokenizer (the model
    answers poorly without it, and trainkit/tools/ask.py asks with it)."""
    tokenizer = tokenizer_of(cfg)
    if cfg.chat_template:  # the template the run rendered its conversations with goes along (trainkit/tools/ask.py)
        tokenizer.chat_template = sft.chat_template(tokenizer, cfg.chat_template)
    if cfg.lora_r:
        model.save_pretrained(str(out_dir / "adapter"), state_dict=state_dict)  # peft keeps only the adapters' keys
        tokenizer.save_pretrained(str(out_dir / "adapter"))
        if cfg.load_in_4bit or cfg.load_in_8bit:  # the base trained quantised: the adapters merge into it, dequantised
            model = pretrained.load("model", cfg, lambda path, **kw: quantised.merged_into_dequantised(
                model, auto_class, path, str(out_dir / "adapter"), cfg, base_dtype(cfg), **kw))
        else:
            model = lora.merged(model, state_dict, auto_class)
        state_dict = None
    model.save_pretrained(str(out_dir), state_dict=state_dict)
    tokenizer.save_pretrained(str(out_dir))
    for folder in [out_dir, *([out_dir / "adapter"] if cfg.lora_r else [])] if system is not None else []:
        (folder / sft.CHAT_DEFAULTS).write_text(json.dumps({"system": system}) + "\n")
