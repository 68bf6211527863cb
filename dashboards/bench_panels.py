"""Panels for the benchmarks (`kvnotes bench ...`): time to first token, the cost of an edit, the
patch-sweep speedup, the erratum pattern on a vLLM server, and the per-slot sweep as one nnsight
session (`kvnotes sweep`). Rendering only."""

from __future__ import annotations

import plotly.graph_objects as go

from dashboards.figures import (
    GREEN,
    Panel,
    ci_bars,
    ci_curves,
    fmt,
    style,
)
from dashboards.registry import panel

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


@panel("patch_semantics")
def patch_semantics_panels(b, key: str) -> list[Panel]:
    """The per-slot sweep under both patching semantics: seconds per way, and how far apart the two
    questions' answers are."""
    if not b.results:
        return [Panel(title="Patching semantics", reading="Not measured.", key=f"{key}/patch_semantics")]
    r = b.results[0]
    ways = [
        ("kvnotes, later slots kept", r.keep_s),
        ("kvnotes, recomputed", r.recompute_s),
        ("TransformerLens run_with_hooks", r.run_with_hooks_s),
    ]
    fig = go.Figure(go.Bar(x=[w for w, _ in ways], y=[s for _, s in ways], marker_color=GREEN))
    style(fig, f"A {r.slots}-slot sweep of a {r.tokens}-token prompt", "way", "seconds")
    reading = (
        f"Recomputing later positions, as TransformerLens patches, takes {r.recompute_s:.3f} s here "
        f"against run_with_hooks' {r.run_with_hooks_s:.3f} s ({r.run_with_hooks_s / r.recompute_s:.2f}×), "
        "with the same "
        f"logits to {r.agree:.1e}. Keeping them (kvnotes' default) asks what the decision reads from a slot: "
        f"its answers differ from TransformerLens's by up to {r.semantics_gap:.4f} logits on an effect of "
        f"{r.effect:.3f}."
    )
    note = f"median of {r.repeats} timing(s), {b.machine}"
    return [
        Panel(
            title="Patching semantics", reading=reading, figure=fig, note=note, key=f"{key}/patch_semantics"
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


@panel("slot_sweep")
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
        else ""  # no note (Panel.note is a str; every reader tests it for truth)
    )
    return [Panel(title="Slot sweep", reading=reading, figure=fig, key=key, note=note)]
