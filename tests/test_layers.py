"""The import layers of docs/architecture.md, checked by reading every module's imports.

Imports point down only: dashboards/ over circuits/ over probes/ over kvnotes/. Inside kvnotes the
layers are, from the bottom: errors, types and the lazy re-exports; the models (`kvnotes.models`:
what a model is, whatever runs it); the engine (`kvnotes.engine` with each backend and its model
class, and the notebook operations built on `run`); the task definitions; the loaders
(`kvnotes.zoo`, which build each backend's model class); then everything else (benches, serving, the
analysis framework). Only the CLI (the one composition root) may reach upward.

Every import counts, wherever it stands: at module level, inside a function (a lazy import is still
a dependency) and under `if TYPE_CHECKING:` (a type is a dependency too; a models -> engine import
made only for typing is still the models knowing the engine). Importing `a.b.c` also runs the
`__init__` of `a` and `a.b` first, so it counts as importing those packages, except a package the
importer is itself inside (its `__init__` is already running). Over all of these the import graph
must have no cycle.
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
# kvnotes' own layers, lowest first; a module may import only its own layer and those below it
# (every kvnotes module not listed stands above them all)
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("errors, types and the lazy re-exports", ("kvnotes.errors", "kvnotes.types", "kvnotes.lazy")),
    ("models", ("kvnotes.models",)),
    (
        "engine",
        (
            "kvnotes.engine",
            "kvnotes.notebook",
            "kvnotes.ops",
            "kvnotes.batches",
            "kvnotes.rope",
            "kvnotes.hooks",
            "kvnotes.prompt",
            "kvnotes.metrics",
            "kvnotes.capture",
        ),
    ),
    ("tasks", ("kvnotes.tasks",)),
    ("zoo (the loaders)", ("kvnotes.zoo",)),
)
ABOVE = (len(LAYERS), "the rest of kvnotes")


@dataclass(frozen=True)
class Import:
    """One import statement's resolved project module, where it stands and how it runs."""

    module: str  # the importing module
    path: str  # its file, relative to the root
    line: int
    target: str  # the imported project module
    kind: str  # "module" (runs at import), "lazy" (inside a function) or "typing" (under TYPE_CHECKING)


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
    """The project modules one import statement loads (`from pkg import sub` names the submodule),
    with the packages whose `__init__` runs on the way there (not those `module` is inside)."""
    if isinstance(node, ast.Import):
        found = {_resolve(alias.name, modules) for alias in node.names}
    else:
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
    out = set()
    for target in filter(None, found):
        parts = target.split(".")
        for end in range(1, len(parts) + 1):
            step = ".".join(parts[:end])
            if step in modules and (step == target or not _within(module, step)):
                out.add(step)
    return out


def _imports_of(root: Path, path: Path, modules: set[str]) -> list[Import]:
    module = _module_name(root, path)
    is_package = path.name == "__init__.py"
    rel = path.relative_to(root).as_posix()
    found: list[Import] = []

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.body:
                    visit_one(sub, "typing")
                for sub in child.orelse:
                    visit_one(sub, kind)
                continue
            visit_one(child, kind)

    def visit_one(child: ast.AST, kind: str) -> None:
        if isinstance(child, ast.Import | ast.ImportFrom):
            for target in sorted(_targets(child, module, is_package, modules)):
                if target != module:
                    found.append(Import(module, rel, child.lineno, target, kind))
            return
        function = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        visit(child, "lazy" if function and kind == "module" else kind)

    visit(ast.parse(path.read_text(), filename=str(path)), "module")
    return found


def collect_imports(root: Path) -> list[Import]:
    """Every project import in the packages under `root`, resolved to the modules it loads."""
    files = sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py") if "__pycache__" not in p.parts)
    modules = {_module_name(root, p) for p in files}
    return [imp for path in files for imp in _imports_of(root, path, modules)]


def _layer(module: str) -> tuple[int, str]:
    """(rank, name) of a kvnotes module's layer; every unlisted module stands above them all."""
    for rank, (name, prefixes) in enumerate(LAYERS):
        if any(_within(module, p) for p in prefixes):
            return rank, name
    return ABOVE


def _layer_violation(imp: Import) -> str | None:
    """Why this import points upward, or None when it is allowed."""
    if imp.module == COMPOSITION_ROOT:
        return None
    package = imp.module.split(".")[0]
    if any(_within(imp.target, above) for above in UPWARD.get(package, ())):
        return f"{package}/ imports {imp.target.split('.')[0]}/"
    if package == "kvnotes" and _within(imp.target, "kvnotes"):
        (mine, name), (theirs, their_name) = _layer(imp.module), _layer(imp.target)
        if theirs > mine:
            return f"the {name} layer imports the {their_name} layer above it"
    if _within(imp.target, "kvnotes.bench") and not _within(imp.module, "kvnotes.bench"):
        return "only kvnotes/cli.py and kvnotes/bench/ may import kvnotes.bench"
    return None


