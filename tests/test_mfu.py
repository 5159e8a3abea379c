"""MFU on every device: the FLOP count (nanoGPT's, attention included), the CPU peak measured once and cached, the
CPU thread rule, size presets, and a real run's metrics lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, TEST_ENV, assert_refused, launch
from trainkit.config import build_config, config_dict, field_sources
from trainkit.errors import ConfigError
from trainkit.estimate import meta_model
from trainkit.launch import hardware
from trainkit.recipes import load_recipe
from trainkit.run.metrics import count_flops

TINY_LM = ["--recipe", "tiny_transformer", "--hidden", "64", "--layers", "2", "--seq_len", "64"]


def config(*flags: str):
    """The tiny transformer's config from `--field value` pairs, as the command line builds it."""
    overrides = [(flags[i].removeprefix("--"), flags[i + 1], flags[i]) for i in range(0, len(flags), 2)]
    return build_config(load_recipe("tiny_transformer").Config, overrides)


def test_gpt2_small_flops_are_nanogpts():
    """GPT-2 small (the gpt2-small preset): nanoGPT's 123.65M non-embedding parameters (all but the 1024 x 768
    position table; the token table is tied to the output layer and counts), and its 6 N + 12 L h T per token."""
    cfg = config("--size", "gpt2-small")
    model = meta_model(load_recipe("tiny_transformer"), cfg)
    assert sum(p.numel() for p in model.parameters()) == 124_439_808
    flops = count_flops(model, 1024)
    assert flops.params == 124_439_808 - 1024 * 768 == 123_653_376
    assert flops.per_token == 6 * 123_653_376 + 12 * 12 * 768 * 1024
    assert flops.per_sample == flops.per_token * 1024


def test_an_untied_input_embedding_is_not_counted_and_a_model_without_a_sequence_gets_6n():
    recipe = load_recipe("tiny_transformer")
    tied = count_flops(meta_model(recipe, config()), 128)
    untied = count_flops(meta_model(recipe, config("--tie_embeddings", "false")), 128)
    assert untied.params == tied.params  # the new output matrix counts, the input table (a lookup) does not
    mlp = load_recipe("mlp")
    model = meta_model(mlp, mlp.Config())
    flops = count_flops(model, None)
    assert flops.per_token is None and flops.per_sample == 6 * sum(p.numel() for p in model.parameters())


def test_cpu_peak_is_the_best_of_the_first_runs_per_dtype_and_thread_count(tmp_path, monkeypatch):
    """A busy second lowers one measurement: the first PEAK_MEASUREMENTS runs measure, the cache keeps the best."""
    rates = iter([2e11, 1e11, 3e11, 5e10, 7e10])
    measured = []
    monkeypatch.setattr(hardware, "measure_matmul_peak", lambda dtype: measured.append(dtype) or next(rates))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        got = [hardware.cpu_peak_flops(torch.float32, tmp_path) for _ in range(hardware.PEAK_MEASUREMENTS + 1)]
        assert got == [(2e11, True), (2e11, True), (3e11, True), (3e11, False)]  # never lowered; then the cache
        assert hardware.cpu_peak_flops(torch.bfloat16, tmp_path) == (5e10, True)
        # a launch's other processes read what its first one measured, without measuring again
        assert hardware.cpu_peak_flops(torch.bfloat16, tmp_path, may_measure=False) == (5e10, False)
        torch.set_num_threads(2)
        assert hardware.cpu_peak_flops(torch.float32, tmp_path, may_measure=False) == (7e10, True)  # nothing cached
    finally:
        torch.set_num_threads(threads)
    assert measured == [torch.float32] * 3 + [torch.bfloat16, torch.float32]
    cache = json.loads((tmp_path / hardware.CACHE_FILE).read_text())
    assert sorted((entry["flops"], entry["measurements"]) for entry in cache.values()) == [(5e10, 1), (7e10, 1),
                                                                                             (3e11, 3)]
    assert all(hardware.cpu_model() in key and f"torch {torch.__version__}" in key for key in cache)
    assert not list(tmp_path.glob("*.tmp*"))  # written under a temporary name, then renamed


