"""Online reinforcement learning: what an RL recipe (recipes/grpo.py) does between reading its prompts and its loss.

    sampling.py  completions from the policy with its KV cache, each from a generator seeded by the run's seed, the
                 step, the prompt and the completion's number: the same completions on any number of processes
    rewards.py   the user's reward functions (--reward_funcs module.function), called and checked, and their weights

May import the spine (errors), trainkit.data and torch; nothing that knows about strategies or runs.
"""
