"""Recipe loading and command-line overrides: good values land in the config, bad ones end with a clear error."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import ROOT, assert_refused, launch, tmpfs
from trainkit.command_line import parse_command_line
from trainkit.config import ConfigError, TrainConfig, build_config
from trainkit.recipes import load_recipe


def test_shipped_recipes_load_by_name_and_path():
    for name in ("mlp", "tiny_transformer"):
        by_name = load_recipe(name)
        by_path = load_recipe(str(ROOT / "recipes" / f"{name}.py"))
        assert by_name.Config().max_steps == by_path.Config().max_steps


def test_recipe_outside_the_repo_loads_by_path(tmp_path):
    copy = tmp_path / "my_model.py"
    copy.write_text((ROOT / "recipes" / "mlp.py").read_text().replace("hidden: int = 64", "hidden: int = 7"))
    assert load_recipe(str(copy)).Config().hidden == 7


def test_overrides_are_typed():
    options, overrides = parse_command_line(["--recipe", "mlp", "--lr", "0.5", "--set", "hidden=16",
                                             "--batchnorm", "--noise=0.25", "--max_steps", "7"])
    cfg = build_config(load_recipe("mlp").Config, overrides)
    assert (cfg.lr, cfg.hidden, cfg.batchnorm, cfg.noise, cfg.max_steps) == (0.5, 16, True, 0.25, 7)
    assert options.recipe == "mlp" and str(options.output_dir) == "runs/mlp"


@pytest.mark.parametrize("argv, message", [
    (["--set", "hiden=3"], "unknown config field 'hiden' (--set hiden=3): did you mean hidden?"),
    (["--hidden", "wide"], "hidden takes an integer, got 'wide' (--hidden): write it as the recipe's default is "
                           "written: hidden=64"),
    (["--lr", "abc"], "lr takes a number, got 'abc' (--lr): write it as the recipe's default is written: lr=0.01"),
    (["--batchnorm", "maybe"], "batchnorm takes true or false, got 'maybe' (--batchnorm): write it as the recipe's "
                               "default is written: batchnorm=False"),
    (["--lr", "-1"], "lr must be > 0, got -1.0 (config field lr): pass a positive --lr"),
    (["--max_steps", "0", "--batch_size", "0"], "batch_size must be >= 1"),
    (["--seed", "-5"], "seed must be in [0, 2**32 - 1], got -5 (config field seed): pass --seed 0 or another count"),
])
def test_bad_overrides_are_reported(argv, message):
    _, overrides = parse_command_line(["--recipe", "mlp", *argv])
    with pytest.raises(ConfigError) as error:
        build_config(load_recipe("mlp").Config, overrides)
    assert any(message in str(p) for p in error.value.problems), error.value.problems


def test_every_problem_is_reported_at_once():
    _, overrides = parse_command_line(["--recipe", "mlp", "--max_steps", "0", "--batch_size", "0"])
    with pytest.raises(ConfigError) as error:
        build_config(load_recipe("mlp").Config, overrides)
    assert len(error.value.problems) == 2


def test_transformer_checks_its_own_fields():
    _, overrides = parse_command_line(["--recipe", "tiny_transformer", "--hidden", "100", "--heads", "3"])
    with pytest.raises(ConfigError, match=r"hidden \(100\) must be a multiple of heads \(3\)"):
        build_config(load_recipe("tiny_transformer").Config, overrides)


@pytest.mark.parametrize("recipe_text, message", [
    ("def broken(:\n", "failed to import: SyntaxError"),
    ("import not_a_module_anywhere\n", "failed to import: ModuleNotFoundError"),
    ("from trainkit.config import TrainConfig\nConfig = TrainConfig\n", "lacks build_model, build_datasets, loss"),
    ("Config = dict\nbuild_model = build_datasets = loss = None\n", "Config must subclass"),
    ("from trainkit.config import TrainConfig\nclass Config(TrainConfig):\n    width: int = 3\n"
     "def build_model(cfg): ...\ndef build_datasets(cfg, cache_dir): ...\ndef loss(model, batch): ...\n",
     "Config is not a dataclass, so its fields (width) do not exist"),
    ("from trainkit.recipes import load_recipe\nmlp = load_recipe('mlp')\nConfig = mlp.Config\n"
     "build_model, build_datasets = mlp.build_model, mlp.build_datasets\nloss = 3\n", "loss is not a function"),
])
def test_broken_recipe_files(check_only, tmp_path, recipe_text, message):
    path = tmp_path / "broken.py"
    path.write_text(recipe_text)
    run = check_only(tmp_path / "out", "--recipe", str(path))
    assert_refused(run, message)
    assert "Traceback" not in run.stderr and not (tmp_path / "out").exists()


def test_the_hint_for_a_broken_recipe_works_when_pasted(check_only, tmp_path):
    """The refusal says how to see the traceback; the command it gives runs from anywhere and shows it."""
    path = tmp_path / "broken.py"
    path.write_text("from trainkit.config import TrainConfig\nimport not_a_module_anywhere\n")
    run = check_only(tmp_path / "out", "--recipe", str(path))
    hint = run.stderr.split("fix the recipe file (")[1].split(" shows the traceback")[0]
    shown = subprocess.run(hint, shell=True, cwd=tmp_path, capture_output=True, text=True)
    assert "Traceback" in shown.stderr and "No module named 'not_a_module_anywhere'" in shown.stderr, shown.stderr


def test_unknown_recipe_name(check_only, tmp_path):
    assert_refused(check_only(tmp_path / "out", "--recipe", "gpt5"),
                   "no shipped recipe named 'gpt5' (--recipe): use one of causal_lm, distill, dpo, grpo, "
                   "image_classifier, mlp, reward, tiny_transformer")


def test_dry_run_prints_the_resolved_config_and_trains_nothing(check_only, tmp_path):
    run = check_only(tmp_path / "out", "--recipe", "tiny_transformer", "--dry_run", "--lr", "1e-3",
                     "--accelerate_config", str(ROOT / "accelerate_configs" / "ddp.yaml"))
    assert run.returncode == 0, run.stderr
    resolved = json.loads(run.stdout)
    assert resolved["strategy"] == "ddp" and resolved["world_size"] == 2
    assert resolved["global_batch_size"] == 2 * resolved["batch_size"]
    assert resolved["seq_len"] == 128 and resolved["lr"] == 1e-3
    assert resolved["sources"]["lr"] == "--lr" and resolved["sources"]["hidden"] == "recipe default"
    assert resolved["estimated_state_bytes"] > 0
    assert not (tmp_path / "out").exists()


MLP_RECIPE = (ROOT / "recipes" / "mlp.py").read_text()


@pytest.mark.parametrize("change, message", [
    (("    return torch.nn.Sequential(*layers)", "    return layers"),
     "build_model returned list, not a torch.nn.Module (--recipe): return the model from build_model"),
])
def test_recipe_mistakes_found_while_planning(check_only, tmp_path, change, message):
    path = tmp_path / "my_model.py"
    path.write_text(MLP_RECIPE.replace(*change))
    assert_refused(check_only(tmp_path / "out", "--recipe", str(path), "--dry_run"), message)


@pytest.mark.parametrize("change, message", [
    (("    return torch.nn.functional.mse_loss(model(x), y)", "    return torch.nn.functional.mse_loss(model(x), y, "
                                                               "reduction='none')"),
     "loss returned a tensor of shape (32, 1) and dtype torch.float32, not a scalar float tensor"),
    (("    return torch.nn.functional.mse_loss(model(x), y)", "    return torch.nn.functional.mse_loss(model(x), y)"
                                                               ".item()"),
     "loss returned float, not a scalar float tensor"),
    (("    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])",
      "    return [{'x': x[i], 'n': i % 2 and [1] or [1, 2]} for i in range(split)], TensorDataset(x[split:])"),
     "build_datasets' train split does not give batches"),
    (("    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])",
      "    return TensorDataset(x[:split], y[:split])"), "build_datasets returned TensorDataset, not (train, eval)"),
])
def test_recipe_mistakes_found_when_the_run_starts(tmp_path, change, message):
    """Each names the recipe file, the function and what was expected; nothing but an error line, exit 2."""
    path = tmp_path / "my_model.py"
    path.write_text(MLP_RECIPE.replace(*change))
    run = launch(tmp_path / "out", "--recipe", str(path), "--max_steps", "2")
    assert_refused(run, message)
    assert f"recipe {path}" in run.stderr and "Traceback" not in run.stderr


def test_an_exception_in_the_users_code_says_where_it_was_raised(check_only, tmp_path, monkeypatch):
    """The recipe imports a module of the user's from beside it, which raises while the model is built (planning):
    the error names that line and the recipe's call to it, exit 2, no traceback; TRAINKIT_TRACEBACK=1 lets the
    exception itself through."""
    (tmp_path / "my_layers_a.py").write_text("def block(width):\n    raise ValueError(f'no block of width {width}')\n")
    path = tmp_path / "my_model.py"
    path.write_text(MLP_RECIPE.replace("    layers: list[torch.nn.Module] = []\n",
                                       "    from my_layers_a import block\n    block(cfg.hidden)\n"))
    run = check_only(tmp_path / "out", "--recipe", str(path), "--dry_run")
    assert_refused(run, f"ValueError: no block of width 64, raised in the recipe's code ({tmp_path}/my_layers_a.py:2 "
                        "in block: raise ValueError(f'no block of width {width}')): see what it does there (called "
                        f"from {path}:56 in build_model); TRAINKIT_TRACEBACK=1 shows the whole traceback")
    assert "Traceback" not in run.stderr
    monkeypatch.setenv("TRAINKIT_TRACEBACK", "1")
    with pytest.raises(ValueError, match="no block of width 64"):
        check_only(tmp_path / "out", "--recipe", str(path), "--dry_run")


def test_an_exception_from_a_library_called_by_the_users_loss_names_the_users_line(tmp_path):
    """torch raises inside the model while the run trains (the recipe feeds it the wrong width)."""
    path = tmp_path / "my_model.py"
    path.write_text(MLP_RECIPE.replace("    x, y = batch\n", "    x, y = batch\n    x = x[:, :16]\n"))
    run = launch(tmp_path / "out", "--recipe", str(path), "--max_steps", "2")
    assert_refused(run, "RuntimeError: mat1 and mat2 shapes cannot be multiplied (32x16 and 32x64), raised in torch, "
                        f"called by the recipe's code ({path}:79 in loss: return "
                        "torch.nn.functional.mse_loss(model(x), y)): see what it does there; TRAINKIT_TRACEBACK=1")
    assert "Traceback" not in run.stderr


@pytest.mark.slow
def test_an_error_while_the_progress_bar_is_drawn_starts_a_line_of_its_own(tmp_path):
    """The recipe fails at step 3, with the bar on screen: `grep '^error:'` must find the error line (it was glued to
    the bar's `... 2/20 [00:01 ...]`); and the bar's postfix shows the step just done."""
    path = tmp_path / "my_model.py"
    path.write_text(MLP_RECIPE.replace("    x, y = batch\n", "    x, y = batch\n"
                                       "    loss.calls = getattr(loss, 'calls', 0) + 1\n"
                                       "    if loss.calls == 3:\n        raise ValueError('bad batch')\n"))
    run = launch(tmp_path / "out", "--recipe", str(path), "--max_steps", "20", "--eval_every", "0")
    assert_refused(run, "ValueError: bad batch, raised in the recipe's code")
    assert re.search(r"^error: ValueError: bad batch", run.stderr, re.MULTILINE), run.stderr
    losses = [m["loss"] for m in run.metrics]
    assert len(losses) == 2 and "2/20 [" in run.stderr
    shown = re.findall(r" 2/20 \[[^]]*loss=([\d.]+)", run.stderr)  # what the bar showed once step 2 was done
    assert shown and float(shown[-1]) == pytest.approx(losses[1], abs=1e-4), (shown, losses)


def test_running_out_of_memory_names_the_ways_to_need_less(check_only, tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(MLP_RECIPE.replace(
        "    layers: list[torch.nn.Module] = []\n",
        "    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has 1.5 GiB "
        "free.')\n"))
    run = check_only(tmp_path / "out", "--recipe", str(path), "--dry_run")
    assert_refused(run, "rank 0 ran out of memory (OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
                        "GPU 0 has 1.5 GiB free.): a smaller --batch_size with a larger --grad_accum", code=1)
    assert "--estimate --device_memory 80GB names the cheapest that fits" in run.stderr


def test_each_frame_is_named_by_who_wrote_it(tmp_path):
    import json as stdlib_module

    import torch
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from trainkit import errors

    (tmp_path / "mine.py").write_text("")
    assert [errors._origin(f) for f in (torch.__file__, stdlib_module.__file__, errors.__file__,
                                        str(ROOT / "train.py"), f"{cache_dir()}/ab/cabc.py", "<eval_with_key>.3",
                                        str(tmp_path / "mine.py"), str(ROOT / "recipes" / "mlp.py"))] == \
        ["torch", "the standard library", "the runner", "the runner", "torch.compile's generated code",
         "generated code", None, None]


def test_an_exception_of_the_runners_own_keeps_its_traceback(check_only, tmp_path, monkeypatch):
    """No frame of the user's code: a bug of the runner or a library, reported as Python reports it."""
    import operator

    import train

    monkeypatch.setattr(train, "make_plan", operator.truediv)  # options / overrides: raises with no Python frame
    with pytest.raises(TypeError, match="unsupported operand type"):
        check_only(tmp_path / "out", "--recipe", "mlp", "--dry_run")


def test_a_warmup_longer_than_the_run_is_said(check_only, tmp_path):
    run = check_only(tmp_path / "out", "--recipe", "mlp", "--max_steps", "10", "--warmup_steps", "20", "--dry_run")
    assert run.returncode == 0 and "note: warmup_steps 20 >= max_steps 10: the learning rate is still warming up " \
        "when the run ends and never reaches lr 0.01; pass --warmup_steps below --max_steps" in run.stderr, run.stderr
    run = check_only(tmp_path / "out", "--recipe", "mlp", "--max_steps", "10", "--warmup_steps", "5", "--dry_run")
    assert "warmup_steps" not in run.stderr


def test_output_dir_that_is_a_file_is_refused(check_only, tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    assert_refused(check_only(tmp_path / "notes.txt", "--recipe", "mlp"),
                   f"{tmp_path / 'notes.txt'} is a file, not a folder (--output_dir)")
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_data_names_a_dataset_or_a_file_without_guessing_from_a_dot():
    from trainkit.data.text import local_files

    assert local_files("org/name-1.0") is None and local_files("wikitext") is None  # Hugging Face names
    assert local_files("missing.txt") == [Path("missing.txt")]  # a file (refused later: it does not exist)


def test_flags_take_dashes_and_typos_get_advice_that_matches(check_only, tmp_path):
    """train.py's own flags and the recipe's fields are suggested together; dashes are underscores; no abbreviation
    is taken for a flag."""
    run = check_only(tmp_path / "x", "--recipe", "mlp", "--dry_run", "--save-every", "5", "--keep-last", "2",
                     "--warmup-steps", "3")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["warmup_steps"] == 3
    options, _ = parse_command_line(["--recipe", "mlp", "--save-every", "5", "--output-dir", "elsewhere"])
    assert (options.save_every, str(options.output_dir)) == (5, "elsewhere")
    for typo, advice in [("--overwite", "did you mean --overwrite?"), ("--dryrun", "did you mean --dry_run?"),
                         ("--max_step", "did you mean max_steps"), ("--save_evry", "did you mean --save_every")]:
        run = check_only(tmp_path / "x", "--recipe", "mlp", typo, "20")
        assert_refused(run, f"unknown config field {typo[2:]!r} ({typo}): {advice}")


def test_an_output_dir_on_a_read_only_mount_is_refused_with_the_fix_for_it(check_only, tmp_path):
    """A real read-only file system (a tmpfs mounted ro): fixing permissions would not help, so the advice differs."""
    with tmpfs(tmp_path / "ro", "size=1m,ro") as mount:
        assert_refused(check_only(mount / "run", "--recipe", "mlp"),
                       f"cannot write in {mount}: its file system is mounted read-only (--output_dir): pass an "
                       "--output_dir on a writable file system")


def test_an_output_dir_that_cannot_be_written_is_refused(check_only, tmp_path, monkeypatch):
    """Faked (the tests may run as root, for whom every folder is writable): os.access says no."""
    import trainkit.run.checkpoint

    monkeypatch.setattr(trainkit.run.checkpoint.os, "access", lambda path, mode: False)
    assert_refused(check_only(tmp_path / "new" / "run", "--recipe", "mlp"),
                   f"cannot write in {tmp_path} (--output_dir): pass a folder you can write to, or fix its permissions")


@pytest.mark.parametrize(("warmup", "total", "floor"), [(20, 300, 0.1), (2, 8, 0.0), (10, 10, 0.5), (0, 1, 0.1)])
def test_the_schedule_is_transformers_cosine_with_warmup_to_the_bit(warmup, total, floor):
    """trainkit/models/optimizer.py writes the schedule itself (importing transformers.optimization costs every process
    2.7 s):
    every step's learning rate equals get_cosine_with_min_lr_schedule_with_warmup's exactly."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    from trainkit.models.optimizer import build_scheduler

    def rates(make):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
        schedule = make(optimizer)
        found = []
        for _ in range(total + 2):
            found.append(schedule.get_last_lr()[0])
            optimizer.step()
            schedule.step()
        return found

    cfg = TrainConfig(warmup_steps=warmup, max_steps=total, min_lr_ratio=floor)
    ours = rates(lambda optimizer: build_scheduler(cfg, optimizer))
    theirs = rates(lambda optimizer: get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=warmup, num_training_steps=total, min_lr_rate=floor))
    assert ours == theirs and len(set(ours)) > 1
