"""What the dry run (and every launch) refuses in a strategy config, checked inside the test process: DeepSpeed JSON
that disagrees with the run, YAML typos, launches this machine cannot run, and every shipped config accepted."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import ROOT, assert_refused, write_yaml, zero2_json
from trainkit.launch.launcher import shipped_configs


@pytest.mark.parametrize("json_changes, message, fix", [
    ({"train_micro_batch_size_per_gpu": 4},
     "train_micro_batch_size_per_gpu is 4 in {ds} but 8 in the run (--batch_size)", "or pass --batch_size 4"),
    ({"gradient_accumulation_steps": 3}, "gradient_accumulation_steps is 3 in {ds} but 1 in the run (recipe default)",
     "or pass --grad_accum 3"),
    ({"train_batch_size": 32}, "train_batch_size is 32 in {ds} but 16 in the run (batch_size x grad_accum x "
     "num_processes)", "or choose a batch_size x grad_accum x num_processes of 32"),
    ({"gradient_clipping": 5.0}, "gradient_clipping is 5.0 in {ds} but 1.0 in the run (recipe default)",
     "or pass --max_grad_norm 5.0"),
    ({"bf16": {"enabled": True}}, "bf16.enabled is True in {ds} but mixed_precision is no",
     'set "bf16": {"enabled": "auto"} in the JSON'),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, "{ds} defines an optimizer, and so does the recipe",
     'remove "optimizer" from the JSON'),
])
def test_deepspeed_json_that_disagrees_with_the_run_is_refused(check_only, tmp_path, json_changes, message, fix):
    yaml_path = write_yaml(tmp_path, "deepspeed_zero2", zero2_json(**json_changes))
    run = check_only(tmp_path / "out", "--recipe", "mlp", "--batch_size", "8", "--dry_run",
                     "--accelerate_config", str(yaml_path))
    assert_refused(run, message.format(ds=tmp_path / "ds.json"))
    assert fix in run.stderr, run.stderr


def test_every_problem_is_reported_together(check_only, tmp_path):
    yaml_path = write_yaml(tmp_path, "deepspeed_zero2", zero2_json(train_micro_batch_size_per_gpu=4,
                                                                    gradient_clipping=5.0))
    run = check_only(tmp_path / "out", "--recipe", "mlp", "--dry_run", "--accelerate_config", str(yaml_path))
    assert run.returncode == 2 and run.stderr.count("error: ") == 2


def test_explicit_values_that_agree_are_accepted(check_only, tmp_path):
    yaml_path = write_yaml(tmp_path, "deepspeed_zero2", zero2_json(train_micro_batch_size_per_gpu=8,
                                                                    gradient_clipping=1.0))
    run = check_only(tmp_path / "out", "--recipe", "mlp", "--batch_size", "8", "--dry_run",
                     "--accelerate_config", str(yaml_path))
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["zero_stage"] == 2


def test_a_gpu_machine_that_cannot_do_it_is_refused_before_start(check_only, tmp_path, monkeypatch):
    """The dry run on a one-GPU machine whose GPU only emulates bf16 (a V100): both problems, before any GPU hour.
    The machine is faked here (torch.cuda answers as a V100 box would); test_gpu.py refuses on real hardware."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    yaml_path = write_yaml(tmp_path, "ddp", **{'mixed_precision:__"no"': 'mixed_precision: "bf16"'})
    run = check_only(tmp_path / "out", "--recipe", "mlp", "--dry_run", "--accelerate_config", str(yaml_path))
    assert_refused(run, "bf16 needs a GPU with bf16 arithmetic (Ampere or newer); Tesla V100-SXM2-16GB only emulates "
                        "it, many times slower")
    assert "use --mixed_precision fp16 on this GPU" in run.stderr
    assert "2 processes but 1 GPU(s) per machine" in run.stderr


