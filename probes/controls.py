"""The read-out and control probes: knockout, dissociation, false-note injection."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypedDict

import torch

from kvnotes.analysis.registry import Context, Need, analysis, option
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
from kvnotes.errors import BadArgument
from kvnotes.ops import Patch
from kvnotes.prompt import is_delimiter
from kvnotes.tasks import RULE
from probes.causal import note_scores, top_notes

INJECT_K = (1, 2, 4, 8)


def knockout_hooks(model, blocked: torch.Tensor) -> list:
    """Hooks that stop the decision tokens attending to notebook slots: `blocked` is a boolean
    `[batch, slot]` mask (the key axis of `hook_attn_scores` is slots, then computed tokens)."""

    def hook(scores, hook):  # noqa: ARG001 - TransformerLens passes hook= by keyword
        n_extra = scores.shape[-1] - blocked.shape[-1]
        m = torch.cat([blocked, blocked.new_zeros(blocked.shape[0], n_extra)], -1)[:, None, None, :]
        return torch.where(m.to(scores.device), float("-inf"), scores)

    return [(lambda name: name.endswith("attn.hook_attn_scores"), hook)]


def random_slots(t: Trial, k: int, exclude: Sequence[int], rng: random.Random) -> list[int]:
    """`k` random downstream positions not in `exclude` (topped up from the rest of the prompt,
    never the first token, an attention sink in most models)."""
    pool = [p for p in t.pair.downstream() if p not in exclude]
    if len(pool) < k:
        field = set(t.pair.field_span)
        rest = [
            p
            for p in range(1, t.pair.new.span("decision").start)
            if p not in exclude and p not in pool and p not in field
        ]
        pool += rng.sample(rest, min(k - len(pool), len(rest)))
    return rng.sample(pool, min(k, len(pool)))


def _slot_keys(t: Trial) -> dict[int, tuple]:
    """A key for each downstream slot that lines it up across pairs: its token's text and how many
    slots of the same text precede it in the region (the 2nd " ;" after the field, ...), within
    the pair's template. Offsets would not line up: [vary] values of different token lengths
    (names, ids) shift everything after them."""
    down = t.pair.downstream()
    seen: dict[str, int] = {}
    keys = {}
    for p, text in zip(down, t.token_strings(down)):
        keys[p] = (getattr(t.pair, "template", 0), text, seen.get(text, 0))
        seen[text] = seen.get(text, 0) + 1
    return keys


@dataclass(frozen=True)
class Crossing:
    """Which trials `cross_fitted_notes` ranked on the other half of the trials, one flag per
    trial: True where every slot it chose was scored there; False where some were ranked by
    position instead (the other half has no pair of its template, or too few of its slots line
    up) and where one trial was all there was (in-sample). True as a whole only when every trial
    was cross-fitted; `fallback` counts the rest.

    >>> c = Crossing((True, False, True))
    >>> bool(c), c.fallback, c.summary()
    (False, 1, '2/3 pairs ranked on the other half; 1 by position (no line-up there)')
    """

    pairs: tuple[bool, ...]

    def __bool__(self) -> bool:
        return bool(self.pairs) and all(self.pairs)

    @property
    def fallback(self) -> int:
        return sum(not c for c in self.pairs)

    def summary(self) -> str:
        return crossing_summary(self.pairs)


def crossing_summary(pairs) -> str:
    """`Crossing.summary` from saved per-pair flags (None: a report written before them)."""
    if pairs is None:
        return "not recorded"
    n, fell = len(pairs), sum(not c for c in pairs)
    if n == 0:
        return "no pairs"
    if n == 1:
        return "1 pair: nothing to cross-fit on, ranked in-sample"
    said = f"{n - fell}/{n} pairs ranked on the other half"
    return said + (f"; {fell} by position (no line-up there)" if fell else "")


def cross_fitted_notes(trials: Sequence[Trial], k: int) -> tuple[list[list[int]], Crossing]:
    """For each trial, its `k` downstream slots ranked on the OTHER half of the trials (even and odd
    indices): slots are lined up across pairs by `_slot_keys` and scored by the mean single-slot
    recovery the other half measured at the same key (a slot whose key the other half lacks
    ranks last, latest position first). Out of sample, unlike `top_notes`, which ranks a pair's
    slots on that pair. The `Crossing` says, per trial, whether every chosen slot was ranked on
    the other half or some fell back to position (a template the other half lacks: at n = 6 with
    4 templates, two pairs); with one trial it falls back to in-sample and says so."""
    n = len(trials)
    crossed = n >= 2
    keys = [_slot_keys(t) for t in trials]
    scores = [{keys[i][p]: r for r, p in note_scores(t)} for i, t in enumerate(trials)]
    out, flags = [], []
    for i, t in enumerate(trials):
        others = [j for j in range(n) if (j % 2 != i % 2 if crossed else True)]
        mean: dict[tuple, list[float]] = {}
        for j in others:
            for key, r in scores[j].items():
                mean.setdefault(key, []).append(r)
        rank = {key: sum(v) / len(v) for key, v in mean.items()}
        down = t.pair.downstream()
        down.sort(key=lambda p: (-rank.get(keys[i][p], float("-inf")), -p))
        out.append(down[:k])
        flags.append(crossed and _ranked_there([keys[i][p] for p in down[:k]], rank))
    return out, Crossing(tuple(flags))


def _ranked_there(keys: Sequence[tuple], rank: Mapping[tuple, float]) -> bool:
    """Whether every chosen slot's key was scored by the other half (none ranked by position)."""
    return all(key in rank for key in keys)


