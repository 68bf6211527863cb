"""Panels for the circuit analyses (head grids and top-k curves, scrubbing, attribution, SAE
features) and for a single prompt's attribution. Rendering only: every number comes from the
result objects."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from circuits.attribution import AttributionPatching
from circuits.edge_circuits import EdgeCircuits
from circuits.features import SAEFeatures
from circuits.read_write import HeadCircuit
from circuits.scrubbing import Scrubbing
from dashboards.figures import (
    BLUE,
    GREEN,
    GREY,
    ORANGE,
    PALETTE,
    RED,
    Panel,
    ci_bars,
    ci_curves,
    error_bars,
    est,
    fmt,
    fmt_ci,
    heatmap,
    n_note,
    plotly_text,
    say,
    scatter,
    slot_label,
    style,
    token_text,
    visible,
)
from dashboards.registry import panel
from kvnotes.analysis.stats import Curve
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


@panel("prompt_attribution")
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
    if getattr(a, "small_effect", None):  # attributions saved before the flag have none
        reading = f"Caution, {a.small_effect}. " + reading
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


# --- edge-level circuits ---------------------------------------------------------------------------

_KIND_COLOR = {"emb": GREY, "kv": ORANGE, "head": BLUE, "mlp": GREEN, "logit": RED}
_KIND_DX = {"emb": 0.0, "kv": -0.28, "head": 0.0, "mlp": 0.28, "logit": 0.0}  # offsets in a layer column
_SPREAD = ("head", "kv")  # kinds with several nodes per layer and band, spread down the band
_METHOD_NAMES = (
    ("eap", "EAP"),
    ("eap_ig", "EAP-IG"),
    ("atp", "AtP*"),
    ("eap_ig_act", "EAP-IG (activations)"),
    ("acdc", "ACDC"),
    ("pruning", "edge pruning"),
    ("ensemble", "ensemble (EAP-IG + pruning)"),
    ("eap_ig_acdc", "ensemble (EAP-IG + ACDC)"),
)


def _methods_run(r: EdgeCircuits) -> list[tuple[str, str]]:
    """The methods this result scored (EAP, EAP-IG and AtP* always; the others where asked for)."""
    return [(m, name) for m, name in _METHOD_NAMES if f"rho_{m}" in r.parts]


@panel("edges")
def edge_panels(r: EdgeCircuits, key: str) -> list[Panel]:
    """Edge-level circuits: the graph with a circuit-size slider beside the faithfulness curve, and
    the edge scores of each method against exact patching."""
    key = f"{key}/edges"
    if not r.tables.get("graph"):
        return [Panel(title="Edge circuits", key=key, reading="Not measured: no usable pairs.")]
    return [_edge_graph_panel(r, key), _edge_methods_panel(r, key)]


def _node_xy(row: dict, groups: Sequence[str], n_layers: int, spread: dict[str, int]) -> tuple[float, float]:
    """Where a node sits: its layer's column (the embeddings left of layer 0, the logit right of the
    last) and its group's band (field at the top), heads and KV heads spread down the band by index."""
    kind, layer, index = row["kind"], row["layer"], row["index"]
    x = {"emb": -1.0, "logit": float(n_layers)}.get(kind, layer + _KIND_DX[kind])
    band = groups.index(row["group"])
    n = spread.get(kind, 1)
    return x, -band - (0.15 + 0.7 * index / (n - 1) if n > 1 else 0.5)