def test_refused_launch_configs(check_only, tmp_path):
    cases = [
        (write_yaml(tmp_path, "fsdp", **{"fsdp_version: 2": "fsdp_version: 1"}),
         "fsdp_version 1: this runner shards with FSDP2 only"),
        (write_yaml(tmp_path, "deepspeed_zero2", json_text=json.dumps({
            **json.loads(zero2_json()), "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})),
         "offload_param needs ZeRO stage 3, the JSON has stage 2"),
    ]
    for yaml_path, message in cases:
        run = check_only(tmp_path / "out", "--recipe", "mlp", "--dry_run", "--accelerate_config", str(yaml_path))
        assert_refused(run, message)
    run = check_only(tmp_path / "out", "--recipe", "mlp", "--dry_run", "--optimizer", "sgd",
                     "--accelerate_config", str(ROOT / "accelerate_configs" / "deepspeed_zero2_offload.yaml"))
    assert_refused(run, "optimizer sgd cannot run in DeepSpeed's CPU offload")
    run = check_only(tmp_path / "out", "--recipe", "mlp", "--dry_run", "--async_save",
                     "--accelerate_config", str(ROOT / "accelerate_configs" / "deepspeed_zero3.yaml"))
    assert_refused(run, "--async_save does not work under deepspeed_zero3: its checkpoints are written by "
                        "DeepSpeed's engine, which saves synchronously")


def test_dry_run_checks_the_world_the_launch_will_start(check_only, tmp_path):
    """--num_processes / --num_machines override the YAML's world as accelerate launch's flags do: a SLURM job's
    pre-flight (examples/slurm.sbatch) checks its allocation, not the YAML's 2 x 1."""
    yaml_path = str(ROOT / "accelerate_configs" / "multinode.yaml")
    run = check_only(tmp_path / "out", "--recipe", "mlp", "--dry_run", "--accelerate_config", yaml_path,
                     "--num_processes", "16", "--num_machines", "4")
    resolved = json.loads(run.stdout)
    assert run.returncode == 0 and resolved["world_size"] == 16 and resolved["num_machines"] == 4, run.stderr
    assert resolved["global_batch_size"] == 16 * resolved["batch_size"]
    run = check_only(tmp_path / "out", "--recipe", "mlp", "--dry_run", "--num_processes", "3",
                     "--accelerate_config", str(ROOT / "accelerate_configs" / "tp.yaml"))
    assert_refused(run, "the parallelism sizes multiply to 2 (dp_replicate 1 x dp_shard 1 x tp 2) but 3 process(es) "
                        "were launched (parallelism_config in ")
    assert "tp.yaml with --num_processes 3)" in run.stderr
    run = check_only(tmp_path / "out", "--recipe", "mlp", "--num_machines", "2")
    assert_refused(run, "--num_machines goes with --dry_run --accelerate_config")


def test_dry_run_checks_the_yaml_itself(check_only, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed_type: DEEPSPEED\nnum_processes: 0\nmixed_precison: bf16\ndeepspeed_config:\n"
                   "  deepspeed_config_file: ds_configs/zero2.json\n  gradient_accumulation_steps: 4\n")
    run = check_only(tmp_path / "out", "--recipe", "mlp", "--dry_run", "--accelerate_config", str(bad))
    assert_refused(run, "unknown key 'mixed_precison'")
    assert "did you mean mixed_precision?" in run.stderr
    assert "num_processes must be a positive integer, got 0" in run.stderr
    assert "deepspeed_config sets gradient_accumulation_steps next to a deepspeed_config_file" in run.stderr


ONE_PROCESS = ("2 processes asked for, but this launch runs 1: accelerate launch starts one for distributed_type NO or "
               "MULTI_CPU (without mpirun), and for --num_processes without a multi-process config on a machine "
               "without GPUs")


@pytest.mark.parametrize("changes", [
    {"distributed_type: MULTI_GPU": "distributed_type: MULTI_CPU", "use_cpu: false": "use_cpu: true"},  # CPU's own
    {"distributed_type: MULTI_GPU": 'distributed_type: "NO"'},
])
def test_a_yaml_whose_processes_accelerate_would_not_start_is_refused(check_only, tmp_path, changes):
    """`accelerate config` on a machine without GPUs writes MULTI_CPU: accelerate launch then starts one process
    whatever num_processes says; the dry run must not plan the 2 that the YAML names."""
    yaml_path = write_yaml(tmp_path, "ddp", **{k.replace(" ", "__"): v for k, v in changes.items()})
    run = check_only(tmp_path / "out", "--recipe", "mlp", "--dry_run", "--accelerate_config", str(yaml_path))
    assert_refused(run, f"{ONE_PROCESS} (num_processes in {yaml_path}): launch with --config_file "
                        "accelerate_configs/ddp.yaml or another multi-process config")


@pytest.mark.parametrize("argv, asked", [
    (["/usr/bin/python3", "/usr/local/bin/accelerate", "launch", "--num_processes", "2", "train.py", "--recipe", "mlp"],
     (2, "accelerate launch --num_processes")),
    (["python", "-m", "accelerate.commands.launch", "--num_processes=3", "train.py"],
     (3, "accelerate launch --num_processes")),
    # train.py's own --num_processes (with --estimate) is not the launcher's
    (["accelerate", "launch", "--config_file", "{ddp}", "train.py", "--estimate", "--num_processes", "8"],
     (2, "num_processes in {ddp}")),
    (["torchrun", "--nproc_per_node", "2", "train.py"], None),
    (["accelerate", "launch", "--no-such-flag", "train.py"], None),
])
def test_the_launchers_process_count_is_read_from_its_command_line(argv, asked):
    from trainkit.launch.launcher import requested_processes

    ddp = str(ROOT / "accelerate_configs" / "ddp.yaml")
    fill = lambda text: text.format(ddp=ddp)  # noqa: E731
    assert requested_processes([fill(a) for a in argv]) == (asked and (asked[0], fill(asked[1])))


@pytest.mark.parametrize("argv, env, ep", [
    (["/usr/bin/python3", "/usr/local/bin/accelerate", "launch", "--config_file", "{ep}", "train.py"], {}, 2),
    (["python", "-m", "accelerate.commands.launch", "--config_file", "{fsdp}", "train.py"], {}, 1),
    # started without Accelerate: the environment names it, or nothing does
    (["torchrun", "--nproc_per_node", "2", "train.py"], {"PARALLELISM_CONFIG_EP_SIZE": "2"}, 2),
    (["torchrun", "--nproc_per_node", "2", "train.py"], {}, 1),
])
def test_the_expert_parallel_size_is_read_from_the_launchers_yaml(monkeypatch, argv, env, ep):
    """`accelerate launch` passes no expert-parallel size to its processes (Accelerate has no such option): each reads
    it from the YAML its launcher's command line names, as the launch's parallelism sizes."""
    from trainkit.launch import launcher

    configs = {name: str(ROOT / "accelerate_configs" / f"{name}.yaml") for name in ("ep", "fsdp")}
    configs["ep"] = configs["ep"].replace("ep.yaml", "fsdp_ep.yaml")
    monkeypatch.setattr(launcher, "_launcher_argv", lambda: [a.format(**configs) for a in argv])
    for name in list(os.environ):
        if name.startswith("PARALLELISM_CONFIG_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    for name, value in {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "ACCELERATE_USE_FSDP": "true", **env}.items():
        monkeypatch.setenv(name, value)
    assert launcher.Launch.from_env().parallelism_size("ep") == ep


def test_a_key_given_twice_in_the_yaml_is_refused(check_only, tmp_path):
    """YAML and Accelerate keep the last of two, silently: a setting added under the shipped one is lost or wins."""
    yaml_path = write_yaml(tmp_path, "fsdp", **{"fsdp_activation_checkpointing:__false": "fsdp_activation_checkpointing"
                                                ": false\n  fsdp_activation_checkpointing: true"})
    run = check_only(tmp_path / "out", "--recipe", "tiny_transformer", "--dry_run", "--accelerate_config",
                     str(yaml_path))
    line = yaml_path.read_text().splitlines().index("  fsdp_activation_checkpointing: true") + 1
    assert_refused(run, f"{yaml_path}: fsdp_activation_checkpointing is given twice (the second time on line {line}) "
                        f"(--accelerate_config {yaml_path}): keep one of them: Accelerate would silently take the last")


def test_a_key_given_twice_in_the_deepspeed_json_is_refused(check_only, tmp_path):
    """As DeepSpeed itself refuses it when it reads a file; the runner reads the file and hands DeepSpeed a dict."""
    text = zero2_json().replace('"gradient_clipping": "auto"', '"gradient_clipping": "auto", "gradient_clipping": 2.0')
    run = check_only(tmp_path / "out", "--recipe", "mlp", "--dry_run", "--accelerate_config",
                     str(write_yaml(tmp_path, "deepspeed_zero2", text)))
    assert_refused(run, f"{tmp_path / 'ds.json'} is not valid JSON: Duplicate keys in DeepSpeed config: "
                        "['gradient_clipping']")


def test_dry_run_runs_deepspeeds_own_validation(check_only, tmp_path):
    ds = json.loads(zero2_json())
    ds["zero_optimization"]["reduce_bucket_sise"] = 100
    run = check_only(tmp_path / "out", "--recipe", "mlp", "--dry_run",
                     "--accelerate_config", str(write_yaml(tmp_path, "deepspeed_zero2", json.dumps(ds))))
    assert_refused(run, "DeepSpeed rejects the JSON")
    assert "reduce_bucket_sise" in run.stderr


def test_every_shipped_config_passes_the_dry_run(check_only, chat, moe_folder, tmp_path):
    from trainkit.recipes import load_recipe
    from trainkit.strategies.registry import for_launch

    for name, launch in shipped_configs().items():
        if name == "deepspeed_hostfile":  # its example hosts do not exist; test_multinode.py dry-runs it over ssh
            continue
        path = ROOT / "accelerate_configs" / f"{name}.yaml"
        # a strategy that cuts the model needs a model that says where: the tiny transformer does, the MLP does not;
        # one that splits experts needs a mixture of experts
        strategy = for_launch(launch, load_recipe("mlp").Config(), {})
        recipe = ["--recipe", "tiny_transformer" if strategy.splits_model else "mlp"]
        if strategy.needs_experts:
            recipe = ["--recipe", "causal_lm", "--model_name_or_path", str(moe_folder("qwen3_moe")), "--data",
                      str(chat[1]), "--chat_template", "chatml"]
        run = check_only(tmp_path / "out", *recipe, "--dry_run", "--accelerate_config", str(path))
        if strategy.needs_gpu and not torch.cuda.is_available():  # refused here for that reason alone
            assert run.returncode == 2 and run.stderr.count("error: ") == 1 and "CUDA" in run.stderr, run.stderr
            continue
        assert run.returncode == 0, (path.name, run.stderr)


@pytest.mark.parametrize("line, flags, message", [
    ("fsdp_auto_wrap_policy: SIZE_BASED_WRAP", [], "fsdp_auto_wrap_policy SIZE_BASED_WRAP: the runner shards the "
     "model's blocks (TRANSFORMER_BASED_WRAP) or the whole model at once (NO_WRAP)"),
    ("fsdp_ignored_modules: lm_head", [], "fsdp_ignored_modules: the runner shards every module"),
    ("fsdp_activation_checkpointing_offload: true", [], "fsdp_activation_checkpointing_offload: the runner "
     "recomputes activations, it does not move them to the CPU"),
    ("fsdp_activation_checkpointing: true", ["--compile"], "fsdp_activation_checkpointing with --compile"),
    ("fsdp_activation_checkpointing: true", ["--gradient_checkpointing"], "fsdp_activation_checkpointing and the "
     "recipe's gradient_checkpointing both recompute the blocks"),
])
def test_fsdp_settings_the_runner_does_not_apply_are_refused(check_only, tmp_path, line, flags, message):
    # the line replaces the shipped YAML's own setting of that key (fsdp_activation_checkpointing: false), or is added
    key = line.split(":")[0]
    shipped = (ROOT / "accelerate_configs" / "fsdp.yaml").read_text()
    change = {f"{key}:__false": line} if f"  {key}: false" in shipped else \
        {"fsdp_version:__2": f"fsdp_version: 2\n  {line}"}
    yaml_path = write_yaml(tmp_path, "fsdp", **change)
    run = check_only(tmp_path / "out", "--recipe", "tiny_transformer", *flags, "--dry_run", "--accelerate_config",
                     str(yaml_path))
    assert_refused(run, message)
    assert f"(fsdp_config in {yaml_path})" in run.stderr


def test_fsdp_blocks_keep_tied_parameters_in_one_group_and_follow_declared_classes():
    """FSDP2 refuses a parameter managed by two groups: a block that shares a parameter with a module outside it
    (tied embeddings) stays in the root's group. Blocks the YAML or the model declares are used as they are."""
    import dataclasses

    from trainkit.recipes import load_recipe
    from trainkit.strategies.parallelize import FSDPSettings, blocks

    fsdp = shipped_configs()["fsdp"]
    lm = load_recipe(str(ROOT / "tests" / "zoo" / "tied_rnn_lm.py"))
    model = lm.build_model(lm.Config())
    settings = FSDPSettings.of(fsdp)
    assert model.out.weight is model.embed.weight and blocks(model, settings) == []  # its only Linear is tied
    vision = load_recipe(str(ROOT / "tests" / "zoo" / "vision_moe.py"))
    model = vision.build_model(vision.Config())
    assert blocks(model, settings) == [*reversed(model.experts), model.router]  # every Linear, innermost first
    model._no_split_modules = ["Residual"]  # declared by the recipe's build_model
    assert blocks(model, settings) == [model.block]
    declared = dataclasses.replace(fsdp, settings={**fsdp.settings, "fsdp_transformer_layer_cls_to_wrap": "Linear"})
    assert blocks(model, FSDPSettings.of(declared)) == [*reversed(model.experts), model.router]
    whole = dataclasses.replace(fsdp, settings={**fsdp.settings, "fsdp_auto_wrap_policy": "NO_WRAP"})
    assert blocks(model, FSDPSettings.of(whole)) == []  # one group: the root


@pytest.mark.parametrize("yaml_text, messages", [
    ("distributed_type: DEEPSEED\nmixed_precison: bf16\n",
     ["distributed_type 'DEEPSEED' is not one of Accelerate's", "unknown key 'mixed_precison'"]),
    ("distributed_type: MULTI_GPU\nnum_processes: two\n", ["num_processes must be a positive integer, got 'two'"]),
    ("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds_configs/zero2.json\n"
     "  zero3_init_flg: false\n",
     ["unknown key 'zero3_init_flg' in deepspeed_config (deepspeed_config in {yaml}): did you mean zero3_init_flag?"]),
])
def test_every_yaml_problem_is_named_at_once_and_none_crashes_the_check(check_only, tmp_path, yaml_text, messages):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml_text)
    run = check_only(tmp_path / "out", "--recipe", "mlp", "--dry_run", "--accelerate_config", str(path))
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    for message in messages:
        assert f"error: {message.format(yaml=path)}" in run.stderr, run.stderr
    assert run.stderr.count("error: ") == len(messages)
