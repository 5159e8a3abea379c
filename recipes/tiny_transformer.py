"""A tiny decoder-only causal language model, trained from scratch on text that every machine already has.

Trains: a Llama-style (default) or GPT-2-style transformer built from a `transformers` config (no weights are
downloaded), with a byte-level BPE tokenizer trained on the corpus and saved with the model.
Data: CPython's pydoc topics (about 465k characters of English reference text) by default; `--data` takes local
.txt/.jsonl/.csv files (comma-separated or a glob; `--text_field` names the column) or a Hugging Face dataset name
(`--data_config` its configuration). `--streaming` reads it as it trains instead of preparing it first, and a mixture
of sources with weights (`--data 'a-*.jsonl:0.7,b/*.parquet:0.3'`) is always streamed (docs/recipes.md#streaming).
Sizes: `--size tiny` (the default, 1.2M parameters: the tests'), `--size cpu` (GPT-2's block, 29M: keeps a CPU's
cores busy), `--size gpt2-small` (124M, for GPUs); any flag after it sets its own field (`--size cpu --layers 2`).
Output: `final/` loads with AutoModelForCausalLM / AutoTokenizer.from_pretrained.

To make your own language model, copy this file and change `Config` (sizes, data) and `build_model`
(any AutoModelForCausalLM config works); `loss` and `build_datasets` usually stay as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from trainkit.config import TrainConfig
from trainkit.data import sft, text
from trainkit.data.stream import Streamed
from trainkit.data.stream_rows import TextBlocks
from trainkit.errors import Problem
from trainkit.losses import chunked_loss
from trainkit.models import tiled_mlp
from trainkit.strategies import pipeline_decoder


@dataclass(kw_only=True, slots=True)
class Config(TrainConfig):
    # A named size (`--size NAME`) sets the fields below as PRESETS lists them; flags set after it win
    # (`--size cpu --layers 2`). tiny is these defaults (the tests' size).
    size: str = "tiny"
    # Model
    arch: str = "llama"  # llama | gpt2
    vocab_size: int = 1024  # the BPE is trained to this size
    seq_len: int = 128
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    ffn: int = 0  # feed-forward width; 0: 4 x hidden (Llama-2-7B: --hidden 4096 --ffn 11008)
    tie_embeddings: bool = True  # one matrix for input and output embeddings (Llama-2 and GPT-2 sizes: false / true)
    dropout: float = 0.0  # attention dropout (llama); embedding, residual and attention dropout (gpt2)
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, ~30% more compute
    # The loss computes the logits of at most this many MiB (fp32) at a time (trainkit/losses/chunked_loss.py); 0: whole
    loss_chunk_mib: float = chunked_loss.CHUNK_MIB
    # Each layer's MLP a chunk of `hidden` positions at a time, recomputed in backward (trainkit/models/tiled_mlp.py)
    tiled_mlp: bool = False
    # Data
    data: str = "pydoc"  # "pydoc" (built in), local files "a.txt,b.txt", or a Hugging Face dataset name
    data_config: str = ""  # the Hugging Face dataset's configuration, if it has several (e.g. wikitext-2-raw-v1)
    text_field: str = "text"
    eval_fraction: float = 0.05  # the last blocks of the corpus are held out (streamed: its last pieces)
    # auto | true | false: read the data as it trains (trainkit/data/stream.py) instead of tokenising it all first; auto
    # streams a mixture, and local files past 1 GiB
    streaming: str = "auto"
    bad_lines: str = "stop"  # a streamed line that cannot be read: stop naming it, or skip (counted in metrics.jsonl)
    # Training (overrides of TrainConfig's defaults)
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    max_steps: int = 300
    eval_every: int = 100
    eval_batches: int = 2

    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": {},
        # Wide enough that the matmuls, not the framework around them, take a CPU's time, and GPT-2's block, whose
        # LayerNorm and GELU are one fused kernel each (Llama's RMSNorm, rotary embedding and gated MLP take several
        # elementwise passes each): measured MFU in BENCHMARKS.md (bench/mfu.py). At the default lr 3e-3 this
        # width spikes and stalls near the unigram loss in its first 30 steps; at 1e-3 it learns steadily.
        "cpu": {"arch": "gpt2", "hidden": 768, "layers": 4, "heads": 12, "lr": 1e-3},
        # GPT-2 small (124M parameters; for GPUs). On the built-in corpus the BPE stops near 9.2k tokens: the other
        # embedding rows are never used, as in nanoGPT's vocabulary padded to 50304. 1024-token blocks leave that
        # corpus about 100 blocks; a fifth is held out, so that a global batch of 16 fits in it.
        "gpt2-small": {"arch": "gpt2", "vocab_size": 50257, "seq_len": 1024, "hidden": 768, "layers": 12,
                       "heads": 12, "tie_embeddings": True, "batch_size": 8, "eval_fraction": 0.2, "lr": 6e-4,
                       "weight_decay": 0.1},
    }

    # Recomputing activations, chunking the loss or the MLP change memory, not the numbers: a resume may switch them.
    may_change_on_resume = TrainConfig.may_change_on_resume | {"gradient_checkpointing", "loss_chunk_mib",
                                                                   "tiled_mlp"}

    def check(self) -> list[Problem]:
        problems = chunked_loss.problems(self.loss_chunk_mib)
        if self.arch not in ("llama", "gpt2"):
            problems.append(Problem(f"arch must be llama or gpt2, got {self.arch!r}", "config field arch",
                                    "use --arch llama"))
        if self.hidden % self.heads:
            problems.append(Problem(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})",
                                    "config fields hidden, heads", "change --hidden or --heads"))
        if not 0 < self.eval_fraction < 1:
            problems.append(Problem(f"eval_fraction must be in (0, 1), got {self.eval_fraction}",
                                    "config field eval_fraction", "use --eval_fraction 0.05"))
        problems += text.check_streaming(self.data, self.text_field, self.streaming, self.bad_lines)
        problems += text.check_data(self.data, self.text_field, text.streams(self.data, self.streaming))
        if self.vocab_size < 300:
            problems.append(Problem(f"vocab_size must hold the 256 bytes and some merges, got {self.vocab_size}",
                                    "config field vocab_size", "use --vocab_size 1024"))
        return problems


def build_model(cfg: Config) -> torch.nn.Module:
    # The tokenizer's one special token ends and starts documents; generate() stops at it. (The configs' defaults,
    # 1/2 for Llama and 50256 for GPT-2, are an ordinary token and a token outside the vocabulary.) No pad_token_id:
    # blocks are never padded, and Llama would make that token's embedding a frozen zero (padding_idx).
    special = dict(bos_token_id=text.EOS_ID, eos_token_id=text.EOS_ID)
    if cfg.arch == "llama":
        config = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden,
                             intermediate_size=cfg.ffn or cfg.hidden * 4,
                             num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                             num_key_value_heads=cfg.heads, max_position_embeddings=cfg.seq_len,
                             attention_dropout=cfg.dropout, tie_word_embeddings=cfg.tie_embeddings, **special)
        model = LlamaForCausalLM(config)
    else:
        # GPT-2's tanh-approximated GELU as torch's one fused kernel: the same function as GPT2Config's default
        # "gelu_new", which computes it in eight elementwise passes over the 4 x hidden activations.
        config = GPT2Config(vocab_size=cfg.vocab_size, n_embd=cfg.hidden, n_layer=cfg.layers, n_head=cfg.heads,
                            n_inner=cfg.ffn or None, activation_function="gelu_pytorch_tanh",
                            n_positions=cfg.seq_len, resid_pdrop=cfg.dropout,
                            embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, tie_word_embeddings=cfg.tie_embeddings,
                            **special)
        model = GPT2LMHeadModel(config)
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return chunked_loss.configure(tiled_mlp.tile(model) if cfg.tiled_mlp else model, cfg.loss_chunk_mib)


# Pipeline parallelism (--pipeline_stages): where the model can be cut, and each stage's part of it, for either
# architecture (trainkit/strategies/pipeline_decoder.py, which cuts any transformers decoder of the standard layout).
pipeline_layers = pipeline_decoder.layers
pipeline_stage = pipeline_decoder.stage
pipeline_loss = pipeline_decoder.loss


def _data_dir(cfg: Config, cache_dir: Path) -> Path:
    return cache_dir / f"text-{text.data_key(cfg.data, cfg.data_config, cfg.text_field, cfg.vocab_size)}"


def _blocks(cfg: Config, cache_dir: Path):
    docs = text.load_documents(cfg.data, cfg.data_config, cfg.text_field, cache_dir)
    tokenizer = text.train_tokenizer(docs, cfg.vocab_size, _data_dir(cfg, cache_dir) / "tokenizer")
    return text.token_blocks(docs, tokenizer, cfg.seq_len)


def _streamed(cfg: Config, cache_dir: Path) -> Streamed:
    """The data read as it trains: the tokenizer is trained on the sources' first records (TOKENIZER_SAMPLE_BYTES)."""
    streamed = Streamed.open(text.streamed_data(cfg.data, cache_dir), cfg.text_field, cfg.data_config,
                             cfg.eval_fraction, cfg.bad_lines)

    def sample() -> list[dict]:  # read only when no tokenizer is cached
        return [{"text": t} for t in streamed.sample_text(text.TOKENIZER_SAMPLE_BYTES)]

    tokenizer = text.train_tokenizer(sample, cfg.vocab_size, _data_dir(cfg, cache_dir) / "tokenizer")
    return streamed.with_rows(TextBlocks(tokenizer, cfg.seq_len))


