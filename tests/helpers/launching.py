"""Running train.py in the tests: the test environment, the strategy matrix's entries, and launch(), which runs
train.py for real (one process, or N processes through `accelerate launch`), forked from a server that imported what
it imports once (tests/helpers/forked_launch.py) where that is shown to be the same run (tests/test_forked_launch.py).
tests/conftest.py holds the fixtures built on it."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import torch
import yaml
from helpers import forked_launch

from trainkit.launch.launcher import config_path, shipped_configs
from trainkit.launch.train_process import ROOT, Run, launch_command, run_config
from trainkit.recipes import load_recipe
from trainkit.strategies.registry import Strategy, for_launch, shipped_strategies

# What every run in the tests gets: their own data cache, one thread per process (TRAINKIT_CPU_THREADS: under a
# launcher OMP_NUM_THREADS=1 reads as the launcher's default, trainkit/launch/hardware.py), no network.
# Each pytest-xdist worker (pytest.ini runs two) has a cache of its own: two runs never write one file at once.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
TEST_ENV = {"TRAINKIT_CACHE": str(ROOT / ".cache" / "tests" / WORKER), "OMP_NUM_THREADS": "1",
            "TRAINKIT_CPU_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
# The environment that tests/helpers/forked_launch.py's server imports under: a run on another forks nothing.
SERVER_ENV = {**os.environ, **TEST_ENV}



# The longest launch of the suite takes under a minute on 2 cores; a hung rank fails its test after this many seconds
# instead of holding the suite until pytest's own timeout (pytest.ini), which would leave its processes running.
LAUNCH_TIMEOUT = 300


# The max relative loss difference any config may show against the one-process run of the same global batch.
# Measured: DDP, ZeRO-1/2/3 and FSDP within 2e-7 over 20 MLP steps; the cpu_adam offload configs within 3e-7 once the
# runner keeps its own AdamW and cpu_adam's bias correction exact (trainkit/strategies/deepspeed.py). Float32
# summation order is the only difference; 1e-5 leaves it a margin of 30 and catches any real mismatch.
PARITY_BOUND = 1e-5


# Strategies that flags select on a YAML rather than a YAML of their own (docs/model-parallelism.md): the pipeline on
# a data-parallel launch, and its products with the mesh of an FSDP launch (x FSDP2, x TP, x FSDP2 x TP).
# name -> (YAML, config fields, processes: 0 = the YAML's own).
PIPELINE = {"pipeline_stages": 2, "grad_accum": 2}
FLAG_STRATEGIES = {"pipeline": ("ddp", PIPELINE, 0), "pipeline_fsdp": ("fsdp", PIPELINE, 4),
                   "pipeline_tp": ("tp", PIPELINE, 4), "pipeline_fsdp_tp": ("fsdp_tp", PIPELINE, 8)}
# The shipped configs refused on a machine without GPUs (Strategy.needs_gpu), and what the tests launch for them
# there: torch's context parallelism with its ring attention's CUDA kernels replaced by the same mathematics on gloo.
GPU_ONLY = {name for name, launch in shipped_strategies().items() if for_launch(
    launch, load_recipe("tiny_transformer").Config(), {}, load_recipe("tiny_transformer")).needs_gpu}
CPU_STAND_INS = {name: "tests/helpers/context_parallel_on_cpu.py" for name in GPU_ONLY}
LAUNCHES = {**shipped_strategies(),
            **{name: dataclasses.replace(shipped_configs()[yaml], world_size=n or shipped_configs()[yaml].world_size)
               for name, (yaml, _, n) in FLAG_STRATEGIES.items()}}


def strategy_of(name: str, recipe: str = "tiny_transformer") -> Strategy:
    """What a shipped config or a flag strategy runs (made at plan time, nothing built)."""
    fields = FLAG_STRATEGIES[name][1] if name in FLAG_STRATEGIES else {}
    launch = LAUNCHES[name] if name in LAUNCHES else shipped_configs()[name]
    return for_launch(launch, load_recipe(recipe).Config(**fields), {}, load_recipe(recipe))


def processes(name: str) -> tuple[str, ...]:
    """`accelerate launch`'s arguments for a matrix entry's process count, where it is not its YAML's."""
    count = FLAG_STRATEGIES[name][2] if name in FLAG_STRATEGIES else 0
    return ("--num_processes", str(count)) if count else ()


def yaml_of(name: str, folder: Path) -> str:
    """The path of a matrix entry's YAML, for a check in process (--accelerate_config): a copy in `folder` with the
    entry's process count where it is not the YAML's own."""
    yaml, _, count = FLAG_STRATEGIES.get(name, (name, {}, 0))
    if not count:
        return str(ROOT / "accelerate_configs" / f"{yaml}.yaml")
    return str(write_yaml(folder, yaml, **{f"num_processes:__{shipped_configs()[yaml].world_size}":
                                           f"num_processes: {count}"}))


