"""The read-out and control probes: knockout, dissociation, false-note injection."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvnotes.analysis import Context, analysis, option
from kvnotes.errors import BadArgument
from kvnotes.ops import Patch
from kvnotes.tasks import RULE
from probes.causal import effect_estimate, split_by_effect, top_notes
from probes.results import Estimate, ProbeResult
from probes.trials import MIN_EFFECT, Pairs, Trial, shared_trials, with_progress

INJECT_K = (1, 2, 4, 8)


def knockout_hooks(model, blocked: torch.Tensor) -> list:
    """Hooks that stop the decision tokens attending to notebook slots: `blocked` is a boolean
    `[batch, slot]` mask (the key axis of `hook_attn_scores` is slots, then computed tokens)."""

    def hook(scores, hook):  # noqa: ARG001 - TransformerLens passes hook= by keyword
        n_extra = scores.shape[-1] - blocked.shape[-1]
        m = torch.cat([blocked, blocked.new_zeros(blocked.shape[0], n_extra)], -1)[:, None, None, :]
        ignore = model.tl.blocks[0].attn.IGNORE
        return torch.where(m.to(scores.device), ignore.to(scores.dtype), scores)

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


def knockout(
    trials: Sequence[Trial], *, k: int = 4, draws: int = 8, seed: int = 0, min_effect: float = MIN_EFFECT
) -> ProbeResult:
    """Block the decision's attention (all layers, all heads) to the top-`k` note slots of each
    pair in the new-value run, and as control to `k` random slots (`draws` draws, averaged).

    Values are the fraction of the decision lost: (ld_new - ld_knocked) / (ld_new - ld_old);
    0 = nothing lost, 1 = back to the old value's decision. Parts: `top` (headline), `random`.
    """
    used, excluded = split_by_effect(trials, min_effect)
    top_lost, rand_lost, chosen = [], [], []
    for i, t in enumerate(with_progress(used, "knockout")):
        rng = random.Random(f"knockout/{seed}/{i}")
        top = top_notes(t, k)
        rows = [top] + [random_slots(t, len(top), top, rng) for _ in range(draws)]
        mask = torch.zeros(len(rows), t.new_nb.n_slots, dtype=torch.bool)
        for r, pos in enumerate(rows):
            if pos:
                mask[r, t.new_nb.slot_index(pos)] = True
        logit_diffs = t.ld(t.new_nb.expand(len(rows)), hooks=knockout_hooks(t.model, mask))
        lost = 1.0 - t.recovery(logit_diffs)
        top_lost.append(float(lost[0]))
        rand_lost.append(float(lost[1:].mean()))
        chosen.append({"top": top, "tokens": t.token_strings(top)})
    return Knockout.of(
        name="knockout",
        headline="top",
        parts={"top": Estimate.of(top_lost), "random": Estimate.of(rand_lost)},
        excluded=excluded,
        k=k,
        draws=draws,
        slots=chosen,
        description=f"block the decision's attention to the top-{k} note slots (vs {k} random slots)",
    )


def dissociation(rule_trials: Sequence[Trial], *, min_effect: float = MIN_EFFECT) -> ProbeResult:
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
            "notes": Estimate.of(notes),
            "rule_slot": Estimate.of(rule),
            "effect": effect_estimate(rule_trials),
        },
        excluded=excluded,
        description="flip one rule token, field fixed: transplant the notes vs patch the rule token's slot",
    )


def false_note_injection(
    trials: Sequence[Trial], *, ks: Sequence[int] = INJECT_K, seed: int = 0, min_effect: float = MIN_EFFECT
) -> ProbeResult:
    """Into the old notebook (consistent with its live field) write the new run's K/V at the
    top-k note slots, k in `ks`: does the decision follow the injected note against the field?

    Parts per k: `k{k}` recovery toward the injected conclusion; `follows_k{k}` whether the
    chosen answer became the injected one (over pairs whose old and new choices differ); and
    `random_k{k}`, the same injection into k slots drawn at random from the same downstream region,
    as control (when the region has no more than k slots, control and top-k are the same slots).
    Headline: the largest k.
    """
    used, excluded = split_by_effect(trials, min_effect)
    ks = sorted(set(int(k) for k in ks))
    rec = {k: [] for k in ks}
    rand = {k: [] for k in ks}
    follows = {k: [] for k in ks}
    for i, t in enumerate(with_progress(used, "false_note_injection")):
        rng = random.Random(f"inject/{seed}/{i}")
        ranked = top_notes(t, ks[-1])
        down = t.pair.downstream()
        specs = [Patch(positions=tuple(ranked[:k])) for k in ks]
        specs += [Patch(positions=tuple(rng.sample(down, min(k, len(down))))) for k in ks]
        r = t.sweep(specs)
        lds = t.ld_old + r * (t.ld_new - t.ld_old)
        flips = (t.ld_old > 0) != (t.ld_new > 0)
        for j, k in enumerate(ks):
            rec[k].append(float(r[j]))
            rand[k].append(float(r[len(ks) + j]))
            if flips:
                follows[k].append(float((lds[j] > 0) == (t.ld_new > 0)))
    parts = {f"k{k}": Estimate.of(v) for k, v in rec.items()}
    parts.update({f"follows_k{k}": Estimate.of(v) for k, v in follows.items()})
    parts.update({f"random_k{k}": Estimate.of(v) for k, v in rand.items()})
    return FalseNoteInjection.of(
        name="false_note_injection",
        headline=f"k{ks[-1]}",
        parts=parts,
        excluded=excluded,
        ks=ks,
        description="write the opposite conclusion's K/V into the top-k note slots of a consistent notebook",
    )


@dataclass(frozen=True)
class KnockedSlots:
    top: tuple[int, ...]  # positions blocked
    tokens: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class Knockout(ProbeResult):
    """Fraction of the decision lost with the top-k note slots blocked (`top`) vs k random ones."""

    PARTS = ("top", "random")
    k: int
    draws: int
    slots: tuple[KnockedSlots, ...]


@dataclass(frozen=True, kw_only=True)
class Dissociation(ProbeResult):
    """Rule flipped, field fixed: the notes (`notes`) vs the rule token's own slot (`rule_slot`)."""

    PARTS = ("notes", "rule_slot", "effect")


