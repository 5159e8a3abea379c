"""Fine-tune a pretrained causal language model (any AutoModelForCausalLM) from a local folder or a Hub id.

Trains: the model and tokenizer that --model_name_or_path names, on --data: CPython's pydoc topics by default,
local .txt/.jsonl/.csv files (comma-separated; --text_field names the column), or a Hugging Face dataset name.
Each document is cut into samples of seq_len tokens, the last piece padded with the tokenizer's pad token (its end
of text when it has none); the loss of a step is the mean over every learned token of the global batch (padding
masked out; the runner weighs each micro-batch by its learned tokens: loss_weight), so that every split of a global
batch gives the same loss however unevenly the tokens fall. Instruction and chat data (prompt/completion,
chat messages, Alpaca, ShareGPT: trainkit/data/sft.py) train one example per sample with the loss on the answers only.
`--streaming` reads any of them as it trains, and mixtures with weights (`--data 'a-*.jsonl:0.7,b.jsonl:0.3'`) are
always streamed (trainkit/data/stream.py). Reports eval_token_accuracy.
Output: final/ loads with AutoModelForCausalLM / AutoTokenizer.from_pretrained exactly as the input did (the
weights as safetensors; the tokenizer with its special tokens and chat template).

Safe by default: weights are read only from safetensors files (--allow_pickle true accepts pytorch_model.bin), and
code shipped with a Hub model runs only with --trust_remote_code true.

    python train.py --recipe causal_lm --model_name_or_path runs/tiny_transformer/final
    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml --mixed_precision bf16 train.py \\
        --recipe causal_lm --model_name_or_path Qwen/Qwen2.5-0.5B --seq_len 512 --batch_size 4

A Hub id downloads once into the Hugging Face cache (HF_HOME), which needs the network; a gated model also needs
`huggingface-cli login`. Under ZeRO-3 the weights are partitioned as they load (transformers builds the model
inside DeepSpeed's zero.Init: no rank holds it whole); under FSDP2 each rank loads the weights into host memory,
then each block is sharded. --trainable lists the parameters to train (name prefixes; the rest is frozen), for
example `--trainable lm_head,model.layers.3` or `--trainable model.layers.` to freeze the embeddings.
"""

from __future__ import annotations

import functools
import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainkit.data import sft, stream_rows, stream_sources, text
from trainkit.data.stream import Streamed
from trainkit.data.stream_sources import BadRecord
from trainkit.errors import ConfigError, Problem
from trainkit.losses import chunked_loss, router
from trainkit.models import finetune, tiled_mlp
from trainkit.models.finetune import FineTuneConfig, tokenizer_of
from trainkit.strategies import pipeline_decoder


