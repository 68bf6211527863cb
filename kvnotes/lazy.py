"""Lazy re-exports for a package's `__init__`: each name is imported from its module on first use
(PEP 562), so importing the package itself costs nothing (no torch for `kvnotes --help`).

    __all__, __getattr__, __dir__ = lazy_exports(__name__, {"KVModel": "kvnotes.models.model"})
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """`package`'s `__all__`, `__getattr__` and `__dir__` for names read from the modules `exports`
    maps them to; any other name is an AttributeError naming the package."""
    names = sorted(exports)
    table = dict(exports)

    def __getattr__(name: str) -> Any:
        if name in table:
            return getattr(importlib.import_module(table[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return list(names)

    return names, __getattr__, __dir__


def lazy_package(
    package: str, exports: Mapping[str, str]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """`lazy_exports` for a package whose exports include a name its own submodule has
    (`circuits.scrubbing`, the function, lives in `circuits/scrubbing.py`). Importing that submodule
    would bind the module over the name on the package; here the binding is skipped, so the name
    stays the exported object however the submodule was imported (`from package.sub import x` still
    reads the module from `sys.modules`). Call it from the package's `__init__`."""
    shadowed = {name for name, where in exports.items() if where == f"{package}.{name}"}

    class _Package(types.ModuleType):
        def __setattr__(self, name: str, value: Any) -> None:
            if (
                name in shadowed
                and isinstance(value, types.ModuleType)
                and value.__name__ == f"{package}.{name}"
            ):
                return  # the import system binding the submodule: the exported object keeps the name
            super().__setattr__(name, value)

    sys.modules[package].__class__ = _Package
    return lazy_exports(package, exports)
