"""BENCHMARKS.md, written section by section: each bench script owns the text between its two markers and its chart."""

from __future__ import annotations

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
IMAGES = BENCHMARKS.parent / "docs" / "images"  # each section's chart


def replace_section(section: str, start: str, end: str, path: Path = BENCHMARKS) -> None:
    """Put `section` (which begins with the `start` marker and ends with the `end` one) where the file has those
    markers, or at its end the first time; every other section stays as it is."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\nEach section says the command that produced it.\n"
    if start in text:
        text = text[:text.index(start)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def bar_chart(name: str, title: str, unit: str, series: dict[str, dict[str, float]],
              goal: tuple[float, str] | None = None, value: str = "{:,.0f}") -> str:
    """docs/images/<name>.png: a horizontal bar per row and series (`series[label][row]`; a row a series lacks gets
    no bar), each labelled with its `value` format, and an optional goal line; returns the Markdown line that shows
    it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(dict.fromkeys(row for values in series.values() for row in values))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(9, max(2.4, 1.2 + 0.3 * len(rows) * len(series))))
    for i, (label, values) in enumerate(series.items()):
        ys = [j + i * width for j, row in enumerate(rows) if row in values]
        bars = ax.barh(ys, [values[row] for row in rows if row in values], width, label=label)
        ax.bar_label(bars, fmt=value, fontsize=7, padding=2)
    ax.set_yticks([j + (len(series) - 1) * width / 2 for j in range(len(rows))], rows, fontsize=8)
    ax.invert_yaxis()
    if goal:
        ax.axvline(goal[0], color="black", linestyle=":", label=goal[1])
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=10)
    if len(series) > 1 or goal:
        ax.legend(fontsize=8)
    fig.tight_layout()
    png = IMAGES / f"{name}.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return f"![{title}]({png.relative_to(BENCHMARKS.parent)})"
