"""Panels for the circuit analyses (head grids and top-k curves, scrubbing, attribution, SAE
features) and for a single prompt's attribution. Rendering only: every number comes from the
result objects."""

from __future__ import annotations

from collections.abc import Mapping

from dashboards.figures import (
    GREY,
    Panel,
    ci_bars,
    ci_curves,
    fmt,
    heatmap,
    scatter,
    slot_label,
    token_text,
    visible,
)
from dashboards.probe_panels import est, n_note, say
from probes.results import Curve, ProbeResult


def _curve(c: Curve | None, name: str, **kw) -> dict:
    if c is None:
        return {"name": name, "x": [], "mean": []}
    return {"name": name, "x": list(c.x), "mean": c.means, "ci": [p.ci for p in c.points], **kw}


def circuit_panels(analyses: Mapping[str, ProbeResult], key: str) -> list[Panel]:
    out: list[Panel] = []
    for side in ("read_heads", "write_heads"):
        if side in analyses:
            out += head_panels(analyses[side], f"{key}/{side}")
    if "scrubbing" in analyses:
        out.append(scrubbing_panel(analyses["scrubbing"], key))
    if "attribution" in analyses:
        out += attribution_panels(analyses["attribution"], key)
    if "sae" in analyses:
        out += sae_panels(analyses["sae"], key)
    return out


def head_panels(r: ProbeResult, key: str) -> list[Panel]:
    read = r.name == "read_heads"
    where = "at the decision" if read else "at the note slots"
    g = r.details.get("grouping", {})
    ranking = r.tables.get("ranking", [])
    if not ranking:
        return [
            Panel(
                title=f"{'Read' if read else 'Write'} heads",
                key=key,
                reading=f"Not measured: {r.details.get('not_applicable', 'no usable pairs')}.",
            )
        ]
    L = g.get("n_layers") or 1 + max(row["layer"] for row in ranking)
    H = g.get("n_heads") or 1 + max(row["head"] for row in ranking)
    z: list[list[float | None]] = [[None] * H for _ in range(L)]
    for row in ranking:
        z[row["layer"]][row["head"]] = row["mean"]
    grid = heatmap(
        z,
        [f"H{h}" for h in range(H)],
        [f"L{l}" for l in range(L)],
        title=f"{'Read' if read else 'Write'} heads: one head's output {where} from the new run",
        x_title="query head",
        y_title="layer",
        colorbar="recovery",
        height=max(320, 22 * L + 120),
    )
    top = ranking[0]
    paths = ""
    if read and "path_prefix" in top:
        via = max(
            ("prefix", "field", "notes", "query", "self"), key=lambda p: top[f"path_{p}"]["mean"] or -1e9
        )
        paths = f", mostly via the {via} (path {fmt(top[f'path_{via}']['mean'])})"
    reading = (
        f"The strongest single head is {top['label']} ({fmt(top['mean'])}{paths}); "
        f"{g.get('attention', '')} attention, {g.get('n_kv_heads', '?')} KV head(s) per layer."
    )
    panels = [
        Panel(
            title=f"{'Read' if read else 'Write'}-head grid",
            reading=reading,
            figure=grid,
            note=n_note(r) + "; a cell is the mean over pairs",
            key=f"{key}/grid",
        )
    ]
    curve = ci_curves(
        [
            _curve(r.curves.get("topk_curve"), "top-k heads (cross-fitted ranking)"),
            _curve(r.curves.get("random_curve"), "k random heads", color=GREY, dash="dash"),
        ],
        title=f"Top-k vs random-k {'read' if read else 'write'} heads",
        x_title="k (heads patched)",
        y_title="recovery",
    )
    k = r.details.get("headline_k")
    reading = (
        f"The top {k} heads recover {say(r.parts.get('top_k'))}, {k} random heads "
        f"{say(r.parts.get('random_k'))}; all heads together {say(r.parts.get('all_heads'))}."
    )
    panels.append(
        Panel(
            title=f"Top-k vs random-k ({'read' if read else 'write'})",
            reading=reading,
            figure=curve,
            note=n_note(r) + "; heads ranked on the other half of the pairs",
            key=f"{key}/topk",
        )
    )
    if read and "prefix_path" in r.parts:
        items = [
            est(r.parts.get(f"{p}_path"), f"via the {p}")
            for p in ("prefix", "field", "notes", "query", "self")
        ]
        fig = ci_bars(
            items, title=f"Where the top {k} read heads bring it from (path patching)", y_title="recovery"
        )
        panels.append(
            Panel(
                title="Read paths",
                figure=fig,
                note=n_note(r),
                key=f"{key}/paths",
                reading=f"Through the note slots {say(r.parts.get('notes_path'))}, straight from the "
                f"field {say(r.parts.get('field_path'))}, from the prefix "
                f"{say(r.parts.get('prefix_path'))}.",
            )
        )
    return panels


