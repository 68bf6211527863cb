"""Panels for the editing and composing experiments and the benches: editing methods side by side,
selective recompute, seam repair, memory blocks, the errata loop, time to first token, the cost
of an edit, the patch-sweep speedup and the exactness invariants. Rendering only."""

from __future__ import annotations

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
from dashboards.registry import for_type, panel
from kvnotes.analysis.results import ProbeResult

# --- edit and compose ---------------------------------------------------------------------------

METHODS = ("refresh", "suffix", "erratum", "hoist", "full")
METHOD_NAMES = {
    "refresh": "field refresh",
    "suffix": "suffix recompute",
    "erratum": "erratum",
    "hoist": "hoist to end (oracle)",
    "full": "full recompute",
}


@panel("edit_methods")
def edit_panels(r: ProbeResult, key: str) -> list[Panel]:
    ks = list(r.ks)
    sel = [f"selective_causal@{k}" for k in ks if f"selective_causal@{k}" in r.parts]
    best_sel = max(sel, key=lambda m: (r.parts[m].mean or -1e9, -int(m.split("@")[1])), default=None)
    names = [m for m in METHODS if m in r.parts] + ([best_sel] if best_sel else [])
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
def seam_panels(r: ProbeResult, key: str) -> list[Panel]:
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
def keystone_panels(r: ProbeResult, key: str) -> list[Panel]:
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
def agent_panels(r: ProbeResult, key: str) -> list[Panel]:
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
def memory_panels(r: ProbeResult, key: str) -> list[Panel]:
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


# --- cost benches -------------------------------------------------------------------------------


@panel("ttft")
def ttft_panels(b, key: str) -> list[Panel]:
    pts = b.results
    if not pts:
        return [Panel(title="Time to first token", reading="Not measured.", key=f"{key}/ttft")]
    xs = [p.tokens for p in pts]
    last = pts[-1]
    k = last.timed_hosts
    paths = [
        ("full prefill", "full_s"),
        ("prefix-cached (host + chunk cached)", "prefix_cached_s"),
        (f"composed, same host (seam {b.seam})", "composed_s"),
        (f"composed, {k} different hosts", "multi_host_composed_s"),
        (f"prefix-cached, {k} different hosts", "multi_host_prefix_cached_s"),
        (f"full prefill, {k} different hosts", "multi_host_full_s"),
    ]
    fig = ci_curves(  # series with no values (reports from before the four paths) are left out
        [{"name": name, "x": xs, "mean": [getattr(p, attr) for p in pts]} for name, attr in paths],
        title="Time to first token per request: four paths",
        x_title="context tokens",
        y_title="seconds",
        log_x=True,
        log_y=True,
    )
    reading = (
        f"At {last.tokens} tokens composing takes {last.composed_s:.3f} s against {last.full_s:.3f} s "
        f"for full prefill ({last.ratio:.1f}×)"
    )
    if last.prefix_cached_s is not None:
        reading += (
            f"; with the same host every time, prefix caching is exact and takes {last.prefix_cached_s:.3f} s"
        )
    reading += (
        f". Fitted growth exponents: composed {fmt(b.exponent_composed)}, full {fmt(b.exponent_full)}; "
        f"top-1 agrees at {sum(p.top1_agree for p in pts)}/{len(pts)} lengths."
    )
    if last.null_cosine is not None:  # reports written before the null baseline have none
        reading += (
            f" Logit cosine to full prefill {last.logit_cosine:.5f}, against {last.null_cosine:.5f} "
            "between the full logits of two unrelated contexts of that length."
        )
    note = (
        f"median of {last.repeats} side-by-side timing(s) per point, {b.machine}; no CI: a "
        "benchmark, not an estimate over prompts"
    )
    panels = [Panel(title="TTFT curves", reading=reading, figure=fig, note=note, key=f"{key}/ttft")]
    multi = [p for p in pts if p.multi_host_ratio is not None]
    if multi:
        panels.append(_multi_host_panel(b, multi, key, note))
    return panels


def _multi_host_panel(b, pts: list, key: str, note: str) -> Panel:
    """The case splicing exists for: one precompiled chunk after different hosts, against prefix
    caching (which reuses only BOS there) and full prefill, with the decision checked."""
    xs = [p.tokens for p in pts]
    fig = ci_curves(
        [
            {"name": "prefix-cached / composed", "x": xs, "mean": [p.multi_host_ratio for p in pts]},
            {"name": "full prefill / composed", "x": xs, "mean": [p.multi_host_full_ratio for p in pts]},
        ],
        title=f"One chunk after {pts[-1].timed_hosts} different hosts: speed-up of composing",
        x_title="context tokens",
        y_title="× (per request, medians)",
        log_x=True,
    )
    last = pts[-1]
    reading = (
        f"After {last.timed_hosts} different host lines, at {last.tokens} tokens a request takes "
        f"{last.multi_host_composed_s:.3f} s composed, {last.multi_host_prefix_cached_s:.3f} s with "
        f"prefix caching ({last.multi_host_ratio:.1f}×; it can reuse only what the hosts share) and "
        f"{last.multi_host_full_s:.3f} s with full prefill ({last.multi_host_full_ratio:.1f}×); growth "
        f"exponent of the composed path {fmt(b.exponent_multi_host_composed)}. Over {last.hosts} hosts "
        f"at seam {b.seam} the composed decision is full recompute's for "
        f"{fmt(last.decision_agreement)} of them (top-1 {fmt(last.multi_host_top1_rate)}, logit cosine "
        f"{fmt(last.multi_host_cosine, 5)}); {fmt(last.decision_balance)} of full recompute's decisions "
        f"are the first answer and the closest is {fmt(last.decision_min_margin)} logits from flipping, "
        "so agreement means most where decisions differ and margins are small."
    )
    return Panel(
        title="Multi-host splice", reading=reading, figure=fig, note=note, key=f"{key}/ttft_multi_host"
    )


