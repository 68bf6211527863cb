"""Panels for the editing and composing experiments: editing methods side by side, selective
recompute, seam repair, memory blocks, the errata loop, and the exactness invariants (`verify`).
The benches' panels are in `dashboards/bench_panels.py`. Rendering only."""

from __future__ import annotations

from typing import TYPE_CHECKING

import plotly.graph_objects as go

from dashboards.figures import (
    BLUE,
    GREEN,
    GREY,
    RED,
    Panel,
    ci_bars,
    ci_curves,
    error_bars,
    est,
    fmt,
    fmt_ci,
    n_note,
    plotly_text,
    say,
    series,
    style,
)
from dashboards.registry import panel
from kvnotes.analysis.results import TaskResult

if TYPE_CHECKING:  # the result classes, for their fields; importing them would load each probe module
    from probes.agent import AgentLoop
    from probes.compose import SeamRepair
    from probes.edit import EditMethods
    from probes.keystone import Keystone

# --- edit and compose ---------------------------------------------------------------------------

EDIT_METHODS = ("refresh", "suffix", "erratum", "hoist", "full")
METHOD_NAMES = {
    "refresh": "field refresh",
    "suffix": "suffix recompute",
    "erratum": "erratum",
    "hoist": "hoist to end (oracle)",
    "full": "full recompute",
}


@panel("edit_methods")
def edit_panels(r: EditMethods, key: str) -> list[Panel]:
    ks = list(r.ks)
    sel = [f"selective_causal@{k}" for k in ks if f"selective_causal@{k}" in r.parts]
    best_sel = max(sel, key=lambda m: (r.parts[m].mean or -1e9, -int(m.split("@")[1])), default=None)
    names = [m for m in EDIT_METHODS if m in r.parts] + ([best_sel] if best_sel else [])
    label = lambda m: METHOD_NAMES.get(m, m.replace("_", " "))  # noqa: E731
    items = [est(r.parts[m], label(m), group="recovery") for m in names]
    items += [est(r.part(f"{m}.agree"), label(m), group="same answer as full recompute") for m in names]
    fig = ci_bars(
        items, title="Editing methods side by side (one changed field)", y_title="fraction", reference=1.0
    )
    cost = ", ".join(
        f"{label(m)} {fmt(r.parts[f'{m}.tokens'].mean, 0)} tokens"
        for m in names
        if f"{m}.tokens" in r.parts and r.parts[f"{m}.tokens"].mean is not None
    )
    reading = (
        f"The erratum recovers {say(r.part('erratum'))}, field refresh {say(r.part('refresh'))}, "
        f"suffix recompute {say(r.part('suffix'))}. Tokens computed: {cost}."
    )
    panels = [
        Panel(title="Editing methods", reading=reading, figure=fig, note=n_note(r), key=f"{key}/methods")
    ]
    curves = []
    for kind, name in (("causal", "ranked by causal effect"), ("deviation", "ranked by KV deviation")):
        xs = [k for k in ks if f"selective_{kind}@{k}" in r.parts]
        if xs:
            curves.append(series(f"selective@K, {name}", xs, [r.parts[f"selective_{kind}@{k}"] for k in xs]))
    if curves:
        fig = ci_curves(
            curves,
            title="Selective recompute: K slots refreshed",
            x_title="K",
            y_title="recovery",
            log_x=True,
        )
        reading = (
            f"The best selective recompute is K = {best_sel.split('@')[1]} ({say(r.parts[best_sel])})."
            if best_sel
            else ""
        )
        panels.append(
            Panel(
                title="Selective recompute",
                reading=reading,
                figure=fig,
                note=n_note(r),
                key=f"{key}/selective",
            )
        )
    return panels


