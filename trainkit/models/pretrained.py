"""Loading a pretrained Hugging Face model and tokenizer safely (recipes/causal_lm.py): weights only from
safetensors unless allowed, a failure of from_pretrained said as a config problem with its fix, and a tokenizer that
encodes text otherwise than the one saved beside the model refused.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from trainkit.errors import ConfigError, Problem

# Set while --estimate plans a run: it sizes the model from its config alone, so a folder that holds only config.json
# (a model not downloaded yet) is enough: neither weights nor a tokenizer are checked (trainkit/plan.py sets it).
sizes_only: ContextVar[bool] = ContextVar("sizes_only", default=False)


@contextlib.contextmanager
def sizing(on: bool) -> Iterator[None]:
    """sizes_only within the block, when `on`."""
    token = sizes_only.set(on)
    try:
        yield
    finally:
        sizes_only.reset(token)


def weights_problems(model_name_or_path: str, allow_pickle: bool,
                     flag: str = "config field model_name_or_path") -> list[Problem]:
    """A local path that is no folder (a Hub id, org/name, has one slash and starts with none of / . ~), a model
    folder without weights, or with pickled ones only (unless allowed); `flag` names where the path came from. The
    weights are not checked while sizing only."""
    folder = Path(model_name_or_path).expanduser()
    local = model_name_or_path.startswith(("/", ".", "~")) or model_name_or_path.count("/") > 1
    if local and not folder.is_dir():
        return [Problem(f"no model folder {model_name_or_path}", flag, "pass the folder that save_pretrained wrote "
                        "the model into, such as a run's final/ (or a Hub id: org/name)")]
    if sizes_only.get() or not (model_name_or_path and folder.is_dir() and (folder / "config.json").is_file()):
        return []
    safetensors, pickled = any(folder.glob("*.safetensors")), any(folder.glob("*.bin"))
    if not (safetensors or pickled):
        held = ", ".join(sorted(p.name for p in folder.iterdir())[:8])
        return [Problem(f"no weights in {folder} (it holds: {held})", flag,
                        "pass the folder that save_pretrained wrote the model into (model.safetensors beside "
                        "config.json), such as a run's final/")]
    if pickled and not safetensors and not allow_pickle:
        return [Problem(f"{folder} has no .safetensors weights, only pickled ones (.bin)", flag,
                        "pass --allow_pickle true to read pytorch_model.bin if you trust the file, or convert it to "
                        "safetensors")]
    return []


def scorer_problems(folder: str, flag: str) -> list[Problem]:
    """A reward model's folder must hold a trained scoring head of one output: transformers would load a causal LM's
    folder as a sequence classifier with a freshly drawn head, and say so only in its load report. The head is what
    AutoModelForSequenceClassification (built on the meta device: no memory) holds beside its base model; its shape
    is read from the safetensors headers. Pickled weights are not read here."""
    return [] if sizes_only.get() else _scorer_problems(folder, flag)


# Checked when the run is planned; the recipe's settings made again while the model is built (inside ZeRO-3's
# partitioned init, where no model can be made on the meta device) take that answer.
@functools.cache
def _scorer_problems(folder: str, flag: str) -> list[Problem]:
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForSequenceClassification

    path = Path(folder).expanduser()
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        return []
    shapes = {}
    for file in files:
        with safe_open(file, "pt") as f:
            shapes.update({key: f.get_slice(key).get_shape() for key in f.keys()})  # noqa: SIM118 (no __iter__)
    config = AutoConfig.from_pretrained(path)
    config.num_labels = 1  # the head as a reward model has it; the folder's own width is read from its weights
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    prefix = f"{model.base_model_prefix}."
    head = [name for name, _ in model.named_parameters() if not name.startswith(prefix) and name.endswith("weight")]
    fix = ("pass a reward model: the final/ of a reward run (--recipe reward on preference pairs) trains one; a "
           "folder that AutoModelForSequenceClassification saved with num_labels=1")
    missing = [name for name in head if name not in shapes]
    if missing:
        kind = ", ".join(config.architectures or [config.model_type])
        return [Problem(f"{path} is no reward model: its weights have no scoring head ({', '.join(missing)}; it "
                        f"holds a {kind}), so one would be drawn at random", flag, fix)]
    wide = [f"{name} has {shapes[name][0]} outputs" for name in head if shapes[name][0] != 1]
    if wide:
        return [Problem(f"{path} is no reward model: {', '.join(wide)}, a reward model has one (a score)", flag,
                        fix)]
    return []


@contextlib.contextmanager
def named(flag: str) -> Iterator[None]:
    """Loading another model of the run (a teacher, a reward model) through a config whose model_name_or_path is
    that model's: what it refuses names `flag`, the path's own flag, not --model_name_or_path."""
    try:
        yield
    except ConfigError as e:
        raise ConfigError([Problem(p.what, p.where.replace("--model_name_or_path", flag, 1), p.fix)
                           for p in e.problems]) from None


PROBE = "In 2024, 1234567 users wrote:  Naïve CAFÉ's code\n\tdef f(x): return x ** 2  # ok!"


def tokenizer_mismatch(tokenizer, folder: Path) -> Problem | None:
    """The tokenizer that AutoTokenizer loaded from `folder` must encode text as the one saved there (its
    tokenizer.json) does. transformers picks the class from the model type for some types whatever
    tokenizer_config.json says: a PreTrainedTokenizerFast saved beside a Qwen2 config loads as Qwen2Tokenizer, whose
    own pre-tokenizer replaces the saved one ("123" then encodes as other ids), silently. Encodings are compared,
    not the components' JSON: a Hub tokenizer's own class may spell the same components differently. None when they
    agree."""
    from tokenizers import Tokenizer

    saved_file = folder / "tokenizer.json"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not saved_file.is_file() or backend is None:
        return None
    saved = Tokenizer.from_file(str(saved_file))
    got, want = backend.encode(PROBE, add_special_tokens=False).ids, saved.encode(PROBE, add_special_tokens=False).ids
    if got == want:
        return None
    name = type(tokenizer).__name__
    return Problem(f"the tokenizer loaded from {folder} ({name}, chosen by transformers from the model type) is not "
                   f"the one saved there: it encodes {PROBE!r} as {len(got)} ids, the saved one as {len(want)}",
                   "--model_name_or_path", f"pass --tokenizer saved to train with the saved tokenizer.json, or "
                   f"--tokenizer auto to take {name} (what AutoTokenizer gives every user of this folder)")


def source(model_name_or_path: str) -> str:
    """What from_pretrained is given: a local folder as its absolute path, which the loaded model keeps as its
    name_or_path and peft writes into the adapter's adapter_config.json (a relative one would name another folder,
    or none, wherever the adapter is loaded from outside the launch's directory); a Hub id as it is."""
    folder = Path(model_name_or_path)
    return str(folder.resolve()) if folder.is_dir() else model_name_or_path


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
DIGEST_SAMPLES, DIGEST_BLOCK = 16, 1 << 16  # blocks read per weights file, spread over it, and their size


