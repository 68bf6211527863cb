"""Which panels draw which result. Panel modules register a function per analysis (by the name it
has in `kvnotes.analysis.registry`), per section (a summary over several analyses' results) or per result
type (results that are not analyses: `verify`, a prompt's attribution). The modules that register
them are listed once, in `PANEL_MODULES`; `render` loads them (`load_panels`) and looks them up;
an analysis without a panel of its own gets the generic one (its parts as bars with CIs).

    from dashboards.registry import panel
    @panel("my_analysis")
    def my_panels(result, key):  # key: "order-cancel/probes"
        return [Panel(title=..., reading=..., figure=..., key=f"{key}/my_analysis")]
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache

PanelFn = Callable  # (result, key) -> list[Panel]

# every module that registers panels, in one place: `load_panels` imports them
PANEL_MODULES = ("dashboards.probe_panels", "dashboards.circuit_panels", "dashboards.edit_panels")

PANELS: dict[str, PanelFn] = {}
SUMMARIES: dict[str, PanelFn] = {}  # section -> (results by name, key) -> list[Panel]
TYPES: dict[str, PanelFn] = {}  # result class name -> (result, key) -> list[Panel]


@cache
def load_panels() -> None:
    """Import `PANEL_MODULES` (each registers its panels): the renderer calls this before it looks
    a panel up, so which panels exist is read from one list, not from scattered imports."""
    for name in PANEL_MODULES:
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


def for_type(*class_names: str) -> Callable[[PanelFn], PanelFn]:
    """Register `fn(result, key) -> list[Panel]` for results of these classes (not analyses)."""
    return _add_to(TYPES, class_names)


def in_summary(result, key: str) -> list:
    """The panel of an analysis its section's summary already draws: nothing more."""
    del result, key
    return []
