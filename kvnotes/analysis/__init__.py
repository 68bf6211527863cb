"""One analysis framework: the registry (each analysis declared once, beside its code), the typed
results every analysis returns, the runner, and the report that runs them and saves them.

    from kvnotes.analysis import analyses, ReportConfig, run_report
    sorted(analyses())          # ['agent_loop', 'attribution', 'cot_refresh', ...]

- `registry`: `Analysis`, `Section`, `@analysis`, `option`, `Options`, `Context`.
- `results`: `Estimate`, `Curve`, `ProbeResult`, `SectionReport` (alias `ProbeReport`), the bootstrap.
- `runner`: `run_analysis` (analyses over one context), `collect` and `run_section` (a section's report).
- `report`: `ReportConfig`, `Report`, `run_report` (`report.json`, resumable).

The registry's names are imported eagerly (it is light: the CLI reads it without torch); the
others on first use.
"""

from __future__ import annotations

import importlib

from kvnotes.analysis.registry import (
    MIN_EFFECT,
    Analysis,
    Context,
    Need,
    Options,
    Section,
    analyses,
    analysis,
    get,
    option,
    refuse_unmet,
    register,
    register_section,
    sections,
    unregister,
)

_LAZY = {
    "Estimate": "kvnotes.analysis.results",
    "Curve": "kvnotes.analysis.results",
    "ProbeResult": "kvnotes.analysis.results",
    "ProbeReport": "kvnotes.analysis.results",
    "SectionReport": "kvnotes.analysis.results",
    "bootstrap_ci": "kvnotes.analysis.results",
    "run_analysis": "kvnotes.analysis.runner",
    "collect": "kvnotes.analysis.runner",
    "run_section": "kvnotes.analysis.runner",
    "ReportConfig": "kvnotes.analysis.report",
    "Report": "kvnotes.analysis.report",
    "run_report": "kvnotes.analysis.report",
}

__all__ = [  # noqa: RUF022 (grouped as the docstring lists them)
    "Analysis",
    "Context",
    "Curve",
    "Estimate",
    "MIN_EFFECT",
    "Need",
    "Options",
    "ProbeReport",
    "ProbeResult",
    "Report",
    "ReportConfig",
    "Section",
    "SectionReport",
    "analyses",
    "analysis",
    "bootstrap_ci",
    "collect",
    "get",
    "option",
    "register",
    "refuse_unmet",
    "register_section",
    "run_analysis",
    "run_report",
    "run_section",
    "sections",
    "unregister",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvnotes.analysis' has no attribute {name!r}")