def matched_slots(t: Trial, chosen: Sequence[int], rng: random.Random) -> list[int]:
    """A random control for `chosen`: for each chosen slot, in order, another downstream slot
    (between the field and the decision) of the same token class (delimiter or not), none of them
    chosen; where a class runs out, a slot of the other class (`off_class` counts those: a control
    that left its class is not a matched one). Never reaches outside the region: where the region
    runs out, fewer slots than chosen."""
    free = [p for p in t.pair.downstream() if p not in chosen]
    rng.shuffle(free)
    delim = dict(zip(free, (is_delimiter(s) for s in t.token_strings(free))))
    picked: list[int] = []
    for c_delim in (is_delimiter(s) for s in t.token_strings(list(chosen))):
        same = [p for p in free if p not in picked and delim[p] == c_delim]
        rest = [p for p in free if p not in picked]
        if same or rest:
            picked.append((same or rest)[0])
    return picked


def off_class(t: Trial, chosen: Sequence[int], picked: Sequence[int]) -> int:
    """How many of `matched_slots`' `picked` slots are not of the token class of the chosen slot
    they stand for (the i-th picked for the i-th chosen)."""
    pairs = list(zip(chosen, picked))
    kinds = [is_delimiter(s) for s in t.token_strings([p for pair in pairs for p in pair])]
    return sum(a != b for a, b in zip(kinds[0::2], kinds[1::2]))


def paired(a: Sequence[float | None], b: Sequence[float | None]) -> tuple[list, list, list]:
    """`a` and `b` (one value or None per pair) over the same pairs: where either lacks a value,
    both get None (so `dropped` counts it in each), and the per-pair difference a - b."""
    both = [x is not None and y is not None for x, y in zip(a, b)]
    a2 = [x if ok else None for x, ok in zip(a, both)]
    b2 = [y if ok else None for y, ok in zip(b, both)]
    return a2, b2, [x - y if ok else None for x, y, ok in zip(a, b, both)]


def _blocked_lost(t: Trial, rows: Sequence[Sequence[int]], per_forward: int | None = None) -> torch.Tensor:
    """The fraction of the decision lost with each row's slots blocked from the decision, the
    rows `per_forward` at a time (default: all in one forward)."""
    step = per_forward or max(len(rows), 1)
    out = []
    for a in range(0, len(rows), step):
        chunk = rows[a : a + step]
        mask = torch.zeros(len(chunk), t.new_nb.n_slots, dtype=torch.bool)
        for r, pos in enumerate(chunk):
            if pos:
                mask[r, t.new_nb.slot_index(pos)] = True
        out.append(t.ld(t.new_nb.expand(len(chunk)), hooks=knockout_hooks(t.model, mask)))
    return 1.0 - t.recovery(torch.cat(out))


