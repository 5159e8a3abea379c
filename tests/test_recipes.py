"""Recipes people start from: the catalog (list, copy), recipes/README.md's walk-through run from the file itself,
the image classifier and its accuracy, and fine-tuning a pretrained causal LM under DDP, ZeRO-3 and FSDP."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_model

from conftest import PARITY_BOUND, ROOT, TEST_ENV, assert_refused, launch, max_rel_diff
from trainkit.errors import ConfigError
from trainkit.launch.launcher import shipped_configs
from trainkit.recipes import load_recipe, shipped_recipes
from trainkit.tools.catalog import main as catalog


def test_catalog_lists_every_recipe_and_config_with_its_description(capsys):
    assert catalog(["ls"]) == 0
    out = capsys.readouterr().out
    for name in [*shipped_recipes(), *shipped_configs()]:
        line = next(line for line in out.splitlines() if line.strip().startswith(f"{name} "))
        assert len(line.split(maxsplit=1)[1]) > 20, line  # a description, not just the name
        assert line.endswith("."), line  # its whole first sentence, not a docstring's first line cut mid-phrase
    assert "image_classifier" in out and "A small convolutional image classifier" in out
    assert "(the student): both any AutoModelForCausalLM of one vocabulary, of the same architecture or not." in out


def test_catalog_copies_never_over_a_file_and_prints_a_command_that_works(capsys, check_only, tmp_path):
    mine = tmp_path / "my_images.py"
    assert catalog(["cp", "image_classifier", str(mine)]) == 0
    assert mine.read_text() == (ROOT / "recipes" / "image_classifier.py").read_text()
    command = capsys.readouterr().out.split("run it: ")[1].split("    #")[0].split()
    assert command[:2] == ["python", "train.py"]
    assert check_only(tmp_path / "out", *command[2:]).returncode == 0  # the printed dry run passes as printed
    mine.write_text("# my edits\n")
    assert catalog(["cp", "image_classifier", str(mine)]) == 2
    assert "refusing to overwrite it" in capsys.readouterr().err and mine.read_text() == "# my edits\n"
    assert catalog(["cp", "deepspeed_zero3", str(tmp_path / "z3")]) == 0
    assert (tmp_path / "z3.yaml").read_text() == (ROOT / "accelerate_configs" / "deepspeed_zero3.yaml").read_text()
    assert f"accelerate launch --config_file {tmp_path / 'z3.yaml'} train.py" in capsys.readouterr().out
    assert catalog(["cp", "image_clasifier", str(tmp_path / "x.py")]) == 2
    assert "did you mean image_classifier?" in capsys.readouterr().err


def test_catalog_cp_from_elsewhere_prints_where_it_wrote_and_a_command_that_runs_there(capsys, tmp_path, monkeypatch):
    """From another folder, a relative destination: the absolute path written, and a command that goes to the
    repository (train.py and the configs' ds_configs/ paths are read from there); a link at the destination is
    refused, not written through to wherever it points."""
    monkeypatch.chdir(tmp_path)
    assert catalog(["cp", "mlp", "mine.py"]) == 0
    out = capsys.readouterr().out
    assert f"copied mlp to {tmp_path / 'mine.py'}\n" in out
    command = out.split("run it: ")[1].split("    #")[0]
    assert command.startswith(f"cd {ROOT} && python train.py --recipe {tmp_path / 'mine.py'} --dry_run")
    done = subprocess.run(command, shell=True, capture_output=True, text=True, env={**os.environ, **TEST_ENV})
    assert done.returncode == 0, done.stderr  # as printed, from where the user stands
    elsewhere = tmp_path / "elsewhere.py"
    (tmp_path / "link.py").symlink_to(elsewhere)  # dangling: exists() says no
    assert catalog(["cp", "mlp", "link.py"]) == 2
    assert "(a link): refusing to overwrite it" in capsys.readouterr().err and not elsewhere.exists()


def walkthrough(tmp_path: Path) -> Path:
    """The walk-through's recipe, taken from recipes/README.md as a user would copy it."""
    readme = (ROOT / "recipes" / "README.md").read_text()
    code = re.search(r"## Walk-through.*?```python\n(.*?)```", readme, re.S).group(1)
    path = tmp_path / "my_model.py"
    path.write_text(code)
    return path


def test_walkthrough_recipe_passes_the_dry_run_and_the_estimate(check_only, tmp_path):
    path = walkthrough(tmp_path)
    run = check_only(tmp_path / "out", "--recipe", str(path), "--dry_run")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["width"] == 32
    zero3 = check_only(tmp_path / "out", "--recipe", str(path), "--estimate", "--accelerate_config",
                       str(ROOT / "accelerate_configs" / "deepspeed_zero3.yaml"))
    assert zero3.returncode == 0 and "this launch (deepspeed_zero3, 2 process(es))" in zero3.stdout


@pytest.mark.slow
def test_walkthrough_recipe_trains_under_zero3_like_one_process(tmp_path):
    """Steps 2 and 4 of the walk-through, as written there: one process at 32, ZeRO-3 at 2 x 16."""
    path = walkthrough(tmp_path)
    one = launch(tmp_path / "one", "--recipe", str(path)).check()
    zero3 = launch(tmp_path / "zero3", "--recipe", str(path), "--batch_size", "16",
                   config="deepspeed_zero3").check()
    assert one.losses[-1] < 0.5 * one.losses[0]  # it learns
    assert max_rel_diff(zero3.losses, one.losses) <= PARITY_BOUND
    model_recipe = load_recipe(str(path))
    model = model_recipe.build_model(model_recipe.Config(**json.loads((zero3.output_dir / "final" /
                                                                       "config.json").read_text())))
    load_model(model, str(zero3.output_dir / "final" / "model.safetensors"))  # step 5


def test_image_classifier_learns_and_reports_the_accuracy_its_export_has(run_dir):
    """The third kind of model, written through the documented interface only: 200 steps give well over 90 % on
    held-out pictures, and the exported weights classify exactly as the run reported."""
    run = launch(run_dir("out"), "--recipe", "image_classifier").check()
    last = run.metrics[-1]
    assert last["eval_accuracy"] > 0.9 and "eval accuracy" in run.stdout
    recipe = load_recipe("image_classifier")
    cfg = recipe.Config()
    model = recipe.build_model(cfg)
    load_model(model, str(run.output_dir / "final" / "model.safetensors"))
    _, held_out = recipe.build_datasets(cfg, None)
    images, labels = held_out[: run.resolved["eval_batches"] * run.resolved["global_batch_size"]]
    with torch.no_grad():
        accuracy = (model(images).argmax(dim=-1) == labels).float().mean().item()
    assert accuracy == pytest.approx(last["eval_accuracy"], abs=1e-6)


# --- fine-tuning a pretrained causal LM ---------------------------------------------------------------------------

TINY = ["--hidden", "64", "--layers", "2", "--seq_len", "64"]
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """The project's own tiny transformer, trained and exported, with a chat template added: the model that gets
    fine-tuned, as a user's downloaded one would be."""
    out = tmp_path_factory.mktemp("pretrained") / "run"
    run = launch(out, "--recipe", "tiny_transformer", "--max_steps", "100", "--eval_every", "0", "--batch_size", "16",
                 "--warmup_steps", "5", *TINY).check()
    config = json.loads((out / "final" / "tokenizer_config.json").read_text())
    (out / "final" / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return out / "final", run.metrics[-1]["eval_loss"]


def fine_tune(pretrained_folder: Path, output_dir: Path, *args: str, config: str | None = None):
    return launch(output_dir, "--recipe", "causal_lm", "--model_name_or_path", str(pretrained_folder), "--seq_len",
                  "64", "--max_steps", "6", "--eval_every", "0", *args, config=config).check()


@pytest.fixture(scope="module")
def fine_tune_reference(pretrained, tmp_path_factory):
    return fine_tune(pretrained[0], tmp_path_factory.mktemp("ft") / "ref", "--batch_size", "8")


@pytest.mark.slow
@pytest.mark.parametrize("config", ["ddp", "deepspeed_zero3", "deepspeed_zero3_built_whole", "fsdp"])
def test_fine_tuning_starts_where_the_model_ended_and_matches_one_process(pretrained, fine_tune_reference, run_dir,
                                                                         tmp_path, config):
    folder, pretrained_eval = pretrained
    yaml = config
    if config == "deepspeed_zero3_built_whole":
        yaml = tmp_path / "zero3.yaml"
        yaml.write_text((ROOT / "accelerate_configs" / "deepspeed_zero3.yaml").read_text().replace(
            "zero3_init_flag: true", "zero3_init_flag: false"))
    run = fine_tune(folder, run_dir(config), "--batch_size", "4", config=str(yaml))
    # A fresh model starts near ln(1024) = 6.93; the pretrained one where its own training ended.
    assert abs(run.losses[0] - pretrained_eval) < 0.5 and run.losses[0] < 6.93 - 1.0, (run.losses[0], pretrained_eval)
    assert max_rel_diff(run.losses, fine_tune_reference.losses) <= PARITY_BOUND
    if config == "deepspeed_zero3":
        assert "the model was built partitioned across 2 process(es) (zero.Init): no rank held it whole" in run.stderr
    if config == "deepspeed_zero3_built_whole":  # zero3_init_flag false: Accelerate registered zero.Init anyway
        assert "built partitioned" not in run.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run.output_dir / "final")
    tokenizer, original = AutoTokenizer.from_pretrained(run.output_dir / "final"), AutoTokenizer.from_pretrained(folder)
    assert tokenizer.special_tokens_map == original.special_tokens_map and tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.get_vocab() == original.get_vocab()
    ids = tokenizer("The for statement", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False).shape[1] == ids.shape[1] + 5
    weights = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert any(not torch.equal(v, model.state_dict()[k]) for k, v in weights.items())  # it did train


@pytest.mark.slow
def test_freezing_all_but_some_modules_holds_less(pretrained, fine_tune_reference, run_dir):
    """--trainable: the frozen parameters get no gradient and no AdamW state (measured in state_bytes)."""
    run = fine_tune(pretrained[0], run_dir("frozen"), "--batch_size", "8", "--trainable", "model.layers.1.")
    assert run.metrics[-1]["state_bytes"] < 0.6 * fine_tune_reference.metrics[-1]["state_bytes"]
    assert run.losses[1:] != fine_tune_reference.losses[1:] and run.losses[-1] < run.losses[0] + 0.5


def test_a_recipe_written_against_the_earlier_layout_still_loads_and_says_where_its_modules_went(check_only,
                                                                                                  tmp_path):
    """The tiny transformer's recipe as the release before trainkit/ was grouped had its imports: it plans and
    passes the dry run (which imports it and checks its config and data), with one FutureWarning per moved module
    naming its new home."""
    import sys
    import warnings

    import trainkit
    from trainkit import moved

    source = (ROOT / "recipes" / "tiny_transformer.py").read_text()
    new = source[source.index("from trainkit.config"):source.index("from trainkit.strategies import pipeline_decoder")]
    old = source.replace(new, "from trainkit import chunked_loss, decoder_stages, sft, text, tiled_mlp\n"
                              "from trainkit.config import TrainConfig\nfrom trainkit.errors import Problem\n"
                              "from trainkit.rows import TextBlocks\nfrom trainkit.stream import Streamed\n")
    old = old.replace("from trainkit.strategies import pipeline_decoder\n", "").replace("pipeline_decoder.",
                                                                                        "decoder_stages.")
    recipe = tmp_path / "old_layout.py"
    recipe.write_text(old)
    for name in moved.MOVED:  # as in a new process: nothing imported by its old name yet
        sys.modules.pop(f"trainkit.{name}", None)
        if name not in moved.FOLDERS:
            vars(trainkit).pop(name, None)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        run = check_only(tmp_path / "out", "--recipe", str(recipe), "--dry_run")
    assert run.returncode == 0, run.stderr
    assert sorted(str(w.message).split(" moved")[0] for w in said if w.category is FutureWarning) == \
        ["trainkit.chunked_loss", "trainkit.decoder_stages", "trainkit.rows", "trainkit.sft", "trainkit.stream",
         "trainkit.text", "trainkit.tiled_mlp"]
    assert "trainkit.rows moved to trainkit.data.stream_rows: import it from there" in \
        " ".join(str(w.message) for w in said)


def test_fine_tuning_is_safe_by_default(check_only, tmp_path):
    """Pickled weights and code shipped with a model are used only when a flag says so; before anything is built."""
    from transformers import LlamaConfig

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                     num_hidden_layers=1, num_attention_heads=2).to_json_string())
    torch.save({}, pickled / "pytorch_model.bin")
    assert_refused(check_only(tmp_path / "out", "--recipe", "causal_lm", "--model_name_or_path", str(pickled),
                              "--dry_run"), f"{pickled} has no .safetensors weights, only pickled ones")
    remote = tmp_path / "remote"
    remote.mkdir()
    marker = tmp_path / "remote_code_ran"
    (remote / "config.json").write_text(json.dumps({"model_type": "my_custom_lm", "auto_map": {
        "AutoConfig": "configuration_mine.MyConfig", "AutoModelForCausalLM": "modeling_mine.MyModel"}}))
    (remote / "model.safetensors").write_bytes(b"")
    (remote / "configuration_mine.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    run = check_only(tmp_path / "out", "--recipe", "causal_lm", "--model_name_or_path", str(remote), "--dry_run")
    assert_refused(run, "contains custom code")
    assert "pass --trust_remote_code true if you trust the code that comes with it" in run.stderr
    assert not marker.exists()


@pytest.mark.parametrize("flags, message", [
    (["--recipe", "causal_lm", "--model_name_or_path", "./missing"],
     "no model folder ./missing (config field model_name_or_path): pass the folder that save_pretrained wrote"),
    (["--recipe", "grpo", "--reward_model", "runs/reward/final", "--reward_funcs", "rewards.chat.arithmetic",
      "--data", str(ROOT / "data" / "prompts.jsonl")],
     "no model folder runs/reward/final (--reward_model): pass the folder that save_pretrained wrote"),
    (["--recipe", "distill", "--teacher_model_name_or_path", "/missing/final"],
     "no model folder /missing/final (--teacher_model_name_or_path): pass the folder"),
    (["--recipe", "distill", "--teacher_model_name_or_path", "NO_TOKENIZER"],  # transformers asked for sentencepiece
     "no_tokenizer holds no tokenizer (none of tokenizer.json, tokenizer_config.json"),
], ids=["model", "reward-model", "teacher", "teacher-without-tokenizer"])
def test_a_missing_model_is_named_by_its_own_flag(check_only, chat, tmp_path, flags, message):
    """A path that can be no Hub id (absolute, ./, two slashes) and is no folder is refused at plan time, not sent to
    the Hub; a second model of the run (the reward model, the teacher) is named by its own flag, also when it cannot be
    loaded (a model folder without its tokenizer's files)."""
    import shutil

    folder = tmp_path / "no_tokenizer"
    shutil.copytree(chat[0], folder, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    defaults = ["--model_name_or_path", str(chat[0]), "--tokenizer", "saved", "--data", str(chat[1])]
    run = check_only(tmp_path / "out", *defaults, *(str(folder) if f == "NO_TOKENIZER" else f for f in flags),
                     "--dry_run")
    assert_refused(run, message)
    if "NO_TOKENIZER" in flags:
        assert f"(--teacher_model_name_or_path {folder}): save the model's tokenizer beside it" in run.stderr
        assert "sentencepiece" not in run.stderr


def test_a_model_folder_without_weights_is_named_with_what_it_holds(check_only, tmp_path):
    """config and tokenizer, no weights: said as such (not "pass --allow_pickle true"), by the dry run already."""
    from transformers import Qwen2Config

    folder = tmp_path / "noweights"
    Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(folder)
    (folder / "tokenizer.json").write_text("{}")
    for extra in ([], ["--allow_pickle", "true"]):
        run = check_only(tmp_path / "out", "--recipe", "causal_lm", "--model_name_or_path", str(folder), *extra,
                         "--dry_run")
        assert_refused(run, f"no weights in {folder} (it holds: config.json, tokenizer.json) (config field "
                            f"model_name_or_path): pass the folder that save_pretrained wrote the model into")
        assert "allow_pickle" not in run.stderr


@pytest.mark.slow
def test_the_tokenizer_that_trains_is_the_one_saved_in_the_folder(tmp_path):
    """A PreTrainedTokenizerFast saved beside a Qwen2 config loads through AutoTokenizer as Qwen2Tokenizer, which
    splits digits: "123" is one id in the saved tokenizer and three in the loaded one. The run refuses, saying so;
    --tokenizer saved trains with the saved one, --tokenizer auto with transformers' choice."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(["123 4567 2024 users wrote code " * 50] * 20, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    folder = tmp_path / "qwen2"
    Qwen2ForCausalLM(Qwen2Config(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(folder)
    saved = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    saved.save_pretrained(folder)
    assert len(saved("123").input_ids) == 1
    recipe = load_recipe("causal_lm")
    tokenizer_of = sys.modules["recipe_causal_lm"].tokenizer_of  # the recipe's own function, as its build calls it
    with pytest.raises(ConfigError) as refused:
        tokenizer_of(recipe.Config(model_name_or_path=str(folder)))
    assert str(refused.value).startswith(f"the tokenizer loaded from {folder} (Qwen2Tokenizer, chosen by "
                                         f"transformers from the model type) is not the one saved there: it encodes")
    assert "pass --tokenizer saved to train with the saved tokenizer.json" in str(refused.value)
    kept = tokenizer_of(recipe.Config(model_name_or_path=str(folder), tokenizer="saved"))
    assert kept("123").input_ids == saved("123").input_ids
    taken = tokenizer_of(recipe.Config(model_name_or_path=str(folder), tokenizer="auto"))
    assert type(taken).__name__ == "Qwen2Tokenizer" and len(taken("123").input_ids) == 3
    run = launch(tmp_path / "out", "--recipe", "causal_lm", "--model_name_or_path", str(folder), "--max_steps", "1",
                 "--seq_len", "16")
    assert_refused(run, f"the tokenizer loaded from {folder} (Qwen2Tokenizer")


def test_fine_tuning_needs_a_model(check_only, tmp_path):
    assert_refused(check_only(tmp_path / "out", "--recipe", "causal_lm", "--dry_run"),
                   "no model to fine-tune (config field model_name_or_path): pass --model_name_or_path")
