"""The user's reward functions: `--reward_funcs module.function[,...]`, plain Python callables with TRL's signature

    def my_reward(prompts, completions, completion_ids, **kwargs) -> list[float]

one number per completion (the completions are strings, or for chat prompts [{"role": "assistant", "content": ...}]),
`kwargs` every other field of the prompts' records by name, one value per completion, and TRL's three extras:
`trainer_state` (a transformers TrainerState: global_step, the optimizer steps done, and max_steps, for a reward that
changes as training goes on), `log_metric(name, value)` (a number for metrics.jsonl: its mean over the step's calls,
averaged over the processes) and `log_extra(column, values)` (one value per completion, a column of rollouts.jsonl).
An `async def` function is awaited, the step's async functions side by side (an LLM judge's requests). As in TRL,
None says that the function does not apply to a completion (a math reward on a code prompt): it adds nothing to the
completion's reward, and the function's metrics are its means over the completions it scored. A module is imported
from the working directory or the recipe's folder (recipes/rewards/chat.py ships the chat walk-through's:
`rewards.chat.arithmetic`, `rewards.chat.one_line`). A function that is missing, raises, or returns anything but one
number per completion is named with the sample it was given and the fix, before the first step (the dry run calls each
on one sample) as in the run. A number is a real number: a Python, numpy or one-element torch number; a string that
reads as one is refused, not parsed. A function whose signature cannot take what it is called with (the prompts' columns
and TRL's extras by name: `**kwargs` takes them) is refused when the run is planned.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy
import torch

from trainkit.errors import ConfigError, Problem

SIGNATURE = "def f(prompts, completions, completion_ids, **kwargs) -> list[float]"
EXTRAS = ("trainer_state", "log_metric", "log_extra")  # TRL's, passed by name on every call


@dataclass(frozen=True, slots=True)
class Reward:
    name: str  # the function's own name: metrics' rewards/<name>/mean
    path: str  # as --reward_funcs named it
    function: Callable[..., Any]


def load(spec: str, folders: Sequence[Path]) -> list[Reward]:
    """The functions `spec` names (comma-separated module.function; empty: none), importable from `folders`
    (searched after the installed packages)."""
    for folder in folders:
        if str(folder) not in sys.path:
            sys.path.append(str(folder))
    found = []
    for path in [part.strip() for part in spec.split(",") if part.strip()]:
        module_name, _, function = path.rpartition(".")
        if not module_name:
            raise ConfigError([Problem(f"--reward_funcs {path!r} names no module", "--reward_funcs",
                                       "write module.function, e.g. --reward_funcs rewards.chat.arithmetic")])
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # not found, or it fails to import: its own words
            raise ConfigError([Problem(f"--reward_funcs {path}: module {module_name} cannot be imported: "
                                       f"{type(e).__name__}: {e}", "--reward_funcs",
                                       f"put {module_name.replace('.', '/')}.py in the working directory or beside "
                                       f"the recipe, or fix what its import raises")]) from None
        target = getattr(module, function, None)
        if not callable(target):
            raise ConfigError([Problem(f"--reward_funcs {path}: {module_name} has no function {function}",
                                       "--reward_funcs", f"define `{SIGNATURE.replace('def f', f'def {function}')}` in "
                                       f"{getattr(module, '__file__', module_name)}")])
        found.append(Reward(function, path, target))
    return found


def signature_problems(found: Sequence[Reward], columns: Sequence[str]) -> list[Problem]:
    """Each function that cannot be called with the prompts' `columns` and the extras by name (it has no
    **kwargs and leaves one of them out, or wants an argument that is never passed)."""
    problems = []
    passed = ("prompts", "completions", "completion_ids", *columns, *EXTRAS)
    for reward in found:
        try:
            inspect.signature(reward.function).bind(**dict.fromkeys(passed))
        except TypeError as e:
            problems.append(Problem(f"reward function {reward.path} cannot be called as the run calls it ({e}): it "
                                    f"is given prompts, completions, completion_ids, the prompts' columns "
                                    f"({', '.join(columns) or 'none'}) and {', '.join(EXTRAS)} by name",
                                    "--reward_funcs", f"give it TRL's signature, {SIGNATURE}"))
        except ValueError:  # a builtin or C function without a signature: it is called as it is
            continue
    return problems


def weights(spec: str, names: Sequence[str]) -> list[float]:
    """--reward_weights: comma-separated numbers, one per reward (the functions', then the reward model's); empty:
    1 each."""
    if not spec:
        return [1.0] * len(names)
    try:
        values = [float(part) for part in spec.split(",")]
    except ValueError:
        values = []
    if len(values) != len(names):
        raise ConfigError([Problem(f"--reward_weights {spec!r}: {len(names)} reward(s) ({', '.join(names)}) need as "
                                   "many numbers", "--reward_weights",
                                   f"pass {len(names)} comma-separated numbers, e.g. {','.join(['1'] * len(names))}")])
    return values


@dataclass(slots=True)
class Logged:
    """What the functions passed to log_metric (name -> its values) and log_extra (column -> one value per
    completion) while scoring one batch."""
    metrics: dict[str, list[float]] = field(default_factory=dict)
    columns: dict[str, list[Any]] = field(default_factory=dict)


def score(rewards: Sequence[Reward], prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
          columns: dict[str, list[Any]], global_step: int, max_steps: int) -> tuple[list[list[float]], Logged]:
    """Each function's value of each completion: [function][completion], NaN where it returned None, and what they
    logged; a function that fails, returns something else than one finite number (or None) per completion, or logs
    a column of another length, refused naming it and the first sample."""
    from transformers import TrainerState

    logged = Logged()
    extras = {"trainer_state": TrainerState(global_step=global_step, max_steps=max_steps),
              "log_metric": lambda name, value: logged.metrics.setdefault(name, []).append(float(value)),
              "log_extra": lambda column, values: logged.columns.setdefault(column, []).extend(values)}
    sample = json.dumps({"prompt": prompts[0], "completion": completions[0]})[:300]

    def raised(reward: Reward, e: Exception) -> ConfigError:
        return ConfigError([Problem(f"reward function {reward.path} raised {type(e).__name__}: {e} (on "
                                    f"{len(completions)} completions, the first {sample})", "--reward_funcs",
                                    f"fix {reward.path}; it is called as {SIGNATURE}")])

    got: list[Any] = []
    for reward in rewards:
        try:
            got.append(reward.function(prompts=prompts, completions=completions, completion_ids=completion_ids,
                                       **columns, **extras))
        except Exception as e:
            raise raised(reward, e) from None
    waiting = [i for i, value in enumerate(got) if inspect.isawaitable(value)]
    if waiting:  # the async functions side by side, as TRL gathers them
        async def gathered() -> list[Any]:
            return await asyncio.gather(*(got[i] for i in waiting), return_exceptions=True)

        for i, value in zip(waiting, asyncio.run(gathered()), strict=True):
            if isinstance(value, Exception):
                raise raised(rewards[i], value) from None
            got[i] = value
    values = []
    for reward, value in zip(rewards, got, strict=True):
        scored, bad = _numbers(value, len(completions))
        if scored is None:
            raise ConfigError([Problem(f"reward function {reward.path} returned {repr(value)[:200]} for "
                                       f"{len(completions)} completions (the first {sample}): {bad}; it must return "
                                       "one finite real number (or None) per completion", "--reward_funcs",
                                       f"return a list of {len(completions)} floats (None where it does not apply)")])
        values.append(scored)
    for column, logged_values in logged.columns.items():
        if len(logged_values) != len(completions):
            raise ConfigError([Problem(f"the reward functions logged {len(logged_values)} values of column {column!r} "
                                       f"for {len(completions)} completions (the first {sample})", "--reward_funcs",
                                       "call log_extra(column, values) once per batch, one value per completion")])
        try:  # rollouts.jsonl holds them
            json.dumps(logged_values, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ConfigError([Problem(f"the reward functions logged values of column {column!r} that JSON cannot "
                                       f"hold: {e}", "--reward_funcs", "log numbers, strings, and lists or dicts of "
                                       "them (float(x) of a numpy value)")]) from None
    return values, logged


def _numbers(got: Any, count: int) -> tuple[list[float] | None, str]:
    """The values as floats (None: NaN), or None and what is wrong where they are not `count` finite real numbers
    or Nones."""
    if isinstance(got, (str, bytes, dict)) or not hasattr(got, "__iter__"):
        return None, f"that is a {type(got).__name__}, not a list"
    try:
        values = list(got)
    except TypeError:  # a 0-d array or tensor
        return None, f"that is a {type(got).__name__} with no values to list"
    if len(values) != count:
        return None, f"{len(values)} values"
    scored = []
    for i, value in enumerate(values):
        number = math.nan if value is None else _real(value)
        if number is None or (value is not None and not math.isfinite(number)):
            return None, f"completion {i}'s value {value!r} ({type(value).__name__}) is not a finite real number"
        scored.append(number)
    return scored, ""


def _real(value: Any) -> float | None:
    """A real number's value (Python's, numpy's, a one-element tensor's), or None: a string that reads as a number
    is not one (float("0.5") would take it)."""
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.numel() == 1 and not value.is_complex() else None
    if isinstance(value, (numbers.Real, numpy.bool_)):  # numpy's bool is no numbers.Real
        return float(value)
    return None
