"""fp16 with the loss scaler, run on a CPU: torch's CPU autocast and GradScaler("cpu"), which the runner supplies
where Accelerate supplies none (trainkit/strategies/accelerator.py, use_cpu_fp16). Everything after the scaler is
the code a GPU run uses: the skipped-step accounting, the finite checks' fp16 rule, the schedule and data order
across a skipped step, the scaler's state in checkpoints.

The overflow is forced at a known step: tests/zoo/fp16_overflow.py multiplies the loss of chosen training samples
by a boost, and the test picks one sample of step OVERFLOW_STEP's global batch (trainkit/data/batches.py's epoch_order).
A first loss scale of 1024 leaves the MLP no overflow of its own, so that step is the only one skipped.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import assert_refused, launch, max_rel_diff, write_yaml
from trainkit.data.batches import epoch_order

RECIPE = ["--recipe", "tests/zoo/fp16_overflow.py", "--loss_scale", "1024"]  # 12 steps, evaluated at the end
GLOBAL_BATCH = 64
TRAIN_SAMPLES = 8192  # recipes/mlp.py's
OVERFLOW_STEP = 8
FP16 = ("--mixed_precision", "fp16")
# One process against DDP and FSDP2 under fp16: the same steps skipped, and losses within fp16's own rounding
# (2**-10 relative); measured 5.6e-5 (DDP) and 6.0e-5 (FSDP2) over 12 steps. Each rank's weight gradients are sums
# over its half of the batch rounded to fp16 before the fp32 all-reduce, where one process rounds the whole sum once.
FP16_BOUND = 1e-3


def samples_of(*steps: int) -> str:
    """--overflow_samples: the first sample of each step's global batch (epoch 0, seed 0)."""
    order = epoch_order(TRAIN_SAMPLES, 0, 0)
    return ",".join(str(int(order[(step - 1) * GLOBAL_BATCH])) for step in steps)


