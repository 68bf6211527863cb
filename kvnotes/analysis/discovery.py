"""Finding the analyses: no list of modules is kept by hand.

The built-in packages (`BUILTIN`: probes, circuits, kvnotes.bench, and the module that declares
the analyses behind `kvnotes verify` and `kvnotes sweep`) and any package another
distribution names in the `kvnotes.analyses` entry-point group (one entry point per package) are
walked, subpackages included, and every module whose source declares an analysis (`@analysis(` or
`register(Analysis(`) is imported, which registers it. A new module dropped into `probes/` is found
without an edit to any `__init__.py`; modules that declare none (helpers, workers run in other
environments) are not imported, so finding the analyses costs no more than importing them.

This module imports nothing of kvnotes: `kvnotes.cli_spec` reads `packages()` without the registry.

    from kvnotes.analysis.discovery import packages, declaring
    packages()                  # ['kvnotes.analysis.model_commands', 'probes', 'circuits', ...]
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable
from pathlib import Path

BUILTIN = ("kvnotes.analysis.model_commands", "probes", "circuits", "kvnotes.bench")
GROUP = "kvnotes.analyses"
MARKERS = ("@analysis(", "register(Analysis(")


def packages() -> list[str]:
    """The packages analyses are found in: the built-in ones, then each entry point's of `GROUP`
    (by entry-point name) that is not inside one already listed."""
    from importlib.metadata import entry_points

    out = list(BUILTIN)
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        name = ep.value.split(":")[0].strip()
        if not any(name == p or name.startswith(p + ".") for p in out):
            out.append(name)
    return out


def _files(paths: Iterable[str], prefix: str) -> list[tuple[str, Path]]:
    """(module name, source file) of every module under `paths`, subpackages walked without
    importing them; a module whose source is not a .py file gets the directory it was found in."""
    out: list[tuple[str, Path]] = []
    for info in sorted(pkgutil.iter_modules(list(paths)), key=lambda i: i.name):
        where = Path(getattr(info.module_finder, "path", "."))
        name = prefix + info.name
        if info.ispkg:
            out.append((name, where / info.name / "__init__.py"))
            out += _files([str(where / info.name)], name + ".")
        else:
            out.append((name, where / f"{info.name}.py"))
    return out


def declaring(package: str) -> list[str]:
    """The modules of `package` (itself included) whose source declares an analysis, in name order;
    the package is imported (its `__init__` registers its sections), its modules are not."""
    pkg = importlib.import_module(package)
    found = declaring_files(package, Path(pkg.__file__ or "."), getattr(pkg, "__path__", []))
    return [name for name, _ in found]


def declaring_files(package: str, source: Path, paths: Iterable[str]) -> list[tuple[str, Path]]:
    """(module name, source file) of each module that declares an analysis: `package` itself (its
    source file `source`) and every module under `paths` (its search locations), in name order."""
    found = [(package, source), *_files(paths, package + ".")]
    return [(name, path) for name, path in found if _declares(path)]


def _declares(path: Path) -> bool:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):  # not a source file (compiled, zipped): import it to see
        return True
    return any(m in text for m in MARKERS)


def load_all() -> list[str]:
    """Import every module that declares an analysis, package by package; the modules imported."""
    out = []
    for package in packages():
        for name in declaring(package):
            importlib.import_module(name)
            out.append(name)
    return out
