"""The machinery train.py calls, a folder per concern; the spine that every folder builds on sits at this level.

    errors.py        Problem (what / where / fix) and the two error types; imports nothing of the project
    config.py        TrainConfig, the fields every recipe has, and a recipe's config built from overrides
    command_line.py  train.py's flags: the run options and the recipe-field overrides
    recipes.py       the recipe protocol; loading a recipe by shipped name or by path
    plan.py          everything checkable before a model exists, resolved into one frozen Plan
    estimate.py      memory per rank under each strategy, before anything is built
    step.py          one optimizer step, as every engine runs it

    data/        samples to per-rank micro-batches: the order invariant, text, chat, preference pairs, streaming
    models/      the model a recipe trains: loading pretrained weights, LoRA, the optimizer, memory-saving layers
    losses/      objectives: the next-token loss in chunks
    strategies/  every parallelism (DDP, DeepSpeed, FSDP2/TP/CP on one mesh, pipelines, sequence parallelism)
    run/         what a run leaves and how it stops: checkpoints, the output folder, metrics, stop signals, restarts
    launch/      what the launcher asked for, the machine, the hostfile launcher, how a rank ends
    tools/       the commands users type beside training (python -m trainkit.tools.ask | catalog | compare | plot)

Nothing in the package imports tools/, and no recipe does: a tool is a user's command, not a library. The names
of the release before this layout still import, with a warning (moved.py).
"""

from trainkit import moved as _moved

_moved.install()


def __getattr__(name: str):  # `from trainkit import text`: a module of the earlier layout, from its new home
    if name in _moved.MOVED and name not in _moved.FOLDERS:
        globals()[name] = _moved.moved(name)  # said once: the import's second look finds it here
        return globals()[name]
    raise AttributeError(f"module 'trainkit' has no attribute {name!r}")
