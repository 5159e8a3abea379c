"""The problem format and the two error types. Imported by every module; imports nothing of the project."""

from __future__ import annotations

import errno
import shutil
from dataclasses import dataclass
from pathlib import Path


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


def write_failure(error: BaseException, where: Path) -> str:
    """What went wrong when writing under `where`, in words; a full disk is said as such (torch.save's own message
    for it is "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")."""
    existing = next(p for p in (where, *where.absolute().parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if getattr(error, "errno", None) == errno.ENOSPC or free < 64 * 1024 ** 2:
        return f"the disk is full ({free / 1024 ** 2:.1f} MiB free on {existing})"
    return said(error)


def said(error: BaseException) -> str:
    """An exception in one line: its type and the last line of its message (torch.distributed.checkpoint puts each
    rank's whole traceback into its message; the cause is the last line)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1][:300] if lines else ''}"
