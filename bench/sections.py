"""BENCHMARKS.md, written section by section: each bench script owns the text between its two markers."""

from __future__ import annotations

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"


def replace_section(section: str, start: str, end: str, path: Path = BENCHMARKS) -> None:
    """Put `section` (which begins with the `start` marker and ends with the `end` one) where the file has those
    markers, or at its end the first time; every other section stays as it is."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\nEach section says the command that produced it.\n"
    if start in text:
        text = text[:text.index(start)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)
