"""Render typed results: `figure(obj)`, `html(obj)` (a notebook's rich view), `write_page(obj, path)`,
`write_report(report, dir)` (the self-contained index.html) and `compare_html(a, b)`.

Pages are made from the results' JSON alone: a report.json read back renders the same page.
Each page carries plotly.js inline, so it opens offline from disk; figure data sits in
`<script type="application/json">` blocks with `<`, `>` and `&` escaped, and every string from
a result goes through Jinja2's autoescaping or `figures.esc`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import cache
from pathlib import Path

import numpy as np
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup

from dashboards.figures import Panel, ci_bars, esc, est, n_note
from dashboards.registry import PANELS, SUMMARIES, load_panels
from kvnotes.analysis.registry import analyses, sections
from kvnotes.analysis.results import SectionReport, TaskResult
from kvnotes.models.backends import BackendName

# --- from results to panels ---------------------------------------------------------------------


def panels(obj, key: str = "") -> list[Panel]:
    """Every panel of a result object: a Report (its parts), a section's report (SectionReport: its
    results), or one analysis's result, of any level (`verify` and a prompt's attribution too).

    One dispatch: a result is drawn by the panel registered for the name of the analysis that made
    it (`analysis_of`), else by the generic panel (a TaskResult) or its text table.
    `key` is the part's key ("order-cancel/probes", "model/ttft"); panel keys extend it."""
    load_panels()
    if type(obj).__name__ == "Report":
        return [p for _, ps in report_sections(obj) for p in ps]
    if isinstance(obj, SectionReport):
        return _section_panels(obj, key)
    name = analysis_of(obj)
    if isinstance(obj, TaskResult):
        return result_panels({name: obj}, key or name)
    if name in PANELS:
        return explained(PANELS[name](obj, key or name))
    return [table_panel(obj, analyses()[name].title or name, key or name)]


NOTHING = (
    "Nothing to show: every value this chart would draw is undefined on this run (too few usable "
    "pairs, or changes under the minimum effect on this model); more pairs (--n), a lower "
    "--min-effect, or a model whose answer this analysis moves would fill it."
)
NA = " (n/a: undefined on this run, for too few usable pairs or changes under the minimum effect.)"


def _drawn(fig) -> bool:
    """Whether any trace of `fig` has a finite value to draw (y, or z for a heatmap)."""
    for trace in fig.data:
        for axis in ("y", "z"):
            vals = getattr(trace, axis, None)
            flat = list(np.asarray(vals, dtype=object).ravel()) if vals is not None else []
            if any(isinstance(v, int | float) and math.isfinite(v) for v in flat):
                return True
    return False


def explained(made: list[Panel]) -> list[Panel]:
    """Panels whose chart has nothing to draw lose the empty chart and say why and what would fill
    it; a reading with an undefined figure (n/a) says what n/a means. So the page never shows an
    empty chart or a bare n/a."""
    out = []
    for p in made:
        if p.figure is not None and not _drawn(p.figure):
            p = replace(p, figure=None, reading=f"{NOTHING} {p.reading}".strip())
        elif "n/a" in p.reading and "n/a:" not in p.reading and not p.reading.startswith("Nothing"):
            p = replace(p, reading=p.reading.rstrip() + NA)
        out.append(p)
    return out


def analysis_of(obj) -> str:
    """The name of the analysis whose result `obj` is (a TaskResult carries it; another result is
    known by its class, the one analysis registered with it); a TypeError for anything else."""
    if isinstance(obj, TaskResult):
        return obj.name
    made = [name for name, a in analyses().items() if type(obj) is a.result]
    if not made:
        raise TypeError(
            f"dashboards cannot render a {type(obj).__name__}; it renders kvnotes results: a Report, "
            "a SectionReport, or the result of a registered analysis (kvnotes.analysis.registry)"
        )
    return made[0]


def _section_panels(obj: SectionReport, key: str) -> list[Panel]:
    """A section's results, or why the part could not run here."""
    if obj.meta.get("skipped"):
        return [
            Panel(
                title="Not run",
                reading=f"This part could not run here: {obj.meta['skipped']}.",
                key=f"{key or obj.task}/skipped",
            )
        ]
    return result_panels(obj.results, key or obj.task)


def table_panel(obj, title: str, key: str) -> Panel:
    """A model-level result with no panel of its own: its text table, as the CLI prints it."""
    return Panel(
        title=title,
        reading="The table the command prints.",
        html=f"<pre class='table'>{esc(obj.table())}</pre>",
        key=f"{key}/table",
    )