def weights_digest(model_name_or_path: str) -> str:
    """A digest of the weights a local folder holds (every weights file's name, size and DIGEST_SAMPLES blocks spread
    over it: a megabyte read per file, whatever the model's size, and any retrained or requantised weights differ in
    most blocks); "" for a Hub id. What a LoRA run's checkpoint records of the frozen base that a resume loads again
    from the folder (trainkit/run/checkpoint.py's resume_problems)."""
    import xxhash

    folder = Path(model_name_or_path)
    if not folder.is_dir():
        return ""
    digest = xxhash.xxh3_64()
    for file in sorted(f for f in folder.iterdir() if f.suffix in WEIGHT_SUFFIXES):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as f:
            for i in range(DIGEST_SAMPLES):
                f.seek(max(0, size - DIGEST_BLOCK) * i // (DIGEST_SAMPLES - 1))
                digest.update(f.read(DIGEST_BLOCK))
    return digest.hexdigest()


def text_config(config: Any) -> Any:
    """A transformers config's language model part (a vision-language model nests it), or the config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


# What a folder holds where save_pretrained wrote a tokenizer (a fast one's file, or a slow one's vocabulary)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def load(what: str, cfg: Any, from_pretrained: Callable[..., Any]) -> Any:
    """from_pretrained(cfg.model_name_or_path) with the recipe's safety settings (trust_remote_code; allow_pickle
    where the caller passes it on); a failure is a config problem naming the model and the fix."""
    where = f"--model_name_or_path {cfg.model_name_or_path}"
    folder = Path(cfg.model_name_or_path).expanduser()
    if what == "tokenizer" and folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        # transformers would guess a slow tokenizer class from the config and ask for sentencepiece
        raise ConfigError([Problem(f"{folder} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})", where,
                                   "save the model's tokenizer beside it (tokenizer.save_pretrained(folder)), as a "
                                   "run's final/ holds it")])
    try:
        return from_pretrained(source(cfg.model_name_or_path), trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        said = " ".join(str(e).split())
        local = Path(cfg.model_name_or_path).is_dir()
        if "trust_remote_code" in said:
            fix = "pass --trust_remote_code true if you trust the code that comes with it"
        elif "attention implementation" in said or "attn_implementation" in said:
            fix = "pass an --attn_implementation the model supports, or none (its own default)"
        elif "safetensors" in said.lower() and not cfg.allow_pickle and not local:
            fix = "pass --allow_pickle true to read pytorch_model.bin (it unpickles the file)"
        elif local:
            fix = "check the folder (from_pretrained's layout: config.json, the weights, the tokenizer's files)"
        else:
            fix = "check the Hub id and the network (a Hub id downloads once into HF_HOME)"
        said = said if len(said) < 400 else said[:400] + " ..."
        raise ConfigError([Problem(f"transformers cannot load the {what}: {type(e).__name__}: {said}", where,
                                   fix)]) from None