def _edge_graph_panel(r: EdgeCircuits, key: str) -> Panel:
    """Nodes in layer columns and group bands sized by score, edges by weight; a slider over the
    faithfulness curve's circuit sizes lights the circuit's edges and moves the point on the curve."""
    from plotly.subplots import make_subplots

    rows, node_rows = r.tables["graph"], r.tables.get("nodes", [])
    groups = list(r.groups)
    n_layers = max(n["layer"] for n in node_rows if n["kind"] == "logit") if node_rows else 0
    spread = {k: 1 + max((n["index"] for n in node_rows if n["kind"] == k), default=0) for k in _SPREAD}
    where = {n["node"]: _node_xy(n, groups, n_layers, spread) for n in node_rows}
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.7, 0.3],
        horizontal_spacing=0.08,
        subplot_titles=(
            f"The {len(rows)} strongest of {r.n_edges} edges ({plotly_text(r.method)} scores)",
            "Faithfulness over circuit size",
        ),
    )
    titles = [a.to_plotly_json() for a in fig.layout.annotations]  # kept beside the slider's note
    edge_traces = _draw_edges(fig, [e for e in rows if e["src"] in where and e["dst"] in where], where)
    _draw_nodes(fig, node_rows, where, r.group_tokens)
    sizes, curve = _faithfulness_points(r)
    _draw_faithfulness(fig, r, sizes)
    active = _active_size(curve)
    steps = _size_steps(sizes, curve, titles, edge_traces)
    fig.update_layout(
        template="plotly_white",
        title={"text": "Edge-level circuit graph", "x": 0.01, "font": {"size": 15}},
        height=560,
        margin={"l": 70, "r": 20, "t": 70, "b": 110},
        legend={"orientation": "h", "y": -0.32},
        hoverlabel={"namelength": -1},
        shapes=_group_bands(len(groups), n_layers),
        annotations=titles + _size_notes(sizes, curve, active),
        sliders=[
            {
                "active": active,
                "currentvalue": {"prefix": "circuit size (edges): "},
                "pad": {"t": 40},
                "steps": steps,
            }
        ],
    )
    if steps:  # the page opens on the active size, lit
        for t, o in zip(edge_traces, steps[active]["args"][0]["opacity"]):
            fig.data[t].opacity = o
    _graph_axes(fig, groups, n_layers, sizes)
    return Panel(
        title="Edge circuit graph",
        reading=_graph_reading(r, sizes, curve, active),
        figure=fig,
        note=n_note(r) + f"; {r.n_edges} edges, {r.method} with {r.steps} steps; node size: its score "
        "summed over its outgoing edges; red edges push toward the new decision, blue away; the slider "
        "lights the top edges by mean |score| over all pairs (each pair's curve point uses a circuit "
        "chosen on the other half); random circuits: as many edges as the circuit in each bin (kind, "
        "layers, groups), drawn uniformly within the bin, the circuit's own edges allowed",
        key=f"{key}/graph",
    )


def _graph_reading(r: EdgeCircuits, sizes: list[int], curve: list, active: int) -> str:
    if not curve:
        return f"No circuit was scored: {r.circuits_note or 'no usable pairs'}."
    k = sizes[active] if sizes else 0
    return (
        f"Circuits chosen on the other half of the pairs keep {say(r.part('faithfulness_auc'))} of the "
        f"decision's change (area under the curve over the fraction of edges, CPR, per pair); random "
        f"circuits of the same make-up {say(r.part('random_auc'))}, greedy circuits grown from the logit "
        f"{say(r.part('greedy_auc'))}. On the dataset's means, as MIB normalises: "
        f"{say(r.part('faithfulness_auc_mib'))} (random {say(r.part('random_auc_mib'))}). "
        f"At {k} edges the circuit recovers {fmt_ci(*curve[active])}."
    )


def _draw_edges(fig, drawn: list[dict], where: dict) -> list[int]:
    """The edges as lines (width by |score|, the strongest drawn last) and a hover point at each
    midpoint; returns each edge's trace index, strongest first."""
    top = max((abs(e["score"]) for e in drawn), default=1.0) or 1.0
    traces = []
    for rank, e in reversed(list(enumerate(drawn, 1))):  # the strongest drawn last, on top
        (x0, y0), (x1, y1) = where[e["src"]], where[e["dst"]]
        fig.add_trace(
            go.Scatter(
                x=[x0, x1],
                y=[y0, y1],
                name=f"edge #{rank}",
                mode="lines",
                line={"width": 0.6 + 7 * abs(e["score"]) / top, "color": RED if e["score"] > 0 else BLUE},
                hoverinfo="skip",
                showlegend=False,
            ),
            row=1,
            col=1,
        )
        traces.append(len(fig.data) - 1)
    traces.reverse()  # traces[i]: the trace of drawn[i] (strongest first)
    fig.add_trace(
        go.Scatter(
            x=[(where[e["src"]][0] + where[e["dst"]][0]) / 2 for e in drawn],
            y=[(where[e["src"]][1] + where[e["dst"]][1]) / 2 for e in drawn],
            mode="markers",
            marker={"size": 7, "color": "rgba(0,0,0,0.01)"},
            hovertext=[_edge_hover(i, e) for i, e in enumerate(drawn, 1)],
            hoverinfo="text",
            name="edges (hover the midpoint)",
            showlegend=False,
        ),
        row=1,
        col=1,
    )
    return traces