def result_panels(results: Mapping[str, TaskResult], key: str) -> list[Panel]:
    """The panels of some analyses' results, section by section: each section's summary first,
    then each result's own panels (the generic panel where it registered none).

    `key` is a part key ("order-cancel/circuits") or a task; panels are keyed under
    "<task>/<section>"."""
    return [p for _, made in labelled_panels(results, key) for p in made]


def labelled_panels(results: Mapping[str, TaskResult], key: str) -> list[tuple[str, list[Panel]]]:
    """`result_panels`, grouped: (a section's name, its summary's panels) or (an analysis's name,
    its own panels), in page order (the CLI's readings take each group's first reading)."""
    load_panels()
    known = analyses()
    task, _, last = key.rpartition("/")
    task = task if last in sections() else key
    groups: dict[str, dict[str, TaskResult]] = {}
    for name, r in results.items():
        groups.setdefault(known[name].section if name in known else "other", {})[name] = r
    out: list[tuple[str, list[Panel]]] = []
    for section, rs in groups.items():
        skey = f"{task}/{section}"
        if section in SUMMARIES:
            made = explained(SUMMARIES[section](rs, skey))
            out.append((section, _noting_dropped(made, sum(r.dropped() for r in rs.values()))))
        for name, r in rs.items():
            made = PANELS[name](r, skey) if name in PANELS else [generic_panel(r, f"{skey}/{name}")]
            out.append((name, _noting_dropped(explained(made), r.dropped())))
    return out


def _noting_dropped(made: list[Panel], dropped: int) -> list[Panel]:
    """Panels whose notes say how many non-finite values their figures leave out, when any are."""
    if not dropped:
        return made
    say = (
        f"{dropped} undefined or non-finite value(s) left out of the figures "
        "(report.json counts them per part)"
    )
    return [replace(p, note=f"{p.note}; {say}" if p.note else say) for p in made]


def generic_panel(r: TaskResult, key: str) -> Panel:
    """Any other TaskResult: its parts as bars with CIs (seconds and token counts left out)."""
    items = [est(e, name) for name, e in r.parts.items() if not name.endswith((".seconds", ".tokens"))]
    fig = ci_bars(items[:24], title=r.description or r.name, y_title="value")
    return Panel(
        title=r.name.replace("_", " "),
        reading=f"{r.name}: {r.headline} = {r.estimate}.",
        figure=fig,
        note=n_note(r),
        key=key,
    )


def report_sections(report) -> list[tuple[str, list[Panel]]]:
    """(part key, panels) in page order: per task, each part; then the per-model benches."""
    return [(key, panels(part.result, key)) for key, part in report.parts.items()]


def section_title(key: str) -> str:
    """A part's heading: its section's title (a model-level analysis's own), after the task."""
    task, _, name = key.rpartition("/")
    if task == "model":
        a = analyses().get(name)
        return (a.title or name) if a else name
    sec = sections().get(name)
    return f"{task} · {sec.title if sec else name}"


def section_intro(key: str) -> str:
    task, _, name = key.rpartition("/")
    if task == "model":
        a = analyses().get(name)
        return a.help[:1].upper() + a.help[1:] + "." if a else ""
    sec = sections().get(name)
    return sec.intro if sec else ""


# --- HTML ---------------------------------------------------------------------------------------