@dataclass(kw_only=True, slots=True)
class Config(FineTuneConfig):  # the model's settings: trainkit/models/finetune.py
    # Data
    data: str = "pydoc"
    text_field: str = "text"
    # The records' layout (trainkit/data/sft.py): auto (from the first record's fields), text, prompt_completion,
    # messages, alpaca or sharegpt. Every layout but text learns only the answers unless train_on is "all".
    data_format: str = "auto"
    train_on: str = "answers"  # answers | all (prompts, system and user turns too)
    # Roles named otherwise than system/user/assistant/tool, renamed: "bot=assistant,human=user" (an unknown role is
    # refused: its turns would be rendered and never learned)
    role_map: str = ""
    # Instruction and chat examples packed into seq_len rows (best fit), each attending only to itself (a
    # block-diagonal causal mask, position_ids restarting per example) instead of one padded example per row.
    packing: bool = False
    # The loss of a step: "tokens", the mean over every learned token of the global batch (an example weighs as many
    # tokens as it learns); "samples", the mean over its examples of each one's own mean (a short answer weighs as
    # much as a long one), another objective. Either way every split of the global batch gives the same loss.
    loss_average: str = "tokens"
    # auto | true | false: read the data as it trains (trainkit/data/stream.py); auto streams mixtures (`a.jsonl:0.7,
    # b.jsonl:0.3`) and local files past 1 GiB. bad_lines: a streamed record that cannot be read stops the run, or skip
    streaming: str = "auto"
    bad_lines: str = "stop"
    # At each evaluation, the model's greedy answers to the prompts of the first eval_answers held-out examples (the
    # text before their first learned token; plain text: a sample's first quarter), into generations.jsonl
    eval_answers: int = 2
    max_new_tokens: int = 32
    preview: int = 0  # which example --dry_run shows as the model reads it (from 0)
    # The loss computes the logits of at most this many MiB (fp32) at a time, chunks of positions through the head
    # and the cross entropy, each made again in backward (trainkit/losses/chunked_loss.py): a long micro-batch never
    # holds its whole logits. A micro-batch whose logits fit is computed whole; 0: always whole
    loss_chunk_mib: float = chunked_loss.CHUNK_MIB
    # Each decoder layer's MLP a chunk of `hidden` positions at a time, recomputed in backward
    # (trainkit/models/tiled_mlp.py)
    tiled_mlp: bool = False

    may_change_on_resume = FineTuneConfig.may_change_on_resume | {"preview", "loss_chunk_mib", "tiled_mlp"}

    def check(self) -> list[Problem]:
        problems = FineTuneConfig.check(self) + chunked_loss.problems(self.loss_chunk_mib)
        if self.data_format not in ("auto", *sft.FORMATS):
            problems.append(Problem(f"unknown data_format {self.data_format!r}", "config field data_format",
                                    f"use auto or one of {', '.join(sft.FORMATS)}"))
        if self.loss_average not in ("tokens", "samples"):
            problems.append(Problem(f"loss_average must be tokens or samples, got {self.loss_average!r}",
                                    "config field loss_average", "use --loss_average tokens"))
        if self.train_on not in ("answers", "all"):
            problems.append(Problem(f"train_on must be answers or all, got {self.train_on!r}",
                                    "config field train_on", "use --train_on answers"))
        plain = self.data_format == "text" or self.data_format == "auto" and self.layout() == "text"
        if self.pipeline_stages > 1 and (self.packing or self.loss_average == "samples"):
            what = "--packing (each row's examples need their own mask)" if self.packing else \
                "--loss_average samples (each token's weight)"
            problems.append(Problem(f"{what} does not pass through pipeline stages, which carry only the token ids "
                                    "forward", "config field pipeline_stages",
                                    "train it without --pipeline_stages (fsdp.yaml or deepspeed_zero3.yaml shard a "
                                    "model that does not fit)"))
        problems += text.check_streaming(self.data, self.text_field, self.streaming, self.bad_lines)
        if self.eval_data:
            problems += text.check_data(self.eval_data, self.text_field if plain else None, flag="--eval_data")
        roles_wrong = sft.role_map_problems(self.role_map)
        problems += roles_wrong
        if not plain and not roles_wrong and self.layout() in sft.FIELDS:  # each record of each file's first MiB
            roles = sft.parse_role_map(self.role_map)
            problems += [problem for data, flag in ((self.data, "--data"), (self.eval_data, "--eval_data")) if data
                         and not text.streams(data, self.streaming) for path in text.local_files(data) or []
                         if path.suffix in (".jsonl", ".json") and path.is_file() and (problem := sft.check_records(
                             path, self.layout(), roles, flag, text.CHECKED_BYTES))]
        return problems + text.check_data(self.data, self.text_field if plain else None,
                                          text.streams(self.data, self.streaming))

    def layout(self) -> str:
        """The data's layout: data_format, or the one its first local record's fields show (text where they cannot
        be read cheaply: a Hub name is detected when it loads)."""
        if self.data_format != "auto":
            return self.data_format
        fields = text.first_fields(self.data)
        return "text" if fields is None else sft.detect(fields, self.text_field)


