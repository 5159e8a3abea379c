"""Checkpoints: atomic saves under SIGKILL, pruning, staged runs, cross-strategy resume, signals, and final exports
that equal the trained weights. (Exact resume under every shipped config: tests/test_strategies.py.)"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from contextlib import suppress
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file

from conftest import (
    LAUNCH_TIMEOUT,
    RESTARTED,
    ROOT,
    TEST_ENV,
    assert_refused,
    kill_tree,
    launch,
    launch_command,
    max_rel_diff,
    tmpfs,
)
from conftest import (
    LM as MATRIX_LM,
)
from trainkit.errors import write_failure
from trainkit.launch.train_process import run_config

MLP = ["--recipe", "mlp", "--max_steps", "12", "--eval_every", "0", "--batch_size", "8"]
# GPT-2 style with dropout on: the resume must also restore every rank's RNG exactly.
LM = ["--recipe", "tiny_transformer", "--max_steps", "10", "--eval_every", "0", "--batch_size", "4", "--hidden", "64",
      "--layers", "2", "--seq_len", "64", "--arch", "gpt2", "--dropout", "0.1"]


@pytest.mark.slow
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
def test_resume_auto_is_one_command_for_the_first_start_and_every_restart(run_dir):
    """The same command line starts a new folder, continues a stopped run from its newest checkpoint, and finishes
    it: the loss curve of the run that was never stopped, bit for bit, each step once in metrics.jsonl."""
    args = [*MLP, "--save_every", "4", "--resume", "auto"]
    whole = launch(run_dir("whole"), *MLP, "--save_every", "4").check()
    out = run_dir("out")
    first = launch(out, *args, "--stop_at", "6").check()
    assert f"note: --resume auto: no checkpoint in {out}: a fresh start" in first.stderr
    second = launch(out, *args).check()
    assert f"note: --resume auto: continuing from {out / 'checkpoints' / 'step_6'}" in second.stderr
    assert [m["step"] for m in second.metrics] == list(range(1, 13))
    assert [m["loss"] for m in second.metrics] == [m["loss"] for m in whole.metrics]
    again = launch(out, *args).check()  # a restart after the end: nothing left to do, final/ kept
    assert "nothing left to train" in again.stdout and (out / "final" / "model.safetensors").is_file()


def test_a_refusal_is_not_restarted(run_dir):
    """`accelerate launch --max_restarts 3` and a flag that is refused (exit 2): torchrun restarts any failure, and
    each attempt used to redo the imports and checks to be refused alike (1.2 s per attempt measured on 2 cores).
    Now each later attempt finds the refusal in the attempt before's reply file and ends at once, saying so; torchrun's
    report at the end names the refusal instead of "To enable traceback see ..."."""
    run = run_config("ddp", run_dir("out"), ["--recipe", "mlp", "--max_stepz", "3"],
                     launch_args=("--max_restarts", "3"), env=TEST_ENV)
    assert run.returncode != 0
    assert run.stderr.count("error: unknown config field 'max_stepz' (--max_stepz): did you mean max_steps?") >= 4
    for attempt in (2, 3, 4):
        assert f"error: attempt {attempt} of 4 ended at once: the attempt before was refused the same command" \
            in run.stderr, run.stderr[-3000:]
    report = run.stderr[run.stderr.index("Root Cause"):]
    assert "traceback : error: unknown config field 'max_stepz'" in report, report
    assert "note: " not in run.stderr.split("attempt 2 of 4")[-1]  # later attempts never got as far as the plan


@pytest.mark.slow
def test_restarts_that_run_out_say_so(run_dir):
    """A failure that every attempt meets (a loss that diverges at step 2, after the checkpoint of step 1): torchrun
    restarts it until --max_restarts is used up. The last attempt says so: how many attempts ran, that the error above
    is the cause, and the checkpoint to continue from; torchrun's report, the launch's last lines, says the same."""
    out = run_dir("out")
    args = ["--recipe", "mlp", "--max_steps", "20", "--save_every", "1", "--resume", "auto", "--eval_every", "0",
            "--warmup_steps", "0", "--max_grad_norm", "0", "--lr", "1e30"]
    run = run_config("ddp", out, args, launch_args=("--max_restarts", "1"), env=TEST_ENV)
    assert run.returncode != 0
    assert "note: --resume auto: continuing from" in run.stderr, run.stderr[-3000:]  # the second attempt resumed
    newest = max((out / "checkpoints").glob("step_*"), key=lambda p: int(p.name.removeprefix("step_")))
    note = ("the launch ends: attempt 2 of 2 failed (--max_restarts 1 used up); the cause is the error above; once it "
            f"is removed, run the same command with --resume auto: it continues from {newest}")
    assert f"error: {note}" in run.stderr, run.stderr[-3000:]
    report = run.stderr[run.stderr.index("Root Cause"):]
    assert "non-finite" in report and note in report, report


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_killed_or_frozen_rank_restarts_and_the_run_continues_exactly(never_restarted, run_dir, sig):
    """`accelerate launch --max_restarts 1 ... --resume auto`: one rank SIGKILLed (the kernel's OOM killer) or
    SIGSTOPped (a hung rank) at a random step between two checkpoints; its peer loses contact at once or after
    TRAINKIT_DIST_TIMEOUT and ends, torchrun ends the other and starts both again, and the run continues from the
    newest checkpoint to the end. Each step is in metrics.jsonl once (those redone replace the lost ones) with the loss
    of the run that was never stopped, bit for bit; the work lost is less than --save_every steps."""
    import random

    import psutil

    save_every, steps, whole, args = 200, 600, never_restarted, RESTARTED
    out, kill_at = run_dir("out"), random.randint(save_every + 10, 2 * save_every - 40)
    command = launch_command("ddp", out, [*args, "--resume", "auto"], launch_args=("--max_restarts", "1"))
    log = run_dir("launch.log")  # a file, not a pipe: nothing reads the output while the test watches the run
    env = {**os.environ, **TEST_ENV, "TRAINKIT_DIST_TIMEOUT": "10"}  # how long a frozen rank is waited for
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    metrics, deadline, killed = out / "metrics.jsonl", time.time() + 120, None
    while killed is None and proc.poll() is None and time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= kill_at:
            ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if "train.py" in p.cmdline()]
            killed, victim = len(metrics.read_text().splitlines()), max(ranks, key=lambda p: p.pid)
            victim.send_signal(sig)  # one rank of the two
        time.sleep(0.005)
    killed_at, truncated, restart_s = time.time(), False, None  # the resume cuts metrics.jsonl back to its step
    while restart_s is None and proc.poll() is None and time.time() < deadline + 60:
        done = metrics.read_text().count("\n") if metrics.exists() else 0
        truncated = truncated or done < killed
        restart_s = time.time() - killed_at if truncated and done > save_every else None
        time.sleep(0.005)
    try:
        proc.wait(timeout=LAUNCH_TIMEOUT)
    finally:
        kill_tree(proc)
    output = log.read_text()
    assert killed is not None and killed < 2 * save_every, output[-3000:]
    assert proc.returncode == 0, output[-3000:]
    assert f"note: --resume auto: continuing from {out / 'checkpoints' / f'step_{save_every}'}" in output
    assert "note: attempt 2 of this launch (a rank was started again): the ranks joined anew" in output
    # the rank that went silent is named by the one that waited for it (the roll call, trainkit/launch/rank_exit.py)
    assert re.search(rf"error: rank \d lost contact with the other processes \(.*\); rank \d on {socket.gethostname()} "
                     rf"\(machine 0\), pid {victim.pid} did not answer within 3 s", output), output[-3000:]
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    assert [m["loss"] for m in lines] == whole.losses
    print(f"{sig.name} to a rank at step {killed}: steps {save_every + 1}-{killed} redone; {restart_s:.1f} s from "
          f"the signal to the restarted run's first step")
    assert restart_s is not None and restart_s < 90, output[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("config, save", [("ddp", []), ("fsdp", ["--async_save"])], ids=["ddp", "fsdp-async"])
def test_sigkill_during_a_save_keeps_the_previous_checkpoint(run_dir, config, save):
    """Kill every process (SIGKILL) while a checkpoint is half-written (under --async_save: while its write goes on
    beside the training); latest must still name a whole one, and resuming from it must finish exactly like an
    uninterrupted run that saved synchronously."""
    args = ["--recipe", "mlp", "--max_steps", "40", "--eval_every", "0", "--batch_size", "8", "--save_every", "1"]
    full = launch(run_dir("full"), *args, config=config).check()
    for attempt in range(3):  # the kill lands a moment after a save is seen: that save may have ended meanwhile
        out = run_dir(f"killed{attempt}")
        proc = subprocess.Popen(launch_command(config, out, [*args, *save]), cwd=ROOT,
                                env={**os.environ, **TEST_ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline:
            tmp = [p for p in (out / "checkpoints").glob("step_*.tmp")] if (out / "checkpoints").exists() else []
            if tmp and int(re.findall(r"\d+", tmp[0].name)[0]) >= 3:
                kill_tree(proc)
            time.sleep(0.001)
        proc.wait()
        # the saves the kill cut short: their folders left under the temporary name
        cut = sorted(int(re.findall(r"\d+", p.name)[0]) for p in (out / "checkpoints").glob("step_*.tmp"))
        if cut:
            break
    assert cut, "in 3 runs every save had ended when the kill landed"
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert (out / "checkpoints" / latest / "trainer_state.json").exists()
    assert int(latest.removeprefix("step_")) < cut[0]
    resumed = launch(out, *args, *save, "--resume", "latest", config=config).check()
    assert resumed.losses == full.losses
    # the loop's time in each save, recorded with the step after it: none before step 1 and each launch's first
    unsaved = [m["step"] for m in resumed.metrics if m["checkpoint_s"] == 0]
    assert unsaved[0] == 1 and len(unsaved) <= 2, unsaved


@pytest.mark.slow
@pytest.mark.parametrize("config", ["ddp", None], ids=["accelerate_launch", "python_train_py"])
def test_sigterm_stops_every_rank_at_one_step_with_a_checkpoint(run_dir, config):
    """SIGTERM to the launcher's process group, as a scheduler sends it: every rank stops at one step with a
    checkpoint, stopped.json says so, and the exit status is what docs/command-line.md says each launcher returns."""
    args = ["--recipe", "mlp", "--max_steps", "400", "--eval_every", "0", "--batch_size", "8", "--train_samples", "512"]
    out = run_dir("out")
    proc = subprocess.Popen(launch_command(config, out, args), cwd=ROOT, env={**os.environ, **TEST_ENV},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 20:
            break
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGTERM)  # the launcher and what shares its group (torchrun's ranks have their own)
    output = proc.communicate(timeout=120)[0]
    match = re.search(r"stopped after step (\d+) \(SIGTERM\)", output)
    assert match, output[-3000:]
    # every rank exited 0; python train.py too, but torchrun exits 1 after forwarding a SIGTERM: stopped.json below is
    # what tells the stop from a crash
    assert (proc.returncode, "SignalException" in output) == ((1, True) if config else (0, False)), output[-3000:]
    step = int(match.group(1))
    assert step < 400 and (out / "checkpoints" / "latest").read_text().strip() == f"step_{step}"
    assert len((out / "metrics.jsonl").read_text().splitlines()) == step
    # what a scheduler's script reads to tell this preemption from a crash (the launcher's exit status cannot)
    assert json.loads((out / "stopped.json").read_text()) == {
        "stopped_by": "SIGTERM", "step": step, "max_steps": 400,
        "checkpoint": str(out / "checkpoints" / f"step_{step}"), "continue_with": "--resume auto"}
    if config:
        resumed = launch(out, *args, "--resume", "latest", config=config).check()
        assert not (out / "stopped.json").exists()  # the run went on and finished: no stop stands
        full = launch(run_dir("full"), *args, config=config).check()
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
def test_zero3_checkpoint_reshards_with_its_optimizer_state(lm_runs, run_dir):
    """ZeRO-3 on 2 processes continued as ZeRO-3 (with offload) on 1: DeepSpeed's universal checkpoint, with its ZeRO-3
    load mended (one step counter shared by the parameter groups, the first group's weight decay given to all:
    trainkit/strategies/deepspeed_format.py), carries the optimizer state, so the curve goes on as if nothing had
    changed (it was 1e-3 off within 6 steps before the mend). The transformer: weight decay on its matrices only; its
    ZeRO-3 run is the strategy matrix's (tests/conftest.py's lm_runs: 2 x 4 samples a step, a checkpoint at step
    5)."""
    full = lm_runs("deepspeed_zero3")
    one = launch(run_dir("one"), *MATRIX_LM, "--batch_size", "8", "--resume", str(full.output_dir / "checkpoints" /
                 "step_5"), config="deepspeed_zero3_offload", extra_launch=("--num_processes", "1")).check()
    assert "as ZeRO-3 on 1: converted to DeepSpeed's universal checkpoint" in one.stderr
    assert max_rel_diff(one.losses, full.losses[5:]) <= 1e-5


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


def test_nothing_is_lost(check_only, run_dir):
    """Refusals found while planning (in the test process) leave every file of the earlier run as it was."""
    out = run_dir("out")
    launch(out, "--recipe", "mlp", "--max_steps", "4", "--save_every", "2").check()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert_refused(check_only(out, "--recipe", "mlp", "--max_steps", "4"),
                   "already holds a run (checkpoints, metrics.jsonl, final)")
    assert_refused(check_only(out, "--recipe", "mlp", "--max_steps", "4", "--resume", "latest", "--seed", "1"),
                   "seed is 1 but the checkpoint was trained with 0")
    assert_refused(check_only(out, "--recipe", "mlp", "--resume", str(out / "checkpoints" / "step_3")),
                   "is not a complete checkpoint")
    assert_refused(check_only(run_dir("empty"), "--recipe", "mlp", "--resume", "latest"), "no checkpoint to resume")
    # --resume auto continues the newest checkpoint, so it refuses what --resume latest refuses
    assert_refused(check_only(out, "--recipe", "mlp", "--max_steps", "4", "--resume", "auto", "--seed", "1"),
                   "seed is 1 but the checkpoint was trained with 0")
    assert_refused(check_only(out, "--recipe", "mlp", "--resume", "auto", "--overwrite"),
                   "--resume auto and --overwrite contradict each other")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_project_loads_pickles_only_with_weights_only():
    for path in [ROOT / "train.py", *(ROOT / "trainkit").glob("*.py"), *(ROOT / "recipes").glob("*.py")]:
        for call in re.findall(r"torch\.load\([^)]*\)", path.read_text()):
            assert "weights_only=True" in call, f"{path.name}: {call}"


def test_a_damaged_checkpoint_is_named_with_the_newest_intact_one(check_only, run_dir):
    """Every save records the size and checksum of each file it wrote; a truncated file, or one whose bytes changed
    and size did not, is found before anything is loaded, and --resume auto passes over it."""
    out = run_dir("out")
    launch(out, "--recipe", "mlp", "--max_steps", "6", "--save_every", "2").check()
    damaged = max((out / "checkpoints" / "step_6" / "state").iterdir(), key=lambda p: p.stat().st_size)
    size, whole = damaged.stat().st_size, damaged.read_bytes()
    for damage, named in [(whole[: size // 2], f"{damaged} has {size // 2} bytes, {size} when it was written"),
                          (flipped(whole), f"{damaged} holds other bytes than were written")]:
        damaged.write_bytes(damage)
        before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        run = check_only(out, "--recipe", "mlp", "--max_steps", "8", "--resume", "latest")
        assert_refused(run, f"checkpoint {out / 'checkpoints' / 'step_6'} is damaged: {named}")
        assert f"resume from the newest intact one: --resume {out / 'checkpoints' / 'step_4'}" in run.stderr
        auto = check_only(out, "--recipe", "mlp", "--max_steps", "8", "--resume", "auto", "--dry_run")
        assert auto.returncode == 0 and json.loads(auto.stdout)["max_steps"] == 8, auto.stderr
        assert f"note: --resume auto: continuing from {out / 'checkpoints' / 'step_4'} (the newer step_6 damaged)" \
            in auto.stderr
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def flipped(data: bytes, at: float = 0.5) -> bytes:
    """data with 12 bytes inverted at a fraction of its length: the same size, other bytes (measured before
    checksums: such a flip in a DCP shard resumed with exit 0 and ended 3.41 off the uninterrupted curve)."""
    i = int(len(data) * at)
    return data[:i] + bytes(b ^ 0xFF for b in data[i:i + 12]) + data[i + 12:]


@pytest.mark.parametrize("config, files", [
    ("ddp", ["state/__0_0.distcp", "state/__1_0.distcp", "state/.metadata", "rng/rank_1.pt"]),
    ("deepspeed_zero2", ["deepspeed/deepspeed/mp_rank_00_model_states.pt",
                         "deepspeed/deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt"]),
])
def test_flipped_bytes_in_any_checkpoint_file_are_named(check_only, lm_runs, tmp_path, config, files):
    """Each format's model and optimizer files (a DCP shard holds both: flipped near its start and its end), its
    metadata and a rank's RNG state: the checkpoint is refused before anything loads, naming the file and step."""
    run = lm_runs(config)
    for name, at in [(file, at) for file in files for at in ([0.1, 0.9] if file.endswith(".distcp") else [0.5])]:
        out = tmp_path / f"{Path(name).name}-{at}"
        shutil.copytree(run.output_dir, out)
        step = out / "checkpoints" / "step_5"
        (step / name).write_bytes(flipped((step / name).read_bytes(), at))
        refused = check_only(out, "--recipe", "tiny_transformer", "--resume", "latest")
        assert_refused(refused, f"checkpoint {step} is damaged: {step / name} holds other bytes than were written")
        assert "no intact checkpoint is left: start again (--overwrite)" in refused.stderr


