"""The recipe protocol, and loading a recipe by shipped name or by file path.

A recipe is one Python file. It defines:

    Config                          a dataclass subclassing trainkit.config.TrainConfig (declared with
                                    @dataclass(kw_only=True, slots=True))
    build_model(cfg)                -> torch.nn.Module. Also called under `torch.device("meta")` to count parameters
                                    for --estimate and --dry_run: build from the config, load no weights there
    build_datasets(cfg, cache_dir)  -> (train, eval) map-style datasets of equal-shaped samples; the train split may
                                    be a trainkit.data.stream.Streamed instead (data read as it trains)
    loss(model, batch)              -> scalar tensor: the mean loss over the micro-batch; or (that loss, {name: the
                                    sum over the micro-batch's samples of a per-sample value}): each reported in
                                    metrics.jsonl as the mean over the step's global batch, and at evaluation as
                                    eval_<name> over the held-out set (without a second forward; recipes/dpo.py's
                                    rewards)

and optionally (the defaults are `Recipe`'s):

    tokens_per_sample(cfg)          -> int: tokens in one sample, for tokens/s and MFU (token recipes); default None
    summary(cfg, cache_dir)         -> dict of extra numbers for the final summary line; default none
    eval_metrics(model, batch)      -> {name: the sum over the batch's samples of a per-sample value}, e.g.
                                    {"accuracy": (logits.argmax(-1) == labels).sum()}: reported as eval_<name>,
                                    the mean over every held-out sample of every rank; default none
    export(model, state_dict, cfg, cache_dir, out_dir)
                                    writes final/; default model.safetensors + config.json (the run's config)
    preview(cfg, cache_dir)         -> str or None: what --dry_run shows of the data (one example as the model
                                    reads it, what is learned marked); default none
    generate(model, cfg, eval_set)  -> a list of {name: text}: what the model says to a few fixed prompts, at each
                                    evaluation (written to generations.jsonl with the step). Every rank calls it
                                    with its model in eval mode under no_grad: under ZeRO-3 and FSDP2 each forward is
                                    a collective, so every rank must run the same number (generate(synced_gpus=True));
                                    default none
    loss_weight(cfg, batch)         -> number: how many units (learned tokens) the micro-batch's mean loss
                                    averages over. The runner then weighs every micro-batch by it, so that a step's
                                    loss is the mean over every unit of the global batch, however they fall across
                                    micro-batches and ranks; default none (every micro-batch weighs the same)
    precompute(cfg)                 -> None, or a function (model, batch) -> {column: one value per sample of the
                                    micro-batch}: run once over every sample of both splits with the model as it
                                    starts (prepared by the strategy, eval mode, no_grad), before the first step;
                                    each sample then carries its values under those names in every batch, and the
                                    checkpoints keep them (trainkit/data/precompute.py; recipes/dpo.py's
                                    --precompute_ref_logps). Or a precompute.OwnModel(build, fn): fn runs on the
                                    model build() makes, whole on every rank, before the trained model is built
                                    (recipes/distill.py's --precompute_teacher_topk); default None

and, for online RL (recipes/grpo.py):

    rollout(model, cfg, step, micro_batches)
                                    -> a Rollout: the micro-batches this rank trains on at `step`, made from the
                                    ones the data gave (prompts) by the model as it is before the step (completions,
                                    rewards, advantages), the step's metrics (the same on every rank), and rows for
                                    rollouts.jsonl (this rank's; rank 0 writes every rank's, in rank order); or None
                                    where this configuration makes nothing (recipes/dpo.py's: only KTO's reference
                                    point). Called at every step as `generate` is (eval mode, no_grad, the recipe's own
                                    module): under ZeRO-3 and FSDP2 every rank runs as many forwards
    rollout_state()                 -> what the rollout hook holds for the next steps (a dict of tensors and numbers:
                                    --num_iterations' completions), saved per rank with every checkpoint; None: nothing
    load_rollout_state(state)       at a resume, that dict back
    check_strategy(cfg, strategy)   -> [Problem]: what the recipe refuses in the planned strategy (the global batch
                                    against its group size, a strategy it cannot generate under); default none

and, to train under sequence parallelism (a DeepSpeed YAML's parallelism_config_sp_size; on GPUs an FSDP YAML's
parallelism_config_cp_size, context parallelism):

    sequence_parallel = True        the loss reads the parts of token rows the runner cuts
                                    (trainkit/strategies/sequence_parallel.py's rows): input_ids, position_ids and
                                    shift_labels (the next token of each position, -100 where nothing is learned),
                                    all 1/sp (1/cp) of each row's positions; the runner weighs each part by its
                                    learned targets. A transformers model, whose attention Ulysses (or torch's ring)
                                    splits; default False

and, to train under pipeline parallelism (--pipeline_stages; all three or none):

    pipeline_layers(model)          -> the model's repeated layers, in order: stages are cut between them
    pipeline_stage(model, layers, first, last)
                                    -> an nn.Module holding the model's own submodules for the layers in `layers`
                                    (a range), plus what comes before them on the first stage and after them on
                                    the last. Its forward takes the micro-batch's input (first stage) or the
                                    previous stage's output, and returns one tensor
    pipeline_loss(output, target)   -> scalar: the micro-batch's mean loss from the last stage's output. The input
                                    and target are cut from the batch: a tensor is both, a tuple is (input, target),
                                    a dict gives input_ids and labels (or input_ids again)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainkit.config import TrainConfig, config_dict
from trainkit.data.precompute import OwnModel, PrecomputeFn
from trainkit.errors import ConfigError, Problem

ROOT = Path(__file__).resolve().parent.parent
RECIPES_DIR = ROOT / "recipes"


def no_tokens(cfg: TrainConfig) -> int | None:
    return None


def no_summary(cfg: TrainConfig, cache_dir: Path) -> dict[str, float]:
    return {}


def no_metrics(model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    return {}


def no_preview(cfg: TrainConfig, cache_dir: Path) -> str | None:
    return None


def no_generations(model: torch.nn.Module, cfg: TrainConfig, eval_set: Any) -> list[dict[str, str]]:
    return []


def no_precompute(cfg: TrainConfig) -> None:
    return None


def no_strategy_problems(cfg: TrainConfig, strategy: Any) -> list[Problem]:
    return []


def nothing_held() -> None:
    return None


def hold_nothing(state: dict[str, Any]) -> None:
    raise ConfigError([Problem("the checkpoint holds a rollout's completions, and this recipe has no "
                               "load_rollout_state to take them back", "--recipe",
                               "resume with the recipe that wrote the checkpoint")])


@dataclass(frozen=True, slots=True)
class Rollout:
    """What a recipe's rollout hook returns (above)."""

    micro_batches: list
    metrics: dict[str, float]
    rows: list[dict[str, Any]]


