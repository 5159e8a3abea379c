"""Fixtures that run train.py for real (one process, or N processes through `accelerate launch`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from helpers import forked_launch

from trainkit.compare import ROOT, Run, kill_tree, launch_command, max_rel_diff, run_config
from trainkit.launch import config_path, shipped_configs
from trainkit.recipes import load_recipe
from trainkit.strategies import Strategy, for_launch, shipped_strategies

__all__ = ["CPU_STAND_INS", "EXAMPLES", "FLAG_STRATEGIES", "GPU_ONLY", "LAUNCHES", "LAUNCH_TIMEOUT", "LM", "ROOT",
           "TEST_ENV", "Run", "architecture", "assert_refused", "conversation", "entry", "forkable", "kill_tree",
           "launch", "launch_command", "max_rel_diff", "PARITY_BOUND", "processes", "SERVER_ENV", "strategy_of",
           "write_yaml", "yaml_of", "zero2_json"]

# What every run in the tests gets: their own data cache, one thread per process (TRAINKIT_CPU_THREADS: under a
# launcher OMP_NUM_THREADS=1 reads as the launcher's default, trainkit/hardware.py), no network.
TEST_ENV = {"TRAINKIT_CACHE": str(ROOT / ".cache" / "tests"), "OMP_NUM_THREADS": "1", "TRAINKIT_CPU_THREADS": "1",
            "HF_DATASETS_OFFLINE": "1",
            "PYTHONPATH": str(ROOT)}
# The environment that tests/helpers/forked_launch.py's server imports under: a run on another forks nothing.
SERVER_ENV = {**os.environ, **TEST_ENV}



# The longest launch of the suite takes under a minute on 2 cores; a hung rank fails its test after this many seconds
# instead of holding the suite until pytest's own timeout (pytest.ini), which would leave its processes running.
LAUNCH_TIMEOUT = 300


# The max relative loss difference any config may show against the one-process run of the same global batch.
# Measured: DDP, ZeRO-1/2/3 and FSDP within 2e-7 over 20 MLP steps; the cpu_adam offload configs within 3e-7 once the
# runner keeps its own AdamW and cpu_adam's bias correction exact (trainkit/strategies/deepspeed.py). Float32
# summation order is the only difference; 1e-5 leaves it a margin of 30 and catches any real mismatch.
PARITY_BOUND = 1e-5


# Strategies that flags select on a YAML rather than a YAML of their own (docs/model-parallelism.md): the pipeline on
# a data-parallel launch, and its products with the mesh of an FSDP launch (x FSDP2, x TP, x FSDP2 x TP).
# name -> (YAML, config fields, processes: 0 = the YAML's own).
PIPELINE = {"pipeline_stages": 2, "grad_accum": 2}
FLAG_STRATEGIES = {"pipeline": ("ddp", PIPELINE, 0), "pipeline_fsdp": ("fsdp", PIPELINE, 4),
                   "pipeline_tp": ("tp", PIPELINE, 4), "pipeline_fsdp_tp": ("fsdp_tp", PIPELINE, 8)}
# The shipped configs refused on a machine without GPUs (Strategy.needs_gpu), and what the tests launch for them
# there: torch's context parallelism with its ring attention's CUDA kernels replaced by the same mathematics on gloo.
GPU_ONLY = {name for name, launch in shipped_strategies().items() if for_launch(
    launch, load_recipe("tiny_transformer").Config(), {}, load_recipe("tiny_transformer")).needs_gpu}
CPU_STAND_INS = {name: "tests/helpers/context_parallel_on_cpu.py" for name in GPU_ONLY}
LAUNCHES = {**shipped_strategies(),
            **{name: dataclasses.replace(shipped_configs()[yaml], world_size=n or shipped_configs()[yaml].world_size)
               for name, (yaml, _, n) in FLAG_STRATEGIES.items()}}


def strategy_of(name: str, recipe: str = "tiny_transformer") -> Strategy:
    """What a shipped config or a flag strategy runs (made at plan time, nothing built)."""
    fields = FLAG_STRATEGIES[name][1] if name in FLAG_STRATEGIES else {}
    launch = LAUNCHES[name] if name in LAUNCHES else shipped_configs()[name]
    return for_launch(launch, load_recipe(recipe).Config(**fields), {}, load_recipe(recipe))


def processes(name: str) -> tuple[str, ...]:
    """`accelerate launch`'s arguments for a matrix entry's process count, where it is not its YAML's."""
    count = FLAG_STRATEGIES[name][2] if name in FLAG_STRATEGIES else 0
    return ("--num_processes", str(count)) if count else ()


