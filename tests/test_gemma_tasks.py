"""All six probes on every general built-in task with Gemma 3 270M's real weights. Its own file (the
longest Gemma test), so that on two test workers it runs beside the rest of tests/test_gemma.py."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gemma


def test_probes_run_on_every_general_task(gemma):
    """All six probes on each built-in task with real weights: well-formed, exact where it must be."""
    from probes import PROBES, run_probes

    for task in ["order-cancel", "account-access", "refund-window"]:
        report = run_probes(gemma, task, n=2, progress=False)
        assert list(report.results) == list(PROBES), task
        fr = report.results["field_refresh"]
        # exact: invariant 4, slots before the field are the same computation
        assert fr["deviation_before_field"].values == (0.0, 0.0), task
        d = report.to_dict()
        assert all({"mean", "ci", "values"} <= set(p) for p in d["results"].values()), task
