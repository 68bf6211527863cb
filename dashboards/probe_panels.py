"""Panels for the probes, the regime sweep, the editing and composing experiments and the cost
benches. Each function takes a typed result and returns `Panel`s; none computes an analysis,
they only arrange figures the result already holds and say in one line what they show."""

from __future__ import annotations

import re
from collections.abc import Mapping

from dashboards.figures import (
    GREY,
    Panel,
    ci_bars,
    ci_curves,
    esc,
    fmt,
    fmt_ci,
    heatmap,
    slot_label,
    token_text,
    visible,
)
from probes.results import Estimate, ProbeResult


def est(e: Estimate | None, name: str, **kw) -> dict:
    """A bar/curve item from an Estimate (missing → undefined)."""
    if e is None:
        return {"name": name, "mean": None, "ci": None, "n": 0, **kw}
    return {"name": name, "mean": e.mean, "ci": e.ci, "n": e.n, **kw}


def say(e: Estimate | None, digits: int = 2) -> str:
    return fmt_ci(e.mean, e.ci, digits) if e is not None else "n/a"


def n_note(r: ProbeResult, what: str = "pairs") -> str:
    n = r.estimate.n
    excl = len(r.details.get("excluded", []))
    s = f"n = {n} {what}; bars and bands are bootstrap 95% CIs of the mean"
    return s + (
        f"; {excl} pair(s) excluded (decision moved too little, listed in report.json)" if excl else ""
    )


def _above(a: Estimate | None, b: Estimate | None) -> bool:
    """True when a's CI lies wholly above b's (or above b's mean when b has no CI)."""
    if a is None or b is None or a.mean is None or b.mean is None or not a.ci:
        return False
    return a.ci[0] > (b.ci[1] if b.ci else b.mean)


# --- probes -------------------------------------------------------------------------------------


def probe_panels(probes: Mapping[str, ProbeResult], key: str) -> list[Panel]:
    out: list[Panel] = []
    if "note_map" in probes:
        out += note_map_panels(probes["note_map"], key)
    out.append(causal_summary(probes, key))
    if "false_note_injection" in probes:
        out.append(false_note_panel(probes["false_note_injection"], key))
    return out