def export_safetensors(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], cfg: TrainConfig,
                       cache_dir: Path, out_dir: Path) -> None:
    """final/model.safetensors and final/config.json (the run's config, to rebuild the model with build_model).

    A tied parameter (one Parameter under two names, like input and output embeddings) is written once, under its
    first name, as safetensors' own save_model does: its load_model then restores both names from it.
    """
    from safetensors.torch import save_file

    first: dict[int, str] = {}
    tied = [name for name, p in model.named_parameters(remove_duplicate=False) if first.setdefault(id(p), name) != name]
    # contiguous copies: what a reload needs, and gathered tensors may still share memory
    save_file({k: v.detach().contiguous().clone() for k, v in state_dict.items() if k not in tied},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config_dict(cfg), indent=2) + "\n")


@dataclass(frozen=True, slots=True)
class Recipe:
    """A loaded recipe file: its required functions, and its optional hooks or their defaults."""

    path: Path
    Config: type[TrainConfig]
    build_model: Callable[[Any], torch.nn.Module]
    build_datasets: Callable[[Any, Path], tuple[Any, Any]]
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    tokens_per_sample: Callable[[Any], int | None] = no_tokens
    summary: Callable[[Any, Path], dict[str, float]] = no_summary
    eval_metrics: Callable[[torch.nn.Module, Any], dict[str, torch.Tensor]] = no_metrics
    export: Callable[[torch.nn.Module, dict, Any, Path, Path], None] = export_safetensors
    preview: Callable[[Any, Path], str | None] = no_preview
    generate: Callable[[torch.nn.Module, Any, Any], list[dict[str, str]]] = no_generations
    loss_weight: Callable[[Any, Any], Any] | None = None
    precompute: Callable[[Any], PrecomputeFn | OwnModel | None] = no_precompute
    rollout: Callable[[torch.nn.Module, Any, int, list], Rollout] | None = None
    rollout_state: Callable[[], dict[str, Any] | None] = nothing_held
    load_rollout_state: Callable[[dict[str, Any]], None] = hold_nothing
    check_strategy: Callable[[Any, Any], list[Problem]] = no_strategy_problems
    sequence_parallel: bool = False
    pipeline_layers: Callable[[torch.nn.Module], Any] | None = None
    pipeline_stage: Callable[[torch.nn.Module, range, bool, bool], torch.nn.Module] | None = None
    pipeline_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # What the loss reported beside itself since it was last taken (take_reported): each name's sum over the samples
    # of the micro-batches, and under SAMPLES how many samples that is. Not a hook.
    reported: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    # The protocol's functions called with their results checked: a recipe mistake is an error naming the file, the
    # function and what was expected, not a traceback from deep inside a library.

    def make_model(self, cfg: TrainConfig) -> torch.nn.Module:
        model = self.build_model(cfg)
        if not isinstance(model, torch.nn.Module):
            raise ConfigError([Problem(f"recipe {self.path}: build_model returned {type(model).__name__}, not a "
                                       f"torch.nn.Module", "--recipe", "return the model from build_model")])
        return model

    def make_datasets(self, cfg: TrainConfig, cache_dir: Path) -> tuple[Any, Any]:
        from torch.utils.data import default_collate

        from trainkit.data.stream import Streamed

        splits = self.build_datasets(cfg, cache_dir)
        if not (isinstance(splits, tuple | list) and len(splits) == 2):
            raise ConfigError([Problem(f"recipe {self.path}: build_datasets returned {type(splits).__name__}, not "
                                       f"(train, eval)", "--recipe", "return two map-style datasets: train, eval")])
        for name, split in zip(("train", "eval"), splits, strict=True):
            if isinstance(split, Streamed):  # read as it trains: its rows are made by trainkit's RowMakers
                continue
            try:
                default_collate([split[0], split[min(1, len(split) - 1)]])
            except Exception as e:  # not a dataset, empty, or samples that do not stack into a batch
                raise ConfigError([Problem(
                    f"recipe {self.path}: build_datasets' {name} split does not give batches: {type(e).__name__}: "
                    f"{' '.join(str(e).split())[:200]}", "--recipe",
                    "return map-style datasets (len and [i]) whose samples are tensors, tuples or dicts of tensors "
                    "of one shape")]) from None
        return splits[0], splits[1]

    def compute_loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        value = self.loss(model, batch)
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
            value, sums = value
            for name, total in {**sums, SAMPLES: torch.tensor(float(_samples(batch)))}.items():
                self.reported[name] = self.reported.get(name, 0.0) + total.detach().float().sum()
        if not (torch.is_tensor(value) and value.numel() == 1 and value.is_floating_point()):
            got = f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}" if torch.is_tensor(value) \
                else type(value).__name__
            raise ConfigError([Problem(f"recipe {self.path}: loss returned {got}, not a scalar float tensor",
                                       "--recipe", "return the mean loss over the micro-batch, e.g. "
                                                   "torch.nn.functional.mse_loss(model(x), y)")])
        if torch.is_grad_enabled() and model.training and not value.requires_grad:
            raise ConfigError([Problem(f"recipe {self.path}: loss returned a tensor that does not require grad "
                                       f"(computed under no_grad, or detached)", "--recipe",
                                       "compute the loss from the model's output without .detach() or .item()")])
        return value


    def take_reported(self) -> dict[str, torch.Tensor]:
        """What the loss reported since the last call (sums, and SAMPLES), emptied; {} for a loss that reports
        nothing."""
        taken = dict(self.reported)
        self.reported.clear()
        return taken

    def evaluation_metrics(self, model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """eval_metrics' sums for the held-out micro-batch the loss was just computed on: the recipe's own, or what
        its loss reported on it."""
        reported = self.take_reported()
        reported.pop(SAMPLES, None)
        return {**reported, **self.eval_metrics(model, batch)}


SAMPLES = "samples"  # Recipe.reported's count of the samples its sums are over


def _samples(batch: Any) -> int:
    """A micro-batch's samples: the first dimension of its first tensor."""
    first = batch
    while not torch.is_tensor(first):
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    return first.shape[0]


REQUIRED = ("Config", "build_model", "build_datasets", "loss")
FLAGS = ("sequence_parallel",)  # what a recipe declares with a value, not a function
OPTIONAL = tuple(f.name for f in dataclasses.fields(Recipe) if f.name not in (*REQUIRED, "path", "reported"))


def shipped_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.py") if not p.name.startswith("_"))


def recipe_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".py" or path.parent != Path("."):
        if not path.is_file():
            raise ConfigError([Problem(f"recipe file {name_or_path} does not exist", "--recipe",
                                       "pass a shipped name or the path of a recipe file")])
        return path.resolve()
    if (RECIPES_DIR / f"{name_or_path}.py").is_file():
        return RECIPES_DIR / f"{name_or_path}.py"
    raise ConfigError([Problem(f"no shipped recipe named {name_or_path!r}", "--recipe",
                               f"use one of {', '.join(shipped_recipes())} or the path of a recipe file")])


def load_recipe(name_or_path: str) -> Recipe:
    """Import the recipe file and check that it provides the protocol above."""
    path = recipe_path(name_or_path)
    module_name = f"recipe_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while the file executes
    if str(path.parent) not in sys.path:  # its own modules beside it import, as when Python runs the file; last, so
        sys.path.append(str(path.parent))  # that a file there never hides an installed package
    try:
        spec.loader.exec_module(module)
    except ConfigError:
        raise
    except Exception as e:  # a broken recipe file: say which file and what broke, without a traceback
        raise ConfigError([Problem(f"recipe {path} failed to import: {type(e).__name__}: {e}", "--recipe",
                                   f"fix the recipe file (PYTHONPATH={ROOT} python {path} shows the traceback)")]
                          ) from e
    missing = [name for name in REQUIRED if not hasattr(module, name)]
    if missing:
        raise ConfigError([Problem(f"recipe {path} lacks {', '.join(missing)}", "--recipe",
                                   "define them as recipes/mlp.py does (copy it and edit)")])
    problems = _config_problems(module.Config, path)
    problems += [Problem(f"recipe {path}: {name} is not a function", "--recipe", f"define `def {name}(...)`")
                 for name in (*REQUIRED[1:], *OPTIONAL)
                 if hasattr(module, name) and name not in FLAGS and not callable(getattr(module, name))]
    problems += [Problem(f"recipe {path}: {name} is {getattr(module, name)!r}, not True or False", "--recipe",
                         f"write `{name} = True`") for name in FLAGS
                 if hasattr(module, name) and not isinstance(getattr(module, name), bool)]
    if problems:
        raise ConfigError(problems)
    hooks = {name: getattr(module, name) for name in OPTIONAL if hasattr(module, name)}
    return Recipe(path=path, Config=module.Config, build_model=module.build_model,
                  build_datasets=module.build_datasets, loss=module.loss, **hooks)


def _config_problems(config: Any, path: Path) -> list[Problem]:
    """Config must be TrainConfig's dataclass subclass, declared as a dataclass itself: without the decorator its
    fields would silently not exist (the base's defaults would train, and its own flags be called unknown)."""
    declare = "declare `@dataclass(kw_only=True, slots=True) class Config(TrainConfig)`"
    if not (isinstance(config, type) and issubclass(config, TrainConfig)):
        return [Problem(f"recipe {path}: Config must subclass trainkit.config.TrainConfig", "--recipe", declare)]
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    own = [name for name in vars(config) if name in fields or name in vars(config).get("__annotations__", {})]
    if config is not TrainConfig and "__dataclass_fields__" not in vars(config) and own:
        return [Problem(f"recipe {path}: Config is not a dataclass, so its fields ({', '.join(own)}) do not exist",
                        "--recipe", f"put @dataclass(kw_only=True, slots=True) on it: {declare}")]
    return []
