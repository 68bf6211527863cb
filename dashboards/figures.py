"""Plotly building blocks: curves and bars with their 95% CIs, heatmaps, scatters, the
prompt's text coloured by a per-token value, and the items every panel module makes from
results (`est`, `series`, `say`, `n_note`).

Every token string is HTML-escaped before it reaches a figure or a page: plotly draws text as
its own small HTML dialect (it decodes `&lt;` back to `<` for display), so escaping shows a
token such as `<script>` as text and never as markup.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass

import plotly.graph_objects as go

from kvnotes.analysis.results import TaskResult
from kvnotes.analysis.stats import Estimate

BLUE, ORANGE, GREY, GREEN, RED = "#1f77b4", "#ff7f0e", "#7f7f7f", "#2ca02c", "#d62728"
PALETTE = (BLUE, ORANGE, GREEN, RED, "#9467bd", "#8c564b", "#e377c2", GREY)
DIVERGING = "RdBu_r"  # red = pushes toward the new decision, blue = away; white = 0


def esc(text: object) -> str:
    """HTML-escape any text that comes from data (token strings, task names, descriptions) for a page."""
    return html.escape(str(text), quote=True)


def plotly_text(text: object) -> str:
    """Escape data text for a plotly string (titles, labels, hover): `<`, `>` and `&` only. Plotly's
    markup turns &lt; &gt; &amp; back into characters but would show &quot; or &#x27; as written,
    and quotes outside a tag are no markup there."""
    return html.escape(str(text), quote=False)


_VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}


def visible(token: str) -> str:
    """A token with its whitespace made visible (␣ space, ↵ newline, ⇥ tab; ∅ if empty), for axis
    labels, buttons and tooltips."""
    return "".join(_VISIBLE.get(c, c) for c in token) or "∅"


def slot_label(position: int, token: str) -> str:
    """A unique, escaped axis label for a slot: its position and token."""
    return f"{position}:{plotly_text(visible(token))}"


def style(fig: go.Figure, title: str, x: str, y: str, *, height: int = 380) -> go.Figure:
    fig.update_layout(
        template="plotly_white",
        title={"text": plotly_text(title), "x": 0.01, "y": 0.98, "yanchor": "top", "font": {"size": 15}},
        xaxis_title=plotly_text(x),
        yaxis_title=plotly_text(y),
        height=height,
        margin={"l": 60, "r": 20, "t": 90, "b": 60},
        # above the plot, under the title: below it the legend covered rotated tick labels
        legend={"orientation": "h", "x": 0, "y": 1.0, "xanchor": "left", "yanchor": "bottom"},
        hoverlabel={"namelength": -1},
    )
    return fig


def fmt(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def fmt_ci(mean: float | None, ci: Sequence[float] | None, digits: int = 2) -> str:
    """ "0.83 [0.71, 0.95]", or "n/a" for an undefined mean."""
    if mean is None:
        return "n/a"
    return f"{mean:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]" if ci else f"{mean:.{digits}f}"


def ci_curves(
    series: Sequence[dict],
    *,
    title: str,
    x_title: str,
    y_title: str,
    log_x: bool = False,
    log_y: bool = False,
    height: int = 380,
) -> go.Figure:
    """Lines with a shaded 95% CI band. Each series: {"name", "x", "mean", "ci" (list of [lo, hi]
    or None per point, optional), "n" (optional)}; points whose mean is None are left out."""
    fig = go.Figure()
    for i, s in enumerate(series):
        color = s.get("color") or PALETTE[i % len(PALETTE)]
        ci = s.get("ci") or [None] * len(s["x"])
        pts = [(x, m, c) for x, m, c in zip(s["x"], s["mean"], ci) if m is not None]
        if not pts:
            continue
        xs, ms, cs = zip(*pts)
        band = [(x, c) for x, c in zip(xs, cs) if c]
        if band:
            bx, bc = zip(*band)
            fig.add_trace(
                go.Scatter(
                    x=[*bx, *bx[::-1]],
                    y=[c[1] for c in bc] + [c[0] for c in bc[::-1]],
                    fill="toself",
                    mode="lines",
                    fillcolor=_alpha(color, 0.15),
                    line={"width": 0},
                    hoverinfo="skip",
                    showlegend=False,
                    legendgroup=plotly_text(s["name"]),
                )
            )
        name = plotly_text(s["name"])
        hover = [f"{name}<br>{plotly_text(x_title)} = {x}<br>{fmt_ci(m, c, 3)}" for x, m, c in pts]
        fig.add_trace(
            go.Scatter(
                x=list(xs),
                y=list(ms),
                mode="lines+markers",
                name=plotly_text(s["name"]),
                line={"color": color, "dash": s.get("dash", "solid")},
                legendgroup=plotly_text(s["name"]),
                hovertext=hover,
                hoverinfo="text",
            )
        )
    fig = style(fig, title, x_title, y_title, height=height)
    if log_x:
        fig.update_xaxes(type="log")
    if log_y:
        fig.update_yaxes(type="log")
    return fig


def ci_bars(
    items: Sequence[dict], *, title: str, y_title: str, height: int = 380, reference: float | None = None
) -> go.Figure:
    """Bars with 95% CI error bars. Each item: {"name", "mean", "ci", "n" (optional), "color"
    (optional), "group" (optional legend group)}; undefined means are drawn as empty, labelled n/a."""
    fig = go.Figure()
    groups: dict[str, list[dict]] = {}
    for it in items:
        groups.setdefault(it.get("group", ""), []).append(it)
    for gi, (group, its) in enumerate(groups.items()):
        names = [plotly_text(it["name"]) for it in its]
        means = [it["mean"] if it["mean"] is not None else 0.0 for it in its]
        text = [fmt(it["mean"]) for it in its]
        hover = [
            f"{plotly_text(it['name'])}<br>{fmt_ci(it['mean'], it['ci'], 3)}"
            + (f"<br>n = {it['n']}" if it.get("n") is not None else "")
            for it in its
        ]
        colors = [it.get("color") or PALETTE[gi % len(PALETTE)] for it in its]
        fig.add_trace(
            go.Bar(
                x=names,
                y=means,
                name=plotly_text(group) or None,
                showlegend=bool(group),
                marker_color=colors,
                text=text,
                textposition="outside",
                cliponaxis=False,
                error_y={**error_bars([(it["mean"], it["ci"]) for it in its]), "color": "#333"},
                hovertext=hover,
                hoverinfo="text",
            )
        )
    if reference is not None:
        fig.add_hline(y=reference, line_dash="dot", line_color=GREY)
    fig.update_layout(barmode="group")
    return style(fig, title, "", y_title, height=height)


def error_bars(points: Sequence[tuple[float | None, Sequence[float] | None]]) -> dict:
    """Plotly's `error_y` for (mean, 95% CI) points: the CI's distance above and below each mean (0
    where the mean or its CI is undefined)."""
    hi = [(ci[1] - m) if m is not None and ci else 0.0 for m, ci in points]
    lo = [(m - ci[0]) if m is not None and ci else 0.0 for m, ci in points]
    return {"type": "data", "array": hi, "arrayminus": lo, "visible": True}


def heatmap(
    z: Sequence[Sequence[float | None]],
    x: Sequence[str],
    y: Sequence[str],
    *,
    title: str,
    x_title: str,
    y_title: str,
    colorbar: str,
    zmid: float | None = 0.0,
    height: int = 420,
    colorscale: str = DIVERGING,
) -> go.Figure:
    """A heatmap; `x` and `y` labels must already be escaped (see `slot_label`)."""
    flat = [abs(v) for row in z for v in row if v is not None]
    extent = max(flat) if flat else 1.0
    kw = {"zmid": zmid, "zmin": -extent, "zmax": extent} if zmid is not None else {}
    fig = go.Figure(
        go.Heatmap(
            z=[list(r) for r in z],
            x=list(x),
            y=list(y),
            colorscale=colorscale,
            colorbar={"title": {"text": plotly_text(colorbar)}},
            xgap=1,
            ygap=1,
            hovertemplate="%{y} · %{x}<br>" + plotly_text(colorbar) + " = %{z:.3f}<extra></extra>",
            **kw,
        )
    )
    fig = style(fig, title, x_title, y_title, height=height)
    fig.update_xaxes(tickangle=-60, type="category")
    fig.update_yaxes(type="category")
    return fig


def scatter(
    points: Sequence[dict],
    *,
    title: str,
    x_title: str,
    y_title: str,
    height: int = 400,
    diagonal: bool = False,
) -> go.Figure:
    """Points {"x", "y", "label", "group" (optional)}; labels must be plain text (escaped here)."""
    fig = go.Figure()
    groups: dict[str, list[dict]] = {}
    for p in points:
        groups.setdefault(p.get("group", ""), []).append(p)
    for i, (g, ps) in enumerate(groups.items()):
        fig.add_trace(
            go.Scatter(
                x=[p["x"] for p in ps],
                y=[p["y"] for p in ps],
                mode="markers",
                name=plotly_text(g) or None,
                showlegend=bool(g),
                marker={"color": PALETTE[i % len(PALETTE)], "size": 8, "opacity": 0.8},
                hovertext=[
                    f"{plotly_text(p['label'])}<br>{plotly_text(x_title)} = {fmt(p['x'], 3)}"
                    f"<br>{plotly_text(y_title)} = {fmt(p['y'], 3)}"
                    for p in ps
                ],
                hoverinfo="text",
            )
        )
    if diagonal and points:
        vals = [v for p in points for v in (p["x"], p["y"]) if v is not None]
        lo, hi = min(vals), max(vals)
        fig.add_trace(
            go.Scatter(
                x=[lo, hi],
                y=[lo, hi],
                mode="lines",
                line={"dash": "dot", "color": GREY},
                name="y = x",
                hoverinfo="skip",
            )
        )
    return style(fig, title, x_title, y_title, height=height)


def token_text(
    tokens: Sequence[str],
    values: Sequence[float | None],
    *,
    value_name: str,
    positions: Sequence[int] | None = None,
    marks: Sequence[str] | None = None,
) -> str:
    """The prompt's text as HTML spans coloured by `values` (red positive, blue negative, scaled to
    the largest |value|; None = not measured, uncoloured). Every token is escaped; a tooltip gives
    its position and value; `marks` adds a CSS class `role-<mark>` per token (e.g. "field", "decision")."""
    positions = list(positions) if positions is not None else list(range(len(tokens)))
    known = [abs(v) for v in values if v is not None and math.isfinite(v)]
    scale = max(known) if known and max(known) > 0 else 1.0
    out = []
    for i, (p, tok) in enumerate(zip(positions, tokens)):
        v = values[i]
        cls = "tok" + (f" role-{marks[i]}" if marks and marks[i] else "")
        if v is None or not math.isfinite(v):
            style, tip = "", f"pos {p} · {visible(tok)} · not measured"
        else:
            a = min(abs(v) / scale, 1.0)
            rgb = "214,39,40" if v > 0 else "31,119,180"
            style = f' style="background: rgba({rgb},{a * 0.85:.3f})"'
            tip = f"pos {p} · {visible(tok)} · {value_name} {v:+.3f}"
        text = esc(tok).replace("\n", "↵<br>")
        out.append(f'<span class="{cls}"{style} title="{esc(tip)}">{text}</span>')
    return f'<div class="prompt-text">{"".join(out)}</div>'


def _alpha(hex_color: str, a: float) -> str:
    h = hex_color.lstrip("#")
    r, g, b = (int(h[i : i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{a})"


@dataclass(frozen=True)
class Panel:
    """One view of a result: a plotly figure and/or an HTML fragment (already escaped), a
    one-line `reading` of what it shows, and a `note` on its sizes and intervals (plain text)."""

    title: str
    reading: str
    figure: go.Figure | None = None
    html: str | None = None
    note: str = ""
    key: str = ""  # stable id, e.g. "order-cancel/probes/note_map_text"


# --- items from results (shared by every panel module) ---------------------------------------------


def est(e: Estimate | None, name: str, **kw) -> dict:
    """A bar/curve item from an Estimate (missing → undefined)."""
    if e is None:
        return {"name": name, "mean": None, "ci": None, "n": 0, **kw}
    return {"name": name, "mean": e.mean, "ci": e.ci, "n": e.n, **kw}


def say(e: Estimate | None, digits: int = 2) -> str:
    return fmt_ci(e.mean, e.ci, digits) if e is not None else "n/a"


def n_note(r: TaskResult, what: str = "pairs") -> str:
    n = r.estimate.n
    excl = len(r.excluded)
    s = f"n = {n} {what}; bars and bands are bootstrap 95% CIs of the mean"
    return s + (
        f"; {excl} pair(s) excluded (decision moved too little, listed in report.json)" if excl else ""
    )


def series(name: str, x: list, es: Sequence[Estimate | None], **kw) -> dict:
    """A `ci_curves` series from one Estimate per x (None where not measured)."""
    return {
        "name": name,
        "x": x,
        "mean": [e.mean if e else None for e in es],
        "ci": [e.ci if e else None for e in es],
        **kw,
    }