def note_map_panels(r: ProbeResult, key: str) -> list[Panel]:
    maps = r.details.get("maps") or []
    if not maps:
        return [
            Panel(
                title="Note map",
                reading="No pair moved its decision enough to map "
                f"({len(r.details.get('excluded', []))} excluded).",
                key=f"{key}/note_map_text",
            )
        ]
    m = maps[0]
    tokens = m.get("prompt_tokens") or m["tokens"]
    positions = list(range(len(tokens))) if "prompt_tokens" in m else m["positions"]
    values: list[float | None] = [None] * len(tokens)
    marks = [""] * len(tokens)
    index = {p: i for i, p in enumerate(positions)}
    for p, v, role in zip(m["positions"], m["recovery"], m["role"]):
        if p in index:
            values[index[p]] = v
            marks[index[p]] = role
    decision = m["positions"][0] + m["distance_to_decision"][0]
    if decision in index:
        marks[index[decision]] = "decision"
    notes = [
        (v, p, t)
        for v, p, t, role in zip(m["recovery"], m["positions"], m["tokens"], m["role"])
        if role == "note"
    ]
    best = max(notes) if notes else None
    share = r.parts.get("delimiter_share")
    reading = (
        f"Pair 1 of {len(maps)}: the field's own slots recover {fmt(m['field_joint'])} of the decision; "
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
    text = Panel(
        title="Note map over the prompt (single-slot transplant, all layers)",
        reading=reading,
        html=token_text(tokens, values, value_name="recovery", positions=positions, marks=marks),
        note="colour: recovery of the new decision when only that slot's K/V (all layers) comes from "
        "the new run; red toward the new decision, blue away; uncoloured slots are not in the "
        "map (before the field). " + n_note(r),
        key=f"{key}/note_map_text",
    )
    down = [(p, t) for p, t, role in zip(m["positions"], m["tokens"], m["role"]) if role == "note"]
    grid = m.get("slot_layer") or []
    panels = [text]
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
        panels.append(
            Panel(
                title="Slot × layer map",
                reading=reading,
                figure=fig,
                note="pair 1; one forward per cell, exact transplants",
                key=f"{key}/slot_layer",
            )
        )
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
        panels.append(
            Panel(
                title="Per-layer note transplant",
                reading=reading,
                figure=fig,
                note=n_note(r),
                key=f"{key}/per_layer",
            )
        )
    return panels


def causal_summary(probes: Mapping[str, ProbeResult], key: str) -> Panel:
    def g(name: str, part: str | None = None) -> Estimate | None:
        if name not in probes:
            return None
        return probes[name].parts.get(part) if part else probes[name].estimate

    items = [
        est(g("field_refresh", "recovery"), "field-only refresh", group="recovery"),
        est(g("notes_transplant", "kv"), "notes transplant (K+V)", group="recovery"),
        est(g("notes_transplant", "k_only"), "notes K only", group="recovery"),
        est(g("notes_transplant", "v_only"), "notes V only", group="recovery"),
        est(g("note_map", "top_slot"), "best single note slot", group="recovery"),
        est(g("knockout", "top"), "knockout: top notes", group="decision lost"),
        est(g("knockout", "random"), "knockout: random slots", group="decision lost"),
        est(g("dissociation", "notes"), "dissociation: rule flipped, notes fixed", group="recovery"),
        est(g("dissociation", "rule_slot"), "dissociation: rule slot only", group="recovery"),
    ]
    items = [i for i in items if i["n"] or i["mean"] is not None]
    fr, nt = g("field_refresh", "recovery"), g("notes_transplant", "kv")
    if _above(nt, fr):
        verdict = (
            "the decision reads the notes, not the field: transplanting the notes recovers it, refreshing "
            "only the field does not"
        )
    elif _above(fr, nt):
        verdict = "the opposite of a notes reading: refreshing the field recovers more than the notes"
    else:
        verdict = "the two do not separate at this n"
    reading = f"Field-only refresh recovers {say(fr)}; the notes transplant {say(nt)}: {verdict}."
    fig = ci_bars(
        items, title="Causal probes and controls", y_title="fraction of the decision", reference=1.0
    )
    any_r = next(iter(probes.values()))
    return Panel(title="Causal probes", reading=reading, figure=fig, note=n_note(any_r), key=f"{key}/causal")


def false_note_panel(r: ProbeResult, key: str) -> Panel:
    ks = r.details.get("ks", [])
    top = [r.parts.get(f"k{k}") for k in ks]
    rnd = [r.parts.get(f"random_k{k}") for k in ks]
    series = [
        {
            "name": "top-k note slots",
            "x": ks,
            "mean": [e.mean if e else None for e in top],
            "ci": [e.ci if e else None for e in top],
        },
        {
            "name": "k random downstream slots",
            "x": ks,
            "mean": [e.mean if e else None for e in rnd],
            "ci": [e.ci if e else None for e in rnd],
            "color": GREY,
            "dash": "dash",
        },
    ]
    fig = ci_curves(
        series,
        title="False-note injection: the opposite conclusion written into k notes",
        x_title="k (slots injected)",
        y_title="recovery toward the injected conclusion",
    )
    last = ks[-1] if ks else None
    reading = (
        f"Injecting the top {last} note slots moves the decision {say(r.parts.get(f'k{last}'))} of the way "
        f"to the injected conclusion, against {say(r.parts.get(f'random_k{last}'))} for {last} random slots."
        if last is not None
        else "Not measured."
    )
    return Panel(
        title="False-note injection", reading=reading, figure=fig, note=n_note(r), key=f"{key}/inject"
    )


# --- regime -------------------------------------------------------------------------------------


def regime_panels(r: ProbeResult, key: str) -> list[Panel]:
    d = r.details.get("filler_tokens", [])
    dist = r.details.get("distance", d)
    fr = [r.parts.get(f"field_refresh@{x}") for x in d]
    nt = [r.parts.get(f"notes_transplant@{x}") for x in d]
    series = [
        {
            "name": "notes transplant",
            "x": dist,
            "mean": [e.mean if e else None for e in nt],
            "ci": [e.ci if e else None for e in nt],
        },
        {
            "name": "field-only refresh",
            "x": dist,
            "mean": [e.mean if e else None for e in fr],
            "ci": [e.ci if e else None for e in fr],
        },
    ]
    fig = ci_curves(
        series,
        title="Regime: the field moved away from the decision",
        x_title="tokens from the field to the decision",
        y_title="recovery",
    )
    reading = (
        f"At {dist[0]} tokens the field-only refresh recovers {say(fr[0])}, at {dist[-1]} tokens "
        f"{say(fr[-1])}; the notes transplant {say(nt[0])} → {say(nt[-1])}."
        if d
        else "Not measured."
    )
    skipped = r.details.get("skipped") or []
    note = f"n = {r.estimate.n} pairs per distance; bands are bootstrap 95% CIs" + (
        f"; {len(skipped)} distance(s) skipped (beyond the model's context)" if skipped else ""
    )
    return [Panel(title="Regime curve", reading=reading, figure=fig, note=note, key=f"{key}/regime")]


# --- edit and compose ---------------------------------------------------------------------------

METHODS = ("refresh", "suffix", "erratum", "hoist", "full")
METHOD_NAMES = {
    "refresh": "field refresh",
    "suffix": "suffix recompute",
    "erratum": "erratum",
    "hoist": "hoist to end (oracle)",
    "full": "full recompute",
}


def edit_panels(r: ProbeResult, key: str) -> list[Panel]:
    ks = r.details.get("ks", [])
    sel = [f"selective_causal@{k}" for k in ks if f"selective_causal@{k}" in r.parts]
    best_sel = max(sel, key=lambda m: (r.parts[m].mean or -1e9, -int(m.split("@")[1])), default=None)
    names = [m for m in METHODS if m in r.parts] + ([best_sel] if best_sel else [])
    label = lambda m: METHOD_NAMES.get(m, m.replace("_", " "))  # noqa: E731
    items = [est(r.parts[m], label(m), group="recovery") for m in names]
    items += [est(r.parts.get(f"{m}.agree"), label(m), group="same answer as full recompute") for m in names]
    fig = ci_bars(
        items, title="Editing methods side by side (one changed field)", y_title="fraction", reference=1.0
    )
    cost = ", ".join(
        f"{label(m)} {fmt(r.parts[f'{m}.tokens'].mean, 0)} tokens"
        for m in names
        if f"{m}.tokens" in r.parts and r.parts[f"{m}.tokens"].mean is not None
    )
    reading = (
        f"The erratum recovers {say(r.parts.get('erratum'))}, field refresh {say(r.parts.get('refresh'))}, "
        f"suffix recompute {say(r.parts.get('suffix'))}. Tokens computed: {cost}."
    )
    panels = [
        Panel(title="Editing methods", reading=reading, figure=fig, note=n_note(r), key=f"{key}/methods")
    ]
    series = []
    for kind, name in (("causal", "ranked by causal effect"), ("deviation", "ranked by KV deviation")):
        xs = [k for k in ks if f"selective_{kind}@{k}" in r.parts]
        es = [r.parts[f"selective_{kind}@{k}"] for k in xs]
        if xs:
            series.append(
                {
                    "name": f"selective@K, {name}",
                    "x": xs,
                    "mean": [e.mean for e in es],
                    "ci": [e.ci for e in es],
                }
            )
    if series:
        fig = ci_curves(
            series,
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


def seam_panels(r: ProbeResult, key: str) -> list[Panel]:
    seams = r.details.get("seams", [])
    series = []
    for prefix, name, dash in (("cosine", "re-rotated", "solid"), ("norot_cosine", "not re-rotated", "dash")):
        es = [r.parts.get(f"{prefix}@{b}") for b in seams]
        series.append(
            {
                "name": f"logit cosine, {name}",
                "x": seams,
                "mean": [e.mean if e else None for e in es],
                "ci": [e.ci if e else None for e in es],
                "dash": dash,
            }
        )
    for prefix, name in (
        ("agree", "same answer, re-rotated"),
        ("norot_agree", "same answer, not re-rotated"),
    ):
        es = [r.parts.get(f"{prefix}@{b}") for b in seams]
        series.append(
            {
                "name": name,
                "x": seams,
                "mean": [e.mean if e else None for e in es],
                "ci": [e.ci if e else None for e in es],
                "dash": "dot",
            }
        )
    fig = ci_curves(
        series,
        title="Seam repair: chunk tokens recomputed in context",
        x_title="seam b (tokens)",
        y_title="agreement with full recompute",
    )
    reading = (
        f"With no repair the spliced chunk's logits have cosine {say(r.parts.get(f'cosine@{seams[0]}'), 4)} "
        f"to full recompute; recomputing {seams[-1]} seam tokens gives "
        f"{say(r.parts.get(f'cosine@{seams[-1]}'), 4)}; without re-rotation "
        f"{say(r.parts.get(f'norot_cosine@{seams[-1]}'), 4)}."
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


def agent_panels(r: ProbeResult, key: str) -> list[Panel]:
    turns = list(range(1, int(r.details.get("turns", 0)) + 1))
    es = [r.parts.get(f"cosine@{t}") for t in turns]
    ag = [r.parts.get(f"agree@{t}") for t in turns]
    fig = ci_curves(
        [
            {
                "name": "logit cosine to recompute",
                "x": turns,
                "mean": [e.mean if e else None for e in es],
                "ci": [e.ci if e else None for e in es],
            },
            {
                "name": "same answer",
                "x": turns,
                "mean": [e.mean if e else None for e in ag],
                "ci": [e.ci if e else None for e in ag],
                "dash": "dot",
            },
        ],
        title="Agent loop: one erratum per turn vs recompute every turn",
        x_title="turn",
        y_title="agreement",
    )
    reading = (
        f"After {len(turns)} errata the cache's logits have cosine {say(r.parts.get('cosine_last'), 4)} to a "
        f"full recompute (worst turn {say(r.parts.get('cosine_min'), 4)}); the answer follows the latest "
        f"erratum {say(r.parts.get('follows'))} of the time."
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


def memory_panels(r: ProbeResult, key: str) -> list[Panel]:
    items = [
        est(r.parts.get(k), name)
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
        f"{say(r.parts.get('split_agree'))} of the time, against {say(r.parts.get('colocated_agree'))} "
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


def ttft_panels(b, key: str) -> list[Panel]:
    pts = b.results
    if not pts:
        return [Panel(title="Time to first token", reading="Not measured.", key=f"{key}/ttft")]
    xs = [p.tokens for p in pts]
    fig = ci_curves(
        [
            {"name": "full prefill", "x": xs, "mean": [p.full_s for p in pts]},
            {
                "name": f"composed (spliced chunk, seam {b.seam})",
                "x": xs,
                "mean": [p.composed_s for p in pts],
            },
        ],
        title="Time to first token: composed vs full prefill",
        x_title="context tokens",
        y_title="seconds",
        log_x=True,
        log_y=True,
    )
    last = pts[-1]
    reading = (
        f"At {last.tokens} tokens composing takes {last.composed_s:.3f} s against {last.full_s:.3f} s "
        f"({last.ratio:.1f}×); fitted growth exponents: composed {fmt(b.exponent_composed)}, full "
        f"{fmt(b.exponent_full)}; top-1 agrees at {sum(p.top1_agree for p in pts)}/{len(pts)} lengths."
    )
    return [
        Panel(
            title="TTFT curves",
            reading=reading,
            figure=fig,
            note=f"one timing per point (best of repeats), {esc(b.machine)}; no CI: a benchmark, not an "
            "estimate over prompts",
            key=f"{key}/ttft",
        )
    ]


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
    return [
        Panel(
            title="Edit cost",
            reading=reading,
            figure=fig,
            note=f"one timing per point, {esc(b.machine)}",
            key=f"{key}/edit_cost",
        )
    ]
