"""Fixtures that run train.py for real (one process, or N processes through `accelerate launch`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainkit.compare import ROOT, Run, max_rel_diff, run_config

__all__ = ["ROOT", "Run", "assert_refused", "launch", "max_rel_diff"]


def launch(output_dir: Path, *args: str, config: str | None = None, extra_launch: tuple[str, ...] = (),
           script: str = "train.py", env: dict | None = None) -> Run:
    """`python train.py ARGS` (config None) or `accelerate launch --config_file <config>.yaml train.py ARGS`,
    with the tests' own data cache, one thread per process and no network."""
    test_env = {"TRAINKIT_CACHE": str(ROOT / ".cache" / "tests"), "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1",
                "PYTHONPATH": str(ROOT), **(env or {})}
    return run_config(config, output_dir, list(args), launch_args=extra_launch, script=script, env=test_env)


def assert_refused(run: Run, message: str, code: int = 2) -> None:
    """A bad input: the given exit status (any non-zero one under a launcher, which reports a failed child with
    its own traceback after ours), our `error:` line, and no traceback from the project's code."""
    assert run.returncode == code or (code and run.returncode != 0 and "ChildFailedError" in run.stderr), run.stderr
    assert f"error: {message}" in run.stderr or message in run.stderr and "error: " in run.stderr, run.stderr
    assert 'train.py", line' not in run.stderr and "trainkit/" not in run.stderr, run.stderr


@pytest.fixture
def run_dir(tmp_path):
    """A fresh output directory per call: run_dir('name')."""
    return lambda name: tmp_path / name