def _draw_nodes(fig, node_rows: list[dict], where: dict, group_tokens: dict) -> None:
    """The nodes, one trace per kind, sized by |score|."""
    biggest = max((abs(n["score"]) for n in node_rows), default=1.0) or 1.0
    for kind in ("emb", "kv", "head", "mlp", "logit"):
        ns = [n for n in node_rows if n["kind"] == kind]
        if not ns:
            continue
        fig.add_trace(
            go.Scatter(
                x=[where[n["node"]][0] for n in ns],
                y=[where[n["node"]][1] for n in ns],
                mode="markers",
                marker={
                    "size": [8 + 22 * abs(n["score"]) / biggest for n in ns],
                    "color": _KIND_COLOR[kind],
                    "line": {"width": 1, "color": "#333"},
                },
                hovertext=[_node_hover(n, group_tokens) for n in ns],
                hoverinfo="text",
                name={"emb": "embeddings", "kv": "KV slots", "head": "heads", "mlp": "MLPs"}.get(
                    kind, "answer logit difference"
                ),
            ),
            row=1,
            col=1,
        )


def _draw_faithfulness(fig, r: EdgeCircuits, sizes: list[int]) -> None:
    """The faithfulness curves (top, greedy, matched random) with their CIs, in the right panel."""
    for name, label, color, dash in (
        ("faithfulness", "top edges (chosen on the other half)", BLUE, "solid"),
        ("greedy", "greedy from the logit", GREEN, "dot"),
        ("random", "matched random", GREY, "dash"),
    ):
        c = r.curve(name)
        if c is None or not c.points:
            continue
        pts = list(enumerate(c.points))
        fig.add_trace(
            go.Scatter(
                x=[j for j, _ in pts],
                y=[p.mean for _, p in pts],
                mode="lines+markers",
                name=label,
                line={"color": color, "dash": dash},
                error_y={**error_bars([(p.mean, p.ci) for _, p in pts]), "thickness": 1},
                hovertext=[f"{label}<br>{sizes[j]} edges<br>{fmt_ci(p.mean, p.ci, 3)}" for j, p in pts],
                hoverinfo="text",
            ),
            row=1,
            col=2,
        )


def _group_bands(n_groups: int, n_layers: int) -> list[dict]:
    """A faint band behind each position group's row of nodes."""
    return [
        {
            "type": "rect",
            "xref": "x",
            "yref": "y",
            "x0": -1.5,
            "x1": n_layers + 0.5,
            "y0": -g,
            "y1": -g - 1,
            "fillcolor": PALETTE[g % len(PALETTE)],
            "opacity": 0.06,
            "line": {"width": 0},
            "layer": "below",
        }
        for g in range(n_groups)
    ]


def _size_steps(sizes: list[int], curve: list, titles: list[dict], edge_traces: list[int]) -> list[dict]:
    """The slider's steps: at size k the top k edges lit, the others faint, and the curve's note moved."""
    steps = []
    for j, k in enumerate(sizes):
        opacity = [1.0 if i < k else 0.12 for i in range(len(edge_traces))]
        steps.append(
            {
                "method": "update",
                "label": str(k),
                "args": [
                    {"opacity": opacity},
                    {"annotations": titles + _size_notes(sizes, curve, j)},
                    edge_traces,
                ],
            }
        )
    return steps