def entry(name: str, global_batch: int, grad_accum: int = 1) -> tuple[str, list[str]]:
    """(YAML, flags) that run a matrix entry with this global batch: the micro-batch shrinks as the data-parallel
    size grows; a flag strategy brings its own flags (and accumulation)."""
    yaml, fields, _ = FLAG_STRATEGIES.get(name, (name, {}, 0))
    grad_accum = fields.get("grad_accum", grad_accum)
    flags = [f"--{k}={v}" for k, v in fields.items() if k != "grad_accum"] + ["--grad_accum", str(grad_accum)]
    return yaml, [*flags, "--batch_size", str(global_batch // (grad_accum * strategy_of(name).data_parallel_size))]



def write_yaml(tmp_path, base: str, json_text: str | None = None, **changes: str):
    """A copy of a shipped YAML (and optionally of its DeepSpeed JSON) with some lines changed."""
    text = (ROOT / "accelerate_configs" / f"{base}.yaml").read_text()
    if json_text is not None:
        ds = tmp_path / "ds.json"
        ds.write_text(json_text)
        text = text.replace(f"ds_configs/{base.removeprefix('deepspeed_')}.json", str(ds))
    for old, new in changes.items():
        text = text.replace(old.replace("__", " "), new)
    path = tmp_path / f"{base}_custom.yaml"
    path.write_text(text)
    return path


def zero2_json(**changes) -> str:
    ds = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    ds.update(changes)
    return json.dumps(ds)


def launch(output_dir: Path, *args: str, config: str | None = None, extra_launch: tuple[str, ...] = (),
           script: str = "train.py", env: dict | None = None) -> Run:
    """_launch, each launch's seconds appended to TRAINKIT_LAUNCH_LOG where that names a file: which test launched
    what, for how long (how the suite's budget is measured; the README's test section)."""
    started = time.monotonic()
    run = _launch(output_dir, *args, config=config, extra_launch=extra_launch, script=script, env=env)
    if log := os.environ.get("TRAINKIT_LAUNCH_LOG"):
        with open(log, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0],
                                "config": config, "script": script, "args": [str(a) for a in args],
                                "seconds": round(time.monotonic() - started, 2)}) + "\n")
    return run


def forked_run_config(config, output_dir, args, num_processes=None, launch_args=(), script="train.py", env=None,
                      timeout=None) -> Run:
    """trainkit.tools.compare's run_config as the suite launches its runs: forked, where tests/test_forked_launch.py
    shows that path to train as the real command does (tests/test_docs.py and tests/test_strategies.py patch it in)."""
    processes = ("--num_processes", str(num_processes)) if num_processes else ()
    return launch(output_dir, *args, config=config, extra_launch=(*launch_args, *processes), script=script, env=env)


def _launch(output_dir: Path, *args: str, config: str | None = None, extra_launch: tuple[str, ...] = (),
            script: str = "train.py", env: dict | None = None) -> Run:
    """`python train.py ARGS` (config None) or `accelerate launch --config_file <config>.yaml train.py ARGS`,
    with TEST_ENV; a launch that has not ended after LAUNCH_TIMEOUT seconds is killed and fails its test. The
    launcher and train.py's processes are forked from one that imported what they import, once
    (tests/helpers/forked_launch.py). A shipped config that needs a GPU runs, on a machine without one, through
    CPU_STAND_INS' script (train.py with the one part that has no CPU kernels replaced: the script says how)."""
    if script == "train.py" and config in GPU_ONLY and not torch.cuda.is_available():
        script, args = CPU_STAND_INS[config], ("--output_dir", str(output_dir), "--report_to", "none", *args)
    command = launch_command(config, output_dir, list(args), launch_args=extra_launch, script=script)
    run_env = {**os.environ, **TEST_ENV, **(env or {})}
    if config is None and script == "train.py" and forkable(None):
        return Run("one process", *forked_launch.train(command[2:], ROOT, run_env, LAUNCH_TIMEOUT, SERVER_ENV),
                   output_dir)
    if config is None or not forkable(config):
        return run_config(config, output_dir, list(args), launch_args=extra_launch, script=script,
                          env={**TEST_ENV, **(env or {})}, timeout=LAUNCH_TIMEOUT)
    assert command[1:3] == ["-m", "accelerate.commands.launch"], command
    return Run(config, *forked_launch.launch(command[3:], ROOT, run_env, LAUNCH_TIMEOUT, SERVER_ENV), output_dir)


def forkable(config: str | None) -> bool:
    """Whether a run may be forked (tests/helpers/forked_launch.py): not on a machine with CUDA, and for a launch
    (config not None) not where a rank reads its launcher's process count from its command line
    (trainkit/launch/launcher.py): under Accelerate's one-process launcher (distributed_type NO or MULTI_CPU)."""
    if not forked_launch.available():
        return False
    if config is None:
        return True
    try:
        return yaml.safe_load((ROOT / config_path(config)).read_text())["distributed_type"] not in ("NO", "MULTI_CPU")
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
        return False  # what Accelerate makes of it is the test's to see


def error_lines(stderr: str) -> list[str]:
    """The project's error lines (a launch's closing report quotes them again, indented: trainkit/run/restarts.py)."""
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def assert_refused(run: Run, message: str, code: int = 2) -> None:
    """A bad input: the given exit status (any non-zero one under a launcher, which reports a failed child with
    its own traceback after ours), our `error:` line, and no traceback from the project's code."""
    assert run.returncode == code or (code and run.returncode != 0 and "ChildFailedError" in run.stderr), run.stderr
    assert f"error: {message}" in run.stderr or message in run.stderr and "error: " in run.stderr, run.stderr
    assert 'train.py", line' not in run.stderr and "trainkit/" not in run.stderr, run.stderr
