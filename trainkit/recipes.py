"""The recipe protocol, and loading a recipe by shipped name or by file path.

A recipe is one Python file. It defines:

    Config                      a dataclass subclassing trainkit.config.TrainConfig
    build_model(cfg)            -> torch.nn.Module
    build_datasets(cfg, cache_dir) -> (train, eval) map-style datasets of equal-shaped samples
    loss(model, batch)          -> scalar tensor: the mean loss over the micro-batch

and optionally:

    tokens_per_sample(cfg)      -> int: tokens in one sample, for tokens/s and MFU (token recipes)
    summary(cfg, cache_dir)     -> dict of extra numbers to print and record at the end (e.g. unigram entropy)
    export(model, state_dict, cfg, cache_dir, out_dir)  writes final/ (default: model.safetensors + config.json)
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

from trainkit.config import ConfigError, TrainConfig, problem

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
REQUIRED = ("Config", "build_model", "build_datasets", "loss")


def shipped_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.py") if not p.name.startswith("_"))


def recipe_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".py" or path.parent != Path("."):
        if not path.is_file():
            raise ConfigError([problem(f"recipe file {name_or_path} does not exist", "--recipe",
                                       "pass a shipped name or the path of a recipe file")])
        return path.resolve()
    if (RECIPES_DIR / f"{name_or_path}.py").is_file():
        return RECIPES_DIR / f"{name_or_path}.py"
    raise ConfigError([problem(f"no shipped recipe named {name_or_path!r}", "--recipe",
                               f"use one of {', '.join(shipped_recipes())} or the path of a recipe file")])


def load_recipe(name_or_path: str) -> types.ModuleType:
    """Import the recipe file and check that it provides the protocol above."""
    path = recipe_path(name_or_path)
    module_name = f"recipe_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(module)
    except ConfigError:
        raise
    except Exception as e:  # a broken recipe file: say which file and what broke, without a traceback
        raise ConfigError([problem(f"recipe {path} failed to import: {type(e).__name__}: {e}", "--recipe",
                                   f"fix the recipe file (`python {path}` shows the traceback)")]) from e
    missing = [name for name in REQUIRED if not hasattr(module, name)]
    if missing:
        raise ConfigError([problem(f"recipe {path} lacks {', '.join(missing)}", "--recipe",
                                   "define them as recipes/mlp.py does (copy it and edit)")])
    if not (isinstance(module.Config, type) and issubclass(module.Config, TrainConfig)):
        raise ConfigError([problem(f"recipe {path}: Config must subclass trainkit.config.TrainConfig", "--recipe",
                                   "declare `@dataclass(kw_only=True, slots=True) class Config(TrainConfig)`")])
    return module
