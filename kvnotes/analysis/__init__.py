"""One analysis framework: the registry (each analysis declared once, beside its code), the typed
results every analysis returns, the runner, and the report that runs them and saves them.

    from kvnotes.analysis import analyses, ReportConfig, run_report
    sorted(analyses())          # ['agent_loop', 'attribution', 'cot_refresh', ...]

- `registry`: `Analysis`, `Section`, `@analysis`, `option`, `Options`, `Context`.
- `results`: the result protocol `Result`, `TaskResult`, `SectionReport`; `stats`: `Estimate`,
  `Curve`, the bootstrap; `codec` (results as JSON and back), `migrate` (older layouts),
  `bench_report` (`BenchReport`, the benches' reports).
- `trials`: the trial layer every analysis stands on: `Trial` (a pair prefilled once),
  `make_trials`, `shared_trials`, `PairOptions`, `split_by_effect`, `effect_estimate`.
- `runner`: `run_analysis` (analyses over one context), `run_one` (one, at any level),
  `collect` and `run_section` (a section's report).
- `report`: `ReportConfig`, `Report`, `run_report` (`report.json`, resumable).
- `discovery`: how the analyses are found (the packages walked, no hand-kept list).

Every name is imported on first use: `kvnotes.analysis.discovery` is read without the registry.
"""

from __future__ import annotations

from kvnotes.lazy import lazy_exports

_LAZY = {
    "MIN_EFFECT": "kvnotes.analysis.registry",
    "Analysis": "kvnotes.analysis.registry",
    "Context": "kvnotes.analysis.registry",
    "Need": "kvnotes.analysis.registry",
    "Options": "kvnotes.analysis.registry",
    "Section": "kvnotes.analysis.registry",
    "analyses": "kvnotes.analysis.registry",
    "analysis": "kvnotes.analysis.registry",
    "get": "kvnotes.analysis.registry",
    "option": "kvnotes.analysis.registry",
    "refuse_unmet": "kvnotes.analysis.registry",
    "register": "kvnotes.analysis.registry",
    "register_section": "kvnotes.analysis.registry",
    "sections": "kvnotes.analysis.registry",
    "unregister": "kvnotes.analysis.registry",
    "Estimate": "kvnotes.analysis.stats",
    "Curve": "kvnotes.analysis.stats",
    "TaskResult": "kvnotes.analysis.results",
    "SectionReport": "kvnotes.analysis.results",
    "bootstrap_ci": "kvnotes.analysis.stats",
    "PairOptions": "kvnotes.analysis.trials",
    "Trial": "kvnotes.analysis.trials",
    "effect_estimate": "kvnotes.analysis.trials",
    "make_trials": "kvnotes.analysis.trials",
    "shared_trials": "kvnotes.analysis.trials",
    "split_by_effect": "kvnotes.analysis.trials",
    "run_analysis": "kvnotes.analysis.runner",
    "run_one": "kvnotes.analysis.runner",
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
    "PairOptions",
    "TaskResult",
    "Trial",
    "Report",
    "ReportConfig",
    "Section",
    "SectionReport",
    "analyses",
    "analysis",
    "bootstrap_ci",
    "collect",
    "effect_estimate",
    "get",
    "make_trials",
    "option",
    "register",
    "refuse_unmet",
    "register_section",
    "run_analysis",
    "run_one",
    "run_report",
    "run_section",
    "sections",
    "shared_trials",
    "split_by_effect",
    "unregister",
]

_, __getattr__, __dir__ = lazy_exports(__name__, _LAZY)
