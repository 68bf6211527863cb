"""The import layers of DESIGN.md ("Layers"), checked by reading every module's imports.

Imports point down only: dashboards/ over circuits/ over probes/ over kvnotes/; inside kvnotes the
engine stands under the benches, the serving code and the analysis framework, and only the CLI (the
one composition root) may reach upward. Both module-level and function-level imports count (a lazy
import is still a dependency); imports under `if TYPE_CHECKING:` do not (they never run). No two
modules may import each other, and module-level imports may form no cycle.
"""

from __future__ import annotations

import ast
import graphlib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvnotes", "probes", "circuits", "dashboards")
COMPOSITION_ROOT = "kvnotes.cli"
# each package may not import the packages listed against it
UPWARD = {
    "kvnotes": ("probes", "circuits", "dashboards"),
    "probes": ("circuits", "dashboards"),
    "circuits": ("dashboards",),
}
ENGINE = (
    "kvnotes.engine",
    "kvnotes.models",
    "kvnotes.notebook",
    "kvnotes.ops",
    "kvnotes.rope",
    "kvnotes.hooks",
    "kvnotes.prompt",
    "kvnotes.metrics",
    "kvnotes.types",
    "kvnotes.errors",
)
ABOVE_ENGINE = ("kvnotes.bench", "kvnotes.serving", "kvnotes.analysis")


@dataclass(frozen=True)
class Import:
    """One import statement's resolved project module, where it stands and whether it runs at import."""

    module: str  # the importing module
    path: str  # its file, relative to the root
    line: int
    target: str  # the imported project module
    top_level: bool  # False inside a function body


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest project module that `name` starts with (`kvnotes.ops.splice` -> `kvnotes.ops`)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The project modules one import statement loads (`from pkg import sub` names the submodule)."""
    if isinstance(node, ast.Import):
        found = {_resolve(alias.name, modules) for alias in node.names}
        return {t for t in found if t}
    base = node.module or ""
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    found = set()
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        found.add(sub if sub in modules else _resolve(base, modules))
    return {t for t in found if t}


def _imports_of(root: Path, path: Path, modules: set[str]) -> list[Import]:
    module = _module_name(root, path)
    is_package = path.name == "__init__.py"
    rel = path.relative_to(root).as_posix()
    found: list[Import] = []

    def visit(node: ast.AST, top_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:
                    visit_one(sub, top_level)
                continue
            visit_one(child, top_level)

    def visit_one(child: ast.AST, top_level: bool) -> None:
        if isinstance(child, ast.Import | ast.ImportFrom):
            for target in sorted(_targets(child, module, is_package, modules)):
                if target != module:
                    found.append(Import(module, rel, child.lineno, target, top_level))
            return
        inner = top_level and not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        visit(child, inner)

    visit(ast.parse(path.read_text(), filename=str(path)), True)
    return found


def collect_imports(root: Path) -> list[Import]:
    """Every project import in the packages under `root`, resolved to the module it loads."""
    files = sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py") if "__pycache__" not in p.parts)
    modules = {_module_name(root, p) for p in files}
    return [imp for path in files for imp in _imports_of(root, path, modules)]


def _layer_violation(imp: Import) -> str | None:
    """Why this import points upward, or None when it is allowed."""
    if imp.module == COMPOSITION_ROOT:
        return None
    package = imp.module.split(".")[0]
    if any(_within(imp.target, above) for above in UPWARD.get(package, ())):
        return f"{package}/ imports {imp.target.split('.')[0]}/"
    in_engine = any(_within(imp.module, e) for e in ENGINE)
    if in_engine and any(_within(imp.target, above) for above in ABOVE_ENGINE):
        return "the engine imports what stands on it"
    if _within(imp.target, "kvnotes.bench") and not _within(imp.module, "kvnotes.bench"):
        return "only kvnotes/cli.py and kvnotes/bench/ may import kvnotes.bench"
    return None


def _cycles(imports: list[Import]) -> list[tuple[str, ...]]:
    """Cycles among module-level imports: graphlib finds one, it is broken, and the search goes on."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.top_level:
            graph.setdefault(imp.module, set()).add(imp.target)
    cycles = []
    while True:
        try:
            tuple(graphlib.TopologicalSorter(graph).static_order())
            return cycles
        except graphlib.CycleError as err:
            # args[1] lists the cycle with each node a predecessor of (imported by) the next one;
            # reversed, each module imports the one after it
            cycle = tuple(reversed(err.args[1]))
            cycles.append(cycle)
            graph[cycle[0]].discard(cycle[1])  # break this cycle so the next search finds another


def layer_violations(root: Path) -> list[str]:
    """Every breach of the import layers under `root`, one line each (file:line: what and why)."""
    imports = collect_imports(root)
    found = []
    for imp in imports:
        why = _layer_violation(imp)
        if why:
            found.append(f"{imp.path}:{imp.line}: {imp.module} imports {imp.target} ({why})")
    pairs = {(imp.module, imp.target): imp for imp in imports}
    for (a, b), imp in sorted(pairs.items()):
        if a < b and (b, a) in pairs:
            back = pairs[(b, a)]
            found.append(f"{imp.path}:{imp.line} and {back.path}:{back.line}: {a} and {b} import each other")
    for cycle in _cycles(imports):
        found.append("module-level import cycle: " + " -> ".join(cycle))
    return found


def test_the_tree_keeps_its_layers():
    found = layer_violations(ROOT)
    assert not found, "imports that break DESIGN.md's layers:\n" + "\n".join(found)


def _write(root: Path, rel: str, text: str = "") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_checker_names_an_upward_import_and_a_mutual_one(tmp_path):
    for pkg in PACKAGES:
        _write(tmp_path, f"{pkg}/__init__.py")
    _write(tmp_path, "kvnotes/engine/__init__.py")
    _write(tmp_path, "kvnotes/engine/run.py", "def f():\n    from probes import causal\n")
    _write(tmp_path, "probes/causal.py", "from kvnotes.engine import run\n")
    _write(tmp_path, "probes/a.py", "from . import b\n")
    _write(tmp_path, "probes/b.py", "import probes.a\n")
    _write(
        tmp_path, "probes/ok.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import circuits\n"
    )
    _write(tmp_path, "kvnotes/cli.py", "import dashboards\nimport kvnotes.bench\n")
    _write(tmp_path, "kvnotes/bench/__init__.py")
    found = layer_violations(tmp_path)
    text = "\n".join(found)
    assert (
        "kvnotes/engine/run.py:2: kvnotes.engine.run imports probes.causal (kvnotes/ imports probes/)" in text
    )
    assert "probes.a and probes.b import each other" in text
    assert "module-level import cycle: " in text and "probes.a" in text
    # the mutual pair engine.run <-> probes.causal is named too; the TYPE_CHECKING import and the CLI are not
    assert "kvnotes.engine.run and probes.causal import each other" in text
    assert "probes/ok.py" not in text and "kvnotes/cli.py" not in text
    assert len(found) == 4, text