@dataclass(frozen=True, kw_only=True)
class Knockout(TaskResult):
    """Fraction of the decision lost with the top-k note slots blocked (`top`) vs k random ones;
    out of sample, the cross-fitted top slots (`top_xfit`) vs slots matched to them (`matched`)."""

    PARTS = ("top", "random")
    # optional: reports written before them load too
    PART_PATTERNS = ("top_xfit", "matched", "xfit_minus_matched")
    IN_SAMPLE = ("top", "random")
    k: int
    draws: int
    slots: tuple[KnockedSlots, ...]
    # True: every pair's top_xfit ranked on the other half (False: some by position, or one pair)
    cross_fitted: bool | None = None
    cross_fitted_pairs: tuple[bool, ...] | None = None  # per used pair: ranked on the other half
    matched_off_class: tuple[int, int] | None = None  # control slots that left their class, of all drawn

    def notes(self) -> list[tuple[str, str]]:
        return _control_notes(self, {self.k: self.matched_off_class})


def knockout(
    trials: Sequence[Trial], *, k: int = 4, draws: int = 8, seed: int = 0, min_effect: float = MIN_EFFECT
) -> TaskResult:
    """Block the decision's attention (all layers, all heads) to the top-`k` note slots of each
    pair in the new-value run, and as control to `k` random slots (`draws` draws, averaged).

    Values are the fraction of the decision lost: (ld_new - ld_knocked) / (ld_new - ld_old);
    0 = nothing lost, 1 = back to the old value's decision.

    Headline, out of sample: `top_xfit` blocks the k slots ranked on the other half of the pairs
    (`cross_fitted_notes`), `matched` as many slots matched to those in region and token class
    (`matched_slots`, `draws` draws), and `xfit_minus_matched` is their difference pair by pair
    (its CI is the paired comparison). The three run over the same pairs: on a pair whose region
    has fewer than 2k slots there is no matched control, and the pair is left out of all three
    (counted in their `dropped`). `cross_fitted_pairs` says which pairs were ranked on the other
    half (not by position), `matched_off_class` how many control slots had to leave their token
    class. In-sample, kept beside them: `top` (the top slots of the pair's own map) and `random`
    (slots drawn outside them, topped up from before the field).
    """
    used, excluded = split_by_effect(trials, min_effect)
    top_lost, rand_lost, chosen = [], [], []
    xfit_lost, matched_lost = [], []
    off, drawn = 0, 0
    xfit, crossed = cross_fitted_notes(used, k)
    for i, t in enumerate(with_progress(used, "knockout")):
        rng = random.Random(f"knockout/{seed}/{i}")
        top = top_notes(t, k)
        randoms = [random_slots(t, len(top), top, rng) for _ in range(draws)]
        chosen.append({"top": top, "tokens": t.token_strings(top)})
        mrng = random.Random(f"knockout-matched/{seed}/{i}")
        controls = [matched_slots(t, xfit[i], mrng) for _ in range(draws)]
        rows = [[top], randoms, [xfit[i]], controls]  # shared: one forward blocks them all
        per_forward = None if sharing_enabled() else draws + 1  # unshared: a forward per row set
        flat = [r for group in rows for r in group]
        lost = _blocked_lost(t, flat, per_forward).split([len(g) for g in rows])
        top_lost.append(float(lost[0][0]))
        rand_lost.append(float(lost[1].mean()))
        xfit_lost.append(float(lost[2][0]))
        whole = all(len(c) == len(xfit[i]) for c in controls)  # else the region is too small to match
        matched_lost.append(float(lost[3].mean()) if whole else None)
        if whole:
            off += sum(off_class(t, xfit[i], c) for c in controls)
            drawn += sum(len(c) for c in controls)
    xfit_lost, matched_lost, diff = paired(xfit_lost, matched_lost)
    return Knockout.of(
        name="knockout",
        headline="top_xfit",
        parts={
            k: Estimate.of(v, clusters=clusters_of(used))  # one value (or None) per used trial
            for k, v in (
                ("top", top_lost),
                ("random", rand_lost),
                ("top_xfit", xfit_lost),
                ("matched", matched_lost),
                ("xfit_minus_matched", diff),
            )
        },
        cross_fitted=bool(crossed),
        cross_fitted_pairs=crossed.pairs,
        matched_off_class=(off, drawn),
        excluded=excluded,
        k=k,
        draws=draws,
        slots=chosen,
        description=f"block the decision's attention to the top-{k} note slots, ranked on the other "
        "pairs (vs as many slots matched to them)",
    )