@panel("seam_repair")
def seam_panels(r: SeamRepair, key: str) -> list[Panel]:
    seams = list(r.seams)
    curves = [
        series(f"logit cosine, {name}", seams, [r.part(f"{prefix}@{b}") for b in seams], dash=dash)
        for prefix, name, dash in (
            ("cosine", "re-rotated", "solid"),
            ("norot_cosine", "not re-rotated", "dash"),
        )
    ]
    curves += [
        series(name, seams, [r.part(f"{prefix}@{b}") for b in seams], dash="dot")
        for prefix, name in (
            ("agree", "same answer, re-rotated"),
            ("norot_agree", "same answer, not re-rotated"),
        )
    ]
    fig = ci_curves(
        curves,
        title="Seam repair: chunk tokens recomputed in context",
        x_title="seam b (tokens)",
        y_title="agreement with full recompute",
    )
    reading = (
        f"With no repair the spliced chunk's logits have cosine {say(r.part(f'cosine@{seams[0]}'), 4)} "
        f"to full recompute; recomputing {seams[-1]} seam tokens gives "
        f"{say(r.part(f'cosine@{seams[-1]}'), 4)}; without re-rotation "
        f"{say(r.part(f'norot_cosine@{seams[-1]}'), 4)}."
        if seams
        else "Not measured."
    )
    return [
        Panel(
            title="Seam-repair curve",
            reading=reading,
            figure=fig,
            note=f"n = {r.estimate.n} prompt × host-offset runs; 95% bootstrap CIs",
            key=f"{key}/seam",
        )
    ]


@panel("keystone")
def keystone_panels(r: Keystone, key: str) -> list[Panel]:
    """Every editing method's recovery on the composed notebook against the recomputed one, with the
    diagonal, and the same without re-rotation (the ablation that must leave it)."""
    names = list(r.methods)
    if not names:
        return [Panel(title="Keystone", key=f"{key}/keystone", reading="Not measured: no usable pairs.")]
    fig = go.Figure()
    lo, hi = 0.0, 1.0
    for side, label, color in (
        ("composed", "re-rotated and spliced", BLUE),
        ("norot", "not re-rotated", GREY),
    ):
        xs = [r.part(f"recomputed.{m}") for m in names]
        ys = [r.part(f"{side}.{m}") for m in names]
        pts = [(m, x, y) for m, x, y in zip(names, xs, ys) if x.mean is not None and y.mean is not None]
        lo = min([lo] + [min(x.mean, y.mean) for _, x, y in pts])
        hi = max([hi] + [max(x.mean, y.mean) for _, x, y in pts])
        fig.add_trace(
            go.Scatter(
                x=[x.mean for _, x, _ in pts],
                y=[y.mean for _, _, y in pts],
                mode="markers+text" if side == "composed" else "markers",
                text=[plotly_text(m) for m, _, _ in pts] if side == "composed" else None,
                textposition="top right",
                name=label,
                marker={"color": color, "size": 9},
                error_x={**error_bars([(x.mean, x.ci) for _, x, _ in pts]), "thickness": 1},
                error_y={**error_bars([(y.mean, y.ci) for _, _, y in pts]), "thickness": 1},
                hovertext=[
                    f"{plotly_text(m)} ({label})<br>recomputed {fmt_ci(x.mean, x.ci, 3)}"
                    f"<br>composed {fmt_ci(y.mean, y.ci, 3)}"
                    for m, x, y in pts
                ],
                hoverinfo="text",
            )
        )
    fig.add_trace(
        go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="diagonal", line={"color": RED, "dash": "dot"})
    )
    style(
        fig,
        "Keystone: editing a composed cache",
        "recovery on the recomputed cache",
        "recovery on the composed cache",
        height=460,
    )
    d, n = r.diagonal, r.norot_diagonal
    reading = (
        f"Farthest from the diagonal: {d.get('method', 'n/a')}, composed minus recomputed "
        f"{fmt_ci(d.get('gap'), d.get('ci'), 3)}; without re-rotation {n.get('method', 'n/a')} "
        f"{fmt_ci(n.get('gap'), n.get('ci'), 3)}."
        if d
        else "Not measured."
    )
    return [
        Panel(
            title="Keystone: every edit, composed against recomputed",
            reading=reading,
            figure=fig,
            note=n_note(r) + f"; a host of {r.host} tokens, the skill's first {r.seam} tokens recomputed at "
            "the seam; each method's recovery uses its notebook's own old decision and the same target "
            "(the new prompt prefilled whole)",
            key=f"{key}/keystone",
        )
    ]