def test_a_cache_from_before_the_count_is_one_measurement(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "measure_matmul_peak", lambda dtype: 1e11)
    assert hardware.cpu_peak_flops(torch.float32, tmp_path) == (1e11, True)
    cache_file = tmp_path / hardware.CACHE_FILE
    (key, entry), = json.loads(cache_file.read_text()).items()
    cache_file.write_text(json.dumps({key: {"flops": 2e11, "measured": entry["measured"]}}))  # the old form
    assert hardware.cpu_peak_flops(torch.float32, tmp_path) == (2e11, True)  # measured again, the better one kept
    assert json.loads(cache_file.read_text())[key]["measurements"] == 2


def test_peak_flops_flag_overrides_and_bf16_selects_the_bf16_peak(tmp_path, monkeypatch):
    measured = []
    monkeypatch.setattr(hardware, "measure_matmul_peak", lambda dtype: measured.append(dtype) or 5e10)
    cpu = torch.device("cpu")
    assert hardware.device_peak_flops(cpu, "no", 1e12, tmp_path) == hardware.Peak(1e12, "--peak_flops")
    assert measured == []
    assert hardware.device_peak_flops(cpu, "bf16", None, tmp_path).flops == 5e10 and measured == [torch.bfloat16]


def test_what_py_cpuinfo_says_is_asked_once_per_boot(tmp_path, monkeypatch):
    """DeepSpeed's CPU Adam asks py-cpuinfo three times per process, each a second of new processes: after the first
    answer on a boot, the cache answers (another boot asks again; a failed probe's empty answer is not kept)."""
    import cpuinfo

    answers = [{}, {"vendor_id_raw": "AuthenticAMD", "flags": ["avx512f"]}, {"vendor_id_raw": "GenuineIntel"}]
    asked = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: asked.append(1) or answers[len(asked) - 1])
    monkeypatch.setattr(hardware, "_boot_id", lambda: "boot-1")
    hardware.remember_cpu_info(tmp_path)
    assert cpuinfo.get_cpu_info() == {} and not (tmp_path / hardware.CPU_INFO_FILE).exists()
    assert [cpuinfo.get_cpu_info() for _ in range(3)] == [answers[1]] * 3 and len(asked) == 2
    hardware.remember_cpu_info(tmp_path)  # installed again (a second run in one process): not wrapped twice
    assert cpuinfo.get_cpu_info() == answers[1] and len(asked) == 2
    monkeypatch.setattr(hardware, "_boot_id", lambda: "boot-2")
    hardware.remember_cpu_info(tmp_path)
    assert cpuinfo.get_cpu_info() == answers[2] and cpuinfo.get_cpu_info() == answers[2] and len(asked) == 3


def test_a_real_matmul_peak_is_positive_and_quick():
    assert hardware.measure_matmul_peak(torch.float32) > 1e8


@pytest.mark.parametrize("env, threads", [
    ({}, 8),  # python train.py: the machine's cores
    ({"OMP_NUM_THREADS": "1"}, 1),  # without a launcher: the user's
    ({"OMP_NUM_THREADS": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, 4),  # torchrun's default: a share
    ({"OMP_NUM_THREADS": "1", "ACCELERATE_MIXED_PRECISION": "no"}, 8),  # accelerate launch of one process
    ({"OMP_NUM_THREADS": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, 3),  # not a launcher's default
    ({"OMP_NUM_THREADS": "1", "LOCAL_RANK": "0", "LOCAL_SIZE": "3"}, 2),  # DeepSpeed's launcher
    ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "16"}, 1),  # at least one
    ({"OMP_NUM_THREADS": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "TRAINKIT_CPU_THREADS": "1"}, 1),
])
def test_cpu_threads_rule(env, threads):
    assert hardware.choose_cpu_threads(env, cores=8).count == threads


