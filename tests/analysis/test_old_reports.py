"""Reports written before the result format changed still load and render: tests/data/report-v3.json
is a `kvnotes.report/3` report (tiny-llama, order-cancel, quick; six parts) as that version wrote it,
its sections' results keyed "probes", its results without their names, and its model-level parts'
kinds the class names of their results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvnotes.analysis.report import SCHEMA, Part, Report
from kvnotes.analysis.results import SectionReport, TaskResult
from kvnotes.bench.edit_cost import EditCostReport
from kvnotes.bench.ttft import TTFTReport
from kvnotes.errors import ReportFileError

OLD = Path(__file__).resolve().parents[1] / "data" / "report-v3.json"


def test_the_fixture_is_of_the_old_format():
    d = json.loads(OLD.read_text())
    assert d["schema"] == "kvnotes.report/3" != SCHEMA
    assert "probes" in d["parts"]["order-cancel/probes"]["result"]
    assert d["parts"]["model/ttft"]["kind"] == "TTFTReport"


def test_an_old_report_loads_as_todays_and_saves_in_the_new_format(tmp_path):
    r = Report.load(OLD)
    assert list(r.parts) == [
        "order-cancel/probes",
        "order-cancel/regime",
        "order-cancel/edit",
        "order-cancel/memory",
        "model/ttft",
        "model/edit_cost",
    ]
    probes = r.part("order-cancel", "probes")
    assert isinstance(probes, SectionReport) and list(probes.results)[0] == "field_refresh"
    assert all(isinstance(v, TaskResult) and v.name == k for k, v in probes.results.items())
    assert isinstance(r.part("model", "ttft"), TTFTReport)
    assert isinstance(r.part("model", "edit_cost"), EditCostReport)
    new = r.to_dict()
    assert new["schema"] == SCHEMA
    assert new["parts"]["model/ttft"]["kind"] == "analysis" and new["parts"]["model/ttft"]["name"] == "ttft"
    section = new["parts"]["order-cancel/probes"]
    assert section["kind"] == "section" and "probes" not in section["result"]
    assert section["result"]["results"]["field_refresh"]["name"] == "field_refresh"
    r.save(tmp_path / "report.json")
    again = Report.load(tmp_path)
    assert again.to_dict() == new  # the new format reads back exactly


def test_an_old_report_renders(tmp_path):
    from dashboards.render import report_html, write_report

    page = report_html(Report.load(OLD))
    assert "order-cancel · Causal probes and the note map" in page
    assert "Time to first token" in page or "time to first token" in page.lower()
    assert write_report(Report.load(OLD), tmp_path).stat().st_size > 100_000  # plotly inline


def test_a_part_of_no_known_kind_is_refused_naming_it():
    with pytest.raises(ReportFileError, match="part 'model/nope' has kind 'NopeReport'"):
        Part.from_dict("model/nope", {"kind": "NopeReport", "seconds": 0.0, "result": {}})