@panel("agent_loop")
def agent_panels(r: AgentLoop, key: str) -> list[Panel]:
    turns = list(range(1, r.turns + 1))
    es = [r.part(f"cosine@{t}") for t in turns]
    ag = [r.part(f"agree@{t}") for t in turns]
    fig = ci_curves(
        [series("logit cosine to recompute", turns, es), series("same answer", turns, ag, dash="dot")],
        title="Agent loop: one erratum per turn vs recompute every turn",
        x_title="turn",
        y_title="agreement",
    )
    reading = (
        f"After {len(turns)} errata the cache's logits have cosine {say(r.part('cosine_last'), 4)} to a "
        f"full recompute (worst turn {say(r.part('cosine_min'), 4)}); the answer follows the latest "
        f"erratum {say(r.part('follows'))} of the time."
    )
    return [
        Panel(
            title="Errata loop",
            reading=reading,
            figure=fig,
            note=f"n = {r.estimate.n} prompts",
            key=f"{key}/agent",
        )
    ]


@panel("memory_blocks")
def memory_panels(r: TaskResult, key: str) -> list[Panel]:
    items = [
        est(r.part(k), name)
        for k, name in (
            ("split_agree", "split blocks: same answer"),
            ("colocated_agree", "colocated: same answer"),
            ("split_cosine", "split: logit cosine"),
            ("colocated_cosine", "colocated: logit cosine"),
            ("reference_correct", "full recompute answers right"),
        )
    ]
    fig = ci_bars(
        items,
        title="Memory blocks: two-hop facts in separately compiled blocks",
        y_title="fraction",
        reference=1.0,
    )
    reading = (
        f"With the two facts in separately compiled blocks the answer matches full recompute "
        f"{say(r.part('split_agree'))} of the time, against {say(r.part('colocated_agree'))} "
        "when they share a block."
    )
    return [
        Panel(
            title="Memory blocks",
            reading=reading,
            figure=fig,
            note=f"n = {r.estimate.n} prompts",
            key=f"{key}/memory",
        )
    ]


@panel("verify")
def verify_panels(v, key: str) -> list[Panel]:
    """The exactness invariants: each one's largest error against its tolerance (log scale)."""
    names = [plotly_text(r.name) for r in v.invariants]
    errs = [max(r.max_abs_error, 1e-12) for r in v.invariants]
    fig = go.Figure(
        [
            go.Bar(
                x=names,
                y=errs,
                name="max |error|",
                marker_color=[GREEN if r.passed else RED for r in v.invariants],
                hovertext=[
                    f"{plotly_text(r.description)}<br>max |error| {r.max_abs_error:.3e}"
                    f"<br>tolerance {r.tolerance:.1e}"
                    + ("" if r.gap_multiple is None else f"<br>{r.gap_multiple:.2f}x {v.dtype}'s own gap")
                    for r in v.invariants
                ],
                hoverinfo="text",
            ),
            go.Scatter(
                x=names,
                y=[r.tolerance for r in v.invariants],
                mode="markers",
                marker={"symbol": "line-ew-open", "size": 30, "color": "#333"},
                name="tolerance",
            ),
        ]
    )
    fig = style(fig, f"Exactness invariants on {v.model}", "", "largest |error| (0 is drawn at 1e-12)")
    fig.update_yaxes(type="log")
    failed = [r.name for r in v.invariants if not r.passed]
    reading = (
        f"All {len(v.invariants)} invariants hold within tolerance."
        if not failed
        else f"{len(failed)} invariant(s) fail: {', '.join(failed)}."
    )
    return [
        Panel(
            title="Exactness",
            reading=reading,
            figure=fig,
            key=key,
            note="prompts: " + ", ".join(f"{k} ({n} tokens)" for k, n in v.prompts.items()),
        )
    ]
