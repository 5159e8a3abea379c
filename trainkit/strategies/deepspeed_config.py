"""DeepSpeed's config, one source of truth: every value the run already knows comes from the run.

The config comes from a JSON (`deepspeed_config_file`, as the shipped YAMLs do) or from the Accelerate YAML's own
`deepspeed_config` keys (`zero_stage`, `offload_optimizer_device`, ..., what `accelerate config` writes when you
decline a JSON), translated here into the same JSON. Then, either way: values the run knows (micro-batch,
accumulation, global batch, clipping, precision) are filled where they stand as "auto" or are absent, and an explicit
value that disagrees is refused naming both sources; optimizer and scheduler sections made only of "auto" values
give way to the recipe's (said in a note); ZeRO settings that cannot work are refused; DeepSpeed's own schema check
runs last. Clipping is always written explicitly: DeepSpeed's default (1.0) would silently differ from the other
strategies.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainkit.config import TrainConfig
from trainkit.data.batches import global_batch_size
from trainkit.errors import Problem
from trainkit.estimate import hidden_size
from trainkit.launch.launcher import Launch, is_true

# Keys of the YAML's deepspeed_config block that say how to launch, not how to train: they may stand next to a JSON.
LAUNCH_KEYS = ("deepspeed_config_file", "zero3_init_flag", "deepspeed_hostfile", "deepspeed_multinode_launcher",
               "deepspeed_exclusion_filter", "deepspeed_inclusion_filter", "deepspeed_moe_layer_cls_names")
# Keys that describe the training config itself when there is no JSON, with their types (values read from the
# launcher's environment arrive as text).
INLINE_KEYS = {"zero_stage": int, "offload_optimizer_device": str, "offload_param_device": str,
               "offload_optimizer_nvme_path": str, "offload_param_nvme_path": str, "gradient_accumulation_steps": int,
               "gradient_clipping": float, "zero3_save_16bit_model": bool}
# torch.optim.AdamW's defaults: what the recipe's AdamW uses besides lr and weight decay.
ADAMW_DEFAULTS = {"betas": [0.9, 0.999], "eps": 1e-8}


@dataclass
class DeepSpeedConfig:
    """The filled config for the engine, where it came from (for messages), and what was found."""

    config: dict[str, Any]
    name: str  # the JSON's path, or "deepspeed_config in <the YAML>"
    where: str  # for messages: the JSON and the YAML that names it
    inline: bool  # from the YAML's deepspeed_config keys, not a JSON
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def fix_for(self, json_key: str, yaml_key: str | None = None) -> str:
        """How to let the run fill a key, in the form the user wrote the config in."""
        if self.inline:
            return f"remove {yaml_key or json_key} from deepspeed_config in the YAML (the run fills it)"
        return f'set "{json_key}": "auto" in the JSON so the run fills it'


def resolve(launch: Launch, cfg: TrainConfig, sources: Mapping[str, str], data_parallel: int) -> DeepSpeedConfig:
    """The DeepSpeed config for this run, every "auto" it knows filled, and every problem found (`data_parallel`: the
    ranks that train on other samples, all but those that share a sequence)."""
    loaded = _load(launch)
    if not loaded.config:  # nothing to fill or check: the problems say why
        return loaded
    _fill_run_values(loaded, launch, cfg, sources, data_parallel)
    _recipe_sections(loaded, cfg, sources)
    _check_zero(loaded, cfg)
    if not loaded.problems:
        loaded.problems += _validate_with_deepspeed(loaded.config, loaded.where)
    return loaded


def _load(launch: Launch) -> DeepSpeedConfig:
    """The JSON that deepspeed_config_file names, or the YAML's keys translated as Accelerate's DeepSpeedPlugin does."""
    settings, source = launch.settings, launch.source
    yaml_where = f"deepspeed_config in {source}"
    known = (*LAUNCH_KEYS, *INLINE_KEYS)
    problems = []
    for key in sorted(set(launch.block_keys) - set(known)):
        close = difflib.get_close_matches(key, known, n=1)
        problems.append(Problem(f"unknown key {key!r} in deepspeed_config", yaml_where,
                                f"did you mean {close[0]}?" if close else f"use one of {', '.join(known)}"))
    path = settings.get("deepspeed_config_file")
    if path:
        inline = sorted(set(launch.block_keys) & set(INLINE_KEYS))
        if inline:
            problems.append(Problem(f"deepspeed_config sets {', '.join(inline)} next to a deepspeed_config_file",
                                    yaml_where, "set them in the JSON (the recipe fills accumulation and clipping)"))
        where = f"{path} (deepspeed_config_file in {source})"
        from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys

        try:  # DeepSpeed's own reading: a key given twice is refused (DeepSpeed never sees the file, only the dict)
            ds = json.loads(Path(path).read_text(), object_pairs_hook=dict_raise_error_on_duplicate_keys)
        except FileNotFoundError:
            return DeepSpeedConfig({}, str(path), where, False, problems + [Problem(
                f"DeepSpeed config {path} does not exist", source,
                "run from the repository root or give deepspeed_config_file an absolute path")])
        except ValueError as e:  # json.JSONDecodeError, or DeepSpeed's "Duplicate keys in DeepSpeed config: [...]"
            return DeepSpeedConfig({}, str(path), where, False,
                                   problems + [Problem(f"{path} is not valid JSON: {e}", source, "fix the file")])
        return DeepSpeedConfig(ds, str(path), where, False, problems)
    values = {}
    for key, kind in INLINE_KEYS.items():
        if key not in settings:
            continue
        try:
            values[key] = is_true(settings[key]) if kind is bool else kind(settings[key])
        except (TypeError, ValueError):
            problems.append(Problem(f"deepspeed_config.{key} must be {kind.__name__}, got {settings[key]!r}",
                                    yaml_where, f"write {key}: {kind(2) if kind is not bool else 'true'}"))
    if "zero_stage" not in values and not problems:
        problems.append(Problem("deepspeed_config names neither a zero_stage nor a deepspeed_config_file", yaml_where,
                                "add zero_stage: 2 (or point deepspeed_config_file at a file in ds_configs/)"))
    stage = values.get("zero_stage")
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": "auto"}
    zero.update({"stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                 "stage3_gather_16bit_weights_on_model_save": values.get("zero3_save_16bit_model", True)}
                if stage == 3 else {"allgather_bucket_size": "auto"})
    for part in ("optimizer", "param"):
        device = values.get(f"offload_{part}_device", "none")
        if device == "nvme" and f"offload_{part}_nvme_path" not in values:
            problems.append(Problem(f"offload_{part}_device is nvme but no offload_{part}_nvme_path reaches the run "
                                    f"(Accelerate's launcher does not pass it on)", yaml_where,
                                    f"use a DeepSpeed JSON with zero_optimization.offload_{part}.nvme_path"))
        if device != "none":
            zero[f"offload_{part}"] = {"device": device, "pin_memory": torch.cuda.is_available(),
                                       **({"nvme_path": values[f"offload_{part}_nvme_path"]}
                                          if device == "nvme" and f"offload_{part}_nvme_path" in values else {})}
    ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
          "gradient_accumulation_steps": values.get("gradient_accumulation_steps", "auto"),
          "gradient_clipping": values.get("gradient_clipping", "auto"), "zero_optimization": zero}
    return DeepSpeedConfig(ds, yaml_where, yaml_where, True, problems)


def _fill_run_values(loaded: DeepSpeedConfig, launch: Launch, cfg: TrainConfig, sources: Mapping[str, str],
                     data_parallel: int) -> None:
    ds, name, where = loaded.config, loaded.name, loaded.where
    run_values = {  # the JSON key: the run's value, the recipe field behind it
        "train_micro_batch_size_per_gpu": (cfg.batch_size, "batch_size"),
        "gradient_accumulation_steps": (cfg.grad_accum, "grad_accum"),
        "train_batch_size": (global_batch_size(cfg.batch_size, cfg.grad_accum, data_parallel), None),
        "gradient_clipping": (float(cfg.max_grad_norm), "max_grad_norm"),
    }
    for key, (value, flag) in run_values.items():
        given = ds.get(key, "auto")
        if given != "auto" and given != value:
            product = "batch_size x grad_accum x num_processes" + (" / sp size" if data_parallel < launch.world_size
                                                                     else "")
            source = sources.get(flag, "recipe default") if flag else product
            instead = f"pass --{flag} {given}" if flag else f"choose a {product} of {given}"
            loaded.problems.append(Problem(f"{key} is {given} in {name} but {value} in the run ({source})", where,
                                           f"{loaded.fix_for(key)}, or {instead}"))
        ds[key] = value
    for precision in ("bf16", "fp16"):
        section = ds.setdefault(precision, {})
        wanted = launch.mixed_precision == precision
        given = section.get("enabled", "auto")
        if given != "auto" and bool(given) != wanted:
            loaded.problems.append(Problem(f"{precision}.enabled is {given} in {name} but mixed_precision is "
                                           f"{launch.mixed_precision} ({launch.source})", where,
                                           f'set "{precision}": {{"enabled": "auto"}} in the JSON'))
        section["enabled"] = wanted


def _recipe_sections(loaded: DeepSpeedConfig, cfg: TrainConfig, sources: Mapping[str, str]) -> None:
    """The JSON's optimizer and scheduler sections give way to the recipe's, under every strategy the same, so that
    curves compare. Values left "auto" (the Hugging Face docs' JSONs) are the recipe's; an explicit value that
    disagrees with the recipe is refused, as is an optimizer other than Adam(W)."""
    ds, name, where = loaded.config, loaded.name, loaded.where
    recipe_adamw = {"lr": cfg.lr, "weight_decay": cfg.weight_decay, **ADAMW_DEFAULTS}
    if "optimizer" in ds:
        section = ds.pop("optimizer")
        kind = str(section.get("type", "?"))
        explicit = {k: v for k, v in section.get("params", {}).items() if v != "auto"}
        wrong = {k: v for k, v in explicit.items() if k not in recipe_adamw or _differs(v, recipe_adamw[k])}
        if kind.lower() not in ("adam", "adamw") or cfg.optimizer != "adamw" or wrong:
            said = ", ".join(f"{k} is {v} in the JSON but {recipe_adamw.get(k, 'not set')} in the run "
                             f"({sources.get(k, 'recipe default')})" for k, v in wrong.items())
            loaded.problems.append(Problem(
                f"{name} defines an optimizer, and so does the recipe: the JSON names {kind}"
                + (f", the recipe {cfg.optimizer}" if cfg.optimizer != "adamw" or kind.lower() not in ("adam", "adamw")
                   else "") + (f"; {said}" if said else ""), where,
                'remove "optimizer" from the JSON, or leave its values "auto": the recipe\'s optimizer is used '
                "under every strategy"))
        else:
            loaded.notes.append(f"the optimizer section of {name} ({kind}) is the recipe's AdamW: lr {cfg.lr}, "
                                f"weight decay {cfg.weight_decay} on matrices only, betas (0.9, 0.999), eps 1e-8")
    if "scheduler" in ds:
        section = ds.pop("scheduler")
        kind = str(section.get("type", "?"))
        explicit = {k: v for k, v in section.get("params", {}).items() if v != "auto"}
        if explicit:
            loaded.problems.append(Problem(
                f"{name} defines a scheduler with its own values ({', '.join(f'{k} {v}' for k, v in explicit.items())}"
                f"), and so does the recipe", where,
                'remove "scheduler" from the JSON, or leave its values "auto", and set the schedule with --lr, '
                "--warmup_steps and --min_lr_ratio"))
        else:
            loaded.notes.append(f"{name} names the scheduler {kind}; the recipe's schedule runs instead (linear "
                                f"warm-up over {cfg.warmup_steps} steps, then cosine to lr x {cfg.min_lr_ratio} at "
                                f"step {cfg.max_steps}), as under every strategy, so that curves compare")


def _differs(given: Any, wanted: Any) -> bool:
    if isinstance(wanted, list):
        return not isinstance(given, list | tuple) or len(given) != len(wanted) or any(
            _differs(g, w) for g, w in zip(given, wanted, strict=True))
    try:
        return not math.isclose(float(given), float(wanted), rel_tol=1e-9)
    except (TypeError, ValueError):
        return True


def _check_zero(loaded: DeepSpeedConfig, cfg: TrainConfig) -> None:
    ds, where = loaded.config, loaded.where
    kind = "YAML" if loaded.inline else "JSON"
    zero = ds.setdefault("zero_optimization", {})
    stage = zero.get("stage")
    offload_optimizer = zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None)
    if stage not in (0, 1, 2, 3):
        loaded.problems.append(Problem(f"zero_optimization.stage must be 0-3, got {stage!r}", where,
                                       "write zero_stage: 2 in the YAML" if loaded.inline else
                                       'write the stage explicitly, e.g. "stage": 2'))
    if stage == 3 and zero.get("stage3_gather_16bit_weights_on_model_save") is not True:
        loaded.problems.append(Problem(
            "ZeRO-3 without stage3_gather_16bit_weights_on_model_save cannot write final/ (it would fail after "
            "training)", where, "set zero3_save_16bit_model: true in the YAML's deepspeed_config" if loaded.inline
            else 'set "stage3_gather_16bit_weights_on_model_save": true in zero_optimization'))
    if zero.get("offload_param", {}).get("device", "none") not in ("none", None) and stage != 3:
        loaded.problems.append(Problem(f"offload_param needs ZeRO stage 3, the {kind} has stage {stage}", where,
                                       "use ds_configs/zero3_offload.json, or remove offload_param"))
    if offload_optimizer and stage not in (1, 2, 3):
        loaded.problems.append(Problem(f"offload_optimizer needs ZeRO stage 1-3, the {kind} has stage {stage}", where,
                                       "use ds_configs/zero2_offload.json"))
    if offload_optimizer and cfg.optimizer != "adamw":
        loaded.problems.append(Problem(f"optimizer {cfg.optimizer} cannot run in DeepSpeed's CPU offload (cpu_adam is "
                                       f"Adam only)", where, "use --optimizer adamw"))
    if offload_optimizer:
        # Accelerate otherwise swaps the run's DeepSpeedCPUAdam for a copy with adamw_mode=False (L2 decay: the curve
        # leaves one process's wherever weight_decay > 0) that the scheduler does not drive: after a resume the
        # schedule stops moving (accelerate/utils/deepspeed.py, map_pytorch_optim_to_deepspeed).
        if ds.get("zero_force_ds_cpu_optimizer", "auto") not in ("auto", False):
            loaded.problems.append(Problem(
                "zero_force_ds_cpu_optimizer is true: Accelerate would replace the run's AdamW by an Adam with L2 "
                "weight decay that the schedule no longer drives after a resume", where,
                'remove "zero_force_ds_cpu_optimizer" from the JSON (the run sets it false)'))
        ds["zero_force_ds_cpu_optimizer"] = False


def _validate_with_deepspeed(ds: dict, where: str) -> list[Problem]:
    """DeepSpeed's own schema check (unknown keys, wrong types), on a copy whose "auto" values are placeholders."""
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's logger writes to stdout; --dry_run's stdout is JSON
        from deepspeed.runtime.config import DeepSpeedConfig as Schema

    probe = json.loads(json.dumps(ds))
    probe.pop("train_batch_size", None)  # DeepSpeed checks it against its own world size, which is 1 here
    for key, value in probe.get("zero_optimization", {}).items():
        if value == "auto":
            probe["zero_optimization"][key] = 1
    try:
        Schema(probe)
    except Exception as e:  # pydantic's ValidationError or DeepSpeed's assertions: their words, one line
        first = " ".join(str(e).split())[:300]
        return [Problem(f"DeepSpeed rejects the JSON: {first}", where, "fix the key it names (ds_configs/README.md)")]
    return []


def persistence_threshold(hidden: int) -> int:
    """ZeRO-3 keeps parameters smaller than this whole on every rank (Accelerate's formula)."""
    return 10 * hidden


def fill_bucket_sizes(ds: dict, model: torch.nn.Module) -> None:
    """Replace "auto" bucket sizes with Accelerate's formulas from the model's hidden size (Accelerate's own fill
    raises for models without `model.config`), bounded by DeepSpeed's default (5e8 elements) and rounded up to a
    multiple of 64: DeepSpeed asserts that allgather_bucket_size is even, and a model's hidden size (or the square
    root of its largest parameter) can be odd."""
    hidden = hidden_size(model)
    bucket = math.ceil(min(hidden * hidden, 500_000_000) / 64) * 64
    derived = {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
               "stage3_prefetch_bucket_size": int(0.9 * bucket),
               "stage3_param_persistence_threshold": persistence_threshold(hidden)}
    zero = ds.get("zero_optimization", {})
    for key, value in derived.items():
        if zero.get(key) == "auto":
            zero[key] = value
