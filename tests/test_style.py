"""The code stays as pyproject.toml's ruff settings say (line length, import order, no unused or undefined names), and
readable in pieces: no module of the package, train.py or a recipe over 400 lines, no function over 60."""

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
