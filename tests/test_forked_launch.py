"""The suite's runs come from tests/helpers/forked_launch.py's server: a forked run trains as the real command does,
takes its signals, dies with its client, and a run on an environment the server did not import under is not forked.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import forked_launch

from conftest import (
    FLAG_STRATEGIES,
    GPU_ONLY,
    LAUNCHES,
    ROOT,
    SERVER_ENV,
    TEST_ENV,
    entry,
    forkable,
    launch,
    processes,
    strategy_of,
)
from trainkit.launch.train_process import run_config
from trainkit.strategies.registry import REGISTRY, shipped_strategies

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not forked_launch.available(),
                                                  reason="runs are not forked where CUDA is (the real commands run)")]

MLP = ["--recipe", "mlp", "--max_steps", "4", "--eval_every", "2"]
LONG = ["--recipe", "mlp", "--max_steps", "1000000", "--eval_every", "0", "--report_to", "none"]


def server_log() -> str:
    return Path(forked_launch.server(SERVER_ENV)).with_name("server.log").read_text()


def server_children() -> set[int]:
    forked_launch.server(SERVER_ENV)
    return {p.pid for p in psutil.Process(forked_launch.SERVER[0].pid).children(recursive=True)}


def started(out: Path) -> subprocess.Popen:
    """A long one-process run through the client, once it has trained a step."""
    client = subprocess.Popen([sys.executable, forked_launch.__file__, "--rank", forked_launch.server(SERVER_ENV),
                               str(forked_launch.TRAIN), *LONG, "--output_dir", str(out)],
                              cwd=ROOT, env={**os.environ, **TEST_ENV}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    while not (out / "metrics.jsonl").exists():
        assert client.poll() is None, client.communicate()
        time.sleep(0.2)
    return client


def one_per_launch_path() -> list[str | None]:
    """One process, and per strategy family (the path a launch takes through the launcher, the engine and the
    libraries they import: torchrun-style DDP, DeepSpeed, the FSDP2/TP mesh, the pipeline), its most demanding
    2-process config: offload where the family has it. The other configs of a family differ only in settings read
    after the fork; each of them is forked by the suite's strategy matrix (tests/test_strategies.py), which launches
    every config through this fast path.
    Not the GPU-only configs: nothing is forked where CUDA is, and without it they are refused (the tests launch their
    CPU stand-in script instead, which is never forked)."""
    best: dict[type, tuple[int, str]] = {}
    for name in [*(n for n in shipped_strategies() if n not in GPU_ONLY), *FLAG_STRATEGIES]:
        strategy = strategy_of(name)
        if LAUNCHES[name].world_size == 2 and not strategy.needs_experts:  # a mixture of experts only: test_moe.py
            best[type(strategy)] = max(best.get(type(strategy), (-1, "")), (strategy.speed_rank, name))
    return [None, *sorted(name for _, name in best.values())]


MATRIX = one_per_launch_path()
SMALL_LM = ["--recipe", "tiny_transformer", "--max_steps", "2", "--eval_every", "1", "--hidden", "32", "--layers",
            "4", "--seq_len", "32", "--warmup_steps", "1"]


def test_one_config_of_each_launch_path_is_compared():
    """Every strategy family the registry holds has its real-versus-forked comparison (one process: the first)."""
    from trainkit.strategies.ddp import Single

    assert MATRIX[0] is None and {type(strategy_of(name)) for name in MATRIX[1:]} == set(REGISTRY) - {Single}


@pytest.mark.parametrize("config", MATRIX)
def test_a_forked_run_trains_as_the_real_command(tmp_path, config):
    """Launch path by launch path, the proof that the suite's fast path is the real one: a run forked from the server
    gives the same losses, evaluations, printed lines, output files and exit status as the real `python train.py` /
    `python -m accelerate.commands.launch` of the same config, and it was forked (the server names every run it did
    not fork)."""
    yaml, flags = entry(config, 16) if config else (None, ["--batch_size", "16"])
    args = [*(SMALL_LM if config and strategy_of(config).splits_model else MLP), *flags]
    extra = processes(config) if config else ()
    forked = launch(tmp_path / "forked", *args, config=yaml, extra_launch=extra).check()
    real = run_config(yaml, tmp_path / "real", args, launch_args=extra, env=TEST_ENV, timeout=300).check()
    assert forked.losses == real.losses and len(forked.losses) == (2 if "tiny_transformer" in args else 4)
    assert [m["eval_loss"] for m in forked.metrics if "eval_loss" in m] == \
        [m["eval_loss"] for m in real.metrics if "eval_loss" in m]
    assert sorted(os.listdir(tmp_path / "forked")) == sorted(os.listdir(tmp_path / "real"))
    evaluations = [line for line in real.stdout.splitlines() if line.startswith("step ")]  # "step 2: eval loss ..."
    assert [line for line in forked.stdout.splitlines() if line.startswith("step ")] == evaluations
    assert len(evaluations) == 2
    if config is None or forkable(yaml):
        assert str(tmp_path / "forked") not in server_log()


@pytest.mark.slow
def test_a_forked_expert_parallel_run_trains_as_the_real_command(chat, moe_folder, tmp_path):
    """fsdp_ep.yaml's ranks read the ep size from the YAML their launcher's command line names, which a forked rank's
    does not (the server's is above it): the fast path gives that size in the environment, as the YAML has it
    (tests/helpers/forked_launch.py's runner_sizes), and the run is the real command's: the experts split alike, the
    same losses, evaluations and printed lines."""
    args = ["--recipe", "causal_lm", "--model_name_or_path", str(moe_folder("qwen3_moe")), "--data", str(chat[1]),
            "--chat_template", "chatml", "--seq_len", "64", "--max_steps", "2", "--eval_every", "1", "--batch_size",
            "4", "--router_aux_loss_coef", "1"]
    forked = launch(tmp_path / "forked", *args, config="fsdp_ep").check()
    real = run_config("fsdp_ep", tmp_path / "real", args, env=TEST_ENV, timeout=300).check()
    assert trained(forked) == trained(real) and "eval_aux_loss" in real.metrics[-1]
    split = [line for line in real.stderr.splitlines() if "this rank holds" in line]
    assert split and split == [line for line in forked.stderr.splitlines() if "this rank holds" in line]
    assert [line for line in forked.stdout.splitlines() if line.startswith("step ")] == \
        [line for line in real.stdout.splitlines() if line.startswith("step ")]
    assert str(tmp_path / "forked") not in server_log()


def trained(run) -> list[dict]:
    """What a run's metrics.jsonl says of its training, without its timings."""
    return [{k: v for k, v in m.items() if "loss" in k or k.startswith("expert_load") or
             k in ("step", "grad_norm", "lr", "state_bytes")} for m in run.metrics]


def test_a_run_on_another_environment_is_the_real_process(tmp_path):
    """A variable that a library may read at import (MKL's threads here) differs from the server's: the client
    becomes `python train.py` itself, and the server's log says why."""
    out = tmp_path / "out"
    code, _, err = forked_launch.train([*MLP, "--output_dir", str(out), "--report_to", "none"], ROOT,
                                       {**SERVER_ENV, "MKL_NUM_THREADS": "1"}, 300, SERVER_ENV)
    assert code == 0, err
    assert f"not forked: {forked_launch.TRAIN} {' '.join(MLP)} --output_dir {out}" in server_log()
    assert server_log().rstrip().endswith(": MKL_NUM_THREADS")


def test_sigterm_to_the_client_stops_the_forked_run_at_a_step_with_a_checkpoint(tmp_path):
    """The client passes SIGTERM on: the run stops at a step boundary, saves there and exits 0 (the contract's
    preemption), as `python train.py` does."""
    out = tmp_path / "out"
    client = started(out)
    client.send_signal(signal.SIGTERM)
    _, err = client.communicate(timeout=60)
    assert client.returncode == 0, err
    assert (out / "stopped.json").exists() and (out / "checkpoints" / "latest").exists()
    assert str(out) not in server_log()


def test_a_client_killed_takes_its_forked_run_with_it(tmp_path):
    """SIGKILL to the client (a launcher's torchrun ending its workers, a test's time running out): its rank ends
    too, and nothing the server forked for it is left."""
    out = tmp_path / "out"
    client = started(out)
    forked = server_children()  # the run's watcher and the run
    assert len(forked) >= 2
    client.kill()
    client.communicate()
    deadline = time.monotonic() + 10
    while forked & server_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.returncode == -signal.SIGKILL and not forked & server_children()
