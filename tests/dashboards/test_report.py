"""The per-model report: JSON round trip into the same result objects, rendering from the JSON
alone, resuming from saved parts, escaping, and the rich display of every result type."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace

import pytest

from dashboards.figures import esc
from dashboards.render import figure, html, panels, report_html, write_report
from kvnotes.analysis.registry import get
from kvnotes.analysis.report import Part, Report, ReportConfig, ReportFileError, run_report
from kvnotes.analysis.results import SectionReport, TaskResult
from kvnotes.analysis.stats import Estimate
from kvnotes.bench.ttft import EditCostReport, TTFTReport
from kvnotes.cli import main
from probes.causal import NoteMap
from tests.helpers import get_model

SIZES = dict(
    n=3,
    draws=3,
    k_max=3,
    sae_train_pairs=4,
    sae_eval_pairs=4,
    sae_samples=1024,
    distances=(0, 64),
    seams=(0, 2),
    turns=2,
    lengths=(256, 400),
    tokens=256,
    min_effect=0.0,
)
CFG = ReportConfig.quick(**SIZES)


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    report = run_report(get_model("tiny-llama"), ["order-cancel"], out, CFG, progress=False)
    write_report(report, out)
    return out, report


def test_every_part_is_there_with_its_type(report_dir):
    _, report = report_dir
    kinds = {k: type(p.result) for k, p in report.parts.items()}
    assert kinds == {
        "order-cancel/probes": SectionReport,
        "order-cancel/regime": SectionReport,
        "order-cancel/circuits": SectionReport,
        "order-cancel/edit": SectionReport,
        "order-cancel/compose": SectionReport,
        "order-cancel/memory": SectionReport,
        "model/ttft": TTFTReport,
        "model/edit_cost": EditCostReport,
    }
    assert report.meta["pending"] == []
    assert {"kvnotes", "torch", "plotly", "python"} <= set(report.meta["versions"])
    assert report.meta["model_info"]["n_layers"] == get_model("tiny-llama").n_layers


def test_report_json_round_trips_into_the_same_objects(report_dir):
    out, report = report_dir
    back = Report.load(out)  # the directory; report.json inside
    assert back.config == report.config and back.tasks == report.tasks and back.model == report.model
    assert set(back.parts) == set(report.parts)
    for key, part in report.parts.items():
        assert type(back.parts[key].result) is type(part.result), key
        assert back.parts[key].result.to_dict() == json.loads(json.dumps(part.result.to_dict())), key
    circuits = back.part("order-cancel", "circuits")
    read = circuits.results["read_heads"]
    orig = report.part("order-cancel", "circuits").results["read_heads"]
    assert read.parts["top_k"] == orig.parts["top_k"] and read.curves == orig.curves
    assert read.tables["ranking"] == json.loads(json.dumps(orig.tables["ranking"]))
    assert back.to_dict() == json.loads(json.dumps(report.to_dict()))


def test_every_section_writes_one_layout(report_dir):
    _, report = report_dir
    d = report.to_dict()
    assert d["schema"] == "kvnotes.report/4"
    for key, part in d["parts"].items():
        assert part["name"] == key.rpartition("/")[2], key  # a part names its section or analysis
        if not key.startswith("model/"):
            assert part["kind"] == "section", key
            assert set(part["result"]) == {"model", "task", "n", "seed", "results", "meta"}, key
            assert all(r["name"] == k for k, r in part["result"]["results"].items()), key
        else:
            assert part["kind"] == "analysis", key
    circuits = report.part("order-cancel", "circuits")
    assert isinstance(circuits, SectionReport) and "read_heads" in circuits.results


def _as_v2(d: dict) -> dict:
    """A report's JSON as `kvnotes.report/2` wrote it: section parts of kind "ProbeReport" with their
    results keyed "probes" and without their names, and the circuits part of kind "CircuitReport"
    with each analysis a top-level key."""
    old = json.loads(json.dumps(d))
    old["schema"] = "kvnotes.report/2"
    for key, part in old["parts"].items():
        if part.pop("kind") != "section":
            part["kind"] = get(part.pop("name")).result.__name__  # a class name, as /1 to /3 stored it
            continue
        del part["name"]
        results = {
            k: {f: v for f, v in r.items() if f != "name"} for k, r in part["result"].pop("results").items()
        }
        if key.endswith("/circuits"):
            part["kind"] = "CircuitReport"
            part["result"] = {**part["result"], **results}
        else:
            part["kind"] = "ProbeReport"
            part["result"]["probes"] = results
    return old


def test_report_files_of_schema_1_and_2_still_load(report_dir, tmp_path):
    _, report = report_dir
    v2 = _as_v2(report.to_dict())
    assert "read_heads" in v2["parts"]["order-cancel/circuits"]["result"]
    v1 = {
        **v2,
        "schema": "kvnotes.report/1",
        "config": {"n": 3, "seed": 0, "min_effect": 0.0, "preset": "quick"},
    }
    want = json.loads(json.dumps(report.to_dict()))["parts"]
    for old in (v1, v2):
        (tmp_path / "report.json").write_text(json.dumps(old))
        back = Report.load(tmp_path)
        assert {k: p.to_dict() for k, p in back.parts.items()} == want, old["schema"]
        read = back.part("order-cancel", "circuits").results["read_heads"]
        assert read.to_dict() == want["order-cancel/circuits"]["result"]["results"]["read_heads"]


def test_html_renders_from_the_json_alone(report_dir):
    out, report = report_dir
    from_json = report_html(Report.load(out / "report.json"))
    assert from_json == report_html(report)
    assert (out / "index.html").read_text(encoding="utf-8") == from_json
    # every figure the page declares has its data; plotly.js is inline (the page works offline)
    ids = re.findall(r'class="kv-fig" id="([^"]+)"', from_json)
    assert len(ids) >= 20 and len(set(ids)) == len(ids)
    assert len(re.findall(r'class="kv-fig-data" data-target=', from_json)) == len(ids)
    assert "Plotly.newPlot" in from_json and len(from_json) > 3_000_000  # plotly.js itself is inline
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", from_json)  # nothing fetched


def test_resume_reuses_parts_and_recomputes_changed_ones(report_dir, tmp_path):
    source, report = report_dir
    out = tmp_path / "copy"  # resuming rewrites report.json: leave the module's report as the others read it
    shutil.copytree(source, out)
    again = run_report(get_model("tiny-llama"), ["order-cancel"], out, CFG, progress=False)
    assert again.meta["reused"] == list(report.parts)
    assert again.part("order-cancel", "probes").to_dict() == report.part("order-cancel", "probes").to_dict()
    # a corrupt part and a different config are recomputed, not trusted
    work = tmp_path / "r"
    small = ReportConfig.quick(**{**SIZES, "lengths": (), "tokens": 0})
    run_report(get_model("tiny-llama"), ["order-cancel"], work, small, progress=False)
    (work / "parts" / "order-cancel__edit.json").write_text("{not json")
    r2 = run_report(get_model("tiny-llama"), ["order-cancel"], work, small, progress=False)
    assert "order-cancel/edit" not in r2.meta["reused"] and "order-cancel/probes" in r2.meta["reused"]
    r3 = run_report(get_model("tiny-llama"), ["order-cancel"], work, replace(small, seed=1), progress=False)
    assert r3.meta["reused"] == []


def test_a_bad_report_file_says_what_is_wrong(tmp_path):
    (tmp_path / "report.json").write_text("[1, 2]")
    with pytest.raises(ReportFileError, match="not a report this kvnotes reads.*kvnotes render"):
        Report.load(tmp_path)
    (tmp_path / "report.json").write_text("{oops")
    with pytest.raises(ReportFileError, match="not valid JSON"):
        Report.load(tmp_path)
    (tmp_path / "report.json").write_text(
        json.dumps(
            {"schema": "kvnotes.report/1", "model": "m", "tasks": [], "config": {"quick": True}, "parts": {}}
        )
    )
    with pytest.raises(ReportFileError, match=r"unknown report config key\(s\) \['quick'\].*rerun"):
        Report.load(tmp_path)
    with pytest.raises(ReportFileError, match="does not exist"):
        Report.load(tmp_path / "nowhere")
    with pytest.raises(ReportFileError, match="kind"):
        Part.from_dict("x/y", {"kind": "Pickle", "seconds": 0, "result": {}})
    with pytest.raises(ValueError, match="preset"):
        ReportConfig(preset="fast")


PAYLOAD = [
    "<script>window.__pwned=1</script>",
    ' "q" ',
    " 'q' ",
    " Tom & Jerry",
    "<img src=x onerror=alert(1)>",
]


def _hostile_note_map() -> TaskResult:
    toks = ["<bos>", "status", ":", " shipped", *PAYLOAD, "\n", "decision", ":"]
    n = len(toks)
    pos = list(range(3, n - 1))
    m = {
        "positions": pos,
        "tokens": toks[3 : n - 1],
        "prompt_tokens": toks,
        "role": ["field"] + ["note"] * (len(pos) - 1),
        "recovery": [0.1 * i for i in range(len(pos))],
        "field_joint": 0.2,
        "deviation": [1.0] * len(pos),
        "delimiter": [False] * len(pos),
        "distance_to_decision": [n - 1 - p for p in pos],
        "per_layer": [0.5],
        "layer_windows": [[0]],
        "per_window": [0.5],
        "slot_layer": [[0.1 * i] for i in range(len(pos) - 1)],
    }
    parts = {k: Estimate.of([0.5, 0.6]) for k in NoteMap.PARTS + ("layer_0",)}
    return NoteMap.of(name="note_map", headline="top_slot", parts=parts, maps=[m], layer_window=1)


def test_token_strings_are_escaped_in_pages_and_figures(tmp_path):
    from dashboards.render import write_page

    page = write_page(_hostile_note_map(), tmp_path / "p.html").read_text(encoding="utf-8")
    body = page.split("</style>", 1)[1]
    body = body.replace(body[body.index("<script>") : body.index("</script>") + 9], "", 1)  # inline plotly.js
    assert "<script>window.__pwned" not in body and "<img src=x" not in body
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in body  # the prompt text shows it, escaped
    assert "Tom &amp; Jerry" in body
    # figure JSON carries no raw angle brackets or ampersands that could end its <script> element
    for data in re.findall(r'class="kv-fig-data"[^>]*>(.*?)</script>', body, flags=re.S):
        assert "<" not in data and ">" not in data and "&" not in data
        assert "\\u0026lt;script\\u0026gt;" in data or "window.__pwned" not in data
    # only our own scripts: plotly.js, one data block per figure, the loader
    scripts = re.findall(r"<script[^>]*>", body)
    ours = re.compile(r'<script>|<script type="application/json" class="kv-fig-data" data-target="fig-\d+">')
    assert scripts and all(ours.fullmatch(x) for x in scripts), scripts
    assert body.count("<script>") == 1  # the loader; plotly.js was cut above


def test_every_result_type_displays_itself(report_dir):
    import plotly.graph_objects as go

    _, report = report_dir
    objs = [
        report,
        *[p.result for p in report.parts.values()],
        report.part("order-cancel", "probes").results["note_map"],
        report.part("order-cancel", "circuits").results["sae"],
    ]
    for obj in objs:
        fig = obj.figure()
        assert isinstance(fig, go.Figure) and len(fig.data) > 0, type(obj).__name__
        view = obj._repr_html_()
        assert all(esc(p.title) in view for p in panels(obj))
    assert figure(report).to_json() == report.figure().to_json()
    n_figs = len([p for p in panels(report) if p.figure is not None])
    assert html(report).count('class="kv-fig-data"') == n_figs


def test_cli_report_quick_on_a_tiny_model(tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(f"report --model tiny-llama --task order-cancel --quick --n 2 --out {out}".split()) == 0
    report = Report.load(out)
    assert report.config.preset == "quick" and {
        c.n for c in report.config.analyses.values() if hasattr(c, "n")
    } == {2}
    assert (out / "index.html").stat().st_size > 1_000_000  # plotly.js inline
    assert "open " in capsys.readouterr().out
    assert main(["render", str(out / "report.json"), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "index.html").read_text() == (out / "index.html").read_text()
    with pytest.raises(SystemExit) as refused:  # a task that does not exist: refused as it is parsed
        main(["report", "--model", "tiny-llama", "--task", "no-such-task", "--out", str(out)])
    assert refused.value.code == 2


def test_verify_and_bench_reports_display_themselves():
    import plotly.graph_objects as go

    from kvnotes.bench.sweep import patch_sweep_report
    from kvnotes.conformance import verify

    model = get_model("tiny-llama")
    v = verify(model)
    fig = v.figure()
    assert isinstance(fig, go.Figure)
    assert list(fig.data[0].y) == [max(r.max_abs_error, 1e-12) for r in v.invariants]
    assert "invariants hold" in v._repr_html_()
    sweep = patch_sweep_report(model, [64], n_slots=4)
    assert list(sweep.figure().data[0].y) == [p.ratio for p in sweep.results]
    assert "Patch-sweep speedup" in sweep._repr_html_()


def test_an_empty_chart_or_a_bare_n_a_always_says_why():
    """`explained`: a chart with nothing finite to draw is dropped and its reading says why and what
    would fill it; a reading with an undefined figure says what n/a means; a drawn chart is kept."""
    import plotly.graph_objects as go

    from dashboards.figures import Panel
    from dashboards.render import explained

    empty = Panel(title="e", reading="recovers n/a early", figure=go.Figure(go.Bar(x=["a"], y=[None])))
    blank = Panel(title="b", reading="nothing drawn", figure=go.Figure())
    na = Panel(
        title="n", reading="moves the decision n/a of the way", figure=go.Figure(go.Bar(x=["a"], y=[0.5]))
    )
    drawn = Panel(title="d", reading="0.50", figure=go.Figure(go.Heatmap(z=[[None, 1.0]])))
    e, b, n, d = explained([empty, blank, na, drawn])
    assert e.figure is None and e.reading.startswith("Nothing to show") and "--n" in e.reading
    assert b.figure is None and b.reading.startswith("Nothing to show")
    assert n.figure is not None and "n/a: undefined on this run" in n.reading
    assert d == drawn


def test_the_organism_s_quick_report_has_no_unexplained_empty_chart(tmp_path):
    """The report a user first meets on an organism: every chart on its page draws something, or
    stands beside a "Nothing to show" reading instead (the memory placement's edits on the notes
    organism, which reads no memory, once drew an empty chart headed "recovers n/a")."""
    from dashboards.render import _drawn, panels

    cfg = ReportConfig.quick(
        n=3, draws=3, k_max=3, sae_train_pairs=4, sae_eval_pairs=4, sae_samples=1024, turns=2
    )
    report = run_report(get_model("notes-organism"), ["notes-organism"], tmp_path, cfg, progress=False)
    shown = panels(report)
    assert len(shown) > 20
    for p in shown:
        assert p.figure is None or _drawn(p.figure), p.title
        if p.figure is None and p.html is None:
            assert p.reading, p.title
        assert "n/a" not in p.reading or "n/a:" in p.reading or p.reading.startswith("Nothing"), p.reading
    edits = next(p for p in shown if p.title == "Editing placed memory")
    assert edits.figure is None and edits.reading.startswith("Nothing to show")