def build_model(cfg: Config) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = finetune.build(cfg, AutoModelForCausalLM)
    return chunked_loss.configure(tiled_mlp.tile(model) if cfg.tiled_mlp else model, cfg.loss_chunk_mib)


def build_datasets(cfg: Config, cache_dir: Path):
    """(train, held-out) samples: the held-out ones are --eval_data's, or eval_fraction of --data's (plain text: its
    last blocks; instruction and chat data: examples drawn from the seed before packing)."""
    layout = cfg.layout()
    if text.streams(cfg.data, cfg.streaming):  # a streamed Hub dataset's layout, if not text: --data_format
        train, held_out = _streamed(cfg, layout, cache_dir)
        return train, _samples(cfg, layout, cfg.eval_data, cache_dir, cfg.eval_split) if cfg.eval_data else held_out
    if cfg.data_format == "auto" and text.local_files(cfg.data) is None and cfg.data != "pydoc":  # a Hub name
        layout = sft.detect(text.load_records(cfg.data, cfg.data_config, None, cache_dir).column_names,
                            cfg.text_field)
    if cfg.eval_data:
        return (_samples(cfg, layout, cfg.data, cache_dir),
                _samples(cfg, layout, cfg.eval_data, cache_dir, cfg.eval_split))
    if layout == "text":
        return text.split_held_out(_samples(cfg, layout, cfg.data, cache_dir), cfg.eval_fraction, cfg.data,
                                   f"samples of {cfg.seq_len} tokens")
    examples = _encoded(cfg, layout, _records(cfg, layout, cfg.data, cache_dir), cfg.data)
    train, held_out = text.drawn_held_out(examples, cfg.eval_fraction, cfg.seed, cfg.data,
                                          "examples with something to learn")
    return _rows(cfg, train), _rows(cfg, held_out)


def _samples(cfg: Config, layout: str, data: str, cache_dir: Path, split: str = "train"):
    """Every sample of `data` (a Hub dataset's `split`), as torch tensors: blocks of plain text, or examples."""
    if layout != "text":
        return _rows(cfg, _encoded(cfg, layout, _records(cfg, layout, data, cache_dir, split), data))
    docs = text.load_documents(data, cfg.data_config, cfg.text_field, cache_dir, split, cfg.flag_of(data))
    tokenizer = tokenizer_of(cfg)
    pieces = stream_rows.TextPieces(tokenizer, cfg.seq_len, cfg.loss_average == "samples", cfg.packing)
    columns = ["input_ids", *(["labels"] if cfg.packing else ["attention_mask"]), *(["weight"] * pieces.weights)]

    def cut(batch):  # documents to their pieces: padded rows, or with --packing the pieces to pack
        made = [row for ids in tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
                for row, _ in (pieces.pieces if cfg.packing else pieces.cut)([*ids, tokenizer.eos_token_id])]
        return {key: [row[key] for row in made] for key in columns}

    made = docs.map(cut, batched=True, remove_columns=docs.column_names)
    return (sft.packed(made, cfg.seq_len, sft.pad_id(tokenizer)) if cfg.packing else made).with_format("torch")


def _streamed(cfg: Config, layout: str, cache_dir: Path) -> tuple[Streamed, list]:
    """The data read as it trains: the same rows as below, made in the data workers (trainkit/data/stream_rows.py)."""
    streamed = Streamed.open(text.streamed_data(cfg.data, cache_dir), cfg.text_field, cfg.data_config,
                             cfg.eval_fraction, cfg.bad_lines, None if layout == "text" else sft.FIELDS[layout])
    tokenizer, weights = tokenizer_of(cfg), cfg.loss_average == "samples"
    streamed = streamed.with_rows(stream_rows.TextPieces(tokenizer, cfg.seq_len, weights, cfg.packing)
                                  if layout == "text" else _maker(cfg, layout, cfg.packing))
    return streamed, streamed.held_out()


