"""Panels for the circuit analyses (head grids and top-k curves, scrubbing, attribution, SAE
features) and for a single prompt's attribution. Rendering only: every number comes from the
result objects."""

from __future__ import annotations

from circuits.attribution import AttributionPatching
from circuits.features import SAEFeatures
from circuits.read_write import HeadCircuit
from circuits.scrubbing import Scrubbing
from dashboards.figures import (
    GREY,
    Panel,
    ci_bars,
    ci_curves,
    est,
    fmt,
    heatmap,
    n_note,
    say,
    scatter,
    slot_label,
    token_text,
    visible,
)
from dashboards.registry import for_type, panel
from kvnotes.analysis.results import Curve
from probes.controls import crossing_summary


def _curve(c: Curve | None, name: str, **kw) -> dict:
    if c is None:
        return {"name": name, "x": [], "mean": []}
    return {"name": name, "x": list(c.x), "mean": c.means, "ci": [p.ci for p in c.points], **kw}


@panel("read_heads", "write_heads")
def head_panels(r: HeadCircuit, key: str) -> list[Panel]:
    """A head circuit: the layer × head grid, top-k against random-k, and (read side) the paths."""
    key = f"{key}/{r.name}"
    read = r.name == "read_heads"
    ranking = r.tables.get("ranking", [])
    if not ranking:
        return [
            Panel(
                title=f"{'Read' if read else 'Write'} heads",
                key=key,
                reading=f"Not measured: {r.not_applicable or 'no usable pairs'}.",
            )
        ]
    panels = [_head_grid_panel(r, key, ranking), _topk_panel(r, key)]
    if read and "prefix_path" in r.parts:
        panels.append(_read_paths_panel(r, key))
    return panels


def _head_grid_panel(r: HeadCircuit, key: str, ranking: list) -> Panel:
    """One head's output patched from the new run, every layer × head, and the strongest one."""
    read = r.name == "read_heads"
    where = "at the decision" if read else "at the note slots"
    g = r.grouping
    L, H = g.n_layers, g.n_heads
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
        f"{g.attention} attention, {g.n_kv_heads} KV head(s) per layer."
    )
    return Panel(
        title=f"{'Read' if read else 'Write'}-head grid",
        reading=reading,
        figure=grid,
        note=n_note(r) + "; a cell is the mean over pairs",
        key=f"{key}/grid",
    )


def _topk_panel(r: HeadCircuit, key: str) -> Panel:
    """Recovery of the top-k heads (ranked on held-out pairs) against k random heads."""
    read = r.name == "read_heads"
    curve = ci_curves(
        [
            _curve(r.curve("topk_curve"), "top-k heads (cross-fitted ranking)"),
            _curve(r.curve("random_curve"), "k random heads", color=GREY, dash="dash"),
        ],
        title=f"Top-k vs random-k {'read' if read else 'write'} heads",
        x_title="k (heads patched)",
        y_title="recovery",
    )
    k = r.headline_k
    reading = (
        f"The top {k} heads recover {say(r.part('top_k'))}, {k} random heads "
        f"{say(r.part('random_k'))}; all heads together {say(r.part('all_heads'))}."
    )
    return Panel(
        title=f"Top-k vs random-k ({'read' if read else 'write'})",
        reading=reading,
        figure=curve,
        note=n_note(r) + "; heads ranked on the other half of the pairs",
        key=f"{key}/topk",
    )


def _read_paths_panel(r: HeadCircuit, key: str) -> Panel:
    """Path patching of the top read heads: where what they read comes from."""
    items = [est(r.part(f"{p}_path"), f"via the {p}") for p in ("prefix", "field", "notes", "query", "self")]
    fig = ci_bars(
        items,
        title=f"Where the top {r.headline_k} read heads bring it from (path patching)",
        y_title="recovery",
    )
    return Panel(
        title="Read paths",
        figure=fig,
        note=n_note(r),
        key=f"{key}/paths",
        reading=f"Through the note slots {say(r.part('notes_path'))}, straight from the "
        f"field {say(r.part('field_path'))}, from the prefix "
        f"{say(r.part('prefix_path'))}.",
    )


@panel("scrubbing")
def scrubbing_panel(r: Scrubbing, key: str) -> list[Panel]:
    names = {
        "hypothesis": "hypothesis (top notes + read heads)",
        "random_circuit": "random circuit, same size",
        "notes_only": "notes only",
        "heads_only": "heads only",
        "with_field": "hypothesis + field",
        "hypothesis_xfit": "hypothesis ranked on the other pairs",
        "matched_circuit": "matched circuit (same region, class, layers)",
    }
    items = [est(r.part(k), v) for k, v in names.items() if k in r.parts]
    fig = ci_bars(
        items,
        title="Causal scrubbing: what the hypothesis preserves",
        y_title="effect preserved",
        reference=1.0,
    )
    undefined = r.undefined
    if undefined:
        reading = f"Undefined here: {undefined}."
    elif "hypothesis_xfit" in r.parts:
        reading = (
            "Keeping only the hypothesis chosen on the other pairs preserves "
            f"{say(r.part('hypothesis_xfit'))} of the effect, a circuit matched to it in region, "
            f"token class and layers {say(r.part('matched_circuit'))}; chosen on the same pairs it "
            f"preserves {say(r.part('hypothesis'))}."
            + ("" if r.cross_fitted else f" Cross-fitting: {_crossing(r)}.")
        )
    else:  # a report written before the out-of-sample parts
        reading = (
            f"Keeping only the hypothesis preserves {say(r.part('hypothesis'))} of the effect, "
            f"a random circuit of the same size {say(r.part('random_circuit'))}."
        )
    return [
        Panel(title="Causal scrubbing", reading=reading, figure=fig, note=n_note(r), key=f"{key}/scrubbing")
    ]


