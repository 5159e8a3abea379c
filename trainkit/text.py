"""Text data for language-model recipes: a corpus that needs no download, a BPE tokenizer trained on it, and
fixed-length token blocks made with `datasets.map` (cached, so the second run starts at once).

The default corpus is the English reference text that CPython ships in `pydoc_data` (the help() topics): it
exists on every machine with Python. `--data` takes local .txt/.jsonl/.json/.csv files or a Hugging Face dataset
name; with no network a hub name fails with a message that says so.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import Counter
from pathlib import Path

from trainkit.errors import ConfigError, Problem

EOS = "<|endoftext|>"
EOS_ID = 0  # BpeTrainer gives the special tokens the first ids; the model configs need it before any tokenizer exists
LOCAL_FORMATS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".csv": "csv"}


def default_corpus(cache_dir: Path) -> Path:
    """CPython's pydoc topics as JSON lines, one topic per document, written once into the cache."""
    import pydoc_data.topics

    path = cache_dir / "pydoc_topics.jsonl"
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "w") as f:
            for name in sorted(pydoc_data.topics.topics):
                f.write(json.dumps({"text": pydoc_data.topics.topics[name]}) + "\n")
        tmp.replace(path)  # atomic: concurrent builders never see half a file
    return path


def local_files(data: str) -> list[Path] | None:
    """The local files `--data` names, or None when it names a Hugging Face dataset (or the built-in corpus).

    Local means: the path exists, or it ends in a suffix of LOCAL_FORMATS (a missing file is then refused by name).
    Anything else is a dataset name, dots and slashes included (`org/name-1.0`).
    """
    if data == "pydoc":
        return None
    files = [Path(p) for p in data.split(",")]
    return files if any(p.exists() or p.suffix in LOCAL_FORMATS for p in files) else None


def check_data(data: str) -> list[Problem]:
    """Problems with `--data` that can be seen without loading it (run before anything is built)."""
    files = local_files(data)
    if files is None:
        return []
    where = f"--data {data}"
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        return [Problem(f"data file(s) not found: {', '.join(missing)}", where,
                        "pass existing .txt/.jsonl/.csv files, comma-separated")]
    formats = {LOCAL_FORMATS.get(p.suffix) for p in files}
    if len(formats) != 1 or None in formats:
        return [Problem(f"cannot tell one format from the suffixes of {data}", where,
                        "use files of one kind: .txt, .jsonl/.json or .csv")]
    return []


def load_documents(data: str, data_config: str, text_field: str, cache_dir: Path):
    """A `datasets.Dataset` with a `text` column, from the default corpus, local files, or a hub dataset."""
    import datasets

    datasets.disable_progress_bars()
    hf_cache = str(cache_dir / "hf_datasets")
    files = [default_corpus(cache_dir)] if data == "pydoc" else local_files(data)
    where = f"--data {data}"
    if files is not None:
        problems = check_data(data)
        if problems:
            raise ConfigError(problems)
        builder = LOCAL_FORMATS[files[0].suffix]
        kwargs = {"keep_linebreaks": True} if builder == "text" else {}
        ds = datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train", cache_dir=hf_cache,
                                   **kwargs)
    else:
        try:
            ds = datasets.load_dataset(data, data_config or None, split="train", cache_dir=hf_cache)
        except Exception as e:  # offline, unknown name, gated: the library's own words, and what to do instead
            raise ConfigError([Problem(f"could not load the Hugging Face dataset {data!r}: {type(e).__name__}: "
                                       f"{str(e).splitlines()[0] if str(e) else ''}", where,
                                       "check the name and the network, or pass local .txt/.jsonl/.csv files")]
                              ) from None
    if text_field not in ds.column_names:
        raise ConfigError([Problem(f"the data has no column {text_field!r} (columns: {', '.join(ds.column_names)})",
                                   where, "name the text column with --text_field")])
    return ds.select_columns([text_field]).rename_column(text_field, "text") if text_field != "text" else \
        ds.select_columns(["text"])


def train_tokenizer(docs, vocab_size: int, out_dir: Path):
    """A byte-level BPE trained on the corpus (no download), saved where AutoTokenizer.from_pretrained finds it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if (out_dir / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(out_dir))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((row["text"] for row in docs), trainer=trainer, length=len(docs))
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    wrapped.save_pretrained(str(tmp))
    tmp.rename(out_dir)
    return wrapped


def token_blocks(docs, tokenizer, seq_len: int):
    """Every document tokenised and followed by EOS, concatenated, and cut into blocks of seq_len tokens."""

    def tokenize(batch):
        return {"input_ids": [ids + [tokenizer.eos_token_id] for ids in tokenizer(batch["text"])["input_ids"]]}

    def group(batch):
        flat = [t for ids in batch["input_ids"] for t in ids]
        usable = len(flat) // seq_len * seq_len
        return {"input_ids": [flat[i:i + seq_len] for i in range(0, usable, seq_len)]}

    tokens = docs.map(tokenize, batched=True, remove_columns=["text"])
    # One batch holds the whole corpus so that no tokens are lost between blocks; fine at this scale.
    return tokens.map(group, batched=True, batch_size=len(tokens))


def unigram_entropy(blocks) -> float:
    """Entropy (nats per token) of the corpus's token frequencies: the loss of a model that ignores context."""
    counts = Counter(t for row in blocks["input_ids"] for t in row)
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


def data_key(data: str, data_config: str, text_field: str, vocab_size: int) -> str:
    """A cache folder name for one corpus + tokenizer choice; a local file that changes gets a new one."""
    stamps = [f"{p}:{os.stat(p).st_size}:{os.stat(p).st_mtime_ns}" for p in data.split(",") if os.path.isfile(p)]
    parts = [data, data_config, text_field, str(vocab_size), *stamps]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]
