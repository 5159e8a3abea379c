"""--compile: torch.compile changes speed, not numbers, names or checkpoints.

One process (the strategies' own compile paths are measured by bench/compile.py against eager, 2 processes each):
the compiled transformer follows the eager one (the session's one-process reference), its final/ weights and its
checkpoint hold the model's own parameter names, and a run resumes across the flag in both directions. ZeRO-3, where
compiling buys nothing, refuses the flag before anything is built.
"""

from __future__ import annotations

import pytest
from safetensors import safe_open

from conftest import LM, PARITY_BOUND, ROOT, launch, max_rel_diff

MLP = ["--recipe", "mlp", "--max_steps", "6", "--eval_every", "0", "--warmup_steps", "2", "--batch_size", "16"]


def weight_names(run) -> list[str]:
    with safe_open(str(run.output_dir / "final" / "model.safetensors"), "pt") as f:
        return sorted(f.keys())


def checkpoint_names(run, step: int) -> list[str]:
    """The model entries of a step's torch.distributed.checkpoint, as its metadata lists them."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(run.output_dir / "checkpoints" / f"step_{step}" / "state")).read_metadata()
    return sorted(key for key in metadata.state_dict_metadata if key.startswith("model."))


@pytest.mark.slow
def test_compiled_transformer_follows_eager_keeps_its_names_and_resumes_eager(lm_reference, tmp_path):
    compiled = launch(tmp_path / "compiled", *LM, "--batch_size", "8", "--compile", "--save_every", "4").check()
    assert "torch.compile (inductor)" in compiled.stderr
    assert max_rel_diff(compiled.losses, lm_reference.losses) <= PARITY_BOUND
    names = weight_names(compiled)
    assert names == weight_names(lm_reference) and not any("_orig_mod" in n for n in names)
    saved = checkpoint_names(compiled, 4)
    assert saved and not any("_orig_mod" in n for n in saved)
    # A compiled run's checkpoint continues without --compile, on the eager curve.
    eager = launch(tmp_path / "eager", *LM, "--batch_size", "8", "--resume",
                   str(compiled.output_dir / "checkpoints" / "step_4"), "--set", "compile=false").check()
    assert [m["step"] for m in eager.metrics] == [5, 6, 7, 8]
    assert max_rel_diff(eager.losses, lm_reference.losses[4:]) <= PARITY_BOUND


@pytest.mark.slow
def test_an_eager_checkpoint_resumes_compiled(tmp_path):
    eager = launch(tmp_path / "eager", *MLP, "--save_every", "3").check()
    compiled = launch(tmp_path / "compiled", *MLP, "--compile", "--resume",
                      str(eager.output_dir / "checkpoints" / "step_3")).check()
    assert compiled.resolved["compile"] is True and "torch.compile (inductor)" in compiled.stderr
    assert [m["step"] for m in compiled.metrics] == [4, 5, 6]
    assert max_rel_diff(compiled.losses, eager.losses[3:]) <= PARITY_BOUND


@pytest.mark.parametrize("config", ["deepspeed_zero3", "deepspeed_zero3_offload"])
def test_zero3_refuses_compile_before_anything_is_built(check_only, tmp_path, config):
    run = check_only(tmp_path / "out", "--recipe", "tiny_transformer", "--dry_run", "--compile",
                     "--accelerate_config", str(ROOT / "accelerate_configs" / f"{config}.yaml"))
    assert run.returncode == 2
    assert f"error: --compile does not work under {config}: ZeRO-3 frees each layer's gathered parameters" in run.stderr
    assert "drop --compile" in run.stderr and "deepspeed_zero2.yaml" in run.stderr
    assert not (tmp_path / "out").exists()