@dataclass(frozen=True, kw_only=True)
class Dissociation(TaskResult):
    """Rule flipped, field fixed: the notes (`notes`) vs the rule token's own slot (`rule_slot`)."""

    PARTS = ("notes", "rule_slot", "effect")


def dissociation(rule_trials: Sequence[Trial], *, min_effect: float = MIN_EFFECT) -> TaskResult:
    """Field held fixed, rule token flipped (trials of kind "rule"): transplanting the notes
    (slots after both rule and field, before the decision) should carry the flipped conclusion,
    patching the rule token's own slots alone should carry little.

    Parts: `notes` (headline), `rule_slot`, `effect` (how far the flip moves the decision).
    """
    if any(t.pair.kind != "rule" for t in rule_trials):
        raise BadArgument("dissociation needs rule-flip trials: make them with make_trials(..., kind='rule')")
    used, excluded = split_by_effect(rule_trials, min_effect)
    notes, rule = [], []
    for t in with_progress(used, "dissociation"):
        r = t.sweep([Patch(positions=tuple(t.pair.downstream())), Patch(positions=tuple(t.pair.field_span))])
        notes.append(float(r[0]))
        rule.append(float(r[1]))
    return Dissociation.of(
        name="dissociation",
        headline="notes",
        parts={
            "notes": Estimate.of(notes, clusters=clusters_of(used)),
            "rule_slot": Estimate.of(rule, clusters=clusters_of(used)),
            "effect": effect_estimate(rule_trials),
        },
        excluded=excluded,
        description="flip one rule token, field fixed: transplant the notes vs patch the rule token's slot",
    )


@dataclass(frozen=True, kw_only=True)
class FalseNoteInjection(TaskResult):
    """Per k: recovery toward the injected conclusion (`k{k}`), whether the answer follows it
    (`follows_k{k}`), and the same injection into random slots (`random_k{k}`); out of sample, the
    cross-fitted top slots (`xfit_k{k}`) and slots matched to them (`matched_k{k}`)."""

    PART_PATTERNS = (
        r"k\d+",
        r"follows_k\d+",
        r"random_k\d+",
        r"xfit_k\d+",
        r"matched_k\d+",
        r"xfit_minus_matched_k\d+",
    )
    IN_SAMPLE = (r"k\d+", r"follows_k\d+", r"random_k\d+")
    ks: tuple[int, ...]
    cross_fitted: bool | None = None  # as Knockout's
    cross_fitted_pairs: tuple[bool, ...] | None = None
    matched_off_class: Mapping[int, tuple[int, int]] | None = None  # per k, as Knockout's
    GRID_ROWS: ClassVar[str] = "slots injected"

    def notes(self) -> list[tuple[str, str]]:
        return _control_notes(self, self.matched_off_class)

    def cell(self, part: str) -> tuple[str, str] | None:
        """Each k a row; the injection, whether the answer follows, and the controls the columns."""
        what, _, k = part.rpartition("k")
        return (f"k={k}", what.rstrip("_") or "recovery")