def test_bad_thread_count_is_refused():
    with pytest.raises(ConfigError, match=r"TRAINKIT_CPU_THREADS='0' is not a positive number of threads \(the "
                                          r"environment variable TRAINKIT_CPU_THREADS\): set TRAINKIT_CPU_THREADS"):
        hardware.choose_cpu_threads({"TRAINKIT_CPU_THREADS": "0"}, cores=2)


def test_threads_are_set_only_to_change_them(monkeypatch):
    """torch.set_num_threads also pins MKL's threads and turns its own choice off (trainkit/launch/hardware.py: a slower
    step on small products), so the runner calls it only when the count changes."""
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setenv("TRAINKIT_CPU_THREADS", str(torch.get_num_threads()))
    assert hardware.use_cpu_threads().count == torch.get_num_threads() and calls == []
    monkeypatch.setenv("TRAINKIT_CPU_THREADS", str(torch.get_num_threads() + 1))
    assert calls == [hardware.use_cpu_threads().count] == [torch.get_num_threads() + 1]


KEEP_FREED = """
import resource, sys, torch
from trainkit.launch.hardware import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 256))
x = torch.randn(2048, 256)  # activations of 2-16 MiB, allocated and freed in every step
for step in range(20):
    if step == 2:  # from the third step on: the steady state
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model(x).square().mean().backward()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc: Linux only")
def test_freed_memory_is_kept_for_the_next_step():
    """glibc's defaults give large freed blocks back to the kernel, so the next step's activations arrive as fresh
    pages (measured: 42,000-120,000 page faults over 18 steps of this MLP); with keep_freed_memory the freed blocks
    are reused (0-8,200: glibc now and then still extends its heap for an aligned block). The bound leaves room for
    both ends meeting in one run (42,401 against 8,193 in a full suite on 2 cores)."""
    faults = {}
    for mode in ("default", "keep"):
        out = subprocess.run([sys.executable, "-c", KEEP_FREED, mode], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True).stdout.split()
        assert out[0] == {"default": "None", "keep": "True"}[mode]
        faults[mode] = int(out[1])
    assert faults["default"] > 2 * faults["keep"] + 10_000, faults


@pytest.mark.parametrize("allowed, env, says", [
    ({0, 1}, {"OMP_PROC_BIND": "close", "LOCAL_RANK": "0"}, None),  # every CPU: nothing to say
    ({0}, {"OMP_PROC_BIND": "close", "OMP_NUM_THREADS": "2"}, None),  # python train.py, the count given: one
    # thread per core
    ({0}, {"OMP_PROC_BIND": "close"}, "OMP_PROC_BIND=close bound this process's first thread to CPU(s) 0 as torch was "
     "imported, so 1 of the machine's 2 CPUs were counted for its threads: set OMP_NUM_THREADS to the count you want"),
    ({0}, {"OMP_PROC_BIND": "close", "LOCAL_RANK": "1"}, "this process may run only on CPU(s) 0 of this machine's 2: "
     "OMP_PROC_BIND=close bound the launcher to one core and every process it starts inherited it; unset "
     "OMP_PROC_BIND before `accelerate launch`"),
    ({1}, {}, "this process may run only on CPU(s) 1 of this machine's 2 (its CPU affinity: taskset, numactl or a "
     "container's cpuset)"),
])
def test_a_narrowed_cpu_affinity_is_named_with_its_cause(allowed, env, says):
    threads = hardware.choose_cpu_threads(env, cores=len(allowed))  # as the runner counts them: the allowed cores
    assert hardware.narrowed_affinity(allowed, 2, env, threads) == says


@pytest.mark.slow
def test_omp_proc_bind_is_named_with_the_fix(run_dir):
    """The real traps. `accelerate launch` imports torch, its OpenMP binds the launcher to core 0, both ranks inherit
    that one core: the run still trains (a user's cpuset may mean it) and says why it is slow and what to unset.
    `python train.py`: OpenMP binds the main thread to one core, whose cores the runner counts for its threads."""
    run = launch(run_dir("launched"), "--recipe", "mlp", "--max_steps", "2", config="ddp",
                 env={"OMP_PROC_BIND": "close"}).check()
    assert "note: this process may run only on CPU(s) 0 of this machine's" in run.stderr
    assert "unset OMP_PROC_BIND before `accelerate launch`" in run.stderr
    unset = ("OMP_NUM_THREADS", "TRAINKIT_CPU_THREADS")  # TEST_ENV's: here the runner must count the cores
    env = {k: v for k, v in {**os.environ, **TEST_ENV, "OMP_PROC_BIND": "close"}.items() if k not in unset}
    alone = subprocess.run([sys.executable, "train.py", "--recipe", "mlp", "--max_steps", "2", "--output_dir",
                            str(run_dir("alone")), "--report_to", "none"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
    assert alone.returncode == 0, alone.stderr
    assert "note: OMP_PROC_BIND=close bound this process's first thread to CPU(s) 0 as torch was imported" \
        in alone.stderr


def test_size_presets_under_explicit_flags():
    cfg = config("--size", "cpu", "--layers", "2")
    assert (cfg.size, cfg.arch, cfg.hidden, cfg.heads, cfg.layers) == ("cpu", "gpt2", 768, 12, 2)
    sources = field_sources(cfg, [("size", "cpu", "--size"), ("layers", "2", "--layers")])
    assert (sources["hidden"], sources["lr"], sources["layers"], sources["seq_len"]) == \
        ("size cpu", "size cpu", "--layers", "recipe default")
    default = config()
    assert default.size == "tiny" and config_dict(default) == config_dict(load_recipe("tiny_transformer").Config())
    # a resumed run's values sit above the preset: --size must not reset what the checkpoint restored
    restored = build_config(type(cfg), [], restored={"size": "cpu", "layers": 2})
    assert (restored.hidden, restored.layers) == (768, 2)


def test_unknown_size_is_refused_with_the_names(check_only, tmp_path):
    assert_refused(check_only(tmp_path / "out", *TINY_LM, "--size", "huge", "--dry_run"),
                   "unknown size 'huge' (--size): use one of tiny, cpu, gpt2-small")


def test_gpt2_small_passes_the_dry_run(check_only, tmp_path):
    run = check_only(tmp_path / "out", "--recipe", "tiny_transformer", "--size", "gpt2-small", "--dry_run")
    assert run.returncode == 0, run.stderr
    resolved = json.loads(run.stdout)
    assert (resolved["hidden"], resolved["vocab_size"], resolved["seq_len"], resolved["batch_size"]) == \
        (768, 50257, 1024, 8)
    assert resolved["flops_param_count"] == 123_653_376 and resolved["sources"]["arch"] == "size gpt2-small"


def test_metrics_carry_mfu_and_elapsed_seconds_on_cpu(run_dir):
    """A short one-process run: every metrics line has a float MFU (the CPU's measured peak, no --peak_flops) and the
    seconds since the process started; resolved_config.json says what they were computed from."""
    run = launch(run_dir("out"), *TINY_LM, "--max_steps", "3", "--eval_every", "0", "--report_to", "none").check()
    for line in run.metrics:
        assert isinstance(line["mfu"], float) and 0 < line["mfu"] < 1.5, line
    elapsed = [line["elapsed_s"] for line in run.metrics]
    assert 0 < elapsed[0] < elapsed[1] < elapsed[2]
    resolved = run.resolved
    assert resolved["cpu_threads"] == 1 and resolved["sources"]["cpu_threads"] == "TRAINKIT_CPU_THREADS"  # TEST_ENV
    assert resolved["peak_flops"] > 0 and "float32 matmul, 1 thread(s)" in resolved["sources"]["peak_flops"]
    tokens_per_s = run.metrics[-1]["tokens_per_s"]
    assert run.metrics[-1]["mfu"] == pytest.approx(tokens_per_s * resolved["flops_per_token"] / resolved["peak_flops"])
    assert "note: 1 CPU thread(s) per process (TRAINKIT_CPU_THREADS" in run.stderr
