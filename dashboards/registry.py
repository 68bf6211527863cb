"""Which panels draw which result. Panel modules register a function per analysis (by the name it
has in `kvnotes.analysis.registry`) or per section (a summary over several analyses' results); every
result, `verify` and a prompt's attribution included, is an analysis, so a result's panel is found
by its analysis's name alone. The panel modules are found, not listed: every module of this package
whose name ends in `_panels` (`panel_modules()`); `render` loads them (`load_panels`) and looks
them up; an analysis without a panel of its own gets the generic one (its parts as bars with CIs),
or its text table.

    from dashboards.registry import panel
    @panel("my_analysis")
    def my_panels(result, key):  # key: "order-cancel/probes"
        return [Panel(title=..., reading=..., figure=..., key=f"{key}/my_analysis")]
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from functools import cache

PanelFn = Callable  # (result, key) -> list[Panel]

PANELS: dict[str, PanelFn] = {}
SUMMARIES: dict[str, PanelFn] = {}  # section -> (results by name, key) -> list[Panel]


def panel_modules() -> list[str]:
    """Every module of `dashboards` whose name ends in `_panels` (each registers its panels)."""
    import dashboards

    found = pkgutil.iter_modules(dashboards.__path__, "dashboards.")
    return sorted(m.name for m in found if m.name.endswith("_panels"))


@cache
def load_panels() -> None:
    """Import `panel_modules()`: the renderer calls this before it looks a panel up, so a new panel
    module registers by its name alone, with no list or import to edit."""
    for name in panel_modules():
        importlib.import_module(name)


def _add_to(table: dict[str, PanelFn], keys: tuple[str, ...]) -> Callable[[PanelFn], PanelFn]:
    def add(fn: PanelFn) -> PanelFn:
        for key in keys:
            table[key] = fn
        return fn

    return add


def panel(*names: str) -> Callable[[PanelFn], PanelFn]:
    """Register `fn(result, key) -> list[Panel]` as the panels of the analyses `names`."""
    return _add_to(PANELS, names)


def summary(section: str) -> Callable[[PanelFn], PanelFn]:
    """Register `fn(results, key) -> list[Panel]`, drawn first in `section` from all its results."""
    return _add_to(SUMMARIES, (section,))


def in_summary(result, key: str) -> list:
    """The panel of an analysis its section's summary already draws: nothing more."""
    del result, key
    return []