def _graph_axes(fig, groups: list[str], n_layers: int, sizes: list[int]) -> None:
    fig.update_xaxes(
        tickvals=list(range(-1, n_layers + 1)),
        ticktext=["emb", *[f"L{l}" for l in range(n_layers)], "logit"],
        title_text="layer",
        row=1,
        col=1,
    )
    fig.update_yaxes(
        tickvals=[-g - 0.5 for g in range(len(groups))],
        ticktext=groups,
        range=[-len(groups), 0],
        zeroline=False,
        row=1,
        col=1,
    )
    fig.update_xaxes(
        tickvals=list(range(len(sizes))),
        ticktext=[str(k) for k in sizes],
        title_text="edges kept",
        row=1,
        col=2,
    )
    fig.update_yaxes(title_text="recovery of the new decision", row=1, col=2)


def _edge_hover(rank: int, e: dict) -> str:
    exact = f"<br>exact patch: {fmt(e['exact'], 3)}" if e.get("exact") is not None else ""
    return (
        f"#{rank} {plotly_text(e['src'])} → {plotly_text(e['dst'])} ({e['kind']})"
        f"<br>score {fmt_ci(e['score'], e['ci'], 3)}{exact}"
    )


def _node_hover(n: dict, group_tokens: dict[str, list[str]]) -> str:
    toks = group_tokens.get(n["group"], [])
    shown = " ".join(f"[{plotly_text(visible(t))}]" for t in toks[:24]) + (" …" if len(toks) > 24 else "")
    return f"{plotly_text(n['node'])}<br>score {fmt_ci(n['score'], n['ci'], 3)}" + (
        f"<br>{plotly_text(n['group'])} tokens (pair 1): {shown}" if shown and n["kind"] != "logit" else ""
    )


def _faithfulness_points(r: EdgeCircuits) -> tuple[list[int], list[tuple]]:
    """The circuit sizes in edges and the faithfulness curve's (mean, CI) at each."""
    c = r.curve("faithfulness")
    if c is None:
        return [], []
    return [round(x * r.n_edges) for x in c.x], [(p.mean, p.ci) for p in c.points]


def _active_size(curve: list) -> int:
    """The size the slider opens on: the smallest whose faithfulness reaches 0.8, else the largest."""
    for j, (m, _) in enumerate(curve):
        if m is not None and m >= 0.8:
            return j
    return max(len(curve) - 1, 0)


def _size_notes(sizes: list[int], curve: list, j: int) -> list[dict]:
    """The annotation that marks size `j` on the faithfulness curve (the slider replaces it)."""
    if not curve:
        return []
    m, ci = curve[j]
    return [
        {
            "xref": "x2",
            "yref": "y2",
            "x": j,
            "y": m if m is not None else 0,
            "text": f"{sizes[j]} edges: {fmt_ci(m, ci, 3)}",
            "showarrow": True,
            "arrowhead": 2,
            "ax": -40,
            "ay": -40,
            "bgcolor": "rgba(255,255,255,0.85)",
            "bordercolor": BLUE,
        }
    ]


def _edge_methods_panel(r: EdgeCircuits, key: str) -> Panel:
    """Each method's Spearman rho and recall@k against exact edge patching, and its time a pair."""
    run = _methods_run(r)
    items = [
        est(r.part(f"{what}_{m}"), name, group=label)
        for what, label in (("rho", "Spearman rho vs exact"), ("recall", f"recall@{r.top} vs exact"))
        for m, name in run
    ]
    fig = ci_bars(items, title="Edge scores against exact edge patching", y_title="agreement", reference=1.0)
    times = ", ".join(f"{name} {fmt(r.part(f'{m}_seconds').mean, 2)} s" for m, name in run)
    rhos = ", ".join(f"{name} {say(r.part(f'rho_{m}'))}" for m, name in run)
    reading = (
        f"Against exact patching of {r.recall_over}: Spearman rho {rhos}. Time a pair: {times}; every edge "
        f"patched exactly would take {say(r.part('exhaustive_seconds'), 1)} s, "
        f"{say(r.part('speedup'), 0)}× EAP-IG."
    )
    return Panel(
        title="Edge scores vs exact",
        reading=reading,
        figure=fig,
        note=n_note(r) + f"; recall@{r.top}: the share of the exact top {r.top} among a method's top {r.top}",
        key=f"{key}/methods",
    )


