"""The tests' fixtures: shared runs that every test comparing with them reads (launched once per session), the chat
fixture's model and data, the small models of each architecture, check_only for in-process planning. How a run is
launched is tests/helpers/launching.py's."""

from __future__ import annotations

import collections
import contextlib
import json
import subprocess
from pathlib import Path

import pytest
from helpers.launching import (
    CPU_STAND_INS,
    FLAG_STRATEGIES,
    GPU_ONLY,
    LAUNCH_TIMEOUT,
    LAUNCHES,
    PARITY_BOUND,
    SERVER_ENV,
    TEST_ENV,
    assert_refused,
    entry,
    error_lines,
    forkable,
    forked_run_config,
    launch,
    processes,
    strategy_of,
    write_yaml,
    yaml_of,
    zero2_json,
)

from trainkit.launch.train_process import ROOT, Run, kill_tree, launch_command, max_rel_diff

__all__ = ["CPU_STAND_INS", "EXAMPLES", "FLAG_STRATEGIES", "GPU_ONLY", "LAUNCHES", "LAUNCH_TIMEOUT", "LM", "ROOT",
           "TEST_ENV", "Run", "architecture", "mixture_of_experts", "assert_refused", "conversation", "entry",
           "forkable", "forked_run_config", "kill_tree",
           "error_lines", "launch", "launch_command", "max_rel_diff", "PARITY_BOUND", "processes", "SERVER_ENV",
           "strategy_of",
           "write_yaml", "yaml_of", "zero2_json"]

# Two pytest-xdist workers (pytest.ini): a test that waits (an ssh launch, a frozen rank's timeout, a restart) leaves
# the processor to the other worker's runs. Measured before choosing: tests/test_multinode.py alone left the 2 cores
# 35% idle; it and tests/test_checkpoint.py beside tests/test_pipeline.py and tests/test_preference.py took 533 s
# against 778 s one after the other, every test passing.
# Each file runs whole on one worker (its module-scoped runs are launched once); the files that read the strategy
# matrix's shared runs (lm_runs) run together. xdist's own `--dist loadgroup` cannot do it under pytest 9: it marks
# a test's group by rewriting `item._nodeid`, which pytest 9 no longer reads (Node.nodeid is `_id`), so its groups
# were silently ignored and files split between the workers; the scheduler below groups by file name instead.
SHARED_RUNS = {name: "strategy_matrix" for name in ("test_strategies", "test_tensor_parallel", "test_pipeline",
                                                    "test_checkpoint", "test_context_parallel",
                                                    "test_sequence_parallel")}


def group(path: str) -> str:
    """The work unit a test file belongs to: its name, or the name of the runs it shares with other files."""
    stem = Path(path).stem
    return SHARED_RUNS.get(stem, stem)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduler with a test file (or a group of files sharing runs) as the scope, the scopes handed out
    in the collection's order (pytest.ini: --no-loadscope-reorder), which pytest_collection_modifyitems sets."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group(nodeid.split("::", 1)[0])

    return ByFile(config, log)


def pytest_collection_modifyitems(config, items):
    """The groups with the most slow tests first: the two workers then end close together, a long group never left
    for last."""
    slow = collections.Counter(group(str(item.path)) for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[group(str(item.path))])  # stable: a file's tests stay in their order


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
    tests/test_tensor_parallel.py, tests/test_pipeline.py, tests/test_checkpoint.py, tests/test_context_parallel.py,
    tests/test_sequence_parallel.py: SHARED_RUNS keeps them on one worker, where each run is launched once)."""
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
    its dropout off, as the others have it, for runs on different process counts to compare); and the mixtures of
    experts (mixture_of_experts)."""
    import transformers

    if name in MIXTURES_OF_EXPERTS:
        return mixture_of_experts(name)
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



MIXTURES_OF_EXPERTS = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss", "deepseek_v3", "ernie4_5_moe", "phimoe")


def mixture_of_experts(name: str, **config):
    """A small untrained mixture of experts of each family the MoE tests use, on the chat fixture's 400-token
    vocabulary, its router logits on (the balancing loss computed), 4 experts, top 2, none of them written for this
    project: fused experts (Qwen3-MoE, Mixtral, OLMoE, gpt-oss with its sliding-window layers and attention sinks),
    a shared expert beside the routed ones (Qwen2-MoE), and DeepSeek-V3 (multi-head latent attention, a dense first
    layer, a shared expert, a router balanced by a bias instead of a loss: it computes no aux_loss); families with
    rules of their own: Ernie4.5-MoE (a routing bias that is a parameter and takes no gradient) and PhiMoE (a router
    that samples in training). `config`: more config fields (router_aux_loss_coef)."""
    import transformers

    torch_seed = config.pop("seed", 0)
    sizes = {"vocab_size": 400, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "output_router_logits": True, "pad_token_id": 0, "eos_token_id": 0, **config}
    routed = {"num_experts_per_tok": 2, "num_key_value_heads": 2}
    models = {
        "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **sizes, **routed, num_experts=4, moe_intermediate_size=16, head_dim=8)),
        "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **sizes, **routed, num_local_experts=4)),
        "olmoe": lambda: transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**sizes, **routed, num_experts=4)),
        "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **sizes, **routed, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16)),
        "gpt_oss": lambda: transformers.GptOssForCausalLM(transformers.GptOssConfig(
            **sizes, **routed, num_local_experts=4, head_dim=8, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"])),
        "deepseek_v3": lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **sizes, num_experts_per_tok=2, num_key_value_heads=4, n_routed_experts=4, moe_intermediate_size=16,
            first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4, v_head_dim=8,
            qk_nope_head_dim=4, n_group=1, topk_group=1)),
        # a routing bias that takes no gradient (moe_statics.e_score_correction_bias), shared experts
        "ernie4_5_moe": lambda: transformers.Ernie4_5_MoeForCausalLM(transformers.Ernie4_5_MoeConfig(
            **sizes, num_key_value_heads=2, moe_k=2, moe_num_experts=4, moe_intermediate_size=16,
            moe_num_shared_experts=1, moe_layer_start_index=0, use_bias=False)),
        # a router that samples its experts in training (sparsemixer) and jitters its input
        "phimoe": lambda: transformers.PhimoeForCausalLM(transformers.PhimoeConfig(
            **sizes, **routed, num_local_experts=4)),
    }
    import torch

    torch.manual_seed(torch_seed)
    return models[name]()


@pytest.fixture(scope="session")
def moe_folder(chat, tmp_path_factory):
    """moe_folder(name): the family `name` of mixture_of_experts saved with the chat fixture's tokenizer, once."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("moe")

    def folder(name: str) -> Path:
        model_dir = root / name
        if not model_dir.exists():
            mixture_of_experts(name).save_pretrained(model_dir)
            AutoTokenizer.from_pretrained(chat[0]).save_pretrained(model_dir)
        return model_dir

    return folder


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