def scrubbing_panel(r: ProbeResult, key: str) -> Panel:
    names = {
        "hypothesis": "hypothesis (top notes + read heads)",
        "random_circuit": "random circuit, same size",
        "notes_only": "notes only",
        "heads_only": "heads only",
        "with_field": "hypothesis + field",
    }
    items = [est(r.parts.get(k), v) for k, v in names.items() if k in r.parts]
    fig = ci_bars(
        items,
        title="Causal scrubbing: what the hypothesis preserves",
        y_title="effect preserved",
        reference=1.0,
    )
    undefined = r.details.get("undefined")
    reading = (
        f"Undefined here: {undefined}."
        if undefined
        else f"Keeping only the hypothesis preserves {say(r.parts.get('hypothesis'))} of the effect, "
        "a random "
        f"circuit of the same size {say(r.parts.get('random_circuit'))}."
    )
    return Panel(
        title="Causal scrubbing", reading=reading, figure=fig, note=n_note(r), key=f"{key}/scrubbing"
    )


def attribution_panels(r: ProbeResult, key: str) -> list[Panel]:
    rows = r.tables.get("heads", [])
    pts = [{"x": row["activation"], "y": row["attribution"], "label": row["label"]} for row in rows]
    fig = scatter(
        pts,
        title="Attribution patching vs activation patching, per head",
        diagonal=True,
        x_title="activation patching (recovery)",
        y_title="attribution estimate (recovery)",
    )
    reading = (
        f"Spearman's rho between the two head rankings is {say(r.parts.get('rank_correlation'))} "
        f"(slots {say(r.parts.get('slot_rank_correlation'))}); attribution is "
        f"{say(r.parts.get('speedup'))}× faster."
    )
    panels = [
        Panel(
            title="Attribution vs activation patching",
            reading=reading,
            figure=fig,
            note=n_note(r) + "; each point is a head's mean over pairs",
            key=f"{key}/attribution",
        )
    ]
    slots = r.details.get("slots") or []
    if slots:
        s = slots[0]
        labels = [slot_label(p, t) for p, t in zip(s["positions"], s["tokens"])]
        fig = heatmap(
            [s["activation"], s["attribution"]],
            labels,
            ["activation", "attribution"],
            title="Per slot (pair 1): exact transplant vs gradient estimate",
            x_title="slot",
            y_title="",
            colorbar="recovery",
            height=300,
        )
        panels.append(
            Panel(
                title="Slots: exact vs estimate",
                figure=fig,
                key=f"{key}/attribution_slots",
                reading="The same slots ranked two ways: single-slot transplants (one forward each) "
                "and one backward pass.",
                note="pair 1",
            )
        )
    return panels


