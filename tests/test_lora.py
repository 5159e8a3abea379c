"""LoRA through peft (recipes/causal_lm.py --lora_r), on packed chats: under every shipped config it trains like one
process with the base frozen bit for bit on every rank, checkpoints hold the adapters and their optimizer state
alone and resume exactly (also under another config), final/ holds the merged model and final/adapter/ the adapters
in peft's layout, and the memory estimate knows that a frozen base has no gradients or optimizer states.

The models are the chat fixture's (tests/conftest.py): a Qwen2, and a tied Llama, GPT-NeoX and GPT-2 (whose linear
layers are Conv1D) with the same tokenizer. tests/zoo/lora_probe.py is causal_lm with a witness of the frozen weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import PARITY_BOUND, ROOT, architecture, assert_refused, entry, launch, max_rel_diff
from trainkit.recipes import load_recipe

PROBE = str(ROOT / "tests" / "zoo" / "lora_probe.py")
# Packed (two or three conversations a row): LoRA and packing together, as fine-tuners run them
LORA = ["--tokenizer", "saved", "--chat_template", "chatml", "--packing", "--seq_len", "192", "--max_steps", "10",
        "--eval_every", "5", "--lr", "3e-3", "--lora_r", "8", "--save_every", "5", "--max_new_tokens", "8"]
CONFIGS = ["ddp", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero2_offload", "deepspeed_zero3",
           "deepspeed_zero3_offload", "fsdp", "fsdp_offload"]


def lora_args(chat, output_dir) -> list[str]:
    folder, data = chat
    return ["--recipe", PROBE, "--model_name_or_path", str(folder), "--data", str(data), *LORA,
            "--probe_dir", str(output_dir / "probe")]


@pytest.fixture(scope="module")
def lora_runs(chat, tmp_path_factory):
    """lora_runs(config): 10 LoRA steps of global batch 8 under a shipped config ("single": one process), a
    checkpoint at step 5; launched on first use and shared by the tests below. ZeRO-3 generates from the model
    gathered once (--gather_for_generation, its default); the offload cell from a gather per layer and token, so that
    both paths give one process's answers."""
    done = {}

    def run(config: str):
        if config not in done:
            out = tmp_path_factory.mktemp(f"lora-{config}") / "out"
            yaml, flags = ("single", ["--batch_size", "8"]) if config == "single" else entry(config, 8)
            if config == "deepspeed_zero3_offload":
                flags += ["--gather_for_generation", "false"]
            done[config] = launch(out, *lora_args(chat, out), *flags,
                                  config=None if yaml == "single" else yaml).check()
        return done[config]

    return run


def probes(run) -> list[dict]:
    return [json.loads((run.output_dir / "probe" / f"rank_{r}.json").read_text())
            for r in range(run.resolved["world_size"])]


def answers(run) -> list[dict]:
    return [json.loads(line) for line in (run.output_dir / "generations.jsonl").read_text().splitlines()]


