"""train.py as a child process: its command line under a launcher (or none), run to its end or for at most a time
limit, and the whole process tree killed when it overstays. What python -m trainkit.tools.compare, the benchmarks in
bench/ and the tests launch runs with."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from trainkit.launch.launcher import config_path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Run:
    """A finished train.py run: its exit status, output and output directory."""

    name: str
    returncode: int
    stdout: str
    stderr: str
    output_dir: Path

    @property
    def metrics(self) -> list[dict]:
        path = self.output_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]

    @property
    def resolved(self) -> dict:
        return json.loads((self.output_dir / "resolved_config.json").read_text())

    def check(self) -> Run:
        assert self.returncode == 0, f"{self.name} failed ({self.returncode}):\n{self.stderr[-4000:]}"
        return self


def launch_command(config: str | None, output_dir: Path, args: list[str], num_processes: int | None = None,
                   launch_args: tuple[str, ...] = (), script: str = "train.py") -> list[str]:
    """`python SCRIPT ARGS` (config None), or `accelerate launch --config_file CONFIG [--num_processes N] LAUNCH_ARGS
    SCRIPT ARGS` on a free port, CONFIG a name from accelerate_configs/ or a path to a .yaml; train.py also gets
    --output_dir and --report_to none."""
    if config is None:
        cmd = [sys.executable, script]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_path(config)),
               "--main_process_port", "0", *launch_args]
        if num_processes:
            cmd += ["--num_processes", str(num_processes)]
        cmd.append(script)
    if script == "train.py":
        cmd += ["--output_dir", str(output_dir), "--report_to", "none"]
    return [*cmd, *args]


def run_config(config: str | None, output_dir: Path, args: list[str], num_processes: int | None = None,
               launch_args: tuple[str, ...] = (), script: str = "train.py", env: dict | None = None,
               timeout: float | None = None) -> Run:
    """Run launch_command(...) from the repository root to its end, or for at most `timeout` seconds: a launch still
    running then (a rank that hung) is killed with every process under it and reads as failed."""
    cmd = launch_command(config, output_dir, args, num_processes, launch_args, script)
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, **(env or {})}) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            stdout, stderr = proc.communicate()
            stderr += f"\nkilled after {timeout:.0f} s: the launch had not ended\n"
    return Run(config or "one process", proc.returncode, stdout, stderr, output_dir)


def kill_tree(proc: subprocess.Popen | psutil.Process, sig: int = signal.SIGKILL) -> None:
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
    if sig == signal.SIGKILL:
        _wait_ended(tree)


def _wait_ended(procs: list[psutil.Process], timeout: float = 10.0) -> None:
    """Return once every process has ended (gone, or a zombie that its parent has not reaped yet): a killed process
    closes its pipes before it has ended, so a caller that read the launch's output to its end could still see it
    running."""
    deadline = time.monotonic() + timeout
    for p in procs:
        while time.monotonic() < deadline:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)


def max_rel_diff(curve: list[float], reference: list[float]) -> float:
    if len(curve) != len(reference):
        return float("inf")
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(curve, reference, strict=True))
