"""The layout stays readable: no Python file over 600 lines, no function over 80 lines (its docstring aside)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("fastckpt", "benchmarks", "tests", "examples", "scripts")
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def python_files() -> list[Path]:
    return sorted(path for folder in FOLDERS for path in (ROOT / folder).rglob("*.py"))


def body_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The function's lines from its signature (or, after a docstring, from the first statement) to its end."""
    first = function.body[0]
    has_docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    start = first.end_lineno + 1 if has_docstring and isinstance(first.value.value, str) else function.lineno
    return function.end_lineno - start + 1


def test_the_scan_finds_the_package_and_measures_a_function():
    assert len(python_files()) > 100
    source = 'def f(x):\n    """Doc\n    string."""\n    y = x\n    return y\n'
    assert body_lines(ast.parse(source).body[0]) == 2


def test_no_python_file_is_over_600_lines():
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in python_files()}
    long = {name: n for name, n in lines.items() if n > MAX_FILE_LINES}
    assert not long, f"split these by theme: {long}"


def test_no_function_is_over_80_lines():
    long = {}
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and body_lines(node) > MAX_FUNCTION_LINES:
                long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = body_lines(node)
    assert not long, f"split these where they hold several steps: {long}"
