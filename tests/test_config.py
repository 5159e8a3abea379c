"""Recipe loading and command-line overrides: good values land in the config, bad ones end with a clear error."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, assert_refused, launch
from trainkit.config import ConfigError, build_config, parse_command_line
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
    (["--hidden", "wide"], "hidden takes an integer, got 'wide' (--hidden)"),
    (["--batchnorm", "maybe"], "batchnorm takes true or false, got 'maybe'"),
    (["--lr", "-1"], "lr must be > 0, got -1.0 (config field lr): pass a positive --lr"),
    (["--max_steps", "0", "--batch_size", "0"], "batch_size must be >= 1"),
])
def test_bad_overrides_are_reported(argv, message):
    _, overrides = parse_command_line(["--recipe", "mlp", *argv])
    with pytest.raises(ConfigError) as error:
        build_config(load_recipe("mlp").Config, overrides)
    assert any(message in p for p in error.value.problems), error.value.problems


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
])
def test_broken_recipe_files(tmp_path, recipe_text, message):
    path = tmp_path / "broken.py"
    path.write_text(recipe_text)
    run = launch(tmp_path / "out", "--recipe", str(path))
    assert_refused(run, message)
    assert "Traceback" not in run.stderr and not (tmp_path / "out").exists()


def test_unknown_recipe_name(tmp_path):
    assert_refused(launch(tmp_path / "out", "--recipe", "gpt5"),
                   "no shipped recipe named 'gpt5' (--recipe): use one of mlp, tiny_transformer")


def test_dry_run_prints_the_resolved_config_and_trains_nothing(tmp_path):
    run = launch(tmp_path / "out", "--recipe", "tiny_transformer", "--dry_run", "--lr", "1e-3",
                 "--accelerate_config", str(ROOT / "accelerate_configs" / "ddp.yaml"))
    assert run.returncode == 0, run.stderr
    resolved = json.loads(run.stdout)
    assert resolved["strategy"] == "ddp" and resolved["world_size"] == 2
    assert resolved["global_batch_size"] == 2 * resolved["batch_size"]
    assert resolved["seq_len"] == 128 and resolved["lr"] == 1e-3
    assert resolved["sources"]["lr"] == "--lr" and resolved["sources"]["hidden"] == "recipe default"
    assert resolved["estimated_state_bytes"] > 0
    assert not (tmp_path / "out").exists()
