"""The results' old address: `from probes.results import Estimate, ProbeResult, ...` keeps working.
They live in `kvnotes.analysis.results` (`collect` in `kvnotes.analysis.runner`), one framework
with the registry and the report."""

from kvnotes.analysis.results import (
    CONFIDENCE,
    N_RESAMPLES,
    Curve,
    Estimate,
    GenericResult,
    ProbeReport,
    ProbeResult,
    SectionReport,
    bootstrap_ci,
    cluster_bootstrap_ci,
    decode,
    encode,
)
from kvnotes.analysis.runner import collect

__all__ = [
    "CONFIDENCE",
    "Curve",
    "Estimate",
    "GenericResult",
    "N_RESAMPLES",
    "ProbeReport",
    "ProbeResult",
    "SectionReport",
    "bootstrap_ci",
    "cluster_bootstrap_ci",
    "collect",
    "decode",
    "encode",
]
