"""Reward functions for the grpo tests (tests/test_grpo.py), named by --reward_funcs tests.helpers.rl_rewards.NAME:
dense ones that an untrained model's completions already spread, and broken ones whose mistakes are to be named."""

from __future__ import annotations

import asyncio

LOW = 40  # share_of_low_ids rewards the ids below it: a tenth of the tests' 400-token vocabulary


def share_of_low_ids(prompts, completions, completion_ids, **columns) -> list[float]:
    """The share of the completion's tokens whose id is below LOW: learnable from scratch, chance about 0.1."""
    return [sum(1 for i in ids if i < LOW) / max(1, len(ids)) for ids in completion_ids]


def even_ids(prompts, completions, completion_ids, **columns) -> list[float]:
    """The share of even token ids: about 0.5 for a random model, different for every completion."""
    return [sum(1 for i in ids if i % 2 == 0) / max(1, len(ids)) for ids in completion_ids]


def short(prompts, completions, completion_ids, answer=None, **columns) -> list[float]:
    """1 / (1 + tokens): reads the records' `answer` column to show it arrives."""
    assert answer is not None and len(answer) == len(completions)
    return [1.0 / (1 + len(ids)) for ids in completion_ids]


def raises(prompts, completions, completion_ids, **columns) -> list[float]:
    raise KeyError("label")


def too_few(prompts, completions, completion_ids, **columns) -> list[float]:
    return [1.0] * (len(completions) - 1)


def partial(prompts, completions, completion_ids, answer, **columns) -> list[float | None]:
    """None (TRL's "does not apply", as a multi-task reward says for other tasks' prompts) where the record's answer
    is odd, else 1: its mean over the completions it scored is 1, over all of them less."""
    return [None if a % 2 else 1.0 for a in answer]


async def even_ids_async(prompts, completions, completion_ids, **columns) -> list[float]:
    """even_ids as an LLM judge would be written: awaited."""
    await asyncio.sleep(0)
    return even_ids(prompts, completions, completion_ids)


def curriculum(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, **columns) -> list[float]:
    """TRL's extras: 1 for a completion longer than the optimizer steps done (trainer_state.global_step), else 0;
    logs the steps done and the share of completions whose first token id is even (log_metric), and each
    completion's first token id (log_extra)."""
    first = [ids[0] if ids else -1 for ids in completion_ids]  # the dry run's sample is empty
    log_metric("curriculum/steps_done", trainer_state.global_step)
    log_metric("curriculum/even_first", sum(i % 2 == 0 for i in first) / len(first))
    log_extra("first_id", first)
    return [float(len(ids) > trainer_state.global_step) for ids in completion_ids]


async def raises_async(prompts, completions, completion_ids, **columns) -> list[float]:
    raise TimeoutError("the judge did not answer")


def logs_a_set(prompts, completions, completion_ids, log_extra, **columns) -> list[float]:
    log_extra("seen", [set(ids) for ids in completion_ids])
    return [0.0] * len(completions)


def logs_the_loss(prompts, completions, completion_ids, log_metric, **columns) -> list[float]:
    log_metric("loss", 1.0)
    return [0.0] * len(completions)


def logs_an_advantage(prompts, completions, completion_ids, log_extra, **columns) -> list[float]:
    log_extra("advantage", [1.0] * len(completions))
    return [0.0] * len(completions)


def not_numbers(prompts, completions, completion_ids, **columns) -> list:
    return ["high"] * len(completions)


def numbers_as_strings(prompts, completions, completion_ids, **columns) -> list:
    """Strings that float() would read as 0.5: not numbers, refused (they trained as reward 0.5, advantage 0)."""
    return ["0.5"] * len(completions)


def no_kwargs(prompts, completions, completion_ids) -> list[float]:
    """No **kwargs: the columns and TRL's extras cannot be passed to it."""
    return [0.0] * len(completions)


def names_everything(prompts, completions, completion_ids, answer, trainer_state, log_metric, log_extra) -> list:
    """No **kwargs, but every argument it is called with named: callable."""
    return [0.0] * len(completions)
