"""No function in the library is longer than a screen and a half (100 lines): the house reads top to
bottom (docs/architecture.md). A function that grows past it is split into named steps."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvnotes", "probes", "circuits", "dashboards")
MOST = 100


def long_functions(root: Path = ROOT, most: int = MOST) -> list[str]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > most:
                        out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_is_longer_than_100_lines():
    assert long_functions() == []


def test_the_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MOST))
    (tmp_path / "circuits").mkdir()
    (tmp_path / "circuits" / "long.py").write_text(f"def grown():\n{body}\n")
    assert long_functions(tmp_path) == [f"{Path('circuits', 'long.py')}:1 grown ({MOST + 1} lines)"]