@panel("edit_cost")
def edit_cost_panels(b, key: str) -> list[Panel]:
    pts = b.results
    if not pts:
        return [Panel(title="Edit cost", reading="Not measured.", key=f"{key}/edit_cost")]
    xs = [p.field_position for p in pts]
    fig = ci_curves(
        [
            {"name": "full prefill", "x": xs, "mean": [p.full_s for p in pts]},
            {"name": "suffix recompute", "x": xs, "mean": [p.suffix_s for p in pts]},
            {"name": "erratum", "x": xs, "mean": [p.erratum_s for p in pts]},
        ],
        title=f"One changed field in a {pts[0].tokens}-token prompt: time to update",
        x_title="position of the changed field",
        y_title="seconds",
    )
    reading = (
        f"An erratum costs {min(p.erratum_s for p in pts):.3f}–{max(p.erratum_s for p in pts):.3f} s "
        "wherever "
        f"the field is; suffix recompute grows from {pts[-1].suffix_s:.3f} s (field near the end) to "
        f"{pts[0].suffix_s:.3f} s (near the start); full prefill ≈ {pts[0].full_s:.3f} s."
    )
    checked = [p for p in pts if p.erratum_agrees is not None]
    if checked:  # reports written before the answers were checked have none
        same = sum(p.erratum_agrees for p in checked)
        recs = [p.erratum_recovery for p in checked if p.erratum_recovery is not None]
        reading += (
            f" The erratum's decision is full recompute's at {same} of {len(checked)} positions"
            + (f" (recovery {min(recs):.2f}–{max(recs):.2f})" if recs else "")
            + f"; suffix recompute's at {sum(bool(p.suffix_agrees) for p in checked)} of {len(checked)}."
        )
    return [
        Panel(
            title="Edit cost",
            reading=reading,
            figure=fig,
            note=f"median of {pts[0].repeats} timing(s) per point, {b.machine}",
            key=f"{key}/edit_cost",
        )
    ]


# --- the engine ---------------------------------------------------------------------------------


@panel("patch_sweep")
def sweep_panels(b, key: str) -> list[Panel]:
    """Each way's time over the engine's, per prompt length: the naive way first, then every strong
    baseline that ran (> 1: the engine is faster)."""
    xs = [p.tokens for p in b.results]
    names = list(dict.fromkeys(x.name for p in b.results for x in p.baselines))
    curves = [{"name": "naive, one forward per patch", "x": xs, "mean": [p.ratio for p in b.results]}]
    for name in names:
        ratios = [next((x.ratio for x in p.baselines if x.name == name), None) for p in b.results]
        curves.append({"name": name.replace("_", " "), "x": xs, "mean": ratios})
    fig = ci_curves(
        curves,
        title="Per-slot transplant sweep: each way's time over the engine's",
        x_title="prompt tokens",
        y_title="× engine time",
        log_y=True,
    )
    readings = []
    for p in b.results:
        text = f"{p.tokens} tokens: engine {p.engine_s:.2f} s, naive {p.ratio:.0f}× slower"
        if p.baselines:
            best = min(p.baselines, key=lambda x: x.seconds)
            name = best.name.replace("_", " ")
            text += f", fastest baseline {name} {best.seconds:.2f} s ({best.ratio:.2f}×)"
        readings.append(text)
    skipped = sorted({n for p in b.results for n in p.skipped})
    reps = b.results[0].repeats if b.results else 1
    note = f"median of {reps} timing(s) per way, {b.machine}"
    if skipped:
        note += "; not run: " + ", ".join(skipped)
    return [
        Panel(
            title="Patch-sweep speedup",
            figure=fig,
            key=key,
            note=note,
            reading="; ".join(readings) + ".",
        )
    ]


@for_type("VerifyReport")
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
                    + ("" if r.gap_multiple is None else f"<br>{r.gap_multiple:.2f}x float32's own gap")
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


