"""A static check for exact float comparisons in the tests and the doctests.

`x == 0.0` on a computed float passes or fails with the last bits of the arithmetic, which change
with the attention path, the thread count and the BLAS kernel: it is green on one machine and red on
the next. The check flags `==` / `!=` where one side is a float literal, or an integer literal
beside something the project types as a float (a result field annotated `float`, an estimate's
`.mean`). A comparison that is exact by construction (a fraction of agreeing decisions, a slot that
is copied, an invariant that promises 0)
stays, with a comment on its line or on the line above: `# exact: <why>`.
"""

from __future__ import annotations

import ast
import doctest
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvnotes", "probes", "circuits", "dashboards")
MARK = "# exact:"
ALWAYS_FLOAT = {"mean", "recovery", "ld", "ld_patched", "ld_old", "ld_new", "logit_diff"}
_FLOAT_TEXT = re.compile(r"(?<![\w.])-?\d+\.\d+(?:e-?\d+)?")


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


def float_fields(roots: tuple[str, ...] = PACKAGES) -> frozenset[str]:
    """Names the project annotates as floats in its classes (`recovery: float`, `ld_old: float | None`)."""
    names = set(ALWAYS_FLOAT)
    for root in roots:
        for f in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.ClassDef):
                    for item in node.body:
                        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                            if re.fullmatch(r"float( \| None)?", ast.unparse(item.annotation)):
                                names.add(item.target.id)
    return frozenset(names)


def _float_literal(node: ast.expr) -> bool:
    """A float written out: `0.5`, `-1.0`, or a list or tuple holding one (`[0.25, 1.0]`)."""
    if isinstance(node, ast.List | ast.Tuple):
        return any(_float_literal(e) for e in node.elts)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        node = node.operand
    return isinstance(node, ast.Constant) and isinstance(node.value, float)


def _int_literal(node: ast.expr) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) is int


def _last_name(node: ast.expr) -> str | None:
    """The name a value is read by: `r.recovery` → recovery, `est["x"].mean` → mean, `ld` → ld."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def _exact(a: ast.expr, b: ast.expr, floats: frozenset[str]) -> bool:
    """Whether `a == b` compares a computed float exactly."""
    for x, y in ((a, b), (b, a)):
        if _float_literal(x) and not (_float_literal(y) or _int_literal(y)):
            return True
        if _int_literal(x) and _last_name(y) in floats:
            return True
    return False


def scan_source(source: str, path: str, floats: frozenset[str], first_line: int = 1) -> Iterator[Finding]:
    """Every unmarked exact float comparison in `source` (Python code)."""
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for op, a, b in zip(node.ops, operands, operands[1:]):
            if isinstance(op, ast.Eq | ast.NotEq) and _exact(a, b, floats):
                above = node.lineno - 2  # a comment line of its own just above counts too
                first = above if above >= 0 and lines[above].lstrip().startswith("#") else node.lineno - 1
                span = lines[first : (node.end_lineno or node.lineno)]
                if not any(MARK in line for line in span):
                    yield Finding(path, first_line + node.lineno - 1, ast.unparse(node))
                break


def scan_doctests(source: str, path: str, floats: frozenset[str]) -> Iterator[Finding]:
    """The same in a module's docstring examples, and examples whose expected output is a float that
    nothing rounds (`>>> r.recovery` then `0.9999999`)."""
    parser = doctest.DocTestParser()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node, clean=False)
        if not doc:
            continue
        start = 1 if isinstance(node, ast.Module) else node.body[0].lineno
        for ex in parser.get_examples(doc):
            line = start + ex.lineno
            try:
                yield from scan_source(ex.source, path, floats, first_line=line)
            except SyntaxError:
                continue
            rounded = "round(" in ex.source or ":." in ex.source or MARK in ex.source
            if _FLOAT_TEXT.search(ex.want) and not rounded:
                shown = f"{ex.source.strip()} -> {ex.want.strip()}"
                yield Finding(path, line, f"{shown} (unrounded float output)")


def scan_tree(root: Path = ROOT) -> list[Finding]:
    """Every unmarked exact float comparison in tests/ and in the packages' doctests."""
    floats = float_fields()
    found: list[Finding] = []
    for f in sorted((root / "tests").rglob("*.py")):
        found += scan_source(f.read_text(), str(f.relative_to(root)), floats)
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            found += scan_doctests(f.read_text(), str(f.relative_to(root)), floats)
    return found
