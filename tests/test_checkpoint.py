"""Checkpoints: exact resume under every strategy, atomic saves under SIGKILL, pruning, cross-strategy resume,
signals, and final exports that equal the trained weights."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, TEST_ENV, assert_refused, kill_tree, launch, launch_command, max_rel_diff

MLP = ["--recipe", "mlp", "--max_steps", "12", "--eval_every", "0", "--batch_size", "8"]
# GPT-2 style with dropout on: the resume must also restore every rank's RNG exactly.
LM = ["--recipe", "tiny_transformer", "--max_steps", "10", "--eval_every", "0", "--batch_size", "4", "--hidden", "64",
      "--layers", "2", "--seq_len", "64", "--arch", "gpt2", "--dropout", "0.1"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["mlp", "tiny_transformer"])
@pytest.mark.parametrize("config", ["ddp", "deepspeed_zero2", "deepspeed_zero3", "fsdp"])
def test_resume_is_bitwise_exact(run_dir, config, recipe):
    """Resumed mid-epoch from step 5: the losses equal the uninterrupted run's, bit for bit (fp32, CPU)."""
    args = MLP if recipe == "mlp" else LM
    full = launch(run_dir("full"), *args, "--save_every", "5", config=config).check()
    state = json.loads((full.output_dir / "checkpoints" / "step_5" / "trainer_state.json").read_text())
    assert state["epoch"] == 0 and state["batch_in_epoch"] == 5  # mid-epoch
    resumed = launch(run_dir("resumed"), *args, "--resume", str(full.output_dir / "checkpoints" / "step_5"),
                     config=config).check()
    assert "resumed from" in resumed.stderr
    assert [m["step"] for m in resumed.metrics] == list(range(6, len(full.losses) + 1))
    assert resumed.losses == full.losses[5:]


def test_stop_at_then_resume_crosses_an_epoch(run_dir):
    """A 2-epoch run stopped (--stop_at) in the second epoch continues with that epoch's order."""
    args = ["--recipe", "mlp", "--train_samples", "256", "--batch_size", "32", "--max_steps", "14", "--eval_every", "0"]
    full = launch(run_dir("full"), *args).check()
    out = run_dir("staged")
    stopped = launch(out, *args, "--stop_at", "11").check()
    assert "stopped after step 11" in stopped.stdout and not (out / "final").exists()
    assert json.loads((out / "checkpoints/step_11/trainer_state.json").read_text())["epoch"] == 1
    assert launch(out, *args, "--resume", "latest").check().losses == full.losses


def test_keep_last_prunes_only_after_the_new_one_is_complete(run_dir):
    out = run_dir("out")
    launch(out, "--recipe", "mlp", "--max_steps", "10", "--save_every", "2", "--keep_last", "2").check()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_10", "step_8"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_10"


