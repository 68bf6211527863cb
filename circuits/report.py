"""The report's old address: `from circuits.report import ReportConfig, run_report` keeps working.
The report lives in `kvnotes.analysis.report`, beside the registry and the results it runs."""

from kvnotes.analysis.report import (
    READS,
    SCHEMA,
    Part,
    Report,
    ReportConfig,
    model_info,
    plan_parts,
    run_report,
)

plan = plan_parts  # its name here before the report's parts had a name of their own

__all__ = [
    "READS",
    "SCHEMA",
    "Part",
    "Report",
    "ReportConfig",
    "model_info",
    "plan",
    "plan_parts",
    "run_report",
]