def _maker(cfg: Config, layout: str, packing: bool = False) -> stream_rows.Examples:
    """What makes instruction and chat records into examples: the tokenizer, its template, what is learned."""
    tokenizer = tokenizer_of(cfg)
    return stream_rows.Examples(tokenizer, cfg.seq_len, layout, sft.chat_template(tokenizer, cfg.chat_template),
                         cfg.train_on == "all", cfg.loss_average == "samples", packing,
                         tuple(sft.parse_role_map(cfg.role_map).items()))


def _records(cfg: Config, layout: str, data: str, cache_dir: Path, split: str = "train"):
    """Instruction or chat records of `data`, refused when they lack the layout's fields; local files are checked
    record by record first, a record that cannot be rendered named by file and line."""
    for path in text.local_files(data) or []:
        if path.suffix in (".jsonl", ".json") and (
                problem := sft.check_records(path, layout, sft.parse_role_map(cfg.role_map), cfg.flag_of(data))):
            raise ConfigError([problem])
    records = text.load_records(data, cfg.data_config, None, cache_dir, split, cfg.flag_of(data))
    missing = [f for f in sft.FIELDS[layout] if f not in records.column_names]
    if missing:
        raise ConfigError([Problem(f"the {layout} layout needs the field(s) {', '.join(missing)}; the data has "
                                   f"{', '.join(records.column_names)}", f"{cfg.flag_of(data)} {data}",
                                   "pass --data_format for the layout the data has (docs/recipes.md)")])
    return records


def _encoded(cfg: Config, layout: str, records, data: str):
    """Instruction or chat records, one example each (cut to seq_len), with labels only on what is learned. Examples
    that teach less than they seem to (sft.ANSWER_GAPS: no answer, none left within seq_len, empty answers, a turn
    after the last answer) are counted and said, those with nothing to learn left out, and all of them left out
    refused naming why."""
    maker = _maker(cfg, layout)
    roles = dict(maker.role_map)
    columns = ("input_ids", "labels", *(["weight"] if maker.weights else []))

    def encode(batch, indices):
        listed = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
        made = maker.examples(listed)
        if bad := next((e for e in made if isinstance(e, BadRecord)), None):  # a Hub dataset's: no file to check
            raise ConfigError([Problem(f"a record of {data} {bad.why}", f"{cfg.flag_of(data)} {data}",
                                       "pass --role_map name=role for a role named otherwise, or mend the data")])
        gaps = [("" if maker.train_on_all else sft.answer_gap(record, layout, roles)) for record in listed]
        why = [gap if gap == "no_answer" or example else "cut" for gap, example in zip(gaps, made, strict=True)]
        return {**{key: [e[key] if e else [] for e in made] for key in columns}, "why": why, "record": indices}

    encoded = records.map(encode, batched=True, with_indices=True, remove_columns=records.column_names)
    counts = Counter(encoded["why"])
    left_out = counts["no_answer"] + counts["cut"]
    said = [f"{n} {sft.ANSWER_GAPS[why].replace('--seq_len', f'--seq_len {cfg.seq_len}')} (the first: record "
            f"{encoded['record'][encoded['why'].index(why)] + 1})" for why, n in counts.items() if why]
    if left_out == len(records):
        fix = "pass a larger --seq_len, or --train_on all" if counts["cut"] else \
            "give each conversation the assistant's answer to learn (or --train_on all to learn every token)"
        raise ConfigError([Problem(f"none of the {len(records)} examples of {data} has a token to learn: "
                                   f"{'; '.join(said)}", f"{cfg.flag_of(data)} {data}", fix)])
    if said and int(os.environ.get("RANK", "0")) == 0:
        print(f"note: of the {len(records)} examples of {data}, {'; '.join(said)}", file=sys.stderr, flush=True)
    kept = encoded.filter(lambda why: why not in ("no_answer", "cut"), input_columns="why") if left_out else encoded
    return kept.remove_columns(["why", "record"])


