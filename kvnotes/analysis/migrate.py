"""Older result layouts read in today's terms. A report section's results were once keyed
`"probes"` (report schema /1 and /3), and `kvnotes.report/2` wrote a circuits section with each
analysis as a top-level key; results saved before /4 carried no name. (The report's own /1 config
is migrated by `ReportConfig.from_v1`, beside the config it becomes.)
"""

from __future__ import annotations

from collections.abc import Mapping

from kvnotes.analysis.codec import expect_shape

# a section's keys beside its results, in every layout
SECTION_META = ("model", "task", "n", "seed", "meta")


def section_results(d: Mapping) -> dict:
    """A saved section's results, each keyed by its analysis and carrying its name: from
    `"results"` (/4), `"probes"` (/1 and /3) or the old circuits layout (/2: each analysis a
    top-level key); a result saved without its name (before /4) takes its key's."""
    if "results" in d:
        saved = d["results"]
    elif "probes" in d:  # report schema /1 and /3
        saved = d["probes"]
    else:  # the old circuits layout: each analysis a top-level key
        saved = {k: v for k, v in d.items() if k not in SECTION_META}
    expect_shape(isinstance(saved, Mapping), "a section's results", "a mapping", saved)
    return {k: {"name": k, **v} if isinstance(v, Mapping) else v for k, v in saved.items()}