def base_and_adapter(chat, final):
    """(the model trained with the run's final adapters loaded by peft, the merged model final/ holds)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(chat[0]), str(final / "adapter"))
    return tuned.eval(), AutoModelForCausalLM.from_pretrained(final).eval()


@pytest.mark.slow
def test_one_process_lora_trains_the_adapters_alone_and_exports_both_forms(chat, lora_runs, test_env, tmp_path):
    """The adapters learn (the loss falls), the base does not move, final/adapter/ loaded over the base model gives
    the run's last eval loss, and the merged final/ computes what base + adapters compute."""
    run = lora_runs("single")
    assert run.losses[-1] < run.losses[0] and run.resolved["lora_r"] == 8
    (probe,) = probes(run)
    written = answers(run)  # at each evaluation, the prompts of the first 2 held-out examples: their first turns
    assert [a["step"] for a in written] == [5, 5, 10, 10] and written[0]["prompt"] == written[2]["prompt"]
    assert written[0]["prompt"].endswith("?<|im_end|>\n<|im_start|>assistant\n")
    assert written[0]["expected"].split("<|im_end|>")[0] in {f"{a} plus {b} is {a + b}." for a in range(9)
                                                             for b in range(9)}
    assert all(len(a["answer"]) > 0 for a in written)
    base_tensors = len(list(architecture("qwen2", "sdpa").parameters()))
    # every micro-batch of the 10 steps and of the 2 evaluations
    assert probe["calls"] >= 12 and probe["tensors"] == base_tensors and probe["changed"] == []
    tuned, merged = base_and_adapter(chat, run.output_dir / "final")
    adapter_config = json.loads((run.output_dir / "final" / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["r"] == 8 and adapter_config["base_model_name_or_path"] == str(chat[0])
    recipe = load_recipe("causal_lm")
    cfg = recipe.Config(model_name_or_path=str(chat[0]), tokenizer="saved", data=str(chat[1]),
                        chat_template="chatml", seq_len=192, packing=True)
    train, held_out = recipe.make_datasets(cfg, tmp_path)
    padding = 1 - sum(int(row["attention_mask"].sum()) for row in train) / (len(train) * 192)
    assert f"padding_share {padding:.4f}" in run.stdout and padding < 0.2  # the summary line says what packing left
    assert len(held_out) < 8  # a few packed rows: the run evaluated them as one batch
    batch = {k: torch.tensor(v) for k, v in held_out[:].items()}
    with torch.no_grad():
        assert recipe.loss(tuned, batch).item() == pytest.approx(run.metrics[-1]["eval_loss"], rel=1e-5)
        ids = batch["input_ids"]
        assert torch.allclose(merged(ids).logits, tuned(ids).logits, atol=1e-5)
        with tuned.disable_adapter():  # the base alone: the adapters changed what the model computes
            assert (merged(ids).logits - tuned(ids).logits).abs().max() > 1e-2
    from transformers import AutoTokenizer

    from trainkit.tools.ask import answer

    final = run.output_dir / "final"  # the run's ChatML went along with the tokenizer: ask renders the question so
    assert "<|im_start|>" in (final / "chat_template.jinja").read_text()
    prompt = "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n"
    ids = AutoTokenizer.from_pretrained(final)(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        greedy = tuned.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
    said = AutoTokenizer.from_pretrained(final).decode(greedy, skip_special_tokens=True).split("<|im_end|>")[0]
    assert answer(final / "adapter", "What is 2 plus 3?", 8) == said.strip()
    # The conversations all opened with a system turn: final/ keeps it, and the ask tool (run from another folder:
    # requirements.txt installs the package) asks after it unless told otherwise
    for folder in (final, final / "adapter"):
        assert json.loads((folder / "chat_defaults.json").read_text()) == {"system": "You add numbers."}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    asked = subprocess.run([sys.executable, "-m", "trainkit.tools.ask", str(final / "adapter"), "What is 2 plus 3?",
                            "--max_new_tokens", "8"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert asked.returncode == 0, asked.stderr
    assert "note: asking after the system turn the model was trained with" in asked.stderr, asked.stderr
    assert asked.stdout.strip() == answer(final / "adapter", "What is 2 plus 3?", 8, system="You add numbers.")


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_lora_under_every_config_follows_one_process(chat, lora_runs, config):
    """The curve of one process within 1e-5 over 10 steps, every rank's share of the frozen
    base bit-identical at every micro-batch to what it was at the first, final/ and final/adapter/ the one process's
    (gathered under ZeRO-3 and FSDP2, never empty), and the memory estimate within 10% of what rank 0 held."""
    one, run = lora_runs("single"), lora_runs(config)
    assert max_rel_diff(run.losses, one.losses) < PARITY_BOUND
    ranks = probes(run)
    assert all(p["calls"] >= 12 and p["changed"] == [] and p["elements"] > 0 for p in ranks), ranks
    if config.startswith("deepspeed_zero3") or config.startswith("fsdp"):  # each rank holds about half of the base
        assert ranks[0]["elements"] < 0.6 * probes(one)[0]["elements"]
    if config.startswith("deepspeed_zero3"):  # the base built inside zero.Init, the adapters partitioned after
        assert "(zero.Init): no rank held it whole (28 parameter(s) added after it, such as LoRA's adapters" in \
            run.stderr
    from safetensors.torch import load_file

    for name in ("adapter/adapter_model.safetensors", "model.safetensors"):
        mine, reference = (load_file(r.output_dir / "final" / name) for r in (run, one))
        assert mine.keys() == reference.keys() and all(t.numel() > 0 for t in mine.values())
        assert max((mine[k] - reference[k]).abs().max().item() for k in mine) < 1e-4, name
    estimated, held = run.resolved["estimated_state_bytes"], run.metrics[-1]["state_bytes"]
    assert abs(estimated - held) <= 0.1 * held, (estimated, held)
    # generate() on every rank (synced_gpus: each forward gathers the shards), the greedy answers of one process
    assert answers(run) == answers(one)


@pytest.mark.slow
def test_a_lora_checkpoint_holds_the_adapters_and_their_optimizer_state_alone(lora_runs):
    """Under torch.distributed.checkpoint (single, DDP, FSDP2) and DeepSpeed (ZeRO-1/2/3): the model's entries are
    the adapters' only, and the bytes are the adapters' weights and two Adam moments; a full fine-tune of the same
    model writes the frozen weights too (measured in docs/recipes.md's LoRA section)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    adapters = load_file(lora_runs("single").output_dir / "final" / "adapter" / "adapter_model.safetensors")
    numel = sum(t.numel() for t in adapters.values())
    for config in ("single", "fsdp"):
        meta = dcp.FileSystemReader(str(lora_runs(config).output_dir / "checkpoints" / "step_5" / "state")
                                    ).read_metadata().state_dict_metadata
        model_keys = [k for k in meta if k.startswith("model.")]
        assert len(model_keys) == len(adapters) and all(".lora_" in k for k in model_keys)
        tensors = sum(m.size.numel() for k, m in meta.items() if hasattr(m, "size") and m.size.numel() > 1)
        assert tensors == 3 * numel  # weights, exp_avg, exp_avg_sq
    for config in ("deepspeed_zero2", "deepspeed_zero3"):
        folder = lora_runs(config).output_dir / "checkpoints" / "step_5" / "deepspeed" / "deepspeed"
        states = torch.load(next(folder.glob("*model_states.pt")), weights_only=False)
        assert sorted(states["module"]) and all(".lora_" in k for k in states["module"])
        assert not states["frozen_param_shapes"]


@pytest.mark.slow
@pytest.mark.parametrize("saved, resumed", [("ddp", "ddp"), ("deepspeed_zero3", "deepspeed_zero3"),
                                            ("fsdp", "single"), ("deepspeed_zero2", "deepspeed_zero1")],
                         ids=lambda name: name)
def test_a_lora_run_resumes_bit_exactly(chat, lora_runs, run_dir, saved, resumed):
    """From the step-5 checkpoint (the adapters and their optimizer state; the base rebuilt from the model folder),
    steps 6-10 are the uninterrupted run's bit for bit under the config it was saved with (both formats:
    torch.distributed.checkpoint under DDP, DeepSpeed's under ZeRO-3; tests/test_checkpoint.py resumes every config
    bit-exactly, and these are the two places frozen parameters are left out), and from FSDP2 on two processes to
    one (torch.distributed.checkpoint reshards) and from ZeRO-2 to ZeRO-1 (DeepSpeed's universal checkpoint) within
    the parity bound (another reduction order)."""
    first = lora_runs(saved)
    out = run_dir("resumed")
    yaml, flags = ("single", ["--batch_size", "8"]) if resumed == "single" else entry(resumed, 8)
    run = launch(out, *lora_args(chat, out), *flags, "--resume", str(first.output_dir / "checkpoints" / "step_5"),
                 config=None if yaml == "single" else yaml).check()
    assert [m["step"] for m in run.metrics] == list(range(6, 11)) and [a["step"] for a in answers(run)] == [10, 10]
    if saved == resumed:
        assert run.losses == first.losses[5:]
    else:
        assert max_rel_diff(run.losses, first.losses[5:]) < PARITY_BOUND
    assert all(p["changed"] == [] for p in probes(run))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt_neox", "gpt2"])
def test_lora_on_architectures_it_was_not_written_for(chat, run_dir, tmp_path, name):
    """A tied Llama, GPT-NeoX (one fused query-key-value layer) and GPT-2 (Conv1D layers, tied): peft's all-linear
    finds their layers, the base stays frozen, and the merged final/ computes what base + adapters compute."""
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / name
    architecture(name, "sdpa").save_pretrained(folder)
    PreTrainedTokenizerFast.from_pretrained(chat[0]).save_pretrained(folder)
    out = run_dir("out")
    padded = [arg for arg in lora_args((folder, chat[1]), out) if arg != "--packing"]  # one conversation a row
    run = launch(out, *padded, "--seq_len", "96", "--batch_size", "8", "--max_steps", "6", "--save_every", "0").check()
    assert run.losses[-1] < run.losses[0] and probes(run)[0]["changed"] == []
    tuned, merged = base_and_adapter((folder, chat[1]), out / "final")
    ids = torch.randint(0, 400, (2, 24))
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, tuned(ids).logits, atol=1e-5)
    base = tuned.get_base_model()
    assert torch.equal(merged.get_input_embeddings().weight, base.get_input_embeddings().weight)


def test_lora_mistakes_are_named_with_the_fix(check_only, chat, tmp_path):
    folder, data = chat
    base = ["--recipe", "causal_lm", "--model_name_or_path", str(folder), "--tokenizer", "saved", "--data", str(data),
            "--chat_template", "chatml", "--lora_r", "8", "--dry_run"]
    assert_refused(check_only(tmp_path / "a", *base, "--accelerate_config", str(ROOT / "accelerate_configs" /
                                                                                "tp.yaml")),
                   "PeftModelForCausalLM carries peft adapters (LoRA), whose layers wrap the Linear layers that "
                   "tensor parallelism cuts and do not take cut (DTensor) weights")
    assert_refused(check_only(tmp_path / "b", *base, "--trainable", "lm_head"),
                   "--trainable and --lora_r each choose what trains (config field trainable): pass one")
    assert_refused(check_only(tmp_path / "c", *base, "--lora_target_modules", "query,value"),
                   "peft cannot put LoRA on this model")
    assert_refused(check_only(tmp_path / "d", *base, "--lora_target_modules", "query,value"),
                   "use all-linear, or names of its linear layers: down_proj, gate_proj, k_proj, lm_head, o_proj")
    assert_refused(check_only(tmp_path / "e", *base, "--lora_alpha", "0"), "LoRA needs lora_r >= 0, lora_alpha > 0")


def test_the_estimate_counts_no_gradients_or_optimizer_states_for_a_frozen_base(check_only, chat, tmp_path):
    """Measured against what ranks held: tests above (within 10% under every config)."""
    folder, data = chat
    base = ["--recipe", "causal_lm", "--model_name_or_path", str(folder), "--tokenizer", "saved", "--data", str(data),
            "--chat_template", "chatml", "--dry_run"]
    full = json.loads(check_only(tmp_path / "a", *base).stdout)["estimated_state_bytes"]
    lora = json.loads(check_only(tmp_path / "b", *base, "--lora_r", "8").stdout)["estimated_state_bytes"]
    params = sum(p.numel() for p in architecture("qwen2", "sdpa").parameters())
    assert full == 16 * params  # fp32 weights, gradients, two Adam moments
    assert 4 * params < lora < 0.5 * full  # the base's weights alone, the adapters' four copies


def test_an_adapter_names_its_base_wherever_it_is_loaded_from(chat, test_env, tmp_path, monkeypatch, capsys):
    """A relative --model_name_or_path is written into adapter_config.json as the folder's absolute path, so that
    peft and trainkit.tools.ask load the adapter from any directory; an adapter whose base is not found is refused
    naming
    --base, which then answers (after a --system turn too)."""
    from trainkit.tools import ask

    folder = chat[0]
    monkeypatch.chdir(folder.parent)
    recipe = load_recipe("causal_lm")
    cfg = recipe.Config(model_name_or_path=folder.name, tokenizer="saved", data=str(chat[1]), lora_r=4)
    adapter = tmp_path / "adapter"
    recipe.build_model(cfg).save_pretrained(str(adapter))
    sys.modules["recipe_causal_lm"].tokenizer_of(cfg).save_pretrained(str(adapter))
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        folder.resolve())
    monkeypatch.chdir(tmp_path)
    assert ask.main([str(adapter), "What is 2 plus 3?", "--max_new_tokens", "2"]) == 0
    settings = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**settings, "base_model_name_or_path": "runs/sft/final"}))
    assert ask.main([str(adapter), "What is 2 plus 3?"]) == 2  # written by an older run: relative to its launch
    error = capsys.readouterr().err
    assert f"error: the base model of {adapter} cannot be loaded from 'runs/sft/final' (" in error and \
        error.rstrip().endswith("pass the base model it was trained on with --base FOLDER_OR_HUB_ID")
    assert ask.main([str(adapter), "What is 2 plus 3?", "--base", str(folder), "--system", "Add.",
                     "--max_new_tokens", "2"]) == 0
    assert "Traceback" not in capsys.readouterr().err


@pytest.fixture(scope="module")
def fp32_base(chat, tmp_path_factory):
    """One process, LoRA over the base loaded in fp32: the reference of the bf16-base runs."""
    out = tmp_path_factory.mktemp("fp32-base") / "out"
    return launch(out, *DTYPE_ARGS(chat), "--model_dtype", "fp32", "--batch_size", "8").check()


def DTYPE_ARGS(chat) -> list[str]:  # noqa: N802 (a constant made from the fixture)
    return ["--recipe", "causal_lm", "--model_name_or_path", str(chat[0]), "--data", str(chat[1]), "--tokenizer",
            "saved", "--chat_template", "chatml", "--packing", "--seq_len", "192", "--max_steps", "6", "--eval_every",
            "0", "--lr", "3e-3", "--lora_r", "8"]


@pytest.mark.slow
@pytest.mark.parametrize("config", ["single", "ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3"])
def test_a_bf16_base_holds_half_the_frozen_bytes_and_trains_like_the_fp32_one(chat, fp32_base, run_dir, config):
    """--model_dtype bf16 (the Qwen2 was saved in fp32): the frozen base held in bf16, the adapters and their
    optimizer state in fp32; the curve within 1e-4 of the fp32 base's (measured 2e-5 over 6 steps: the base's
    matmuls round to bf16), the state the estimate said to 1%. ZeRO-3 partitions every weight in its training
    dtype: under fp32 it holds the base in fp32 again and gives the fp32 curve."""
    yaml, flags = ("single", ["--batch_size", "8"]) if config == "single" else entry(config, 8)
    run = launch(run_dir("out"), *DTYPE_ARGS(chat), "--model_dtype", "bf16", *flags,
                 config=None if yaml == "single" else yaml).check()
    held, estimated = run.metrics[-1]["state_bytes"], run.resolved["estimated_state_bytes"]
    if config == "deepspeed_zero3":  # its partitions' padding and persistent parameters: 5.6% here, 10% elsewhere
        assert abs(estimated - held) <= 0.1 * held and max_rel_diff(run.losses, fp32_base.losses) < PARITY_BOUND
        return
    assert abs(estimated - held) <= 0.01 * held, (estimated, held)
    assert 0 < max_rel_diff(run.losses, fp32_base.losses) < 1e-4 and run.losses[-1] < run.losses[0]
    reference = fp32_base.metrics[-1]["state_bytes"] / (1 if config in ("single", "ddp", "deepspeed_zero2") else 2)
    assert held < 0.8 * reference
