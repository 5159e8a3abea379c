"""--activation_offload (trainkit/models/activation_offload.py): on a CPU the activations already are in host memory, so
the run is the
same run, said so; the memory it saves on a GPU is measured by tests/test_gpu.py."""

from __future__ import annotations

from conftest import LM, ROOT, launch


def test_activation_offload_on_a_cpu_trains_the_same_curve_and_says_why(lm_reference, tmp_path):
    run = launch(tmp_path / "out", *LM, "--batch_size", "8", "--activation_offload").check()
    assert run.resolved["activation_offload"] is True
    assert run.losses == lm_reference.losses
    assert "--activation_offload: on a CPU run the activations already are in host memory; nothing moves" in run.stderr


def test_activation_offload_is_refused_under_a_pipeline(check_only, tmp_path):
    run = check_only(tmp_path / "out", *LM, "--grad_accum", "2", "--pipeline_stages", "2", "--activation_offload",
                     "--dry_run", "--accelerate_config", str(ROOT / "accelerate_configs" / "ddp.yaml"))
    assert run.returncode == 2, run.stderr
    assert "--activation_offload does not reach the pipeline's stages" in run.stderr