def test_a_checkpoint_that_does_not_load_says_which_and_what_to_do(run_dir):
    """What the checks cannot see (a checkpoint written before checksums were recorded, with the same size and other
    bytes): the load fails with the checkpoint named and the library's words."""
    out = run_dir("out")
    launch(out, "--recipe", "mlp", "--max_steps", "6", "--save_every", "2").check()
    step = out / "checkpoints" / "step_6"
    state = json.loads((step / "trainer_state.json").read_text())
    state["files"] = {name: entry["bytes"] for name, entry in state["files"].items()}  # sizes only, as before
    (step / "trainer_state.json").write_text(json.dumps(state))
    (step / "state" / ".metadata").write_bytes(b"\0" * (step / "state" / ".metadata").stat().st_size)
    run = launch(out, "--recipe", "mlp", "--max_steps", "8", "--resume", "latest")
    assert_refused(run, f"could not load checkpoint {step}: ", code=1)
    assert f"resume from an older one (--resume {out / 'checkpoints' / 'step_4'})" in run.stderr


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB file system (tmpfs), mounted for the test and unmounted after it."""
    with tmpfs(tmp_path / "small", "size=3m") as mount:
        yield mount


@pytest.mark.parametrize("save", [[], ["--async_save"]], ids=["sync", "async"])
def test_a_full_disk_stops_the_run_with_the_intact_checkpoint_named(small_disk, save):
    """Measured before: a 3 MB disk ended in torch's "unexpected pos 704 vs 598" traceback. Now: the partial
    step_<N>.tmp is removed, latest stays on the last whole checkpoint, and the message says how to go on; the same
    when the write that fails went on beside the training (--async_save)."""
    out = small_disk / "out"
    run = launch(out, "--recipe", "mlp", "--hidden", "256", "--max_steps", "40", "--save_every", "1", *save)
    assert_refused(run, "the disk is full", code=1)
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert f"could not write checkpoint {out / 'checkpoints'}/step_" in run.stderr
    assert f"{out / 'checkpoints' / latest} is intact; free space and continue with --resume latest" in run.stderr
    assert not list((out / "checkpoints").glob("*.tmp")) and "Traceback" not in run.stderr


def filled(mount: Path) -> Path:
    """mount with no byte left free: a file written until the disk refuses more."""
    with suppress(OSError), open(mount / "filler", "wb") as filler:
        while True:
            filler.write(b"\0" * 4096)
            filler.flush()
    return mount


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["metrics", "tensorboard", "final", "output folder", "data cache"])
def test_a_full_disk_under_any_writer_is_named(tmp_path, writer):
    """Measured before: a disk that filled while TensorBoard wrote gave two raw OSError tracebacks from its writer's
    thread, and the only error line said rank 0 "did not answer"; the lock file and the final export (safetensors'
    own error type) ended in tracebacks. Now every writer ends alike: the path named, the disk said to be full, how to
    go on; no raw OSError, no rank blamed for another's error, what was written before kept, no half-written
    final/. Two processes: rank 0 writes, rank 1 waits for it."""
    args = ["--recipe", "mlp", "--eval_every", "0"]
    with tmpfs(tmp_path / "small", "size=1m" if writer == "final" else "size=64k") as small:
        out, code = (tmp_path / "out", 1) if writer in ("tensorboard", "data cache") else (small / "out", 1)
        if writer == "metrics":
            run = launch(out, *args, "--max_steps", "3000", "--report_to", "none", config="ddp")
        elif writer == "tensorboard":  # its folder alone on the full disk
            out.mkdir()
            (out / "train").symlink_to(filled(small), target_is_directory=True)
            run = launch(out, *args, "--max_steps", "20", "--report_to", "tensorboard", config="ddp")
        elif writer == "final":  # everything fits but the weights (4.3 MB)
            run = launch(out, *args, "--max_steps", "3", "--hidden", "1024", config="ddp")
        elif writer == "data cache":  # the corpus, the tokenizer and the token blocks of the transformer
            run = launch(out, "--recipe", "tiny_transformer", "--max_steps", "1", "--cache_dir", str(filled(small)),
                         config="ddp")
        else:
            out.mkdir()
            filled(small)
            run, code = launch(out, *args, "--max_steps", "3", config="ddp"), 2
        named = {"metrics": out / "metrics.jsonl", "tensorboard": out / "train", "final": out / "final",
                 "data cache": f"{small}/pydoc_topics-"}
        if writer == "output folder":
            assert_refused(run, f"cannot write in {out}: the disk is full", code=2)
        else:
            assert_refused(run, f"could not write {named[writer]}", code=code)
            assert "the disk is full" in run.stderr and "then run the same command with --resume auto" in run.stderr
        assert "OSError" not in run.stderr and "SafetensorError" not in run.stderr, run.stderr
        assert "did not answer" not in run.stderr and "lost contact" not in run.stderr, run.stderr
        errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
        assert all("the disk is full" in line for line in errors), errors  # each the cause, or a rank that names it
        if writer in ("metrics", "final"):  # every line written is whole, one per step from the first
            steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
            assert steps == list(range(1, len(steps) + 1)) and steps, steps
        assert not (out / "final.tmp").exists() and not (out / "final").exists()


@pytest.mark.parametrize("code, fix", [
    (errno.EACCES, "make {folder} writable"),  # freeing space would not help: the advice before
    (errno.EROFS, "make {folder} writable"),
    (errno.EIO, "remove the cause"),
])
def test_a_failed_write_gets_the_fix_for_its_cause(tmp_path, code, fix):
    """The refusal after a failed checkpoint or metrics write names its cause and the fix for that cause (the full
    disk, measured for real above, is the one where "free space" is right)."""
    what, said = write_failure(OSError(code, os.strerror(code)), tmp_path / "out" / "checkpoints")
    assert os.strerror(code) in what and said == fix.format(folder=tmp_path)


@pytest.mark.slow
def test_resume_takes_the_runs_settings_from_the_checkpoint(check_only, run_dir):
    """The README's resume command names no model flags: the checkpoint's settings come back. A flag that would
    change what is trained is refused naming it; the schedule's length may change by design."""
    out = run_dir("out")
    args = ["--recipe", "mlp", "--max_steps", "8", "--eval_every", "0"]
    full = launch(run_dir("full"), *args, "--hidden", "16", "--layers", "3", "--lr", "0.02").check()
    launch(out, *args, "--hidden", "16", "--layers", "3", "--lr", "0.02", "--stop_at", "4").check()
    resumed = launch(out, "--recipe", "mlp", "--resume", "latest").check()  # no other flag
    assert resumed.losses == full.losses and resumed.resolved["hidden"] == 16
    assert resumed.resolved["sources"]["hidden"] == f"checkpoint {out / 'checkpoints' / 'step_4'}"
    refused = check_only(out, "--recipe", "mlp", "--resume", "latest", "--hidden", "32", "--lr", "0.02")
    assert_refused(refused, "hidden is 32 but the checkpoint was trained with 16 (--hidden): drop --hidden: a resumed "
                            "run keeps the checkpoint's hidden")
    assert refused.stderr.count("error: ") == 1  # the same lr is no conflict
    longer = check_only(out, "--recipe", "mlp", "--resume", "latest", "--max_steps", "12", "--dry_run")
    assert longer.returncode == 0 and json.loads(longer.stdout)["max_steps"] == 12