@pytest.mark.slow
def test_sigkill_during_a_save_keeps_the_previous_checkpoint(run_dir):
    """Kill every process (SIGKILL) while a checkpoint is half-written; latest must still name a whole one, and
    resuming from it must finish exactly like an uninterrupted run."""
    args = ["--recipe", "mlp", "--max_steps", "40", "--eval_every", "0", "--batch_size", "8", "--save_every", "1"]
    full = launch(run_dir("full"), *args, config="ddp").check()
    out = run_dir("killed")
    proc = subprocess.Popen(launch_command("ddp", out, args), cwd=ROOT, env={**os.environ, **TEST_ENV},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    caught = None
    deadline = time.time() + 120
    while caught is None and proc.poll() is None and time.time() < deadline:
        tmp = [p for p in (out / "checkpoints").glob("step_*.tmp")] if (out / "checkpoints").exists() else []
        if tmp and int(re.findall(r"\d+", tmp[0].name)[0]) >= 3:
            kill_tree(proc)
            caught = tmp[0]
        time.sleep(0.001)
    proc.wait()
    assert caught is not None, "the run ended before a save could be interrupted"
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert (out / "checkpoints" / latest / "trainer_state.json").exists()
    assert int(latest.removeprefix("step_")) < int(re.findall(r"\d+", caught.name)[0])
    resumed = launch(out, *args, "--resume", "latest", config="ddp").check()
    assert resumed.losses == full.losses


@pytest.mark.slow
def test_sigterm_stops_every_rank_at_one_step_with_a_checkpoint(run_dir):
    args = ["--recipe", "mlp", "--max_steps", "400", "--eval_every", "0", "--batch_size", "8", "--train_samples", "512"]
    out = run_dir("out")
    proc = subprocess.Popen(launch_command("ddp", out, args), cwd=ROOT, env={**os.environ, **TEST_ENV},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 20:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)  # to the launcher, as a scheduler's preemption does
    output = proc.communicate(timeout=120)[0]
    match = re.search(r"stopped after step (\d+) \(SIGTERM\)", output)
    assert match, output[-3000:]
    step = int(match.group(1))
    assert step < 400 and (out / "checkpoints" / "latest").read_text().strip() == f"step_{step}"
    assert len((out / "metrics.jsonl").read_text().splitlines()) == step
    resumed = launch(out, *args, "--resume", "latest", config="ddp").check()
    full = launch(run_dir("full"), *args, config="ddp").check()
    assert resumed.losses == full.losses


@pytest.mark.slow
def test_zero3_on_two_processes_continues_under_ddp_on_one(run_dir):
    """Another strategy cannot read DeepSpeed's optimizer shards: a warm start that says so, never a silent one."""
    out = run_dir("out")
    launch(out, *MLP, "--stop_at", "6", config="deepspeed_zero3").check()
    resumed = launch(out, *MLP[:-1], "16", "--resume", "latest").check()
    assert "weights loaded, optimizer state starts fresh" in resumed.stderr
    assert "saved under deepspeed (ZeRO-3) on 2 process(es)" in resumed.stderr
    continued = resumed.losses[6:]
    uninterrupted = launch(run_dir("uninterrupted"), *MLP[:-1], "16").check().losses[6:]
    # step 7's loss depends only on the weights: the same as never stopping, so they were loaded whole
    assert abs(continued[0] - uninterrupted[0]) <= 1e-5 * uninterrupted[0]
    # from step 8 on Adam's moments matter: fresh ones give another trajectory (as the note said)
    assert continued[1] != pytest.approx(uninterrupted[1], rel=1e-5)


@pytest.mark.slow
def test_zero2_checkpoint_reshards_through_a_universal_checkpoint(run_dir):
    """ZeRO-2 on 2 processes continued as ZeRO-2 on 1 and as ZeRO-1 on 2: DeepSpeed's universal checkpoint carries
    the optimizer state across, so the curve continues as if nothing had changed."""
    full = launch(run_dir("full"), *MLP, "--save_every", "6", config="deepspeed_zero2").check()
    step_6 = str(full.output_dir / "checkpoints" / "step_6")
    one = launch(run_dir("one"), *MLP[:-1], "16", "--resume", step_6, config="deepspeed_zero2",
                 extra_launch=("--num_processes", "1")).check()
    assert "converted to DeepSpeed's universal checkpoint" in one.stderr and "optimizer state kept" in one.stderr
    assert max_rel_diff(one.losses, full.losses[6:]) <= 1e-5
    zero1 = launch(run_dir("zero1"), *MLP, "--resume", step_6, config="deepspeed_zero1").check()
    assert "as ZeRO-1 on 2" in zero1.stderr
    assert max_rel_diff(zero1.losses, full.losses[6:]) <= 1e-5


@pytest.mark.slow
def test_fsdp_checkpoint_reshards_onto_one_process_with_optimizer_state(run_dir):
    """torch.distributed.checkpoint reshards FSDP's DTensor shards: the optimizer state survives the move."""
    out = run_dir("out")
    full = launch(run_dir("full"), *MLP, config="fsdp").check()
    launch(out, *MLP, "--stop_at", "6", config="fsdp").check()
    resumed = launch(out, *MLP[:-1], "16", "--resume", "latest").check()
    assert "optimizer state starts fresh" not in resumed.stderr
    assert max_rel_diff(resumed.losses, full.losses) <= 1e-5


def _weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.slow
def test_zero3_export_equals_the_gathered_training_weights(run_dir):
    out = launch(run_dir("out"), *MLP, "--save_every", "12", config="deepspeed_zero3").check().output_dir
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    trained = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints/step_12/deepspeed"), tag="deepspeed")
    exported = _weights(out / "final")
    assert exported.keys() == trained.keys() and all(exported[k].abs().sum() > 0 for k in exported)
    assert all(torch.equal(exported[k], trained[k]) for k in exported)


@pytest.mark.slow
def test_fsdp_export_equals_the_sharded_training_weights(run_dir):
    out = launch(run_dir("out"), *LM, "--save_every", "10", config="fsdp").check().output_dir
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out / "final")
    state = {"model": {k: torch.empty_like(v) for k, v in exported.state_dict().items()}}
    dcp.load(state, checkpoint_id=str(out / "checkpoints/step_10/state"))
    for name, value in exported.state_dict().items():
        assert torch.equal(value, state["model"][name]), name


def test_nothing_is_lost(run_dir):
    out = run_dir("out")
    launch(out, "--recipe", "mlp", "--max_steps", "4", "--save_every", "2").check()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert_refused(launch(out, "--recipe", "mlp", "--max_steps", "4"),
                   "already holds a run (checkpoints, metrics.jsonl, final)")
    assert_refused(launch(out, "--recipe", "mlp", "--max_steps", "4", "--resume", "latest", "--seed", "1"),
                   "seed is 1 but the checkpoint was trained with 0")
    assert_refused(launch(out, "--recipe", "mlp", "--resume", str(out / "checkpoints" / "step_3")),
                   "is not a complete checkpoint")
    assert_refused(launch(run_dir("empty"), "--recipe", "mlp", "--resume", "latest"), "no checkpoint to resume")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_project_loads_pickles_only_with_weights_only():
    for path in [ROOT / "train.py", *(ROOT / "trainkit").glob("*.py"), *(ROOT / "recipes").glob("*.py")]:
        for call in re.findall(r"torch\.load\([^)]*\)", path.read_text()):
            assert "weights_only=True" in call, f"{path.name}: {call}"