def _rows(cfg: Config, examples):
    """Encoded examples as the rows of seq_len tokens the model reads: one padded example each, or packed."""
    pad = sft.pad_id(tokenizer_of(cfg))
    made = sft.packed(examples, cfg.seq_len, pad) if cfg.packing else \
        examples.map(lambda row: sft.padded(row, cfg.seq_len, pad))
    return made.with_format("torch")


def preview(cfg: Config, cache_dir: Path) -> str | None:
    """--dry_run's view of the data: example --preview (from 0) as the model reads it, the learned tokens between [[
    and ]], and with --packing the row the packer puts it in among the examples that follow it (instruction and chat
    layouts only; streamed data: its first example)."""
    layout = cfg.layout()
    if layout == "text":
        return None
    data = text.streamed_data(cfg.data, cache_dir)
    if text.streams(cfg.data, cfg.streaming):
        source = stream_sources.parse_data(data, cfg.text_field, cfg.data_config)[0]
        number, records = 0, [stream_sources.first_record(source)[1]]
    else:
        loaded = _records(cfg, layout, cfg.data, cache_dir)
        if cfg.preview >= len(loaded):
            raise ConfigError([Problem(f"--preview {cfg.preview}: {cfg.data} holds {len(loaded)} examples",
                                       "--preview", f"pass a number from 0 to {len(loaded) - 1}")])
        _encoded(cfg, layout, loaded, cfg.data)  # what the run refuses or counts, said here too
        number, records = cfg.preview, loaded.select(range(cfg.preview, min(len(loaded), cfg.preview + PACK_WINDOW)))
    tokenizer = tokenizer_of(cfg)
    made = _maker(cfg, layout).examples([dict(r) for r in records])
    if made[0] is None:
        return f"example {number} ({layout}) has no token to learn within --seq_len {cfg.seq_len}: it is dropped"
    shown = (f"example {number} ({layout}, {sft.learned_count(made[0]['labels'])} of {len(made[0]['input_ids'])} "
             f"tokens learned, between [[ and ]]):\n{sft.preview(made[0]['input_ids'], made[0]['labels'], tokenizer)}")
    if not cfg.packing:
        return shown
    kept = [(i, e) for i, e in enumerate(made) if e is not None]
    members = next(row for row in sft.pack([len(e["input_ids"]) for _, e in kept], cfg.seq_len) if 0 in row)
    row = sft.packed_row([kept[i][1] for i in members], cfg.seq_len, sft.pad_id(tokenizer))
    used = sum(1 for segment in row["segment"] if segment)
    together = ", ".join(str(number + kept[i][0]) for i in members)
    return (f"{shown}\nits packed row (--packing: examples {together} of the {len(kept)} from {number} on, {used} of "
            f"{cfg.seq_len} positions used, each example attending only to itself and learning nothing at its first "
            f"token):\n{sft.preview(row['input_ids'][:used], row['labels'], tokenizer)}")


# How many examples from --preview's on the dry run packs to show its row (the run packs them all: best fit)
PACK_WINDOW = 64


def learned_positions(batch: dict) -> torch.Tensor:
    """Which next-token predictions the loss learns from: the real tokens of plain text, the answers of instruction
    and chat data."""
    return batch["labels"][:, 1:] != sft.IGNORE if "labels" in batch else batch["attention_mask"][:, 1:].bool()


def model_inputs(model: nn.Module, batch: dict) -> dict[str, Any]:
    """What `model` (wrapped by its strategy or not) reads of a micro-batch of rows, without a KV cache (in training
    it would only copy every layer's keys and values; generate() still uses one)."""
    ids, mask, positions = batch["input_ids"], batch["attention_mask"], batch.get("position_ids")
    if "segment" in batch:  # packed rows: each example attends only to itself
        attention = _attention_of(model)
        # flash attention's variable-length path finds the examples from the restarting position_ids alone, and so
        # does transformers' own mask without a KV cache: the way for a mixture of experts, whose own balancing
        # loss reads a 2-D mask only (a block mask failed it)
        alone = attention.startswith("flash") or router.balances(model)
        mask = None if alone else sft.block_mask(batch["segment"], attention == "eager")
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "use_cache": False}


