"""The code stays as pyproject.toml's ruff settings say (line length, import order, no unused or undefined names), and
readable in pieces: train.py at most 300 lines, no function over 60, no import circle among the modules."""

from __future__ import annotations

import ast
import subprocess
import sys

from conftest import ROOT


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_train_py_reads_in_one_sitting_and_no_function_is_over_60_lines():
    """Modules are split where a concept ends, not at a count of lines (a cap cut six modules where no concept ended);
    train.py alone has a length: the whole loop, read in one sitting."""
    files = [ROOT / "train.py", *sorted((ROOT / "trainkit").rglob("*.py")), *sorted((ROOT / "recipes").glob("*.py"))]
    long = [f"train.py: {files[0].read_text().count(chr(10))} lines"] if files[0].read_text().count("\n") > 300 else []
    long += [f"{f.relative_to(ROOT)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
             for f in files for node in ast.walk(ast.parse(f.read_text()))
             if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 60]
    assert len(files) > 40 and not long, "\n".join(long)


def test_no_import_circle_among_the_modules():
    """A module-level import (a type-only one too: a reader follows it as well), or the package __init__ it runs,
    never leads back to where it started:
    the step imports no strategy (engines meet its StepEngine protocol), a strategy's base imports its engine and not
    the other way, a checkpoint format reads its engine through a protocol."""
    modules = {"train" if f.name == "train.py" else ".".join(f.relative_to(ROOT).with_suffix("").parts)
               .removesuffix(".__init__"): f for f in [ROOT / "train.py", *sorted((ROOT / "trainkit").rglob("*.py"))]}
    graph = {}
    for name, path in modules.items():
        body = ast.parse(path.read_text()).body
        found = [n for node in body for n in ([node, *ast.walk(node)] if isinstance(node, ast.If) else [node])]
        imported = {f"{n.module}.{a.name}" if f"{n.module}.{a.name}" in modules else n.module
                    for n in found if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("trainkit")
                    for a in n.names}
        # importing a.b.c runs the packages' __init__ first (a, a.b): an edge to each, as Python takes it
        parents = {".".join(m.split(".")[:k]) for m in imported for k in range(1, m.count(".") + 1)}
        graph[name] = (imported | parents) & set(modules) - {name}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and not seen.add(n) and reaches(n, goal, seen)) for n in graph[start])

    circles = sorted(name for name in graph if reaches(name, name, set()))
    assert not circles, circles