@pytest.mark.slow
def test_a_resumed_launch_keeps_saving_as_the_run_was_started_to(run_dir):
    """A preempted job restarted with --resume latest alone keeps its --save_every, --keep_last and --async_save (and
    trackers): it goes on writing (and pruning) checkpoints instead of running unprotected to the end."""
    out = run_dir("out")
    args = ["--recipe", "mlp", "--max_steps", "20", "--eval_every", "0", "--batch_size", "8"]
    launch(out, *args, "--save_every", "5", "--keep_last", "2", "--async_save", "--stop_at", "10",
           config="ddp").check()
    resumed = launch(out, "--recipe", "mlp", "--resume", "latest", config="ddp").check()
    assert "note: run options from the checkpoint: --save_every 5, --keep_last 2, --async_save (a flag" \
        in resumed.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_15", "step_20"]
    assert resumed.resolved["save_every"] == 5 and resumed.resolved["sources"]["keep_last"].startswith("checkpoint ")
    assert resumed.resolved["async_save"] is True
    for step in ("step_15", "step_20"):  # an asynchronous save records every file's checksum too, hashed beside it
        folder = out / "checkpoints" / step
        files = json.loads((folder / "trainer_state.json").read_text())["files"]
        assert {name: entry["xxh3_64"] for name, entry in files.items()} == {
            str(f.relative_to(folder)): xxhash.xxh3_64(f.read_bytes()).hexdigest() for f in folder.rglob("*")
            if f.is_file() and f.name != "trainer_state.json"}
    again = launch(out, "--recipe", "mlp", "--resume", "latest", "--max_steps", "30", "--save_every", "0",
                   config="ddp").check()
    assert "--save_every" not in again.stderr.split("run options from the checkpoint:")[-1].splitlines()[0]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_15", "step_20"]