def _token_losses(model: nn.Module, batch: dict, top_guess: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, chunked_loss.TokenLosses]:
    """Every position's next-token loss, whether it is learned, (top_guess) whether the model's top guess is right,
    and the whole of what next_token_losses found (a mixture of experts' aux_loss and router logits)."""
    if "shift_labels" in batch:  # a sequence-parallel shard: its targets made before the cut, no mask of its own
        targets = batch["shift_labels"]
        out = chunked_loss.next_token_losses(model, top_guess, targets, input_ids=batch["input_ids"],
                                             position_ids=batch["position_ids"], use_cache=False)
        return out.losses, targets != sft.IGNORE, out.guess == targets if top_guess else None, out
    out = chunked_loss.next_token_losses(model, top_guess, **model_inputs(model, batch))
    ids = batch["input_ids"]
    return out.losses, learned_positions(batch), out.guess == ids[:, 1:] if top_guess else None, out


def _weights(batch: dict) -> torch.Tensor:
    """What each next-token loss weighs in the micro-batch's mean: 1 per learned token, or (loss_average samples)
    the batch's `weight`, each example's learned positions summing to 1."""
    if "shift_labels" in batch:  # a sequence-parallel shard (trainkit/strategies/sequence_parallel.py)
        return batch["shift_weight"].float() if "shift_weight" in batch else \
            (batch["shift_labels"] != sft.IGNORE).float()
    return batch["weight"][:, 1:].float() if "weight" in batch else learned_positions(batch).float()


def _attention_of(model: nn.Module) -> str:
    """The attention implementation of the (possibly wrapped) model: eager takes an additive mask."""
    from accelerate.utils import extract_model_from_parallel

    return getattr(getattr(extract_model_from_parallel(model), "config", None), "_attn_implementation", "sdpa")


def loss(model: nn.Module, batch: dict) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's weighed mean (_weights): over its learned tokens, or over its examples of each one's mean.
    With loss_weight the runner makes a step's loss that mean over the whole global batch, however it falls across
    micro-batches and ranks. A mixture of experts whose config asks for its router logits adds its balancing loss
    times its coefficient, each sequence's weighed as its learned tokens, and reports it as aux_loss
    (trainkit/losses/router.py)."""
    token_loss, _, _, out = _token_losses(model, batch)
    weight = _weights(batch)
    mean = (token_loss * weight).sum() / weight.sum().clamp(min=1e-12)
    mask = batch.get("attention_mask", batch.get("balance_mask"))  # a sequence-parallel shard has the latter
    return router.with_router_loss(model, mean, out.aux_loss, out.router_logits, mask, weight.sum(dim=1))


def loss_weight(cfg: Config, batch: dict) -> float:
    """What the micro-batch's mean is over: its learned tokens, or (loss_average samples) its examples."""
    return float(_weights(batch).sum())


# Sequence and context parallelism (a YAML's parallelism_config_sp_size or _cp_size;
# trainkit/strategies/sequence_parallel.py): _token_losses reads the parts of each row the runner cuts (shift_labels,
# the whole row's position_ids).
sequence_parallel = True


# Pipeline parallelism (--pipeline_stages): any transformers decoder of the standard layout (embeddings, a ModuleList
# of layers, a final norm, a head) is cut into stages by trainkit/strategies/pipeline_decoder.py, which refuses another
# model naming it. The runner weighs each micro-batch's mean by its learned tokens (loss_weight) as it does without
# stages.
pipeline_layers = pipeline_decoder.layers
pipeline_stage = pipeline_decoder.stage
pipeline_loss = pipeline_decoder.loss