PAGE_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#222;background:#fafafa}
header,main,footer{max-width:1400px;margin:0 auto;padding:0 20px}
h1{font-size:1.6em;margin:18px 0 4px} h2{border-bottom:2px solid #ddd;padding-bottom:4px;margin-top:36px}
h3{margin:4px 0;font-size:1.05em} .subtitle{color:#555;margin:0 0 10px}
table.facts{border-collapse:collapse;font-size:.85em;margin:8px 0}
table.facts th{text-align:left;padding:2px 12px 2px 0;color:#555;font-weight:600;vertical-align:top}
table.facts td{padding:2px 0}
nav ul{display:flex;flex-wrap:wrap;gap:6px 16px;padding:0;list-style:none;font-size:.9em}
.row{display:grid;gap:16px;margin:14px 0} .row.cols-2{grid-template-columns:1fr 1fr}
.panel{background:#fff;border:1px solid #e3e3e3;border-radius:6px;padding:10px 14px;min-width:0}
.reading{margin:4px 0 8px;font-size:.95em} .note{color:#666;font-size:.8em;margin:6px 0 0}
.intro{color:#444} .missing{color:#999;font-style:italic} .warnings{color:#a33}
footer{color:#777;font-size:.8em;padding:24px 20px}
"""
PANEL_CSS = """
.prompt-text{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:.85em;line-height:1.7;
  white-space:pre-wrap;word-break:break-word;max-height:420px;overflow:auto;border:1px solid #eee;padding:8px}
.tok{border-radius:2px} .tok.role-field{outline:2px solid #2ca02c} .tok.role-decision{outline:2px dashed #555}
.tok.role-exact{outline:1px solid #333}
.kv-fig{width:100%;min-height:300px}
"""
CSS = PAGE_CSS + PANEL_CSS

LOADER = """
(function(){
  function draw(){
    document.querySelectorAll('script.kv-fig-data').forEach(function(s){
      var el=document.getElementById(s.dataset.target); if(!el||el.dataset.drawn)return;
      var f=JSON.parse(s.textContent); el.dataset.drawn='1';
      Plotly.newPlot(el,f.data,f.layout,{responsive:true,displaylogo:false})
        .then(function(){el.dataset.plotted='1';});  // drawn: what a test or a screenshot waits for
    });
  }
  document.querySelectorAll('.prompt-text').forEach(function(el){
    var f=el.querySelector('.tok.role-field'); if(f){el.scrollTop=Math.max(0,f.offsetTop-el.offsetTop-60);}
  });
  if(window.Plotly){draw();}else{window.addEventListener('load',draw);}
})();
"""


@cache
def _env() -> Environment:
    return Environment(
        loader=PackageLoader("dashboards", "templates"), autoescape=select_autoescape(["html"])
    )


@cache
def plotly_js() -> str:
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def fig_json(fig) -> Markup:
    """A figure as JSON safe inside a <script> element (no `<`, `>` or `&` survive)."""
    text = fig.to_json()
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return Markup(text)


def _anchor(key: str) -> str:
    return "s-" + re.sub(r"[^A-Za-z0-9_-]+", "-", key).strip("-")


def _view(p: Panel | None, n: int) -> dict:
    if p is None:
        return {
            "missing": True,
            "anchor": f"missing-{n}",
            "title": "",
            "reading": "not in this report",
            "html": None,
            "fig_id": None,
            "note": "",
        }
    fid = f"fig-{n}" if p.figure is not None else None
    return {
        "anchor": _anchor(p.key) if p.key else f"p-{n}",
        "title": p.title,
        "reading": p.reading,
        "html": Markup(p.html) if p.html else None,
        "fig_id": fid,
        "fig_json": fig_json(p.figure) if p.figure is not None else None,
        "note": p.note,
    }


def render_page(
    title: str,
    sections: Sequence[dict],
    *,
    subtitle: str = "",
    facts: Sequence = (),
    warnings: Sequence[str] = (),
    footer: str = "",
    inline_js: bool = True,
) -> str:
    """A full HTML page. `sections`: {"title", "anchor", "intro", "rows": [[Panel | None, ...], ...]}."""
    n = 0
    views = []
    for s in sections:
        rows = []
        for row in s["rows"]:
            vs = []
            for p in row:
                n += 1
                vs.append(_view(p, n))
            rows.append(vs)
        views.append({**s, "rows": rows})
    return (
        _env()
        .get_template("report.html")
        .render(
            title=title,
            subtitle=subtitle,
            facts=list(facts),
            warnings=list(warnings),
            sections=views,
            toc=len(views) > 1,
            css=Markup(CSS),
            loader=Markup(LOADER),
            footer=footer,
            plotly_js=Markup(plotly_js()) if inline_js else None,
        )
    )


def report_facts(report) -> list[tuple[str, str]]:
    m, c = report.meta, report.config
    info = m.get("model_info", {})
    vers = ", ".join(f"{k} {v}" for k, v in (m.get("versions") or {}).items() if v)
    return [
        (
            "model",
            f"{report.model} ({info.get('n_layers', '?')} layers, {info.get('n_heads', '?')} query heads, "
            f"{info.get('n_kv_heads', '?')} KV heads, d_head {info.get('d_head', '?')}; "
            f"{info.get('backend', BackendName.TRANSFORMER_LENS)} backend)",
        ),
        ("tasks", ", ".join(report.tasks)),
        (
            "sizes",
            f"{c.preset}: seed {c.seed}, min effect {c.min_effect} logits; {c.sizes()}"
            + (f"; left out: {', '.join(c.skip)}" if c.skip else ""),
        ),
        (
            "run",
            f"started {m.get('started', '?')}, {report.seconds:.0f} s of compute"
            + (f", parts reused: {len(m['reused'])}" if m.get("reused") else ""),
        ),
        ("machine", str(m.get("machine", "?"))),
        ("versions", vers),
    ]


def report_html(report) -> str:
    views = [
        {
            "title": section_title(k),
            "anchor": _anchor(k),
            "intro": section_intro(k),
            "rows": [[p] for p in ps],
        }
        for k, ps in report_sections(report)
    ]
    pending = report.meta.get("pending") or []
    warnings = (
        [f"partial report: {len(pending)} part(s) still to run ({', '.join(pending)})"] if pending else []
    )
    return render_page(
        f"kvnotes report · {report.model}",
        views,
        facts=report_facts(report),
        subtitle="Every figure shows its 95% bootstrap CI over prompt pairs (benchmarks: single "
        "timings). report.json beside this page holds every number.",
        warnings=warnings,
        footer=f"kvnotes report schema {report.to_dict()['schema']}",
    )


def write_report(report, out: str | Path) -> Path:
    """Write `out/index.html` for a Report (rendered from its JSON-able data only)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "index.html"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(report_html(report), encoding="utf-8")
    tmp.replace(path)
    return path


def write_page(obj, path: str | Path, *, title: str | None = None) -> Path:
    """Any result object as a standalone, self-contained HTML page."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ps = panels(obj)
    name = title or f"kvnotes · {type(obj).__name__}"
    path.write_text(
        render_page(name, [{"title": name, "anchor": "main", "intro": "", "rows": [[p] for p in ps]}]),
        encoding="utf-8",
    )
    return path


def compare_html(a, b) -> str:
    """Two reports side by side, panel against panel (matched by section and panel, across tasks)."""

    def index(r) -> dict[str, tuple[str, Panel]]:
        out: dict[str, tuple[str, Panel]] = {}
        for key, ps in report_sections(r):
            section = key.rsplit("/", 1)[1]
            for p in ps:
                suffix = p.key.split("/", 1)[1] if "/" in p.key else p.key
                out.setdefault(f"{section}|{suffix}", (section, p))
        return out

    ia, ib = index(a), index(b)
    order = list(ia) + [k for k in ib if k not in ia]
    by_section: dict[str, list] = {}
    for k in order:
        section = (ia.get(k) or ib.get(k))[0]
        by_section.setdefault(section, []).append(
            [ia[k][1] if k in ia else None, ib[k][1] if k in ib else None]
        )
    views = [
        {
            "title": section_title(f"model/{s}") if s not in sections() else sections()[s].title,
            "anchor": _anchor(s),
            "intro": "",
            "rows": rows,
        }
        for s, rows in by_section.items()
    ]
    facts = [
        ("left", f"{a.model} · {', '.join(a.tasks)} · {a.config.preset}"),
        ("right", f"{b.model} · {', '.join(b.tasks)} · {b.config.preset}"),
    ]
    return render_page(
        f"kvnotes · {a.model} vs {b.model}",
        views,
        facts=facts,
        subtitle="Left and right: the same panels of two reports.",
    )


# --- notebooks ----------------------------------------------------------------------------------

_JS_SENT = False


def figure(obj):
    """The main plotly figure of a result (its first panel that has one)."""
    for p in panels(obj):
        if p.figure is not None:
            return p.figure
    raise ValueError(f"this {type(obj).__name__} has no figure (nothing measured)")


def html(obj) -> str:
    """A notebook's rich view: every panel, with plotly.js inlined on the first call in a kernel."""
    global _JS_SENT
    body = []
    for i, p in enumerate(panels(obj)):
        v = _view(p, i)
        fid = f"kvnb-{id(obj):x}-{i}"
        part = [f"<h4>{esc(p.title)}</h4><p>{esc(p.reading)}</p>"]
        if p.html:
            part.append(p.html)
        if p.figure is not None:
            part.append(
                f'<div class="kv-fig" id="{fid}"></div><script type="application/json" class="kv-fig-data" '
                f'data-target="{fid}">{v["fig_json"]}</script>'
            )
        if p.note:
            part.append(f'<p style="color:#666;font-size:.8em">{esc(p.note)}</p>')
        body.append("".join(part))
    js = "" if _JS_SENT else f"<script>{plotly_js()}</script>"
    _JS_SENT = True
    return (
        f'<div class="kvnotes-result"><style>{PANEL_CSS}</style>{js}{"".join(body)}'
        f"<script>{LOADER}</script></div>"
    )