def _cycles(imports: list[Import]) -> list[tuple[str, ...]]:
    """Cycles among all imports (module-level, lazy, typing): graphlib finds one, it is broken, and
    the search goes on."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
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
            found.append(f"{imp.path}:{imp.line}: {imp.module} imports {imp.target} ({imp.kind}; {why})")
    for cycle in _cycles(imports):
        found.append("import cycle: " + " -> ".join(cycle))
    return found


def test_the_tree_keeps_its_layers():
    found = layer_violations(ROOT)
    assert not found, "imports that break docs/architecture.md's layers:\n" + "\n".join(found)


def test_the_scan_sees_every_kind_of_import():
    """The scan reads the real tree's type-checking and lazy imports too (a scan that skipped them
    would pass any tree)."""
    kinds = {imp.kind for imp in collect_imports(ROOT)}
    assert kinds == {"module", "lazy", "typing"}, kinds


def _write(root: Path, rel: str, text: str = "") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _tree(root: Path) -> None:
    """A small tree in the real layout: a neutral model, an engine that imports it, a loader above."""
    for pkg in PACKAGES:
        _write(root, f"{pkg}/__init__.py")
    _write(root, "kvnotes/errors.py")
    _write(root, "kvnotes/models/__init__.py")
    _write(root, "kvnotes/models/model.py", "from kvnotes.errors import *\n")
    _write(root, "kvnotes/engine/__init__.py", "from kvnotes.engine.table import backend_of\n")
    _write(root, "kvnotes/engine/table.py", "from kvnotes.models.model import *\n")
    _write(root, "kvnotes/zoo/__init__.py", "from kvnotes.engine import backend_of\n")


def test_a_clean_tree_passes(tmp_path):
    _tree(tmp_path)
    assert layer_violations(tmp_path) == []


def test_a_planted_models_to_engine_import_is_caught_even_for_typing(tmp_path):
    _tree(tmp_path)
    _write(
        tmp_path,
        "kvnotes/models/model.py",
        "from typing import TYPE_CHECKING\nfrom kvnotes.errors import *\n"
        "if TYPE_CHECKING:\n    from kvnotes.engine.table import Backend\n",
    )
    text = "\n".join(layer_violations(tmp_path))
    assert (
        "kvnotes/models/model.py:4: kvnotes.models.model imports kvnotes.engine.table "
        "(typing; the models layer imports the engine layer above it)" in text
    ), text
    # and the circle it closes (engine.table imports models.model), through the engine's __init__
    assert "import cycle: " in text and "kvnotes.models.model" in text, text


def test_a_planted_lazy_import_of_the_loaders_is_caught(tmp_path):
    _tree(tmp_path)
    _write(tmp_path, "kvnotes/engine/table.py", "def f():\n    from kvnotes.zoo import load_model\n")
    text = "\n".join(layer_violations(tmp_path))
    assert "kvnotes.engine.table imports kvnotes.zoo (lazy; the engine layer imports the zoo" in text, text


def test_a_planted_circle_through_a_package_init_is_caught(tmp_path):
    """`zoo.b` imports `zoo.a`, whose lazy import of the `zoo` package runs `zoo/__init__`, which
    imports `zoo.b`: a circle no single pair of modules shows."""
    _tree(tmp_path)
    _write(tmp_path, "kvnotes/zoo/__init__.py", "from kvnotes.zoo.b import load_model\n")
    _write(tmp_path, "kvnotes/zoo/a.py", "def f():\n    from kvnotes.zoo import load_model\n")
    _write(tmp_path, "kvnotes/zoo/b.py", "from kvnotes.zoo.a import f\n")
    text = "\n".join(layer_violations(tmp_path))
    assert "import cycle: " in text and "kvnotes.zoo.a" in text and "kvnotes.zoo.b" in text, text


def test_the_checker_names_an_upward_import_between_packages(tmp_path):
    _tree(tmp_path)
    _write(tmp_path, "kvnotes/engine/run.py", "def f():\n    from probes import causal\n")
    _write(tmp_path, "probes/causal.py", "from kvnotes.engine import run\n")
    _write(
        tmp_path,
        "probes/ok.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvnotes.zoo\n",
    )
    _write(tmp_path, "kvnotes/cli.py", "import dashboards\nimport kvnotes.bench\n")
    _write(tmp_path, "kvnotes/bench/__init__.py")
    found = layer_violations(tmp_path)
    text = "\n".join(found)
    assert (
        "kvnotes/engine/run.py:2: kvnotes.engine.run imports probes.causal (lazy; kvnotes/ imports probes/)"
        in text
    )
    assert "import cycle: " in text and "probes.causal" in text  # engine.run <-> probes.causal
    assert "probes/ok.py" not in text and "kvnotes/cli.py" not in text  # a downward import; the CLI


# what circuits/ may import from probes/: probe logic proper (the note map's top notes, the controls'
# matched slots, for scrubbing); the trials, options and effect statistics every analysis shares
# live in their own room below both, `kvnotes.analysis.trials`
CIRCUITS_FROM_PROBES = {("circuits.scrubbing", "probes.causal"), ("circuits.scrubbing", "probes.controls")}


def probe_imports_of_circuits(root: Path) -> set[tuple[str, str]]:
    """(circuits module, probes module) for every import of a probes module in circuits/."""
    return {
        (imp.module, imp.target)
        for imp in collect_imports(root)
        if _within(imp.module, "circuits") and _within(imp.target, "probes") and imp.target != "probes"
    }


def test_circuits_import_only_probe_logic_from_probes():
    found = probe_imports_of_circuits(ROOT)
    assert found <= CIRCUITS_FROM_PROBES, (
        f"circuits/ imports {sorted(found - CIRCUITS_FROM_PROBES)} from probes/: what every analysis "
        "shares (trials, options, effect statistics) belongs in kvnotes.analysis.trials"
    )
    assert len(CIRCUITS_FROM_PROBES) <= 2


def test_a_planted_import_of_the_shared_layer_through_probes_is_caught(tmp_path):
    _tree(tmp_path)
    _write(tmp_path, "probes/trials.py")
    _write(tmp_path, "circuits/heads.py", "from probes.trials import Trial\n")
    assert probe_imports_of_circuits(tmp_path) == {("circuits.heads", "probes.trials")}
