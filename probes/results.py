"""The results' old address: `from probes.results import Estimate, ProbeResult, ...` keeps working.
They live in `kvnotes.analysis.results`, one framework with the registry and the report."""

from kvnotes.analysis.results import (
    CONFIDENCE,
    N_RESAMPLES,
    Curve,
    Estimate,
    GenericResult,
    ProbeReport,
    ProbeResult,
    bootstrap_ci,
    cluster_bootstrap_ci,
    collect,
    decode,
    encode,
)

__all__ = [
    "CONFIDENCE",
    "Curve",
    "Estimate",
    "GenericResult",
    "N_RESAMPLES",
    "ProbeReport",
    "ProbeResult",
    "bootstrap_ci",
    "cluster_bootstrap_ci",
    "collect",
    "decode",
    "encode",
]