def false_note_injection(
    trials: Sequence[Trial], *, ks: Sequence[int] = INJECT_K, seed: int = 0, min_effect: float = MIN_EFFECT
) -> TaskResult:
    """Into the old notebook (consistent with its live field) write the new run's K/V at the
    top-k note slots, k in `ks`: does the decision follow the injected note against the field?

    Headline, out of sample, at the largest k at which some pair has a matched control (k8 where
    the region has 16 slots or more): `xfit_k{k}` injects the k slots ranked on the other
    half of the pairs (`cross_fitted_notes`), `matched_k{k}` as many slots matched to those in
    region and token class (`matched_slots`), and `xfit_minus_matched_k{k}` is their difference
    pair by pair (its CI is the paired comparison). The three run over the same pairs: on a pair
    whose region has fewer than 2k slots there is no matched control, and the pair is left out of
    all three at that k (counted in their `dropped`). `cross_fitted_pairs` says which pairs were
    ranked on the other half (not by position), `matched_off_class` per k how many control slots
    had to leave their token class.

    In-sample, kept beside them: `k{k}` (recovery toward the injected conclusion, the pair's own
    top-k slots, so `k1` is the maximum of the list its control samples from), `follows_k{k}`
    (whether the chosen answer became the injected one, over pairs whose old and new choices
    differ) and `random_k{k}` (the same injection into k slots drawn at random from the same
    downstream region; when the region has no more than k slots, the same slots as `k{k}`).
    """
    used, excluded = split_by_effect(trials, min_effect)
    ks = sorted(set(int(k) for k in ks))
    rec = {k: [] for k in ks}
    rand = {k: [] for k in ks}
    follows = {k: [] for k in ks}
    follows_c = []  # the template of each pair whose choice flips (the pairs `follows` counts)
    xfit_slots, crossed = cross_fitted_notes(used, ks[-1])
    xfit: _CrossFitted = {
        "values": {k: [] for k in ks},
        "crossed": crossed,
        "off_class": {k: [0, 0] for k in ks},
    }
    matched: dict[int, list] = {k: [] for k in ks}
    for i, t in enumerate(with_progress(used, "false_note_injection")):
        rng = random.Random(f"inject/{seed}/{i}")
        ranked = top_notes(t, ks[-1])
        down = t.pair.downstream()
        specs = [Patch(positions=tuple(ranked[:k])) for k in ks]
        specs += [Patch(positions=tuple(rng.sample(down, min(k, len(down))))) for k in ks]
        mrng = random.Random(f"inject-matched/{seed}/{i}")
        controls = [matched_slots(t, xfit_slots[i][:k], mrng) for k in ks]
        out_of_sample = [Patch(positions=tuple(xfit_slots[i][:k])) for k in ks]
        out_of_sample += [Patch(positions=tuple(c)) for c in controls]
        if sharing_enabled():  # both sets of injections in one sweep
            r, r_x = t.sweep(specs + out_of_sample).split([len(specs), len(out_of_sample)])
        else:
            r, r_x = t.sweep(specs), t.sweep(out_of_sample)
        _add_out_of_sample(xfit, matched, ks, t, xfit_slots[i], controls, r_x)
        lds = t.ld_old + r * (t.ld_new - t.ld_old)
        flips = (t.ld_old > 0) != (t.ld_new > 0)
        if flips:
            follows_c.append(t.pair.template)
        for j, k in enumerate(ks):
            rec[k].append(float(r[j]))
            rand[k].append(float(r[len(ks) + j]))
            if flips:
                follows[k].append(float((lds[j] > 0) == (t.ld_new > 0)))
    off = {k: tuple(v) for k, v in xfit["off_class"].items()}
    every = clusters_of(used)  # rec, rand, xfit and matched hold one value (or None) per used trial
    parts = {f"k{k}": Estimate.of(v, clusters=every) for k, v in rec.items()}
    parts.update({f"follows_k{k}": Estimate.of(v, clusters=follows_c) for k, v in follows.items()})
    parts.update({f"random_k{k}": Estimate.of(v, clusters=every) for k, v in rand.items()})
    for k in ks:
        x, m, diff = paired(xfit["values"][k], matched[k])
        parts[f"xfit_k{k}"] = Estimate.of(x, clusters=every)
        parts[f"matched_k{k}"] = Estimate.of(m, clusters=every)
        parts[f"xfit_minus_matched_k{k}"] = Estimate.of(diff, clusters=every)
    # the largest k at which some pair's region had room for a matched control (on a short region
    # k8 has none): a choice on region sizes, not on the figures
    room = [k for k in ks if parts[f"xfit_k{k}"].n] or ks
    return FalseNoteInjection.of(
        cross_fitted=bool(xfit["crossed"]),
        cross_fitted_pairs=xfit["crossed"].pairs,
        matched_off_class=off,
        name="false_note_injection",
        headline=f"xfit_k{room[-1]}",
        parts=parts,
        excluded=excluded,
        ks=ks,
        description="write the opposite conclusion's K/V into the top-k note slots of a consistent "
        "notebook, ranked on the other pairs (vs as many slots matched to them)",
    )


