"""Panels for the causal probes, the note map and the regime sweep. Each function takes a typed
result and returns `Panel`s; none computes an analysis, they only arrange figures the result
already holds and say in one line what they show."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from dashboards.figures import (  # est, n_note, say, series: also read from here by older code
    GREY,
    Panel,
    ci_bars,
    ci_curves,
    est,
    fmt,
    heatmap,
    n_note,
    say,
    series,
    slot_label,
    token_text,
    visible,
)
from dashboards.registry import in_summary, panel, summary
from kvnotes.analysis.results import TaskResult
from kvnotes.analysis.stats import Estimate

if TYPE_CHECKING:  # the result classes, for their fields; importing them would load each probe module
    from probes.causal import NoteMap
    from probes.controls import FalseNoteInjection
    from probes.placement import MemoryPlacement
    from probes.regime import Regime


def _above(a: Estimate | None, b: Estimate | None) -> bool:
    """True when a's CI lies wholly above b's (or above b's mean when b has no CI)."""
    if a is None or b is None or a.mean is None or b.mean is None or not a.ci:
        return False
    return a.ci[0] > (b.ci[1] if b.ci else b.mean)


# --- probes -------------------------------------------------------------------------------------


panel("field_refresh", "notes_transplant", "knockout", "dissociation")(in_summary)


@panel("note_map")
def note_map_panels(r: NoteMap, key: str) -> list[Panel]:
    """The note map: the prompt coloured by slot, the slot × layer grid, the per-layer curve."""
    maps = r.maps
    if not maps:
        return [
            Panel(
                title="Note map",
                reading=f"No pair moved its decision enough to map ({len(r.excluded)} excluded).",
                key=f"{key}/note_map_text",
            )
        ]
    panels = [_note_text_panel(r, maps[0], key)]
    panels += [p for p in (_slot_layer_panel(maps[0], key), _per_layer_panel(r, key)) if p is not None]
    return panels


def _note_text_panel(r: NoteMap, m, key: str) -> Panel:
    """The prompt's text coloured by each slot's single-slot recovery (pair 1)."""
    maps = r.maps
    tokens = m.prompt_tokens or m.tokens
    positions = list(range(len(tokens))) if m.prompt_tokens else m.positions
    values: list[float | None] = [None] * len(tokens)
    marks = [""] * len(tokens)
    index = {p: i for i, p in enumerate(positions)}
    for p, v, role in zip(m.positions, m.recovery, m.role):
        if p in index:
            values[index[p]] = v
            marks[index[p]] = role
    decision = m.positions[0] + m.distance_to_decision[0]
    if decision in index:
        marks[index[decision]] = "decision"
    notes = [(v, p, t) for v, p, t, role in zip(m.recovery, m.positions, m.tokens, m.role) if role == "note"]
    best = max(notes) if notes else None
    share = r.part("delimiter_share")
    reading = (
        f"Pair 1 of {len(maps)}: the field's own slots recover {fmt(m.field_joint)} of the decision; "
        + (
            f"the best single note slot is '{visible(best[2])}' at position {best[1]} ({fmt(best[0])})"
            if best
            else "there are no note slots"
        )
        + (
            f"; over all pairs delimiters hold {say(share)} of the positive single-slot effect."
            if share is not None and share.mean is not None
            else "."
        )
    )
    return Panel(
        title="Note map over the prompt (single-slot transplant, all layers)",
        reading=reading,
        html=token_text(tokens, values, value_name="recovery", positions=positions, marks=marks),
        note="colour: recovery of the new decision when only that slot's K/V (all layers) comes from "
        "the new run; red toward the new decision, blue away; uncoloured slots are not in the "
        "map (before the field). " + n_note(r),
        key=f"{key}/note_map_text",
    )


def _slot_layer_panel(m, key: str) -> Panel | None:
    """Recovery of one note slot at one layer (pair 1), where the map has the grid."""
    down = [(p, t) for p, t, role in zip(m.positions, m.tokens, m.role) if role == "note"]
    grid = m.slot_layer
    if grid and down:
        L = len(grid[0])
        z = [[grid[s][l] for s in range(len(down))] for l in range(L)]
        cell = max(((abs(z[l][s]), l, s) for l in range(L) for s in range(len(down))), default=None)
        fig = heatmap(
            z,
            [slot_label(p, t) for p, t in down],
            [f"L{l}" for l in range(L)],
            title="Note slots × layers (pair 1): recovery of one slot at one layer",
            x_title="note slot (position:token)",
            y_title="layer",
            colorbar="recovery",
        )
        reading = (
            f"The largest single cell is layer {cell[1]} at '{visible(down[cell[2]][1])}' "
            f"({fmt(z[cell[1]][cell[2]])}); single cells are small when the conclusion is spread "
            "over several slots or layers."
            if cell
            else ""
        )
        return Panel(
            title="Slot × layer map",
            reading=reading,
            figure=fig,
            note="pair 1; one forward per cell, exact transplants",
            key=f"{key}/slot_layer",
        )
    return None


def _per_layer_panel(r: TaskResult, key: str) -> Panel | None:
    """All note slots transplanted at one layer, layer by layer, over every pair."""
    layers = sorted((int(k.split("_")[1]), e) for k, e in r.parts.items() if re.fullmatch(r"layer_\d+", k))
    if layers:
        best_l = max(((e.mean, l) for l, e in layers if e.mean is not None), default=None)
        fig = ci_curves(
            [
                {
                    "name": "all note slots at one layer",
                    "x": [l for l, _ in layers],
                    "mean": [e.mean for _, e in layers],
                    "ci": [e.ci for _, e in layers],
                }
            ],
            title="Notes transplanted at a single layer",
            x_title="layer",
            y_title="recovery",
        )
        reading = (
            f"Layer {best_l[1]} carries most of the notes' effect on its own "
            f"({say(dict(layers)[best_l[1]])})."
            if best_l
            else "No layer measured."
        )
        return Panel(
            title="Per-layer note transplant",
            reading=reading,
            figure=fig,
            note=n_note(r),
            key=f"{key}/per_layer",
        )
    return None


@summary("probes")
def causal_summary(probes: Mapping[str, TaskResult], key: str) -> list[Panel]:
    def g(name: str, part: str | None = None) -> Estimate | None:
        if name not in probes:
            return None
        return probes[name].part(part) if part else probes[name].estimate

    items = [
        est(g("field_refresh", "recovery"), "field-only refresh", group="recovery"),
        est(g("notes_transplant", "kv"), "notes transplant (K+V)", group="recovery"),
        est(g("notes_transplant", "k_only"), "notes K only", group="recovery"),
        est(g("notes_transplant", "v_only"), "notes V only", group="recovery"),
        est(g("note_map", "top_slot"), "best single note slot", group="recovery"),
        est(g("knockout", "top_xfit"), "knockout: top notes (ranked on other pairs)", group="decision lost"),
        est(
            g("knockout", "matched"),
            "knockout: matched slots (same region, token class)",
            group="decision lost",
        ),
        est(g("knockout", "top"), "knockout: top notes (in-sample)", group="decision lost"),
        est(g("knockout", "random"), "knockout: random slots (in-sample control)", group="decision lost"),
        est(g("dissociation", "notes"), "dissociation: rule flipped, notes fixed", group="recovery"),
        est(g("dissociation", "rule_slot"), "dissociation: rule slot only", group="recovery"),
    ]
    items = [i for i in items if i["n"] or i["mean"] is not None]
    if not items:  # none of the probes it summarises ran (e.g. `kvnotes probe false-note-injection`)
        return []
    fr, nt = g("field_refresh", "recovery"), g("notes_transplant", "kv")
    part = nt is not None and nt.ci is not None and nt.ci[0] > 0
    if _above(nt, fr):
        verdict = "the decision reads the notes more than the field's own slots"
    elif _above(fr, nt):
        verdict = "the decision reads the field's own slots more than the notes" + (
            ", though the notes carry part of it"
            if part
            else "; the notes' share is indistinguishable from 0"
        )
    else:
        verdict = "the two do not separate at this n"
    reading = f"Field-only refresh recovers {say(fr)}; the notes transplant {say(nt)}: {verdict}."
    if fr is None and nt is None:
        reading = "What the probes run here recover (or, knocked out, lose) of the decision."
    fig = ci_bars(
        items, title="Causal probes and controls", y_title="fraction of the decision", reference=1.0
    )
    any_r = next(iter(probes.values()))
    return [
        Panel(title="Causal probes", reading=reading, figure=fig, note=n_note(any_r), key=f"{key}/causal")
    ]


@panel("false_note_injection")
def false_note_panel(r: FalseNoteInjection, key: str) -> list[Panel]:
    ks = list(r.ks)
    top = [r.part(f"k{k}") for k in ks]
    rnd = [r.part(f"random_k{k}") for k in ks]
    xfit = [r.part(f"xfit_k{k}") for k in ks]
    matched = [r.part(f"matched_k{k}") for k in ks]
    curves = [
        series("top-k slots ranked on other pairs", ks, xfit),
        series("k matched slots (same region, token class)", ks, matched, color=GREY, dash="dash"),
        series("top-k slots of the pair's own map (in-sample)", ks, top, dash="dot"),
        series("k random downstream slots (in-sample control)", ks, rnd, color=GREY, dash="dot"),
    ]
    fig = ci_curves(
        curves,
        title="False-note injection: the opposite conclusion written into k notes",
        x_title="k (slots injected)",
        y_title="recovery toward the injected conclusion",
    )
    last = ks[-1] if ks else None
    reading = (
        f"Injecting the top {last} note slots (ranked on the other pairs) moves the decision "
        f"{say(r.part(f'xfit_k{last}'))} of the way to the injected conclusion, against "
        f"{say(r.part(f'matched_k{last}'))} for {last} matched slots (in-sample: "
        f"{say(r.part(f'k{last}'))} against {say(r.part(f'random_k{last}'))})."
        if last is not None
        else "Not measured."
    )
    return [
        Panel(title="False-note injection", reading=reading, figure=fig, note=n_note(r), key=f"{key}/inject")
    ]


# --- regime -------------------------------------------------------------------------------------


@panel("regime")
def regime_panels(r: Regime, key: str) -> list[Panel]:
    d = list(r.filler_tokens)
    dist = list(r.distance)
    fr = [r.part(f"field_refresh@{x}") for x in d]
    nt = [r.part(f"notes_transplant@{x}") for x in d]
    eff = [r.part(f"effect@{x}") for x in d]
    fig = ci_curves(
        [series("notes transplant", dist, nt), series("field-only refresh", dist, fr)],
        title="Regime: the field moved away from the decision",
        x_title="tokens from the field to the decision",
        y_title="recovery",
    )
    defined = [i for i, e in enumerate(fr) if e is not None and e.mean is not None]
    if not defined:
        reading = "No distance has pairs whose decision moves enough to measure a recovery."
    else:
        a, b = defined[0], defined[-1]
        reading = (
            f"At {dist[a]} tokens the field-only refresh recovers {say(fr[a])}, at {dist[b]} tokens "
            f"{say(fr[b])}; the notes transplant {say(nt[a])} → {say(nt[b])}."
        )
        gone = [i for i in range(b + 1, len(d))]
        if gone:
            reading += (
                f" From {dist[gone[0]]} tokens on, the field moves the decision by less than the "
                f"minimum effect (mean {say(eff[gone[0]])} logits), so recovery is undefined there."
            )
    skipped = r.skipped
    n = max((e.n for e in eff if e is not None), default=0)
    note = (
        f"n = {n} pairs per distance (fewer where a pair's decision moves too little); bands are "
        "bootstrap 95% CIs"
    ) + (f"; {len(skipped)} distance(s) skipped (beyond the model's context)" if skipped else "")
    effect = ci_curves(
        [series("decision's move, new − old", dist, eff)],
        title="How much the field still moves the decision",
        y_title="logits",
        x_title="tokens from the field to the decision",
    )
    reading_e = (
        f"The field moves the decision by {say(eff[0])} logits at {dist[0]} tokens and "
        f"{say(eff[-1])} at {dist[-1]}."
        if d
        else "Not measured."
    )
    return [
        Panel(title="Regime curve", reading=reading, figure=fig, note=note, key=f"{key}/regime"),
        Panel(
            title="The field's effect with distance",
            reading=reading_e,
            figure=effect,
            note=note,
            key=f"{key}/regime_effect",
        ),
    ]


# --- memory placement -----------------------------------------------------------------------------

PAPER_PLACEMENT = (
    "The paper (Section 7) finds late placement losing about 0 accuracy at 2k memory tokens, 0.09 at 16k "
    "and 0.16 at 32k against early placement, and transplant equivalent to full recompute on LoCoMo by "
    "TOST at a 0.03 margin."
)


@panel("memory_placement")
def placement_panels(r: MemoryPlacement, key: str) -> list[Panel]:
    """Accuracy by placement against memory size, the edited fact's recovery, and each turn's TTFT."""
    sizes = list(r.sizes)
    part = lambda name: r.parts.get(name)  # noqa: E731
    acc = ci_curves(
        [
            series(label, sizes, [part(f"accuracy@{s}.{side}") for s in sizes], dash=dash)
            for side, label, dash in (
                ("early", "early (prefilled in context)", None),
                ("late", "late (precompiled, re-rotated, spliced)", None),
                ("full", "full recompute of the late layout", "dot"),
            )
        ],
        title="Memory placement: accuracy against memory size",
        x_title="memory tokens",
        y_title="accuracy",
    )
    last = max(sizes)
    t = r.tost.get(str(last), {})
    verdict = "equivalent to" if t.get("equivalent") else "not shown equivalent to"
    reading = (
        f"At {last} memory tokens late placement costs {say(part(f'cost@{last}'), 3)} accuracy against "
        f"early (early minus late); spliced late memory is {verdict} full recompute by TOST at margin "
        f"{r.margin:g} (late minus full {fmt(t.get('mean'), 3)}, p = {fmt(t.get('p'), 3)}). "
        + PAPER_PLACEMENT
    )
    edits = ci_curves(
        [
            series(f"{place}, {m}", sizes, [part(f"recovery@{s}.{place}.{m}") for s in sizes], dash=dash)
            for place, dash in (("early", None), ("late", "dot"))
            for m in ("erratum", "refresh")
        ],
        title="An edited fact: recovery under each placement",
        x_title="memory tokens",
        y_title="recovery",
    )
    ttft = ci_curves(
        [series(name, sizes, [part(f"ttft@{s}.{name}") for s in sizes]) for name in ("early", "late", "full")]
        + [
            series(f"{p}, {m}", sizes, [part(f"ttft@{s}.{p}.{m}") for s in sizes], dash="dot")
            for p in ("early", "late")
            for m in ("erratum", "refresh")
        ],
        title="Time to first token per turn",
        x_title="memory tokens",
        y_title="seconds",
        log_y=True,
    )
    if len(sizes) <= 8:  # ticks at the sizes measured (one size drew one dot among ticks 314-316)
        for fig in (acc, edits, ttft):
            fig.update_xaxes(tickvals=sizes, ticktext=[str(s) for s in sizes])
    note = (
        f"n = {r.episodes} episodes per size, {r.facts} questions each; CIs resample episodes; the memory's "
        f"first {r.seam} tokens recomputed at the seam; timed on {r.machine}"
        + (f"; left out: {'; '.join(r.skipped)}" if r.skipped else "")
    )
    rec = lambda place, m: say(part(f"recovery@{last}.{place}.{m}"))  # noqa: E731
    e_reading = (
        f"At {last} tokens an erratum recovers {rec('early', 'erratum')} early and {rec('late', 'erratum')} "
        f"late; an in-place refresh {rec('early', 'refresh')} early and {rec('late', 'refresh')} late."
    )
    t_reading = (
        f"At {last} tokens a turn takes {say(part(f'ttft@{last}.early'), 3)} s early, "
        f"{say(part(f'ttft@{last}.late'), 3)} s late (the splice included) and "
        f"{say(part(f'ttft@{last}.full'), 3)} s recomputing everything."
    )
    return [
        Panel(title="Memory placement", reading=reading, figure=acc, note=note, key=f"{key}/placement"),
        Panel(
            title="Editing placed memory",
            reading=e_reading,
            figure=edits,
            note=note,
            key=f"{key}/placement_edit",
        ),
        Panel(
            title="Memory placement: TTFT",
            reading=t_reading,
            figure=ttft,
            note=note,
            key=f"{key}/placement_ttft",
        ),
    ]
