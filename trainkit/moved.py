"""The module names of the release before trainkit/ was grouped by concern, kept working for one release: a recipe
written against them (`from trainkit import text`, `import trainkit.sft`) imports the module from its new home, with a
FutureWarning naming it. README.md's "Renamed in this release" lists the same names. Drop this file in the release
after.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

MOVED = {  # old name under trainkit -> its home now
    "data": "trainkit.data.batches", "precompute": "trainkit.data.precompute", "sft": "trainkit.data.sft",
    "stream": "trainkit.data.stream", "rows": "trainkit.data.stream_rows", "sources": "trainkit.data.stream_sources",
    "text": "trainkit.data.text", "decoder_stages": "trainkit.strategies.pipeline_decoder",
    "hardware": "trainkit.launch.hardware", "hosts": "trainkit.launch.hostfile",
    "launch": "trainkit.launch.launcher", "quiet": "trainkit.launch.library_noise",
    "process": "trainkit.launch.rank_exit", "chunked_loss": "trainkit.losses.chunked_loss",
    "offload": "trainkit.models.activation_offload", "finetune": "trainkit.models.finetune",
    "lora": "trainkit.models.lora", "optim": "trainkit.models.optimizer", "pretrained": "trainkit.models.pretrained",
    "tiled_mlp": "trainkit.models.tiled_mlp", "checkpoint": "trainkit.run.checkpoint",
    "metrics": "trainkit.run.metrics", "run_folder": "trainkit.run.output_folder",
    "restarts": "trainkit.run.restarts", "guards": "trainkit.run.stopping",
    "sequence_parallel": "trainkit.strategies.sequence_parallel", "ask": "trainkit.tools.ask",
    "catalog": "trainkit.tools.catalog", "compare": "trainkit.tools.compare", "plot": "trainkit.tools.plot",
}
# data and launch are folders now: `from trainkit import data` is the folder, as a new recipe means it; only the
# dotted imports of their old modules' names reach the old modules (none existed: trainkit.data.X is new)
FOLDERS = {"data", "launch"}


def moved(old: str) -> ModuleType:
    """The module that trainkit.<old> was, imported from its new home, said once per process."""
    new = MOVED[old]
    warnings.warn(f"trainkit.{old} moved to {new}: import it from there (the old name goes in the next release)",
                  FutureWarning, stacklevel=3)
    return importlib.import_module(new)


class OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import trainkit.text` and `from trainkit.text import X`: the new module under the old name."""

    def find_spec(self, fullname: str, path, target=None):
        package, _, old = fullname.partition(".")
        if package != "trainkit" or old not in MOVED or old in FOLDERS:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec) -> ModuleType:
        module = moved(spec.name.partition(".")[2])
        self.own_spec = module.__spec__  # importlib sets the old name's spec on it next: exec_module puts it back
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.own_spec  # the new module ran when it was imported


def install() -> None:
    if not any(isinstance(finder, OldNames) for finder in sys.meta_path):
        sys.meta_path.append(OldNames())