# --- circuit discovery against tracr's compiled circuits ----------------------------------------


def best_methods(b) -> dict[str, tuple[str, float]]:
    """Per program, the method with the highest edge-level AUROC and that AUROC (ties: the first in
    the bench's order), for programs where it is defined."""
    out: dict[str, tuple[str, float]] = {}
    for r in b.results:
        if r.level == "edge" and r.auroc is not None and r.auroc > out.get(r.program, ("", -1.0))[1]:
            out[r.program] = (r.method, r.auroc)
    return out


@panel("ground_truth")
def ground_truth_panels(b, key: str) -> list[Panel]:
    best = best_methods(b)
    methods = list(dict.fromkeys(r.method for r in b.results))
    programs = list(dict.fromkeys(r.program for r in b.results))
    at = {(r.program, r.method): r.auroc for r in b.results if r.level == "edge"}
    z = [[at.get((p, m)) for m in methods] for p in programs]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=methods,
            y=programs,
            zmin=0.5,
            zmax=1.0,
            colorscale="Viridis",
            text=[["-" if v is None else f"{v:.2f}" for v in row] for row in z],
            texttemplate="%{text}",
            hovertemplate="%{y} · %{x}: edge AUROC %{z:.3f}<extra></extra>",
        )
    )
    tall = 120 + 40 * len(programs)
    style(fig, "Edge-level AUROC against the known circuit", "method", "program", height=tall)
    reached = [p for p, (_, a) in best.items() if a >= 0.95]
    reading = (
        f"The best method reaches edge-level AUROC 0.95 on {len(reached)} of {len(best)} programs. Best per "
        "program: " + "; ".join(f"{p} {m} {a:.2f}" for p, (m, a) in best.items()) + "."
    )
    note = f"{b.pairs} pairs a program, AUROC the mean over pairs; {b.machine}"
    title = "Circuit discovery vs tracr"
    return [Panel(title=title, reading=reading, figure=fig, note=note, key=f"{key}/ground_truth")]


@panel("acdc_bench")
def acdc_bench_panels(b, key: str) -> list[Panel]:
    taus = [f"tau {r.tau:g}" for r in b.results]
    fig = go.Figure(
        [
            go.Bar(name="notebook", x=taus, y=[r.notebook_s for r in b.results]),
            go.Bar(name="TransformerLens hooks", x=taus, y=[r.tl_s for r in b.results]),
        ]
    )
    style(fig, "ACDC's run, seconds (median)", "threshold", "seconds")
    differ = sum(r.differ for r in b.results)
    ratios = ", ".join(f"{r.ratio:.2f}x at tau {r.tau:g}" for r in b.results)
    visited = sum(r.visited for r in b.results)
    whole = visited == b.n_edges * len(b.results)
    scope = f"{b.n_edges:,} edges" if whole else f"the {visited:,} edges visited in the forwards timed"
    agree = (
        f"the two ways decided every edge alike ({scope} at {len(b.results)} thresholds)"
        if differ == 0
        else f"the two ways decided {differ} edge(s) differently"
    )
    reading = (
        f"ACDC through the notebook against plain TransformerLens hooks on the same candidates: the "
        f"TransformerLens way takes {ratios} the notebook's time; {agree}; their decisions on random "
        f"circuits differ by at most {b.max_diff:.1e} logits."
    )
    note = f"{b.pairs} pairs, prompts of up to {b.prompt_tokens} tokens; {b.machine}"
    return [
        Panel(
            title="ACDC: notebook vs TransformerLens",
            reading=reading,
            figure=fig,
            note=note,
            key=f"{key}/acdc_bench",
        )
    ]