def build_datasets(cfg: Config, cache_dir: Path):
    if text.streams(cfg.data, cfg.streaming):
        streamed = _streamed(cfg, cache_dir)
        return streamed, streamed.held_out()
    return text.split_held_out(_blocks(cfg, cache_dir), cfg.eval_fraction, cfg.data, f"blocks of {cfg.seq_len} tokens")


def loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The mean next-token loss over every position of the micro-batch's blocks."""
    # No KV cache: in training it would only copy every layer's keys and values (generate() still uses one).
    if "shift_labels" in batch:  # a sequence-parallel shard: its part of every block, the targets made before the cut
        targets = batch["shift_labels"]
        losses = chunked_loss.next_token_losses(model, targets=targets, input_ids=batch["input_ids"],
                                                position_ids=batch["position_ids"], use_cache=False).losses
        return losses.sum() / (targets != sft.IGNORE).sum().clamp(min=1)  # the runner weighs it by those targets
    return chunked_loss.next_token_losses(model, input_ids=batch["input_ids"], use_cache=False)[0].mean()


# Sequence and context parallelism (a YAML's parallelism_config_sp_size or _cp_size;
# trainkit/strategies/sequence_parallel.py): the loss above reads the parts of each row the runner cuts.
sequence_parallel = True


def tokens_per_sample(cfg: Config) -> int:
    return cfg.seq_len


def summary(cfg: Config, cache_dir: Path) -> dict:
    """The unigram entropy is the loss of a model that ignores context: eval loss well below it is real learning.
    Streamed data: that of the held-out split (the corpus is never read whole)."""
    if text.streams(cfg.data, cfg.streaming):
        blocks = [row["input_ids"] for row in _streamed(cfg, cache_dir).held_out()]
    else:
        blocks = _blocks(cfg, cache_dir)
    return {"unigram_entropy": text.unigram_entropy(blocks)}


def export(model, state_dict: dict, cfg: Config, cache_dir: Path, out_dir: Path) -> None:
    model.save_pretrained(str(out_dir), state_dict=state_dict)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(_data_dir(cfg, cache_dir) / "tokenizer"))
    tokenizer.save_pretrained(str(out_dir))
