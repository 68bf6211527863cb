"""Render typed results: `figure(obj)`, `html(obj)` (a notebook's rich view), `write_page(obj, path)`,
`write_report(report, dir)` (the self-contained index.html) and `compare_html(a, b)`.

Pages are made from the results' JSON alone: a report.json read back renders the same page.
Each page carries plotly.js inline, so it opens offline from disk; figure data sits in
`<script type="application/json">` blocks with `<`, `>` and `&` escaped, and every string from
a result goes through Jinja2's autoescaping or `figures.esc`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path

from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup

from dashboards.circuit_panels import circuit_panels, prompt_attribution_panels
from dashboards.edit_panels import (
    agent_panels,
    edit_cost_panels,
    edit_panels,
    memory_panels,
    seam_panels,
    sweep_panels,
    ttft_panels,
    verify_panels,
)
from dashboards.figures import Panel, ci_bars, esc
from dashboards.probe_panels import est, n_note, probe_panels, regime_panels
from probes.results import ProbeReport, ProbeResult

SECTION_TITLES = {
    "probes": "Causal probes and the note map",
    "regime": "Regime",
    "circuits": "Circuits",
    "edit": "Editing",
    "compose": "Composing",
    "ttft": "Time to first token",
    "edit_cost": "Cost of an edit",
}
SECTION_INTROS = {
    "probes": "Where the decision reads its conclusion: the changed field's own slots, or the notes "
    "downstream.",
    "regime": "The same probes as filler pushes the field away from the decision.",
    "circuits": "Which heads write the conclusion onto the notes and which read it at the decision; what a "
    "scrubbed hypothesis keeps; how gradients rank it; which SAE features carry it.",
    "edit": "One changed field: every way to update a stale cache, against full recompute.",
    "compose": "A precompiled chunk spliced into a new context, the seam repaired; errata over many turns.",
    "ttft": "Time to first token of a composed context against prefilling it all.",
    "edit_cost": "Time to update a cache for one changed field, as the field moves through the prompt.",
}


# --- from results to panels ---------------------------------------------------------------------


def panels(obj, key: str = "") -> list[Panel]:
    """Every panel of a result object (a Report, a probe or circuit report, one ProbeResult, a
    bench report, or a prompt attribution)."""
    kind = type(obj).__name__
    if kind == "Report":
        return [p for _, ps in report_sections(obj) for p in ps]
    if kind == "CircuitReport":
        return circuit_panels(obj.analyses, key or f"{obj.task}/circuits")
    if isinstance(obj, ProbeReport) and obj.meta.get("skipped"):
        return [
            Panel(
                title="Not run",
                reading=f"This part could not run here: {obj.meta['skipped']}.",
                key=f"{key or obj.task}/skipped",
            )
        ]
    if isinstance(obj, ProbeReport):
        return probe_report_panels(obj.probes, key or obj.task)
    if isinstance(obj, ProbeResult):
        return probe_report_panels({obj.name: obj}, key or obj.name)
    if kind == "TTFTReport":
        return ttft_panels(obj, key or "ttft")
    if kind == "EditCostReport":
        return edit_cost_panels(obj, key or "edit_cost")
    if kind == "SweepReport":
        return sweep_panels(obj, key or "patch_sweep")
    if kind == "VerifyReport":
        return verify_panels(obj, key or "verify")
    if kind == "PromptAttribution":
        return prompt_attribution_panels(obj, key or "attribution")
    raise TypeError(
        f"dashboards cannot render a {kind}; it renders kvnotes result objects "
        "(Report, ProbeReport, CircuitReport, ProbeResult, bench reports, PromptAttribution)"
    )


PROBE_NAMES = (
    "field_refresh",
    "notes_transplant",
    "note_map",
    "knockout",
    "dissociation",
    "false_note_injection",
)
CIRCUIT_NAMES = ("read_heads", "write_heads", "scrubbing", "attribution", "sae")
SINGLE = {
    "regime": regime_panels,
    "edit_methods": edit_panels,
    "seam_repair": seam_panels,
    "memory_blocks": memory_panels,
    "agent_loop": agent_panels,
}


def probe_report_panels(results: Mapping[str, ProbeResult], key: str) -> list[Panel]:
    out: list[Panel] = []
    probes = {k: v for k, v in results.items() if k in PROBE_NAMES}
    if probes:
        out += probe_panels(probes, f"{key}/probes")
    circuits = {k: v for k, v in results.items() if k in CIRCUIT_NAMES}
    if circuits:
        out += circuit_panels(circuits, f"{key}/circuits")
    for name, r in results.items():
        if name in SINGLE:
            out += SINGLE[name](r, f"{key}/{name}")
        elif name not in PROBE_NAMES and name not in CIRCUIT_NAMES:
            out.append(generic_panel(r, f"{key}/{name}"))
    return out


def generic_panel(r: ProbeResult, key: str) -> Panel:
    """Any other ProbeResult: its parts as bars with CIs (seconds and token counts left out)."""
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
    """(section key, panels) in page order: per task, each part; then the per-model benches."""
    out = []
    for key, part in report.parts.items():
        out.append((key, panels(part.result, key.rsplit("/", 1)[0])))
    return out


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
      Plotly.newPlot(el,f.data,f.layout,{responsive:true,displaylogo:false});
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


def _section_title(key: str) -> str:
    task, _, section = key.rpartition("/")
    name = SECTION_TITLES.get(section, section)
    return name if task == "model" else f"{task} · {name}"


def report_facts(report) -> list[tuple[str, str]]:
    m, c = report.meta, report.config
    info = m.get("model_info", {})
    vers = ", ".join(f"{k} {v}" for k, v in (m.get("versions") or {}).items() if v)
    return [
        (
            "model",
            f"{report.model} ({info.get('n_layers', '?')} layers, {info.get('n_heads', '?')} query heads, "
            f"{info.get('n_kv_heads', '?')} KV heads, d_head {info.get('d_head', '?')})",
        ),
        ("tasks", ", ".join(report.tasks)),
        (
            "sizes",
            f"{c.preset}: n = {c.n} pairs, seed {c.seed}, regime n = {c.regime_n}, "
            f"k ≤ {c.k_max} with {c.draws} random draws, SAE on {c.sae_train_pairs} pairs, "
            f"min effect {c.min_effect} logits",
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
    sections = [
        {
            "title": _section_title(k),
            "anchor": _anchor(k),
            "intro": SECTION_INTROS.get(k.rsplit("/", 1)[1], ""),
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
        sections,
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
    sections = [
        {"title": SECTION_TITLES.get(s, s), "anchor": _anchor(s), "intro": "", "rows": rows}
        for s, rows in by_section.items()
    ]
    facts = [
        ("left", f"{a.model} · {', '.join(a.tasks)} · {a.config.preset}"),
        ("right", f"{b.model} · {', '.join(b.tasks)} · {b.config.preset}"),
    ]
    return render_page(
        f"kvnotes · {a.model} vs {b.model}",
        sections,
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