def eval_metrics(model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
    """Each sample's share of its learned tokens that the model's top guess predicts, summed over the batch."""
    _, real, right, _ = _token_losses(model, batch, top_guess=True)
    return {"token_accuracy": ((right & real).sum(dim=1) / real.sum(dim=1).clamp(min=1)).sum()}


def generate(model: nn.Module, cfg: Config, eval_set) -> list[dict[str, str]]:
    """The answers of eval_answers: {prompt, answer (the model's, to the end of its turn), expected (the data's
    answer to that prompt, not the rest of its conversation)}.
    Every rank generates the same tokens; synced_gpus keeps the ranks stepping together where a forward is a
    collective (ZeRO-3, FSDP2)."""
    import torch.distributed as dist

    tokenizer, answers = _tokenizer(cfg), []
    device = next(model.parameters()).device
    for i in range(min(cfg.eval_answers, len(eval_set))):
        row = {key: torch.as_tensor(value).tolist() for key, value in eval_set[i].items()}
        ids = row["input_ids"][:sum(row["attention_mask"])]
        if "segment" in row:  # a packed row: its first example
            ids = ids[:row["segment"].count(1)]
        learned = [j for j, label in enumerate(row.get("labels", [])[:len(ids)]) if label != sft.IGNORE]
        cut = learned[0] if learned else max(1, len(ids) // 4)
        # the data's answer to that prompt: its first learned turn (plain text: the sample's rest)
        end = cut + next((i for i, j in enumerate(learned) if j != cut + i), len(learned)) if learned else len(ids)
        output = model.generate(torch.tensor([ids[:cut]], device=device), max_new_tokens=cfg.max_new_tokens,
                                do_sample=False, pad_token_id=sft.pad_id(tokenizer), tokenizer=tokenizer,
                                stop_strings=sft.TURN_ENDS,
                                synced_gpus=dist.is_initialized() and dist.get_world_size() > 1)
        answers.append({"prompt": tokenizer.decode(ids[:cut]), "answer": tokenizer.decode(output[0, cut:]),
                        "expected": tokenizer.decode(ids[cut:end])})
    return answers


@functools.cache
def _tokenizer_of(fields: tuple) -> Any:
    return tokenizer_of(Config(**dict(fields)))


def _tokenizer(cfg: Config):
    """tokenizer_of, loaded once per run (generate runs at every evaluation)."""
    return _tokenizer_of(tuple((k, getattr(cfg, k)) for k in ("model_name_or_path", "tokenizer", "trust_remote_code")))


def summary(cfg: Config, cache_dir: Path) -> dict[str, float]:
    """The share of the training rows' positions that is padding: what packing saves (build_datasets' result, read
    back from the datasets cache; streamed data: its held-out rows, the corpus is never read whole)."""
    train, held_out = build_datasets(cfg, cache_dir)
    masks = torch.stack([row["attention_mask"] for row in held_out]).numpy() if isinstance(train, Streamed) else \
        train.with_format("numpy")[:]["attention_mask"]
    return {"padding_share": 1.0 - float(masks.sum()) / (len(masks) * cfg.seq_len)}


def tokens_per_sample(cfg: Config) -> int:
    return cfg.seq_len


def export(model, state_dict: dict, cfg: Config, cache_dir: Path, out_dir: Path) -> None:
    """final/ as from_pretrained loads it (under LoRA: merged, and the adapters alone in final/adapter/), with the
    system turn its first conversations all opened with (trainkit/tools/ask.py's default)."""
    from transformers import AutoModelForCausalLM

    layout, system = cfg.layout(), None
    if layout in ("messages", "sharegpt") and not text.streams(cfg.data, cfg.streaming):
        records = _records(cfg, layout, cfg.data, cache_dir)
        system = sft.shared_system_turn(records.select(range(min(len(records), SYSTEM_SAMPLE))), layout,
                                        sft.parse_role_map(cfg.role_map))
    finetune.export(model, state_dict, cfg, out_dir, AutoModelForCausalLM, system)


SYSTEM_SAMPLE = 256  # the conversations export reads for a shared system turn