def saved(run, step: int) -> tuple[dict[str, torch.Tensor], dict]:
    """A checkpoint's model and optimizer tensors (DCP, read as a whole) and its trainer_state.json."""
    folder = run.output_dir / "checkpoints" / f"step_{step}"
    dcp_to_torch_save(folder / "state", folder.parent / f"step_{step}.pt")

    def flat(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            elif torch.is_tensor(value):
                out[prefix + str(key)] = value
        return out

    tensors = flat(torch.load(folder.parent / f"step_{step}.pt", weights_only=False))
    return tensors, json.loads((folder / "trainer_state.json").read_text())


@pytest.fixture(scope="module")
def fp16_runs(tmp_path_factory):
    """The same fp16 run without and with the forced overflow (a checkpoint at every step), launched once."""
    root = tmp_path_factory.mktemp("fp16")
    plain = launch(root / "plain", *RECIPE, "--batch_size", "64", config="single", extra_launch=FP16).check()
    forced = launch(root / "forced", *RECIPE, "--batch_size", "64", "--overflow_samples", samples_of(OVERFLOW_STEP),
                    "--save_every", "1", config="single", extra_launch=FP16).check()
    return plain, forced


@pytest.mark.slow
def test_an_overflow_is_skipped_counted_and_leaves_the_weights_as_they_were(fp16_runs):
    plain, forced = fp16_runs
    k = OVERFLOW_STEP
    assert "note: fp16 on a CPU: torch's CPU autocast and GradScaler('cpu')" in forced.stderr
    assert [m["skipped_steps"] for m in plain.metrics] == [0] * 12  # no overflow of the MLP's own at scale 1024
    timings = ("samples_per_s", "data_wait_s", "checkpoint_s", "mfu", "elapsed_s", "peak_mem_bytes")
    assert forced.metrics[:k - 1] == [{**m, **{t: forced.metrics[i][t] for t in timings}}
                                      for i, m in enumerate(plain.metrics[:k - 1])]  # the same run until then
    assert [m["skipped_steps"] for m in forced.metrics] == [0] * (k - 1) + [1] * (12 - k + 1)
    assert forced.metrics[k - 1]["grad_norm"] is None  # its scaled gradients overflowed: JSON null for inf
    before, state_before = saved(forced, k - 1)
    after, state_after = saved(forced, k)
    assert before.keys() == after.keys() and any(".exp_avg_sq" in name for name in after)
    unchanged = [name for name in before if torch.equal(before[name], after[name])]
    assert unchanged == list(before), "the skipped step changed weights or optimizer state"
    assert state_after["scaler"]["scale"] == state_before["scaler"]["scale"] / 2 == 512.0
    assert state_after["skipped_steps"] == 1 and state_after["batch_in_epoch"] == k  # its batch was used up
    # The schedule advances on a skipped step (docs/strategies.md#precision): every step's lr is the plain run's.
    assert [m["lr"] for m in forced.metrics] == [m["lr"] for m in plain.metrics]
    assert all(m["loss"] < 100 for m in forced.metrics[k:]) and len(forced.metrics) == 12  # training went on
    assert (forced.output_dir / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_resume_right_after_a_skipped_step_continues_bit_exactly(fp16_runs, run_dir):
    """The scaler's state comes back from the checkpoint: a fresh scaler (scale 1024, not 512) would round the next
    steps' gradients differently."""
    _, forced = fp16_runs
    out = run_dir("resumed")
    args = [*RECIPE, "--batch_size", "64", "--overflow_samples", samples_of(OVERFLOW_STEP)]
    launch(out, *args, "--stop_at", str(OVERFLOW_STEP), config="single", extra_launch=FP16).check()
    resumed = launch(out, "--recipe", "tests/zoo/fp16_overflow.py", "--resume", "latest", config="single",
                     extra_launch=FP16).check()
    keys = ("step", "loss", "grad_norm", "lr", "skipped_steps")
    assert [{k: m[k] for k in keys} for m in resumed.metrics] == \
        [{k: m[k] for k in keys} for m in forced.metrics]


@pytest.mark.slow
def test_a_loss_that_stays_non_finite_stops_an_fp16_run(run_dir):
    """An infinite loss three steps in a row: the first two are skipped like any overflow, the third stops the run
    before its optimizer step, with the last good checkpoint kept and no final/ written."""
    k = OVERFLOW_STEP
    run = launch(run_dir("out"), *RECIPE, "--batch_size", "64", "--overflow_samples", samples_of(k, k + 1, k + 2),
                 "--boost", "inf", "--save_every", "1", config="single", extra_launch=FP16)
    assert_refused(run, f"non-finite loss at step {k + 2} (inf) (3 steps in a row under fp16); the optimizer step "
                        "was not taken", code=1)
    assert [m["skipped_steps"] for m in run.metrics][-2:] == [1, 2] and len(run.metrics) == k + 1
    assert (run.output_dir / "checkpoints" / "latest").read_text().strip() == f"step_{k + 1}"
    assert not (run.output_dir / "final").exists()


@pytest.mark.slow
@pytest.mark.parametrize("config", ["ddp", "fsdp"])
def test_ddp_and_fsdp_give_one_process_fp16_curve(fp16_runs, run_dir, config):
    """The same global batch split over 2 processes: the same steps skipped (every rank sees the overflow, through
    DDP's all-reduce or FSDP2's DTensor gradients), the loss within FP16_BOUND of one process's."""
    _, forced = fp16_runs
    run = launch(run_dir("out"), *RECIPE, "--batch_size", "32", "--overflow_samples", samples_of(OVERFLOW_STEP),
                 config=config, extra_launch=FP16).check()
    assert [m["skipped_steps"] for m in run.metrics] == [m["skipped_steps"] for m in forced.metrics]
    assert max_rel_diff(run.losses, forced.losses) < FP16_BOUND


@pytest.mark.parametrize("config, flags, message", [
    ("deepspeed_zero2", [], "fp16 on a CPU does not work under deepspeed_zero2: DeepSpeed's own fp16 engine needs a "
     "GPU"),
    ("tp", [], "fp16 on a CPU does not work under tp: fp16 on a CPU exists to test the loss scaler's logic"),
    # on any machine: torch's pipeline schedule runs the backward itself, without the scaler
    ("ddp", ["--pipeline_stages", "2", "--grad_accum", "2"], "fp16 does not work with pipeline stages"),
])
def test_fp16_is_refused_where_it_does_not_work(check_only, tmp_path, config, flags, message):
    """The config a user would launch, with fp16 in its YAML, checked as every launch checks it (--dry_run)."""
    yaml_path = write_yaml(tmp_path, config, **{'mixed_precision:__"no"': 'mixed_precision: "fp16"'})
    run = check_only(tmp_path / "out", "--recipe", "tiny_transformer", *flags, "--dry_run", "--accelerate_config",
                     str(yaml_path))
    assert_refused(run, message)
    assert "bf16 (--mixed_precision bf16) or fp32" in run.stderr