@dataclass(frozen=True, kw_only=True)
class FalseNoteInjection(ProbeResult):
    """Per k: recovery toward the injected conclusion (`k{k}`), whether the answer follows it
    (`follows_k{k}`), and the same injection into random slots (`random_k{k}`)."""

    PART_PATTERNS = (r"k\d+", r"follows_k\d+", r"random_k\d+")
    ks: tuple[int, ...]


@dataclass(frozen=True)
class KnockoutConfig(Pairs):
    k: int = option(4, "note slots blocked")
    draws: int = option(8, "random slot sets blocked, as control")


@dataclass(frozen=True)
class InjectConfig(Pairs):
    ks: tuple[int, ...] = option(INJECT_K, "numbers of note slots injected")


@analysis("dissociation", "probes", Pairs, Dissociation, quick={"n": 6}, order=5)
def _dissociation(ctx: Context, cfg: Pairs) -> Dissociation:
    """Flip the rule, keep the field: do the notes carry the flipped conclusion?"""
    if ctx.task.rule is None:
        return Dissociation.of(
            name="dissociation",
            headline="notes",
            parts={"notes": Estimate.of([])},
            not_applicable=f"task {ctx.task.name!r} has no [rule] to flip",
        )
    return dissociation(shared_trials(ctx, cfg.n, kind=RULE), min_effect=ctx.min_effect)


@analysis("knockout", "probes", KnockoutConfig, Knockout, quick={"n": 6}, order=4)
def _run_knockout(ctx: Context, cfg: KnockoutConfig) -> Knockout:
    """Block the decision's attention to the top note slots (vs random slots)."""
    return knockout(
        shared_trials(ctx, cfg.n), k=cfg.k, draws=cfg.draws, seed=ctx.seed, min_effect=ctx.min_effect
    )


@analysis("false_note_injection", "probes", InjectConfig, FalseNoteInjection, quick={"n": 6}, order=6)
def _run_false_note_injection(ctx: Context, cfg: InjectConfig) -> FalseNoteInjection:
    """Write the opposite conclusion into the top-k notes (vs k random slots)."""
    return false_note_injection(
        shared_trials(ctx, cfg.n), ks=cfg.ks, seed=ctx.seed, min_effect=ctx.min_effect
    )
