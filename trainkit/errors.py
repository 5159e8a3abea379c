"""The problem format and the two error types, and the failures named as one of them. Imported by every module;
imports nothing of the project."""

from __future__ import annotations

import errno
import os
import re
import shutil
import sys
import sysconfig
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# Where code that is not the user's lives, by the name an error gives it: the runner, the standard library, installed
# packages (named by their own folder there); torch.compile's generated code is added when it exists (_origin).
_RUNNER = (str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent / "train.py"))
_STDLIB = tuple({str(Path(sysconfig.get_paths()[k]).resolve()) for k in ("stdlib", "platstdlib")})
_PACKAGES = tuple({str(Path(sysconfig.get_paths()[k]).resolve()) for k in ("purelib", "platlib")})


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with what the user asked for, printed as `<what> (<where>): <fix>`.

    `where` names the flag, file or key the value came from, so the user knows what to edit.
    """

    what: str
    where: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what} ({self.where}): {self.fix}"


class ConfigError(Exception):
    """Problems found before training: every one of them, not only the first. Exit status 2."""

    exit_status = 2

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("\n".join(map(str, problems)))
        self.problems = list(problems)

    def lines(self) -> list[str]:
        return [str(p) for p in self.problems]


class TrainingError(Exception):
    """The run cannot go on (a non-finite loss, a lost peer); says what happened and what to do. Exit status 1."""

    exit_status = 1

    def __init__(self, what: str, fix: str) -> None:
        super().__init__(f"{what}: {fix}")
        self.what, self.fix = what, fix

    def lines(self) -> list[str]:
        return [str(self)]


# How a run that ended goes on, once its cause is removed: the advice of every error that ends a run mid-way
CONTINUE = ("run the same command with --resume auto (it continues from the last complete checkpoint, which is "
            "intact, or starts anew where none was written yet)")


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """A write to `path` (a file, or the folder a writer fills) that fails ends the run naming the path and the cause
    (a full disk said as such, trainkit/errors.py's write_failure) and how to go on: every writer of a run ends alike
    (metrics, trackers, the final export, the resolved config; checkpoints name their intact predecessor)."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as e:
        raise write_error(e, path) from None


def write_error(error: BaseException, path: Path) -> TrainingError:
    """The error of a failed write under `path` (the very file named where the error knows it)."""
    where = Path(error.filename) if isinstance(error, OSError) and error.filename else path
    what, fix = write_failure(error, where)
    return TrainingError(f"could not write {where}: {what}", f"{fix}, then {CONTINUE}")


def disk_full(error: BaseException) -> bool:
    """Whether the error is a write that the disk (or a quota) refused: said as such wherever it surfaces, even in a
    library that takes every error for bad input."""
    return getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT)


def write_failure(error: BaseException, where: Path) -> tuple[str, str]:
    """What went wrong when writing under `where`, in words, and what to do first. A full disk is said as such
    (torch.save's own message for it is "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598");
    freeing space would not help a folder that cannot be written."""
    existing = next(p for p in (where, *where.absolute().parents) if p.exists())
    free = shutil.disk_usage(existing).free
    # safetensors' SafetensorError is no OSError: its message carries the code ("I/O error: ... (os error 28)")
    code = getattr(error, "errno", None) or next((int(n) for n in re.findall(r"\(os error (\d+)\)", str(error))), None)
    if code == errno.ENOSPC or free < 64 * 1024 ** 2:
        return f"the disk is full ({free / 1024 ** 2:.1f} MiB free on {existing})", "free space"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return said(error), f"make {existing} writable"
    return said(error), "remove the cause"


def said(error: BaseException) -> str:
    """An exception in one line: its type and the last line of its message (torch.distributed.checkpoint puts each
    rank's whole traceback into its message; the cause is the last line)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1][:300] if lines else ''}"


def out_of_memory(error: BaseException) -> TrainingError | None:
    """The error to report when a device or the host ran out of memory, else None."""
    import torch

    text = str(error)
    if not (isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in text):
        return None
    return TrainingError(
        f"rank {os.environ.get('RANK', '0')} ran out of memory ({said(error)})",
        "a smaller --batch_size with a larger --grad_accum keeps the global batch and needs less; so does a config "
        "that shards more: python train.py --recipe ... --estimate --device_memory 80GB names the cheapest that fits "
        "(its model state; activations come on top)")


def _origin(filename: str) -> str | None:
    """Who wrote the code in this file, as an error names it; None for the user's own code (the recipe, or a module of
    theirs that it imports) and for code that is not in a file."""
    path = str(Path(filename).resolve())
    if path.startswith(_PACKAGES):  # site-packages/<package>/...: the package's name
        return Path(path).relative_to(next(p for p in _PACKAGES if path.startswith(p))).parts[0].removesuffix(".py")
    if path.startswith(_STDLIB):
        return "the standard library"
    if path.startswith(_RUNNER):
        return "the runner"
    inductor = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if inductor is not None and path.startswith(str(Path(inductor.cache_dir()).resolve())):
        return "torch.compile's generated code"
    return None if Path(filename).is_file() else "generated code"


def failure_in_user_code(error: BaseException) -> ConfigError | None:
    """A ConfigError naming where the user's code raised `error`, or called the library that raised it; None when no
    frame of the user's code is on the way (an error of the runner's or of a library's own: its traceback is the
    report)."""
    frames = traceback.extract_tb(error.__traceback__)
    origins = [_origin(f.filename) for f in frames]
    users = [f for f, origin in zip(frames, origins, strict=True) if origin is None]
    if not users:
        return None
    last = users[-1]
    raised_in = "the recipe's code" if origins[-1] is None else f"{origins[-1]}, called by the recipe's code"
    calls = " <- ".join(f"{f.filename}:{f.lineno} in {f.name}" for f in reversed(users[:-1]))
    return ConfigError([Problem(
        f"{said(error)}, raised in {raised_in}", f"{last.filename}:{last.lineno} in {last.name}: {last.line}",
        "see what it does there" + (f" (called from {calls})" if calls else "")
        + "; TRAINKIT_TRACEBACK=1 shows the whole traceback")])
