"""Lazy re-exports for a package's `__init__`: each name is imported from its module on first use
(PEP 562), so importing the package itself costs nothing (no torch for `kvnotes --help`).

    __all__, __getattr__, __dir__ = lazy_exports(__name__, {"KVModel": "kvnotes.models.model"})
"""

from __future__ import annotations

import importlib
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
