"""Fixtures that run train.py for real (one process, or N processes through `accelerate launch`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "accelerate_configs"


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    output_dir: Path

    @property
    def metrics(self) -> list[dict]:
        lines = (self.output_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]

    @property
    def resolved(self) -> dict:
        return json.loads((self.output_dir / "resolved_config.json").read_text())

    def check(self) -> Run:
        assert self.returncode == 0, f"run failed ({self.returncode}):\n{self.stderr[-4000:]}"
        return self


def launch(output_dir: Path, *args: str, config: str | None = None, extra_launch: tuple[str, ...] = (),
           script: str = "train.py", env: dict | None = None, timeout: int = 600) -> Run:
    """`python train.py ARGS` (config None) or `accelerate launch --config_file <config>.yaml train.py ARGS`."""
    if config is None:
        cmd = [sys.executable, script]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / f"{config}.yaml"),
               "--main_process_port", "0", *extra_launch, script]
    if script == "train.py":
        cmd += ["--output_dir", str(output_dir), "--report_to", "none", *args]
    else:
        cmd += list(args)
    full_env = {**os.environ, "TRAINKIT_CACHE": str(ROOT / ".cache" / "tests"), "OMP_NUM_THREADS": "1",
                "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=full_env, timeout=timeout)
    return Run(proc.returncode, proc.stdout, proc.stderr, output_dir)


def assert_refused(run: Run, message: str, code: int = 2) -> None:
    """A bad input: the given exit status (any non-zero one under a launcher, which reports a failed child with
    its own traceback after ours), our `error:` line, and no traceback from the project's code."""
    assert run.returncode == code or (code and run.returncode != 0 and "ChildFailedError" in run.stderr), run.stderr
    assert f"error: {message}" in run.stderr or message in run.stderr and "error: " in run.stderr, run.stderr
    assert 'train.py", line' not in run.stderr and "trainkit/" not in run.stderr, run.stderr


def max_rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), f"curves of different lengths: {len(a)} vs {len(b)}"
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


@pytest.fixture
def run_dir(tmp_path):
    """A fresh output directory per call: run_dir('name')."""
    return lambda name: tmp_path / name
