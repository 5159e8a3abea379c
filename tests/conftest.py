"""Fixtures that run train.py for real (one process, or N processes through `accelerate launch`)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from trainkit.compare import ROOT, Run, launch_command, max_rel_diff, run_config

__all__ = ["ROOT", "TEST_ENV", "Run", "assert_refused", "kill_tree", "launch", "launch_command", "max_rel_diff",
           "parity_bound"]

# What every run in the tests gets: their own data cache, one thread per process, no network.
TEST_ENV = {"TRAINKIT_CACHE": str(ROOT / ".cache" / "tests"), "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1",
            "PYTHONPATH": str(ROOT)}



def parity_bound(config: str | None) -> float:
    """The max relative loss difference a config may show against the one-process run of the same global batch.

    cpu_adam (DeepSpeed's CPU Adam kernel, vectorised differently from torch.optim.AdamW) rounds differently;
    measured 1.3e-6 over 20 steps here, ~1e-4 over longer runs (PITFALLS): 1e-4 is the bound we can justify.
    """
    return 1e-4 if config in ("deepspeed_zero2_offload", "deepspeed_zero3_offload") else 1e-5


def launch(output_dir: Path, *args: str, config: str | None = None, extra_launch: tuple[str, ...] = (),
           script: str = "train.py", env: dict | None = None) -> Run:
    """`python train.py ARGS` (config None) or `accelerate launch --config_file <config>.yaml train.py ARGS`,
    with TEST_ENV."""
    return run_config(config, output_dir, list(args), launch_args=extra_launch, script=script,
                      env={**TEST_ENV, **(env or {})})


def kill_tree(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal a launch and every process under it, workers first (torchrun starts its workers in their own
    sessions, so a process group would miss them)."""
    try:
        parent = psutil.Process(proc.pid)
        tree = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


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


@pytest.fixture
def test_env(monkeypatch) -> None:
    """TEST_ENV in this test's own process (and so in whatever it starts), for tests that call code directly."""
    for name, value in TEST_ENV.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def check_only(capsys, test_env):
    """check_only(output_dir, ARGS): train.main(ARGS) inside the test process, for runs that build and train nothing
    (--dry_run, --estimate). The same code path as `python train.py ARGS`, without a new interpreter's seconds of
    imports per call: it keeps the many refusal tests cheap."""
    import train

    def run(output_dir: Path, *args: str) -> Run:
        capsys.readouterr()
        try:
            code = train.main([*args, "--output_dir", str(output_dir), "--report_to", "none"])
        except SystemExit as e:  # argparse refuses a flag's value by exiting
            code = e.code
        out = capsys.readouterr()
        return Run("in process", code, out.out, out.err, output_dir)

    return run