@pytest.mark.slow
def test_resuming_a_run_that_finished_without_checkpoints_keeps_its_final(check_only, run_dir):
    """--overwrite would delete final/: the advice names the weights and a new folder instead."""
    out = run_dir("out")
    launch(out, "--recipe", "mlp", "--max_steps", "3", "--eval_every", "0").check()
    assert_refused(check_only(out, "--recipe", "mlp", "--resume", "latest", "--dry_run"),
                   f"no checkpoint to resume in {out} (--resume latest): the run there finished without saving a "
                   f"checkpoint to continue from (--save_every), and its weights are in {out / 'final'}: start a new "
                   f"run in a new --output_dir; --overwrite would delete them")
    # --resume auto has nothing to continue either, and a fresh start is refused: final/ is never replaced unasked
    assert_refused(check_only(out, "--recipe", "mlp", "--resume", "auto"), f"{out} already holds a run")
    assert (out / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize("resume, message", [
    ("lastest", "lastest is not a complete checkpoint (no trainer_state.json) (--resume lastest): did you mean "
                "--resume latest?"),
    ("latest", "no checkpoint to resume in {out} (--resume latest): the run there stopped before its first "
               "checkpoint: start it again with --overwrite, without --resume"),
])
def test_a_folder_left_by_a_crash_gets_advice_that_works(check_only, run_dir, resume, message):
    """A run that died before its first checkpoint left metrics.jsonl only: --resume cannot help, --overwrite can,
    and the dry run says the same as the real run would."""
    out = run_dir("out")
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    plain = check_only(out, "--recipe", "mlp")
    assert_refused(plain, f"{out} already holds a run that stopped before its first checkpoint (metrics.jsonl) "
                          f"(--output_dir): pass --overwrite to start it again")
    assert "--resume" not in plain.stderr
    assert_refused(check_only(out, "--recipe", "mlp", "--resume", resume, "--dry_run"), message.format(out=out))
    auto = check_only(out, "--recipe", "mlp", "--resume", "auto", "--dry_run")  # what a restart loop runs
    assert auto.returncode == 0 and f"note: --resume auto: the run in {out} stopped before its first checkpoint; " \
        "a fresh start replaces what it left (metrics.jsonl)" in auto.stderr, auto.stderr
    assert (out / "metrics.jsonl").exists()  # a dry run replaces nothing


# --- the checkpoint format's bookkeeping, in this process (no launch) ---------------------------------------------

def tiny_engine(seed: int, frozen: bool = False, stepped: bool = True):
    """What a format reads from its engine: the model and the optimizer (after a step: it then has state)."""
    from types import SimpleNamespace

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[0].weight.requires_grad_(not frozen)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    if stepped:
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
    return SimpleNamespace(model=model, optimizer=optimizer, checkpointed=lambda: (model, optimizer, None))


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_the_dcp_format_restores_what_trains_and_leaves_the_frozen_weights_out(tmp_path, asynchronous):
    from trainkit.strategies.dcp_format import DCP

    saved = tiny_engine(0, frozen=True)
    kept = {name: value.clone() for name, value in saved.model.state_dict().items()}
    moments = [(s["exp_avg"].clone(), s["exp_avg_sq"].clone()) for s in saved.optimizer.state.values()]
    future = DCP(saved, asynchronous).save(tmp_path)
    assert (future is not None) == asynchronous
    if future is not None:  # the write goes on from a copy: the training after save() returned does not reach it
        with torch.no_grad():
            for tensor in [*saved.model.parameters(), *(s["exp_avg"] for s in saved.optimizer.state.values())]:
                tensor.add_(1.0)
        future.result()
    fresh = tiny_engine(1, frozen=True, stepped=False)  # a resumed launch: other weights, no optimizer state yet
    built = fresh.model[0].weight.clone()
    DCP(fresh).load(tmp_path)
    for name, value in fresh.model.state_dict().items():
        if name == "0.weight":  # frozen: not in the checkpoint, so build_model's value stays
            assert torch.equal(value, built) and not torch.equal(value, kept[name])
        else:
            assert torch.equal(value, kept[name]), name
    restored = [(s["exp_avg"], s["exp_avg_sq"]) for s in fresh.optimizer.state.values()]
    assert len(restored) == len(moments) == 3 and all(
        torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(moments, restored, strict=True))
    warm = tiny_engine(2, frozen=True, stepped=False).model
    DCP.load_weights(warm, tmp_path)  # a warm start: the weights without an optimizer
    assert torch.equal(warm[1].weight, kept["1.weight"])


def test_the_dcp_format_moves_optimizer_state_between_a_whole_model_and_its_pipeline_stages(tmp_path):
    """A pipeline's stages are written under the whole model's names with the optimizer's state and settings per
    parameter, so the whole model reads them, and the stages read the whole model's. Here a 3-layer model with tied
    first and last weights, cut into layers 0-1 and layer 2 (whose tied weight is a copy, as on another process,
    kept equal by summing the two gradients), two parameter groups with their own learning rates."""
    from types import SimpleNamespace

    from trainkit.strategies.dcp_format import DCP

    def whole_model(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        model[2].weight = model[0].weight
        return model

    def optimizer_of(module):
        weights = [p for p in module.parameters() if p.ndim == 2]
        biases = [p for p in module.parameters() if p.ndim == 1]
        return torch.optim.AdamW([{"params": weights, "lr": 0.1}, {"params": biases, "lr": 0.02,
                                                                    "weight_decay": 0.0}])

    def staged(model):
        """The stages of one process (as under the interleaved schedule), their names in the whole model."""
        stages = torch.nn.ModuleList([torch.nn.Sequential(model[0], model[1]), torch.nn.Linear(4, 4)])
        stages[1].load_state_dict(model[2].state_dict())
        names = {"0.0.weight": ["0.weight", "2.weight"], "0.0.bias": ["0.bias"], "0.1.weight": ["1.weight"],
                 "0.1.bias": ["1.bias"], "1.weight": ["0.weight", "2.weight"], "1.bias": ["2.bias"]}
        optimizer = optimizer_of(stages)
        return stages, optimizer, SimpleNamespace(checkpointed=lambda: (stages, optimizer, names))

    def whole(model):
        optimizer = optimizer_of(model)
        return optimizer, SimpleNamespace(checkpointed=lambda: (model, optimizer, None))

    stages, optimizer, engine = staged(whole_model(0))
    for _ in range(2):
        stages[1](stages[0](torch.randn(5, 4))).square().sum().backward()
        tied = stages[0][0].weight.grad + stages[1].weight.grad
        stages[0][0].weight.grad, stages[1].weight.grad = tied.clone(), tied.clone()
        optimizer.step()
        optimizer.zero_grad()
    for group, lr in zip(optimizer.param_groups, (0.05, 0.01), strict=True):  # where a schedule took them
        group["lr"] = lr
    DCP(engine).save(tmp_path / "stages")
    model = whole_model(1)
    model_opt, model_engine = whole(model)
    DCP(model_engine).load(tmp_path / "stages")
    assert torch.equal(model[0].weight, stages[0][0].weight) and torch.equal(model[2].bias, stages[1].bias)
    state = {name: model_opt.state[p] for name, p in model.named_parameters()}
    assert torch.equal(state["0.weight"]["exp_avg"], optimizer.state[stages[0][0].weight]["exp_avg"])
    assert torch.equal(state["2.bias"]["exp_avg_sq"], optimizer.state[stages[1].bias]["exp_avg_sq"])
    assert [g["lr"] for g in model_opt.param_groups] == [0.05, 0.01] and state["1.bias"]["step"] == 2
    DCP(model_engine).save(tmp_path / "whole")  # and back: the stages read what the whole model wrote
    again, again_opt, again_engine = staged(whole_model(2))
    DCP(again_engine).load(tmp_path / "whole")
    assert torch.equal(again[1].weight, stages[0][0].weight) and torch.equal(again[0][1].bias, stages[0][1].bias)
    assert torch.equal(again_opt.state[again[1].weight]["exp_avg"], optimizer.state[stages[1].weight]["exp_avg"])
    assert [g["lr"] for g in again_opt.param_groups] == [0.05, 0.01]


def test_each_format_has_one_name_and_the_deepspeed_one_says_which_moves_it_restores():
    from types import SimpleNamespace

    from trainkit.strategies.deepspeed_format import DeepSpeedFormat
    from trainkit.strategies.registry import REGISTRY, for_format

    formats = {cls.engine.format for cls in REGISTRY}
    assert len({f.name for f in formats}) == len(formats) and len({f.folder for f in formats}) == 2
    assert all(for_format(f.name) is f for f in formats)

    def restores(stage, world_size, saved_stage, saved_world_size, saved_format="deepspeed", ep=1, saved_ep=1):
        engine = SimpleNamespace(strategy=SimpleNamespace(stage=stage, ep=ep),
                                 launch=SimpleNamespace(world_size=world_size))
        autoep = {"expert_parallel": {"enabled": True, "autoep_size": saved_ep}} if saved_ep > 1 else {}
        return DeepSpeedFormat(engine).resumes_exactly(
            {"format": saved_format, "zero_stage": saved_stage, "world_size": saved_world_size,
             "resolved_config": {"deepspeed_config": autoep}})

    assert restores(3, 2, 3, 2) and restores(2, 4, 1, 2) and restores(1, 1, 2, 2)  # natively; universal for 1/2
    assert restores(3, 4, 3, 2) and restores(3, 1, 3, 2)  # ZeRO-3 on another process count: universal, mended
    assert not restores(2, 2, 3, 2) and not restores(3, 2, 2, 2)  # between ZeRO-3 and ZeRO-1/2: a warm start
    assert not restores(2, 2, 2, 2, saved_format="dcp")
    # DeepSpeed's AutoEP: natively only, under the same stage, process count and autoep_size
    assert restores(2, 2, 2, 2, ep=2, saved_ep=2) and not restores(2, 4, 2, 2, ep=2, saved_ep=2)
    assert not restores(1, 2, 2, 2, ep=2, saved_ep=2) and not restores(2, 2, 2, 2, saved_ep=2)
    assert not restores(2, 2, 2, 2, ep=2)
    # the DCP format of before flattened optimizer state (and its pipeline variant): the weights only, a warm start
    dcp = for_format("dcp")
    assert for_format("dcp_pipeline") is dcp and not dcp(None).resumes_exactly({"format": "dcp"})
    assert dcp(None).resumes_exactly({"format": "dcp", "format_version": 2})
