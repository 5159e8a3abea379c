"""Library messages that tell a user of this runner nothing, silenced at their source: each one is listed here with
the reason, so that nothing else is hidden. Everything not listed still prints.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import warnings

import torch

# (category, message regex, why it tells the user nothing)
SILENCED = [
    (FutureWarning, r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
     "DeepSpeed's ZeRO calls these on every step (878 lines in a 20-step ZeRO-3 run); only DeepSpeed can change it"),
    (UserWarning, r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
                  r"(save|load) in a single process",
     "torch.distributed.checkpoint on one process without a process group: exactly what a one-process run does"),
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated",
     "peft's get_peft_model asks transformers for the old name of a property, once per LoRA model built; only peft "
     "can change it"),
]

# (logger, message regex, why): the same for messages that libraries log instead of warn
SILENCED_LOGS = [
    ("torch.distributed.tensor._redistribute", r"While redistributing from .* \d+ sequential \w+ operations will be "
                                               r"performed",
     "DTensor's note that it gathers a parameter sliced on two mesh dimensions (tensor parallelism inside FSDP2's "
     "shards, trainkit/strategies/fsdp.py) in two steps: for the gradient norm and for final/, one line per rank; "
     "every rank gets the same values, and only torch can merge the steps"),
]


def _thread_failed(args: threading.ExceptHookArgs) -> None:
    """TensorBoard's writer thread (tensorboard's _AsyncWriterThread) keeps the error that ended it and raises it in
    the training thread at the next record, where the run names it (trainkit/run/metrics.py): its own traceback, printed
    as the thread ends, says the same twice in raw form (a full disk gave two). Every other thread's as before."""
    if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
        return
    threading.__excepthook__(args)


def silence_library_noise() -> None:
    """Apply SILENCED, SILENCED_LOGS and _thread_failed; and on a machine without GPUs tell DeepSpeed its accelerator
    is the CPU, which is what its detection concludes anyway, after a "Setting accelerator to CPU" warning in every
    process."""
    for category, message, _ in SILENCED:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, message, _ in SILENCED_LOGS:
        logging.getLogger(name).addFilter(lambda record, match=re.compile(message).search:
                                          not match(record.getMessage()))
    threading.excepthook = _thread_failed
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
