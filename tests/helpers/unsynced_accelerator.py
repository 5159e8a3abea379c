"""Reproduces the worst CPU trap: a MULTI_GPU launch whose script builds Accelerator() without cpu=True.

Each process then believes it is alone (DistributedType.NO). The strategy's start-up check must refuse it.
"""

import sys

from accelerate import Accelerator

from trainkit.config import TrainConfig
from trainkit.errors import ConfigError
from trainkit.launch.launcher import Launch
from trainkit.strategies import accelerator as built
from trainkit.strategies.registry import for_launch

accelerator = Accelerator()
try:
    strategy = for_launch(Launch.from_env(), TrainConfig(), {})
    built.verify(accelerator, strategy.engine(strategy))
except ConfigError as e:
    print("\n".join(f"error: {line}" for line in e.lines()), file=sys.stderr)
    sys.exit(2)
print("not refused")