@panel("serve")
def serve_panels(b, key: str) -> list[Panel]:
    """The online serving bench: TTFT and prefix-cache hit rate per prompt strategy and arrival rate,
    and the agent loop's decisions and cumulative TTFT against recomputing every turn."""
    pts = b.results
    if not pts:
        return [Panel(title="Serving", reading="Not measured.", key=f"{key}/serve")]
    strategies = list(dict.fromkeys(p.strategy for p in pts))
    rates = sorted({p.rate for p in pts})
    fig = ci_curves(
        [
            {
                "name": f"{s} p90",
                "x": rates,
                "mean": [b.point(s, r).ttft_p90 if b.point(s, r) else None for r in rates],
            }
            for s in strategies
        ],
        title="p90 time to first token against the arrival rate",
        x_title="requests per second offered",
        y_title="seconds",
        log_y=True,
    )
    top = rates[-1]
    e, i = b.point("erratum", top), b.point("in_place", top)
    reading = f"At {top:g} requests/s: " + "; ".join(
        f"{s} p90 {b.point(s, top).ttft_p90:.3f} s, hit rate "
        f"{'n/a' if b.point(s, top).hit_rate is None else f'{100 * b.point(s, top).hit_rate:.1f}%'}"
        for s in strategies
        if b.point(s, top)
    )
    if e and i and e.ttft_p90 > 0:
        reading += f". In place / erratum p90: {i.ttft_p90 / e.ttft_p90:.1f}×."
    note = (
        f"{b.sessions} sessions of ~{b.tokens} tokens ({b.task}), {pts[0].requests} Poisson arrivals "
        f"per point, {b.server.get('vllm', 'vLLM')} with prefix blocks of {b.server.get('block_size')} "
        f"tokens, {b.machine}"
    )
    bars = ci_bars(
        [
            {"name": f"{p.strategy} @ {p.rate:g}/s", "mean": p.hit_rate, "ci": None, "group": p.strategy}
            for p in pts
        ],
        title="prefix-cache hit rate (tokens hit / tokens queried)",
        y_title="hit rate",
    )
    agree = "; ".join(f"{p.strategy} @ {p.rate:g}/s agrees on {fmt(p.decision_agreement)}" for p in pts)
    panels = [
        Panel(title="Serving: TTFT", reading=reading, figure=fig, note=note, key=f"{key}/serve"),
        Panel(
            title="Serving: prefix-cache hits and decisions",
            reading=f"Decisions against the freshly rendered prompt: {agree}.",
            figure=bars,
            note=note,
            key=f"{key}/serve_hits",
        ),
    ]
    if b.agent:
        panels.append(_serve_agent_panel(b, key))
    return panels


def _serve_agent_panel(b, key: str) -> Panel:
    """The agent loop on the server: each strategy's per-turn agreement with recomputing every turn."""
    turns = b.agent[0].turns
    curves = ci_curves(
        [{"name": a.strategy, "x": list(range(1, turns + 1)), "mean": a.per_turn_agreement} for a in b.agent],
        title="agent loop: agreement with recompute-every-turn per turn",
        x_title="turn",
        y_title="share of prompts",
    )
    reading = "; ".join(
        f"{a.strategy}: agreement {fmt(a.agreement)}, follows the rule {fmt(a.follows)}, "
        f"cumulative TTFT {a.cumulative_ttft:.2f} s"
        for a in b.agent
    )
    agent_note = (
        f"{b.agent_task}, {b.agent[0].prompts} prompt(s) × {turns} turns, one request at a time, "
        f"{b.server.get('vllm', 'vLLM')}, {b.machine}"
    )
    return Panel(
        title="Serving: agent loop",
        reading=reading,
        figure=curves,
        note=agent_note,
        key=f"{key}/serve_agent",
    )


@for_type("SlotSweep")
def slot_sweep_panels(r, key: str) -> list[Panel]:
    """The per-slot transplant sweep as one nnsight session (`kvnotes.serving.remote`): recovery per slot."""
    fig = go.Figure(
        [
            go.Bar(
                x=[str(s) for s in r.slots],
                y=r.recovery,
                hovertext=[
                    f"slot {s}<br>ld {x:+.3f}<br>recovery {v:.3f}"
                    for s, x, v in zip(r.slots, r.ld, r.recovery)
                ],
                hoverinfo="text",
                marker_color=GREEN,
            )
        ]
    )
    fig = style(fig, f"Slot sweep on {r.model} ({r.where})", "slot (position)", "recovery")
    best = max(range(len(r.slots)), key=lambda i: r.recovery[i], default=None)
    reading = (
        f"Moving one slot's K/V (all layers) from the new prompt: slot {r.slots[best]} recovers the most, "
        f"{r.recovery[best]:.2f} of the decision (ld old {r.ld_old:+.2f}, new {r.ld_new:+.2f})."
        if best is not None
        else "No slots were swept."
    )
    note = (
        f"request: {r.request.payload_bytes:,} bytes, largest tensor {r.request.largest_tensor} elements"
        if r.request is not None
        else None
    )
    return [Panel(title="Slot sweep", reading=reading, figure=fig, key=key, note=note)]
