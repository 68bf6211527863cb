"""Read and write circuits: every head ranked by its causal share, and the top-k heads patched
together against k random heads.

The top-k curve is cross-fitted: the trials are split in two halves and each trial's heads are
ranked on the *other* half, so the curve measures heads that generalise across prompts rather
than the noise of the prompt they were picked on (with one usable trial it falls back to
in-sample ranking and says so). Random sets are drawn afresh per trial and k; their recovery is
averaged over draws per trial.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from circuits.heads import Head, Sweep, all_heads, grouping, kv_head, read_sweep, write_sweep
from kvnotes.analysis.registry import Context, analysis, option, replace_default
from kvnotes.analysis.results import TaskResult
from kvnotes.analysis.stats import Curve, Estimate
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

K_MAX = 12
PATHS = ("prefix", "field", "notes", "query", "self")


def path_positions(t: Trial) -> dict[str, list[int]]:
    """Where a decision head's attention can bring the conclusion from: the slots before the
    field (`prefix`), the field, the note slots, the query tokens before the decision, and the
    decision token itself. Together they are every key it attends to."""
    q = t.pair.new.span("decision")
    field = t.pair.field_span
    notes = t.pair.downstream()
    between = [p for p in range(field.stop, notes[0] if notes else field.stop)]  # a rule pair's gap
    return {
        "prefix": list(range(field.start)),
        "field": list(field) + between,
        "notes": notes,
        "query": list(range(q.start, q.stop - 1)),
        "self": [q.stop - 1],
    }


def headline_k(n_heads: int, k_max: int) -> int:
    """The k of the headline top-k vs random-k figure: `k_max`, but at most a third of the
    model's heads, so that k random heads do not cover the model (a tiny model has 4-12)."""
    return max(1, min(k_max, n_heads // 3))


def ranking_table(
    model,
    heads: Sequence[Head],
    scores: np.ndarray,
    clusters: Sequence[int] | None = None,
    **extra: np.ndarray,
) -> list[dict]:
    """Heads sorted by mean recovery (`scores`: `[trial, head]`), each with its estimate and
    the mean/CI of any `extra` per-head score of the same shape; `clusters` labels the trials."""
    rows = []
    for i, (l, h) in enumerate(heads):
        e = Estimate.of(scores[:, i].tolist(), clusters=clusters)
        row = {"layer": l, "head": h, "kv_head": kv_head(model, h), "label": f"L{l}H{h}", **e.to_dict()}
        for name, s in extra.items():
            x = Estimate.of(s[:, i].tolist(), clusters=clusters)
            row[name] = {"mean": x.mean, "ci": list(x.ci) if x.ci else None}
        rows.append(row)
    rows.sort(key=lambda r: -(r["mean"] if r["mean"] is not None else -np.inf))
    return rows


def topk_vs_random(
    trials: Sequence[Trial],
    scores: np.ndarray,
    sweep: Sweep,
    heads: Sequence[Head],
    ks: Sequence[int],
    *,
    draws: int,
    seed: int,
) -> tuple[Curve, Curve, dict]:
    """Cross-fitted top-k curve and the random-k control (see the module docstring)."""
    n = len(trials)
    folds = [list(range(0, n, 2)), list(range(1, n, 2))]
    crossed = n >= 2
    top, rnd = [[] for _ in ks], [[] for _ in ks]
    chosen = []
    for i, t in enumerate(with_progress(trials, "top-k vs random")):
        other = folds[1 - i % 2] if crossed else list(range(n))
        order = np.argsort(-scores[other].mean(0), kind="stable")
        ranked = [heads[j] for j in order]
        rng = random.Random(f"heads/{seed}/{i}")
        sets = [ranked[:k] for k in ks]
        sets += [rng.sample(list(heads), k) for k in ks for _ in range(draws)]
        r = sweep(t, sets).tolist()
        for j in range(len(ks)):
            top[j].append(r[j])
            rnd[j].append(float(np.mean(r[len(ks) + j * draws : len(ks) + (j + 1) * draws])))
        chosen.append([f"L{l}H{h}" for l, h in ranked[: max(ks)]])
    info = {"cross_fitted": crossed, "draws": draws, "top_heads_per_trial": chosen}
    labels = clusters_of(trials)
    return Curve.of("k", list(ks), top, clusters=labels), Curve.of("k", list(ks), rnd, clusters=labels), info


def _head_analysis(
    used: Sequence[Trial], sweep: Sweep, desc: str, *, k_max: int, draws: int, seed: int
) -> tuple[list[Head], np.ndarray, dict, dict, dict]:
    """What the read and write sides share: each head alone and all heads together on every
    trial, then the cross-fitted top-k vs random-k curves. Returns the heads, the per-trial
    single-head recoveries `[trial, head]`, and the common parts, curves and details."""
    model = used[0].model
    heads = all_heads(model)
    ks = list(range(1, min(k_max, len(heads)) + 1))
    kh = headline_k(len(heads), k_max)
    singles, together = [], []
    for t in with_progress(used, desc):
        r = sweep(t, [[h] for h in heads] + [list(heads)]).numpy()
        singles.append(r[:-1])
        together.append(float(r[-1]))
    out = np.array(singles).reshape(len(used), len(heads))
    topk, rnd, info = topk_vs_random(used, out, sweep, heads, ks, draws=draws, seed=seed)
    parts = {
        "top_k": topk.points[kh - 1],
        "random_k": rnd.points[kh - 1],
        "top_head": topk.points[0],
        "all_heads": Estimate.of(together, clusters=clusters_of(used)),
    }
    details = {"grouping": grouping(model), "k_max": ks[-1], "headline_k": kh, **info}
    return heads, out, parts, {"topk_curve": topk, "random_curve": rnd}, details


@dataclass(frozen=True, kw_only=True)
class HeadCircuit(TaskResult):
    """Heads ranked by their causal share, and the top-k heads (cross-fitted) against k random."""

    PARTS = ("top_k", "random_k", "top_head", "all_heads", "effect")
    CURVES = ("topk_curve", "random_curve")
    TABLES = ("ranking",)
    # None only where the analysis could not run (`not_applicable`)
    grouping: Grouping | None = None
    k_max: int | None = None
    headline_k: int | None = None  # the k of `top_k` and `random_k`
    cross_fitted: bool | None = None
    draws: int | None = None
    top_heads_per_trial: tuple[tuple[str, ...], ...] | None = None


@dataclass(frozen=True, kw_only=True)
class ReadHeads(HeadCircuit):
    """Read side: head outputs at the decision; `{path}_path` via one key region at a time."""

    PARTS = HeadCircuit.PARTS + tuple(f"{p}_path" for p in PATHS)


def read_heads(
    trials: Sequence[Trial],
    *,
    k_max: int = K_MAX,
    draws: int = 32,
    seed: int = 0,
    min_effect: float = MIN_EFFECT,
) -> TaskResult:
    """Each head's share in carrying the conclusion into the decision (its output at the
    decision patched from the new-value run), and the top-k heads together against k random.

    Parts: `top_k` (headline; the top `headline_k` heads, cross-fitted), `random_k`, `top_head`, `all_heads`
    (every head: equal to the new run's decision, recovery 1), `{path}_path` for each of
    `PATHS` (every head path-patched through its attention to those keys only: the slots before
    the field, the field, the note slots, the query tokens before the decision, the decision
    token itself). Table `ranking`: heads by output-patching recovery, with their path
    recoveries. Curves `topk_curve`, `random_curve` over k = 1..k_max.
    """
    used, excluded = split_by_effect(trials, min_effect)
    if not used:
        return _empty(ReadHeads, "read_heads", excluded)
    heads, out, parts, curves, details = _head_analysis(
        used, read_sweep, "read heads", k_max=k_max, draws=draws, seed=seed
    )
    singles = [[h] for h in heads]
    paths = {name: ([], []) for name in PATHS}
    for t in with_progress(used, "read paths"):
        where = path_positions(t)
        for name, (per, total) in paths.items():
            r = read_sweep(t, singles + [heads], path=where[name]).numpy()
            per.append(r[:-1])
            total.append(float(r[-1]))
    labels = clusters_of(used)
    table = ranking_table(
        used[0].model, heads, out, labels, **{f"path_{k}": np.array(p) for k, (p, _) in paths.items()}
    )
    parts |= {f"{k}_path": Estimate.of(total, clusters=labels) for k, (_, total) in paths.items()}
    parts["effect"] = effect_estimate(used)
    return ReadHeads.of(
        name="read_heads",
        headline="top_k",
        parts=parts,
        curves=curves,
        tables={"ranking": table},
        excluded=excluded,
        **details,
        description="patch head outputs at the decision from the new-value run: the heads that read "
        "the conclusion",
    )


@dataclass(frozen=True, kw_only=True)
class WriteHeads(HeadCircuit):
    """Write side: head outputs at the note slots during prefill; table `by_layer`."""

    TABLES = ("ranking", "by_layer")
    note_slots: str


def write_heads(
    trials: Sequence[Trial],
    *,
    k_max: int = K_MAX,
    draws: int = 16,
    seed: int = 0,
    min_effect: float = MIN_EFFECT,
) -> TaskResult:
    """Which heads write the conclusion onto the note slots: their outputs at the note slots
    come from the new-value run while the old notebook's note slots are recomputed.

    Parts: `top_k` (headline, cross-fitted), `random_k`, `top_head`, `all_heads` (every head at
    every layer: equal to transplanting the note slots). Tables `ranking` and `by_layer` (all
    heads of one layer). Curves `topk_curve`, `random_curve`. Trials without note slots are
    excluded.
    """
    used, excluded = split_by_effect(trials, min_effect)
    no_notes = [i for i, t in enumerate(used) if not t.pair.downstream()]
    excluded += [{"index": i, "reason": "no note slots between the field and the decision"} for i in no_notes]
    used = [t for i, t in enumerate(used) if i not in no_notes]
    if not used:
        return _empty(WriteHeads, "write_heads", excluded)
    heads, out, parts, curves, details = _head_analysis(
        used, write_sweep, "write heads", k_max=k_max, draws=draws, seed=seed
    )
    model = used[0].model
    layers = [[(l, h) for h in range(model.n_heads)] for l in range(model.n_layers)]
    per_layer = np.array([write_sweep(t, layers).numpy() for t in with_progress(used, "write layers")])
    labels = clusters_of(used)
    by_layer = [
        {"layer": l, **Estimate.of(per_layer[:, l].tolist(), clusters=labels).to_dict()}
        for l in range(model.n_layers)
    ]
    parts["effect"] = effect_estimate(used)
    return WriteHeads.of(
        name="write_heads",
        headline="top_k",
        parts=parts,
        curves=curves,
        tables={"ranking": ranking_table(model, heads, out, labels), "by_layer": by_layer},
        excluded=excluded,
        note_slots="every slot after the field and before the decision",
        **details,
        description="patch head outputs at the note slots during prefill: which heads write the conclusion",
    )


def _empty(cls: type[HeadCircuit], name: str, excluded: list) -> HeadCircuit:
    extra = {"note_slots": "every slot after the field and before the decision"} if cls is WriteHeads else {}
    return cls.of(
        name=name,
        headline="top_k",
        parts={"top_k": Estimate.of([])},
        excluded=excluded,
        not_applicable="no usable trials",
        **extra,
    )


@dataclass(frozen=True)
class Grouping:
    """How the model's query heads share keys and values."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    queries_per_kv_head: int
    attention: str  # multi-head, grouped-query or multi-query
    note: str


@dataclass(frozen=True)
class HeadsConfig(PairOptions):
    k_max: int = option(
        K_MAX,
        "largest k of the top-k vs random-k head curves (and heads in scrubbing's hypothesis)",
        least=1,
        heads=True,
    )
    draws: int = option(32, "random head sets per k", least=1)


WriteHeadsConfig = replace_default(HeadsConfig, draws=16)


@analysis("read_heads", "circuits", HeadsConfig, ReadHeads, quick={"n": 6, "k_max": 8, "draws": 16}, order=1)
def _run_read_heads(ctx: Context, cfg: HeadsConfig) -> ReadHeads:
    """The heads that read the conclusion at the decision, and the paths they read it through."""
    return cfg.call(read_heads, cfg.call(shared_trials, ctx), seed=ctx.seed, min_effect=ctx.min_effect)


@analysis(
    "write_heads", "circuits", WriteHeadsConfig, WriteHeads, quick={"n": 6, "k_max": 8, "draws": 8}, order=2
)
def _run_write_heads(ctx: Context, cfg: HeadsConfig) -> WriteHeads:
    """The heads that write the conclusion onto the note slots."""
    return cfg.call(write_heads, cfg.call(shared_trials, ctx), seed=ctx.seed, min_effect=ctx.min_effect)
