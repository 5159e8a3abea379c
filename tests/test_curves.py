"""Each shipped recipe's first steps against a checked-in loss curve: a change that moves the numbers (initial
weights, data order, tokenizer, schedule, loss averaging, a library upgrade) fails here, so it is never silent.

After a deliberate change: `TRAINKIT_UPDATE_CURVES=1 python -m pytest tests/test_curves.py`, then commit the files in
tests/curves/ with the reason in the message.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TEST_ENV, launch, max_rel_diff
from trainkit.data.text import default_corpus

# One process, fp32, the recipe's own defaults; --stop_at keeps the schedule of the full run (max_steps).
CURVES = {
    "mlp": ["--recipe", "mlp", "--stop_at", "20", "--eval_every", "0"],
    "tiny_transformer": ["--recipe", "tiny_transformer", "--stop_at", "10", "--eval_every", "0"],
}
# Same code and libraries, another CPU: kernels may round differently (measured differences are ~1e-7); any real
# change in what is trained moves the curve by far more.
TOLERANCE = 1e-4


def corpus_sha256() -> str:
    """The built-in corpus the runs read: this Python's pydoc topics (another CPython release ships other text)."""
    return hashlib.sha256(default_corpus(Path(TEST_ENV["TRAINKIT_CACHE"])).read_bytes()).hexdigest()


@pytest.mark.parametrize("recipe", CURVES)
def test_loss_curve_is_the_checked_in_one(run_dir, recipe):
    path = ROOT / "tests" / "curves" / f"{recipe}.json"
    inputs = {"args": CURVES[recipe], "torch": torch.__version__,
              "corpus_sha256": corpus_sha256() if recipe == "tiny_transformer" else None}
    update = bool(os.environ.get("TRAINKIT_UPDATE_CURVES"))
    if not update:
        expected = json.loads(path.read_text())
        if expected["corpus_sha256"] != inputs["corpus_sha256"]:
            pytest.skip("this Python's pydoc topics (the built-in corpus) differ from those the curve was made with")
        assert {k: expected[k] for k in inputs} == inputs, f"{path} was made another way: regenerate it"
    run = launch(run_dir(recipe), *CURVES[recipe]).check()
    if update:
        path.write_text(json.dumps({**inputs, "losses": run.losses}, indent=1) + "\n")
        expected = {"losses": run.losses}
    assert len(run.losses) == len(expected["losses"])
    assert max_rel_diff(run.losses, expected["losses"]) <= TOLERANCE, (
        f"{recipe}'s loss curve moved from {path.name}: if the change is deliberate, regenerate the curve "
        f"(see this file's docstring)")