def sae_panels(r: ProbeResult, key: str) -> list[Panel]:
    d = r.details
    if d.get("not_applicable"):
        return [
            Panel(title="SAE features", reading=f"Not measured: {d['not_applicable']}.", key=f"{key}/sae")
        ]
    rows = d.get("top_features", [])
    pts = [
        {
            "x": row["score"],
            "y": (row.get("recovery") or {}).get("mean"),
            "label": f"feature {row['feature']} (AUC {row['auc']:.2f}, "
            f"high for {row.get('high_for', '?')!r})",
        }
        for row in rows
        if (row.get("recovery") or {}).get("mean") is not None
    ]
    fig = scatter(
        pts,
        title=f"SAE at {d.get('hook_name', '?')}: does a feature that decodes the conclusion carry it?",
        x_title="held-out decoding AUC, max(AUC, 1 − AUC)",
        y_title="single-feature recovery",
    )
    best = d.get("best_feature", {})
    reading = (
        f"{best.get('n_auc_ge_0.99', '?')} features decode the conclusion with AUC ≥ 0.99; the best "
        f"({fmt(best.get('auc'))}) alone recovers {say(r.parts.get('single_feature_recovery'))}; the best "
        f"causal one among the top 32 {say(r.parts.get('best_causal_feature'))}."
    )
    panels = [
        Panel(
            title="SAE: AUC vs causal recovery",
            reading=reading,
            figure=fig,
            note=f"top {len(rows)} features by AUC; {d.get('dead_features', '?')} of {d.get('d_sae', '?')} "
            "features never fire on held-out prompts; " + n_note(r),
            key=f"{key}/sae_scatter",
        )
    ]
    curve = ci_curves(
        [
            _curve(r.curves.get("topk_curve"), "top-k along the conclusion (cross-fitted)"),
            _curve(r.curves.get("auc_topk_curve"), "top-k by AUC", dash="dot"),
            _curve(r.curves.get("random_curve"), "k random changed features", color=GREY, dash="dash"),
        ],
        title="SAE features patched together",
        x_title="k (features)",
        y_title="recovery",
        log_x=True,
    )
    tk = r.curves.get("topk_curve")
    last = f"at k = {tk.x[-1]} {fmt(tk.points[-1].mean)}" if tk and tk.points else ""
    panels.append(
        Panel(
            title="SAE top-k curve",
            figure=curve,
            key=f"{key}/sae_topk",
            note=n_note(r),
            reading=f"Features patched together recover {last}; all features with the error term "
            f"{say(r.parts.get('all_features'))}.",
        )
    )
    scans = [
        _curve(r.curves.get(f"scan_{s}"), f"whole residual at the {s}")
        for s in ("notes", "decision")
        if f"scan_{s}" in r.curves
    ]
    if scans:
        fig = ci_curves(
            scans,
            title="Where the conclusion lives: the whole residual patched after one layer",
            x_title="layer",
            y_title="recovery",
        )
        loc = d.get("located", {})
        panels.append(
            Panel(
                title="Residual scan",
                figure=fig,
                key=f"{key}/scan",
                note=n_note(r),
                reading=f"The SAE was placed at the {loc.get('site', '?')}, layer {loc.get('layer', '?')} "
                "(the rule is in report.json).",
            )
        )
    return panels


def prompt_attribution_panels(a, key: str = "attribution") -> list[Panel]:
    """A single prompt's attribution (`circuits.PromptAttribution`): coloured text and slot × layer."""
    d = a.to_dict()
    tokens, est_grid = d["tokens"], d["estimate"]
    steps = (d.get("meta") or {}).get("steps", 1)
    totals = [sum(col) for col in zip(*est_grid)] if est_grid else []
    exact = {row["position"]: row for row in d.get("exact", [])}
    answers = " vs ".join(repr(x) for x in d.get("answers", []))
    text = token_text(
        tokens,
        totals,
        value_name="estimated effect (logits)",
        positions=d["positions"],
        marks=["exact" if p in exact else "" for p in d["positions"]],
    )
    top = sorted(exact.values(), key=lambda row: -abs(row["total"]))[:3]
    reading = (
        f"Logit difference {answers}: {fmt(d.get('ld'))}; source ({d.get('baseline', '?')}) "
        f"{fmt(d.get('ld_source'))}. Largest exact effects: "
        + "; ".join(f"'{visible(row['token'])}' @{row['position']} {row['total']:+.3f}" for row in top)
        + "."
    )
    panels = [
        Panel(
            title="Attribution over the prompt",
            reading=reading,
            html=text,
            key=f"{key}/text",
            note="colour: first-order estimate summed over layers (logits; red toward the first answer); "
            "outlined slots were refined by exact transplant",
        )
    ]
    if est_grid:
        labels = [slot_label(p, t) for p, t in zip(d["positions"], tokens)]
        fig = heatmap(
            est_grid,
            labels,
            [f"L{l}" for l in range(len(est_grid))],
            title="Slot × layer attribution (gradient estimate)",
            x_title="slot",
            y_title="layer",
            colorbar="logits",
            height=max(320, 22 * len(est_grid) + 140),
        )
        rho = d.get("rank_correlation")
        panels.append(
            Panel(
                title="Slot × layer",
                figure=fig,
                key=f"{key}/slot_layer",
                reading=f"Spearman's rho between estimate and exact transplant over the top slots: "
                f"{fmt(rho)}.",
                note=f"gradients from {steps} forward and backward pass(es) along the path to the source "
                "(integrated gradients when more than one)",
            )
        )
    return panels
