"""The classic data-parallel checks: every split of the same global batch trains exactly like one process."""

from __future__ import annotations

import pytest

from conftest import launch, max_rel_diff

pytestmark = pytest.mark.slow  # 2-process launches

STEPS = ["--max_steps", "25", "--eval_every", "0", "--warmup_steps", "2"]


@pytest.fixture(scope="module")
def mlp_reference(tmp_path_factory):
    """One process, micro-batch 32: the curve every other layout of a 32-sample global batch must reproduce."""
    return launch(tmp_path_factory.mktemp("ref") / "out", "--recipe", "mlp", "--batch_size", "32", *STEPS).check()


@pytest.mark.parametrize("config, processes, batch_size, grad_accum", [
    # 1 process, 4 micro-batches of 8 (2 processes, no accumulation: every config, test_strategies.py), launched as
    # ddp.yaml with --num_processes 1: torchrun's world of one
    ("ddp", 1, 8, 4),
    ("ddp", 2, 4, 4),  # 2 processes x 4 micro-batches of 4
])
def test_mlp_matches_one_process(mlp_reference, run_dir, config, processes, batch_size, grad_accum):
    run = launch(run_dir("run"), "--recipe", "mlp", "--batch_size", str(batch_size), "--grad_accum",
                 str(grad_accum), *STEPS, config=config, extra_launch=("--num_processes", str(processes))).check()
    assert run.resolved["global_batch_size"] == 32 and run.resolved["world_size"] == processes
    assert max_rel_diff(run.losses, mlp_reference.losses) <= 1e-5
    # the curve is a real training curve, not a constant both sides share
    assert mlp_reference.losses[-1] < 0.5 * mlp_reference.losses[0]


def test_unsynchronised_processes_are_refused(run_dir):
    """Without the runner's cpu=True, a CPU machine runs 2 unrelated copies: the start-up check must say so."""
    run = launch(run_dir("x"), config="ddp", script="tests/helpers/unsynced_accelerator.py")
    assert run.returncode != 0
    assert "Accelerate runs as NO, but the launch asked for ddp (MULTI_CPU on this machine)" in run.stderr
    assert "Accelerate sees 1 process(es) but the launcher started 2" in run.stderr
    assert "not refused" not in run.stdout