@panel("attribution")
def attribution_panels(r: AttributionPatching, key: str) -> list[Panel]:
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
        f"Spearman's rho between the two head rankings is {say(r.part('rank_correlation'))} "
        f"(slots {say(r.part('slot_rank_correlation'))}); attribution is "
        f"{say(r.part('speedup'))}× faster."
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
    slots = r.slots
    if slots:
        s = slots[0]
        labels = [slot_label(p, t) for p, t in zip(s.positions, s.tokens)]
        fig = heatmap(
            [list(s.activation), list(s.attribution)],
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


@panel("sae")
def sae_panels(r: SAEFeatures, key: str) -> list[Panel]:
    """SAE features: decoding AUC against causal recovery, the top-k curve, the residual scan."""
    if r.not_applicable:
        return [Panel(title="SAE features", reading=f"Not measured: {r.not_applicable}.", key=f"{key}/sae")]
    rows = r.top_features
    pts = [
        {
            "x": row.score,
            "y": row.recovery.mean,
            "label": f"feature {row.feature} (AUC {row.auc:.2f}, high for {row.high_for!r})",
        }
        for row in rows
        if row.recovery is not None and row.recovery.mean is not None
    ]
    fig = scatter(
        pts,
        title=f"SAE at {r.hook_name}: does a feature that decodes the conclusion carry it?",
        x_title="held-out decoding AUC, max(AUC, 1 − AUC)",
        y_title="single-feature recovery",
    )
    best = r.best_feature
    reading = (
        f"{best['n_auc_ge_0.99']} features decode the conclusion with AUC ≥ 0.99; the best "
        f"({fmt(best['auc'])}) alone recovers {say(r.part('single_feature_recovery'))}; the best "
        f"causal one among the top 32 {say(r.part('best_causal_feature'))}."
    )
    panels = [
        Panel(
            title="SAE: AUC vs causal recovery",
            reading=reading,
            figure=fig,
            note=f"top {len(rows)} features by AUC; {r.dead_features} of {r.d_sae} "
            "features never fire on held-out prompts; " + n_note(r),
            key=f"{key}/sae_scatter",
        )
    ]
    panels.append(_sae_topk_panel(r, key))
    scan = _sae_scan_panel(r, key)
    return panels + ([scan] if scan else [])


def _sae_topk_panel(r: SAEFeatures, key: str) -> Panel:
    """Features patched together, top-k (two rankings) against k random ones."""
    curve = ci_curves(
        [
            _curve(r.curve("topk_curve"), "top-k along the conclusion (cross-fitted)"),
            _curve(r.curve("auc_topk_curve"), "top-k by AUC", dash="dot"),
            _curve(r.curve("random_curve"), "k random changed features", color=GREY, dash="dash"),
        ],
        title="SAE features patched together",
        x_title="k (features)",
        y_title="recovery",
        log_x=True,
    )
    tk = r.curve("topk_curve")
    last = f"at k = {tk.x[-1]} {fmt(tk.points[-1].mean)}" if tk and tk.points else ""
    return Panel(
        title="SAE top-k curve",
        figure=curve,
        key=f"{key}/sae_topk",
        note=n_note(r),
        reading=f"Features patched together recover {last}; all features with the error term "
        f"{say(r.part('all_features'))}.",
    )


def _sae_scan_panel(r: SAEFeatures, key: str) -> Panel | None:
    """The whole residual patched after each layer: where the SAE was placed, and why."""
    scans = [
        _curve(r.curve(f"scan_{s}"), f"whole residual at the {s}")
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
        loc = r.located
        return Panel(
            title="Residual scan",
            figure=fig,
            key=f"{key}/scan",
            note=n_note(r),
            reading=f"The SAE was placed at the {loc.site}, layer {loc.layer} (the rule is in report.json).",
        )
    return None


@for_type("PromptAttribution")
def prompt_attribution_panels(a, key: str = "attribution") -> list[Panel]:
    """A single prompt's attribution (`circuits.PromptAttribution`): coloured text and slot × layer."""
    tokens, est_grid = a.tokens, a.estimate
    steps = a.meta.get("steps", 1)  # meta: how it was run (older files lack "steps": one pass)
    totals = [sum(col) for col in zip(*est_grid)] if est_grid else []
    exact = {row["position"]: row for row in a.exact}
    answers = " vs ".join(repr(x) for x in a.answers)
    text = token_text(
        tokens,
        totals,
        value_name="estimated effect (logits)",
        positions=a.positions,
        marks=["exact" if p in exact else "" for p in a.positions],
    )
    top = sorted(exact.values(), key=lambda row: -abs(row["total"]))[:3]
    reading = (
        f"Logit difference {answers}: {fmt(a.ld)}; source ({a.baseline}) "
        f"{fmt(a.ld_source)}. Largest exact effects: "
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
        labels = [slot_label(p, t) for p, t in zip(a.positions, tokens)]
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
        rho = a.rank_correlation
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


def _crossing(r: Scrubbing) -> str:
    """How the hypothesis was cross-fitted, where it was not on every pair (a report written before
    the per-pair flags had False only for a single pair)."""
    if r.cross_fitted_pairs is None:
        return "with one pair nothing could be cross-fitted, all in-sample"
    return crossing_summary(r.cross_fitted_pairs)
