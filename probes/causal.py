"""The causal probes: field-only refresh, notes transplant, and the note map.

Each takes prefilled `Trial`s (see `make_trials`) and returns a `TaskResult`. Recovery is
computed only on pairs whose decision actually moves (|ld_new - ld_old| >= `min_effect`);
the others are listed under `details["excluded"]` with their effect, never silently dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvnotes.analysis.registry import Context, analysis, option
from kvnotes.analysis.results import TaskResult
from kvnotes.analysis.stats import Estimate
from kvnotes.analysis.trials import (
    MIN_EFFECT,
    PairOptions,
    Trial,
    clusters_of,
    effect_estimate,
    shared_trials,
    split_by_effect,
    with_progress,
)
from kvnotes.batches import sharing_enabled
from kvnotes.metrics import kv_deviation, spearman
from kvnotes.ops import Patch, decide_recomputed, refresh
from kvnotes.prompt import is_delimiter


@dataclass(frozen=True, kw_only=True)
class FieldRefresh(TaskResult):
    """`recovery` (headline), `deviation_before_field` (KV deviation of the slots before the field:
    0 by causality) and `effect` (the field's move of the decision, logits)."""

    PARTS = ("recovery", "deviation_before_field", "effect")
    deviation_exactly_zero: bool


def field_refresh(trials: Sequence[Trial], *, min_effect: float = MIN_EFFECT) -> TaskResult:
    """Recompute only the changed field's K/V with the new value, every other slot stale.

    Parts: `recovery` (headline); `deviation_before_field`, the largest KV deviation between the
    old and new notebooks over all slots before the field (0 exactly: they never saw it); and
    `effect`, the decision's move from old to new in logits.
    """
    used, excluded = split_by_effect(trials, min_effect)
    rec = []
    for t in with_progress(used, "field_refresh"):
        if sharing_enabled():  # the field recomputed in the decision's own forward
            out = decide_recomputed(t.model, t.old_nb, t.pair.new, t.pair.field_span, vocab=t.vocab)
            ld = t.score(out.last)
        else:
            ld = t.ld(refresh(t.model, t.old_nb, t.pair.new, t.pair.changed))
        rec.append(float(t.recovery(ld)[0]))
    dev = []
    for t in trials:
        before = t.pair.field_span.start
        d = kv_deviation(t.old_nb, t.new_nb)[0]  # [layer, slot], slot order = positions order
        pos = t.old_nb.positions
        dev.append(float(d[:, pos < before].max()) if bool((pos < before).any()) else 0.0)
    return FieldRefresh.of(
        name="field_refresh",
        headline="recovery",
        parts={
            "recovery": Estimate.of(rec, clusters=clusters_of(used)),
            "deviation_before_field": Estimate.of(dev, clusters=clusters_of(trials)),
            "effect": effect_estimate(trials),
        },
        excluded=excluded,
        deviation_exactly_zero=all(d == 0.0 for d in dev),
        description="recompute only the field's K/V with the new value; reuse every other slot stale",
    )


@dataclass(frozen=True, kw_only=True)
class NotesTransplant(TaskResult):
    """Every downstream slot from the new run: both K and V (`kv`, headline), or one of them."""

    PARTS = ("kv", "k_only", "v_only")
    n_slots: tuple[int, ...]  # downstream slots per pair


def notes_transplant(trials: Sequence[Trial], *, min_effect: float = MIN_EFFECT) -> TaskResult:
    """Transplant the downstream slots (after the field, before the decision) from the new
    notebook into the old: K and V (headline `kv`), K only, V only."""
    used, excluded = split_by_effect(trials, min_effect)
    parts: dict[str, list[float]] = {"kv": [], "k_only": [], "v_only": []}
    for t in with_progress(used, "notes_transplant"):
        pos = tuple(t.pair.downstream())
        r = t.sweep(
            [Patch(positions=pos), Patch(positions=pos, values=False), Patch(positions=pos, keys=False)]
        )
        for name, v in zip(parts, r.tolist()):
            parts[name].append(v)
    return NotesTransplant.of(
        name="notes_transplant",
        headline="kv",
        parts={k: Estimate.of(v, clusters=clusters_of(used)) for k, v in parts.items()},
        excluded=excluded,
        n_slots=[len(t.pair.downstream()) for t in trials],
        description="transplant every slot after the field and before the decision from the new run",
    )


def single_slot_map(t: Trial, layer_window: int) -> dict:
    """One pair's note map (cached on the trial): per-slot and per-layer transplant recoveries.

    The sweeps that do not depend on `layer_window` run once per pair, whichever window asks
    first (the edit methods' window 1 reuses the note map's); a window of one layer is the
    per-layer sweep itself."""
    key = ("note_map", layer_window)
    if key in t.cache:
        return t.cache[key]
    base = _slot_sweeps(t, reuse=sharing_enabled())
    L = t.model.n_layers
    windows = [tuple(range(s, s + layer_window)) for s in range(0, L - layer_window + 1)]
    if layer_window == 1:
        per_window = list(base["per_layer"])
    else:
        down = tuple(t.pair.downstream())
        per_window = t.sweep([Patch(positions=down, layers=w) for w in windows]).tolist()
    out = {**base, "layer_windows": [list(w) for w in windows], "per_window": per_window}
    t.cache[key] = out
    return out


def _slot_sweeps(t: Trial, *, reuse: bool = True) -> dict:
    """The window-independent part of a pair's note map (cached on the trial; `reuse=False`
    computes it again): the field's slots together, each slot alone, all notes per layer, and
    each note slot x layer."""
    if reuse and "slot_sweeps" in t.cache:
        return t.cache["slot_sweeps"]
    field_pos = list(t.pair.field_span)
    down = t.pair.downstream()
    slots = field_pos + down
    L = t.model.n_layers
    specs = (
        [Patch(positions=tuple(field_pos))]
        + [Patch(positions=(p,)) for p in slots]
        + [Patch(positions=tuple(down), layers=(l,)) for l in range(L)]
        + [Patch(positions=(p,), layers=(l,)) for p in down for l in range(L)]
    )
    r = t.sweep(specs).tolist()
    n_s, n_d = len(slots), len(down)
    field_joint, r = r[0], r[1:]
    per_slot, r = r[:n_s], r[n_s:]
    per_layer, r = r[:L], r[L:]
    grid = [r[i * L : (i + 1) * L] for i in range(n_d)]
    dev = kv_deviation(t.old_nb, t.new_nb)[0]  # [layer, slot]
    dev_slot = dev.pow(2).sum(0).sqrt()
    idx = t.old_nb.slot_index(slots)
    strings = t.token_strings(slots)
    decision = t.pair.new.span("decision").start
    out = {
        "positions": slots,
        "tokens": strings,
        "prompt_tokens": t.token_strings(range(len(t.pair.new))),
        "role": ["field"] * len(field_pos) + ["note"] * n_d,
        "recovery": per_slot,
        "field_joint": field_joint,
        "deviation": dev_slot[idx].tolist(),
        "delimiter": [bool(s) and is_delimiter(s) for s in strings],
        "distance_to_decision": [decision - p for p in slots],
        "per_layer": per_layer,
        "slot_layer": grid,
    }
    t.cache["slot_sweeps"] = out
    return out


def note_scores(t: Trial, layer_window: int = 1) -> list[tuple[float, int]]:  # noqa: ARG001 - kept for callers
    """(single-slot transplant recovery, position) of each downstream slot of the pair.

    Read from the pair's note map when one was computed (any window: the single-slot sweep does
    not depend on it); otherwise only the single-slot transplants are run (the same patches,
    without the per-layer sweeps), and kept on the trial.
    """
    if "slot_sweeps" in t.cache:
        m = t.cache["slot_sweeps"]
        return [(r, p) for r, p, role in zip(m["recovery"], m["positions"], m["role"]) if role == "note"]
    if "note_slots" not in t.cache:
        down = t.pair.downstream()
        t.cache["note_slots"] = list(zip(t.sweep([Patch(positions=(p,)) for p in down]).tolist(), down))
    return list(t.cache["note_slots"])


def top_notes(t: Trial, k: int, layer_window: int = 1) -> list[int]:
    """Positions of the `k` downstream slots whose single-slot transplant recovers the most."""
    notes = sorted(note_scores(t, layer_window), key=lambda x: -x[0])
    return [p for _, p in notes[:k]]


@dataclass(frozen=True, kw_only=True)
class NoteMap(TaskResult):
    """Single-slot, single-layer and slot × layer transplants (see `note_map`)."""

    PARTS = ("top_slot", "field_slots", "delimiter_share", "deviation_effect_spearman")
    PART_PATTERNS = (r"layer_\d+", r"layers_\d+-\d+")
    maps: tuple[SlotMap, ...]
    layer_window: int


def note_map(trials: Sequence[Trial], *, min_effect: float = MIN_EFFECT, layer_window: int = 3) -> TaskResult:
    """Per-slot transplant sweep over the field and downstream slots (all layers), per layer,
    per window of `layer_window` consecutive layers, and per slot × layer.

    Parts: `top_slot` (headline: the best single downstream slot's recovery), `field_slots`
    (the field's own slots together, all layers: equal to field-only refresh, as slots before
    the field never saw it), `delimiter_share` (share of the positive single-slot
    effect on punctuation/whitespace tokens), `deviation_effect_spearman` (rank correlation of
    KV deviation and causal effect over downstream slots: the CacheBlend diagnostic),
    `layer_{l}` and `layers_{a}-{b}` (all downstream slots at those layers).
    """
    used, excluded = split_by_effect(trials, min_effect)
    L = used[0].model.n_layers if used else 0
    layer_window = max(1, min(layer_window, L or 1))
    top, field_slots, share, rho = [], [], [], []
    top_c, share_c, rho_c = [], [], []  # the template of each value appended to top, share, rho
    per_layer: list[list[float]] = [[] for _ in range(L)]
    per_window: list[list[float]] = [[] for _ in range(max(L - layer_window + 1, 0))]
    maps = []
    for t in with_progress(used, "note_map"):
        m = single_slot_map(t, layer_window)
        maps.append(m)
        notes = [i for i, role in enumerate(m["role"]) if role == "note"]
        rec = [m["recovery"][i] for i in notes]
        field_slots.append(m["field_joint"])
        if rec:
            top.append(max(rec))
            top_c.append(t.pair.template)
            pos_total = sum(max(r, 0.0) for r in rec)
            if pos_total > 1e-3:  # below this there is no effect to share out
                share.append(sum(max(m["recovery"][i], 0.0) for i in notes if m["delimiter"][i]) / pos_total)
                share_c.append(t.pair.template)
            dev = [m["deviation"][i] for i in notes]
            r = spearman(dev, rec)
            if r is not None:
                rho.append(r)
                rho_c.append(t.pair.template)
        for l, v in enumerate(m["per_layer"]):
            per_layer[l].append(v)
        for w, v in enumerate(m["per_window"]):
            per_window[w].append(v)
    every = clusters_of(used)  # field_slots, per_layer and per_window have one value per used trial
    parts = {
        "top_slot": Estimate.of(top, clusters=top_c),
        "field_slots": Estimate.of(field_slots, clusters=every),
        "delimiter_share": Estimate.of(share, clusters=share_c),
        "deviation_effect_spearman": Estimate.of(rho, clusters=rho_c),
    }
    parts.update({f"layer_{l}": Estimate.of(v, clusters=every) for l, v in enumerate(per_layer)})
    parts.update(
        {
            f"layers_{w}-{w + layer_window - 1}": Estimate.of(v, clusters=every)
            for w, v in enumerate(per_window)
        }
    )
    return NoteMap.of(
        name="note_map",
        headline="top_slot",
        parts=parts,
        excluded=excluded,
        maps=maps,
        layer_window=layer_window,
        description="transplant one slot (or one layer, or a window of layers) at a time from the new run",
    )


@dataclass(frozen=True)
class SlotMap:
    """One pair's note map: per slot (the field's, then the notes), its transplant recovery and
    more; per layer and window of layers, all notes transplanted there; per note slot × layer."""

    positions: tuple[int, ...]
    tokens: tuple[str, ...]
    prompt_tokens: tuple[str, ...]
    role: tuple[str, ...]  # "field" or "note"
    recovery: tuple[float, ...]
    field_joint: float
    deviation: tuple[float, ...]
    delimiter: tuple[bool, ...]
    distance_to_decision: tuple[int, ...]
    per_layer: tuple[float, ...]
    layer_windows: tuple[tuple[int, ...], ...]
    per_window: tuple[float, ...]
    slot_layer: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class NoteMapConfig(PairOptions):
    layer_window: int = option(
        3, "consecutive layers per window of the per-window transplant", least=1, layers=True
    )


def _trials(ctx: Context, cfg: PairOptions) -> list[Trial]:
    return cfg.call(shared_trials, ctx)


@analysis("field_refresh", "probes", PairOptions, FieldRefresh, quick={"n": 6}, order=1)
def _run_field_refresh(ctx: Context, cfg: PairOptions) -> FieldRefresh:
    """Recompute only the field's slots: how much of the new decision comes back."""
    return field_refresh(_trials(ctx, cfg), min_effect=ctx.min_effect)


@analysis("notes_transplant", "probes", PairOptions, NotesTransplant, quick={"n": 6}, order=2)
def _run_notes_transplant(ctx: Context, cfg: PairOptions) -> NotesTransplant:
    """Transplant every note slot from the new run (K+V, K only, V only)."""
    return notes_transplant(_trials(ctx, cfg), min_effect=ctx.min_effect)


@analysis("note_map", "probes", NoteMapConfig, NoteMap, quick={"n": 6}, order=3)
def _run_note_map(ctx: Context, cfg: NoteMapConfig) -> NoteMap:
    """Single-slot and per-layer transplants over the prompt."""
    return cfg.call(note_map, _trials(ctx, cfg), min_effect=ctx.min_effect)
