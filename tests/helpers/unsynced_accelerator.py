"""Reproduces the worst CPU trap: a MULTI_GPU launch whose script builds Accelerator() without cpu=True.

Each process then believes it is alone (DistributedType.NO). trainkit's start-up check must refuse it.
"""

import sys

from accelerate import Accelerator

from trainkit.config import ConfigError
from trainkit.strategy import Launch, verify_accelerator

accelerator = Accelerator()
try:
    verify_accelerator(Launch.from_env(), accelerator)
except ConfigError as e:
    print("\n".join(f"error: {p}" for p in e.problems), file=sys.stderr)
    sys.exit(2)
print("not refused")