class _CrossFitted(TypedDict):
    """`false_note_injection`'s out-of-sample record: per k the recoveries of the cross-fitted top-k
    slots, which trials were cross-fitted, and per k [control slots off their token class, control
    slots] (`_add_out_of_sample` adds to it trial by trial)."""

    values: dict[int, list[float]]
    crossed: Crossing
    off_class: dict[int, list[int]]


def _add_out_of_sample(
    xfit: _CrossFitted,
    matched: dict,
    ks: Sequence[int],
    t: Trial,
    slots: Sequence[int],
    controls: list,
    r: torch.Tensor,
) -> None:
    """Record one trial's injections into its cross-fitted top-k `slots` and into the slots
    matched to them (`controls`, one per k): `r` holds their recoveries, the cross-fitted ones
    first. A k whose region is too small to match gets None as its matched value."""
    for j, k in enumerate(ks):
        xfit["values"][k].append(float(r[j]))
        whole = len(controls[j]) == len(slots[:k])  # else the region is too small to match
        matched[k].append(float(r[len(ks) + j]) if whole else None)
        if whole:
            xfit["off_class"][k][0] += off_class(t, slots[:k], controls[j])
            xfit["off_class"][k][1] += len(controls[j])


@dataclass(frozen=True)
class KnockedSlots:
    top: tuple[int, ...]  # positions blocked
    tokens: tuple[str, ...]


def _control_notes(r, off: Mapping | None) -> list[tuple[str, str]]:
    """The table's rows on how the out-of-sample figures were chosen: pairs cross-fitted, and
    control slots that left their token class."""
    if r.not_applicable or r.cross_fitted_pairs is None:
        return []
    rows = [(f"{r.name}.cross_fitted", crossing_summary(r.cross_fitted_pairs))]
    for k, got in sorted((off or {}).items()):
        if got is not None:
            left, drawn = got
            where = f"matched_k{k}" if r.name == "false_note_injection" else "matched"
            said = f"{left} of {drawn} control slots left their token class" if drawn else "no pair had room"
            rows.append((f"{r.name}.{where} off class", said))
    return rows


@dataclass(frozen=True)
class KnockoutConfig(PairOptions):
    k: int = option(4, "note slots blocked", least=1)
    draws: int = option(8, "random slot sets blocked, as control", least=1)


@dataclass(frozen=True)
class InjectConfig(PairOptions):
    ks: tuple[int, ...] = option(INJECT_K, "numbers of note slots injected", least=1)


@analysis("dissociation", "probes", PairOptions, Dissociation, quick={"n": 6}, order=5, requires=(Need.RULE,))
def _run_dissociation(ctx: Context, cfg: PairOptions) -> Dissociation:
    """Flip the rule, keep the field: do the notes carry the flipped conclusion?"""
    if ctx.task.rule is None:
        return Dissociation.of(
            name="dissociation",
            headline="notes",
            parts={"notes": Estimate.of([])},
            not_applicable=f"task {ctx.task.name!r} has no [rule] to flip",
        )
    return dissociation(cfg.call(shared_trials, ctx, kind=RULE), min_effect=ctx.min_effect)


@analysis("knockout", "probes", KnockoutConfig, Knockout, quick={"n": 6}, order=4)
def _run_knockout(ctx: Context, cfg: KnockoutConfig) -> Knockout:
    """Block the decision's attention to the top note slots (vs random slots)."""
    return cfg.call(knockout, cfg.call(shared_trials, ctx), seed=ctx.seed, min_effect=ctx.min_effect)


@analysis(
    "false_note_injection",
    "probes",
    InjectConfig,
    FalseNoteInjection,
    quick={"n": 6},
    order=6,
    requires=(Need.RULE,),
)
def _run_false_note_injection(ctx: Context, cfg: InjectConfig) -> FalseNoteInjection:
    """Write the opposite conclusion into the top-k notes (vs k random slots)."""
    trials = cfg.call(shared_trials, ctx)
    return cfg.call(false_note_injection, trials, seed=ctx.seed, min_effect=ctx.min_effect)