def yaml_of(name: str, folder: Path) -> str:
    """The path of a matrix entry's YAML, for a check in process (--accelerate_config): a copy in `folder` with the
    entry's process count where it is not the YAML's own."""
    yaml, _, count = FLAG_STRATEGIES.get(name, (name, {}, 0))
    if not count:
        return str(ROOT / "accelerate_configs" / f"{yaml}.yaml")
    return str(write_yaml(folder, yaml, **{f"num_processes:__{shipped_configs()[yaml].world_size}":
                                           f"num_processes: {count}"}))


def entry(name: str, global_batch: int, grad_accum: int = 1) -> tuple[str, list[str]]:
    """(YAML, flags) that run a matrix entry with this global batch: the micro-batch shrinks as the data-parallel
    size grows; a flag strategy brings its own flags (and accumulation)."""
    yaml, fields, _ = FLAG_STRATEGIES.get(name, (name, {}, 0))
    grad_accum = fields.get("grad_accum", grad_accum)
    flags = [f"--{k}={v}" for k, v in fields.items() if k != "grad_accum"] + ["--grad_accum", str(grad_accum)]
    return yaml, [*flags, "--batch_size", str(global_batch // (grad_accum * strategy_of(name).data_parallel_size))]



# The transformer of the strategy matrix: the recipe's real defaults (Llama, tied embeddings, weight decay 0.01),
# fewer and smaller steps.
LM = ["--recipe", "tiny_transformer", "--max_steps", "8", "--eval_every", "0", "--hidden", "64", "--layers", "2",
      "--seq_len", "64", "--warmup_steps", "2"]


@pytest.fixture(scope="session")
def lm_reference(tmp_path_factory):
    """LM on one process, micro-batch 8: every config's global batch."""
    return launch(tmp_path_factory.mktemp("lm") / "ref", *LM, "--batch_size", "8").check()


@pytest.fixture(scope="session")
def lm_runs(tmp_path_factory):
    """lm_runs(config): LM under a shipped config or a flag strategy, global batch 8, a checkpoint at step 5;
    launched on first use and shared by every module that reads it (tests/test_strategies.py,
    tests/test_tensor_parallel.py)."""
    done: dict[str, Run] = {}

    def run(name: str) -> Run:
        if name not in done:
            yaml, flags = entry(name, 8)
            done[name] = launch(tmp_path_factory.mktemp(f"lm-{name}") / "out", *LM, *flags, "--save_every", "5",
                                config=yaml, extra_launch=processes(name)).check()
        return done[name]

    return run


# A DDP run that kills are tried on: long enough to kill a rank or a machine between two checkpoints
# (tests/test_checkpoint.py, tests/test_multinode.py), short enough to run twice.
RESTARTED = ["--recipe", "mlp", "--max_steps", "600", "--eval_every", "0", "--batch_size", "4", "--save_every", "200"]


@pytest.fixture(scope="session")
def never_restarted(tmp_path_factory):
    """The run of RESTARTED that nothing interrupts: the curve every restarted one must give, bit for bit."""
    return launch(tmp_path_factory.mktemp("whole") / "out", *RESTARTED, config="ddp").check()


def write_yaml(tmp_path, base: str, json_text: str | None = None, **changes: str):
    """A copy of a shipped YAML (and optionally of its DeepSpeed JSON) with some lines changed."""
    text = (ROOT / "accelerate_configs" / f"{base}.yaml").read_text()
    if json_text is not None:
        ds = tmp_path / "ds.json"
        ds.write_text(json_text)
        text = text.replace(f"ds_configs/{base.removeprefix('deepspeed_')}.json", str(ds))
    for old, new in changes.items():
        text = text.replace(old.replace("__", " "), new)
    path = tmp_path / f"{base}_custom.yaml"
    path.write_text(text)
    return path


def zero2_json(**changes) -> str:
    ds = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    ds.update(changes)
    return json.dumps(ds)


def launch(output_dir: Path, *args: str, config: str | None = None, extra_launch: tuple[str, ...] = (),
           script: str = "train.py", env: dict | None = None) -> Run:
    """`python train.py ARGS` (config None) or `accelerate launch --config_file <config>.yaml train.py ARGS`,
    with TEST_ENV; a launch that has not ended after LAUNCH_TIMEOUT seconds is killed and fails its test. The
    launcher and train.py's processes are forked from one that imported what they import, once
    (tests/helpers/forked_launch.py). A shipped config that needs a GPU runs, on a machine without one, through
    CPU_STAND_INS' script (train.py with the one part that has no CPU kernels replaced: the script says how)."""
    if script == "train.py" and config in GPU_ONLY and not torch.cuda.is_available():
        script, args = CPU_STAND_INS[config], ("--output_dir", str(output_dir), "--report_to", "none", *args)
    command = launch_command(config, output_dir, list(args), launch_args=extra_launch, script=script)
    run_env = {**os.environ, **TEST_ENV, **(env or {})}
    if config is None and script == "train.py" and forkable(None):
        return Run("one process", *forked_launch.train(command[2:], ROOT, run_env, LAUNCH_TIMEOUT, SERVER_ENV),
                   output_dir)
    if config is None or not forkable(config):
        return run_config(config, output_dir, list(args), launch_args=extra_launch, script=script,
                          env={**TEST_ENV, **(env or {})}, timeout=LAUNCH_TIMEOUT)
    assert command[1:3] == ["-m", "accelerate.commands.launch"], command
    return Run(config, *forked_launch.launch(command[3:], ROOT, run_env, LAUNCH_TIMEOUT, SERVER_ENV), output_dir)


def forkable(config: str | None) -> bool:
    """Whether a run may be forked (tests/helpers/forked_launch.py): not on a machine with CUDA, and for a launch
    (config not None) not under Accelerate's one-process launcher (distributed_type NO or MULTI_CPU), whose rank
    reads the process count from its launcher's command line (trainkit/launch.py)."""
    if not forked_launch.available():
        return False
    if config is None:
        return True
    try:
        return yaml.safe_load((ROOT / config_path(config)).read_text())["distributed_type"] not in ("NO", "MULTI_CPU")
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return False  # what Accelerate makes of it is the test's to see


def error_lines(stderr: str) -> list[str]:
    """The project's error lines (a launch's closing report quotes them again, indented: trainkit/restarts.py)."""
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def assert_refused(run: Run, message: str, code: int = 2) -> None:
    """A bad input: the given exit status (any non-zero one under a launcher, which reports a failed child with
    its own traceback after ours), our `error:` line, and no traceback from the project's code."""
    assert run.returncode == code or (code and run.returncode != 0 and "ChildFailedError" in run.stderr), run.stderr
    assert f"error: {message}" in run.stderr or message in run.stderr and "error: " in run.stderr, run.stderr
    assert 'train.py", line' not in run.stderr and "trainkit/" not in run.stderr, run.stderr


@contextlib.contextmanager
def tmpfs(mount: Path, options: str):
    """A tmpfs mounted at `mount` (made here) with mount(8)'s options, unmounted after; the test is skipped where it
    cannot be mounted (not root)."""
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


# Chat fine-tuning (tests/test_sft.py, tests/test_lora.py)

EXAMPLES = 120


def conversation(i: int, repeats: int = 1) -> list[dict[str, str]]:
    a, b = i % 7 + 2, i % 5 + 3
    return [{"role": "system", "content": "You add numbers."},
            {"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": " ".join([f"{a} plus {b} is {a + b}."] * repeats)},
            {"role": "user", "content": "And doubled?"},
            {"role": "assistant", "content": f"Doubled it is {2 * (a + b)}."}]


@pytest.fixture(scope="session")
def chat(tmp_path_factory):
    """(model folder, chat.jsonl): a Qwen2 with its own tokenizer, and EXAMPLES two-turn conversations; beside
    them uneven.jsonl, whose first answers repeat 1 to 10 times (learned tokens per example from 16 to 97)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("sft")
    chats = [{"messages": conversation(i)} for i in range(EXAMPLES)]
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    (root / "uneven.jsonl").write_text("".join(json.dumps({"messages": conversation(i, i % 10 + 1)}) + "\n"
                                               for i in range(EXAMPLES)))
    texts = [m["content"] for c in chats for m in c["messages"]] + ["<|im_start|>assistant\n<|im_end|>\n system user"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(texts * 5, trainer=trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    folder = root / "qwen2"
    import torch

    torch.manual_seed(0)  # the same model in every session: a test's outcome never depends on the draw
    Qwen2ForCausalLM(Qwen2Config(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder, data


def architecture(name: str, attention: str = "sdpa", layers: int = 2):
    """A small untrained model of each architecture the fine-tuning and pipeline tests use, on the chat fixture's
    400-token vocabulary: Qwen2 (untied; sliding-window layers from half its depth), Llama with tied embeddings,
    Mistral (a sliding window of 6 tokens), Qwen3 (sliding layers too), GPT-NeoX (rotary on a part of each head,
    parallel residual, one fused query-key-value layer), GPT-2 (tied, its linear layers transformers' Conv1D); and
    the layouts no stage class was written for: Phi-3 (fused query-key-value and gate-up projections), Gemma (scaled
    embeddings, tied), OLMo (norms without weights), Granite (embedding, residual and attention multipliers, logits
    divided), StarCoder2 (biases, LayerNorm, a sliding window) and OPT (learned positions, a projection in and out;
    its dropout off, as the others have it, for runs on different process counts to compare)."""
    import transformers

    sizes = {"vocab_size": 400, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": layers,
             "num_attention_heads": 4, "attn_implementation": attention}
    kv = {"num_key_value_heads": 2}
    other = {
        "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(**sizes, **kv, pad_token_id=0)),
        "gemma": lambda: transformers.GemmaForCausalLM(transformers.GemmaConfig(**sizes, **kv, head_dim=8)),
        "olmo": lambda: transformers.OlmoForCausalLM(transformers.OlmoConfig(**sizes, pad_token_id=0)),
        "granite": lambda: transformers.GraniteForCausalLM(transformers.GraniteConfig(
            **sizes, **kv, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3,
            logits_scaling=3.0)),
        "starcoder2": lambda: transformers.Starcoder2ForCausalLM(transformers.Starcoder2Config(
            **sizes, **kv, sliding_window=6)),
        "opt": lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=400, hidden_size=32, ffn_dim=64, num_hidden_layers=layers, num_attention_heads=4,
            word_embed_proj_dim=16, max_position_embeddings=512, dropout=0.0, attn_implementation=attention)),
    }
    if name in other:
        return other[name]()
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    sliding = {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": layers // 2}
    if name == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**sizes, num_key_value_heads=2, **(sliding if layers > 2 else {})))
    if name == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**sizes, num_key_value_heads=2, head_dim=8, **sliding))
    if name == "mistral":
        return MistralForCausalLM(MistralConfig(**sizes, num_key_value_heads=2, sliding_window=6))
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(**sizes, num_key_value_heads=2, tie_word_embeddings=True))
    if name == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=400, n_embd=32, n_layer=layers, n_head=4, n_positions=512,
                                          attn_implementation=attention))
    return GPTNeoXForCausalLM(GPTNeoXConfig(**sizes))



@pytest.fixture
def run_dir(tmp_path):
    """A fresh output directory per call: run_dir('name')."""
    return lambda name: tmp_path / name


@pytest.fixture
def test_env(monkeypatch) -> None:
    """TEST_ENV in this test's own process (and so in whatever it starts), for tests that call code directly."""
    for name, value in TEST_ENV.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def check_only(capsys, test_env):
    """check_only(output_dir, ARGS): train.main(ARGS) inside the test process, for runs that build and train nothing:
    --dry_run, --estimate, and refusals found while planning (before an Accelerator exists). The same code path as
    `python train.py ARGS`, without a new interpreter's seconds of imports per call: it keeps refusal tests cheap."""
    import train

    def run(output_dir: Path, *args: str) -> Run:
        capsys.readouterr()
        try:
            code = train.main([*args, "--output_dir", str(output_dir),
                               *(() if "--report_to" in args else ("--report_to", "none"))])
        except SystemExit as e:  # argparse refuses a flag's value by exiting
            code = e.code
        out = capsys.readouterr()
        return Run("in process", code, out.out, out.err, output_dir)

    return run
