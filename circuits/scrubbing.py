"""Causal scrubbing of the notes hypothesis: keep only the hypothesised circuit from the
new-value run and resample everything else from other prompts of the task.

The hypothesis is "the decision is carried by these read heads, reading these note slots".
The scrubbed decision is computed on a resampled prompt (another draw of the task: other
names, ids and shot order, with the *old* conclusion) whose notebook has the hypothesis's note
slots transplanted from the trial's new-value run; at the query tokens every head outputs what
it did on the resampled prompt, except the hypothesis's read heads, which run live on the
mixed notebook. (Keeping every slot and head gives the new run's decision exactly; keeping
nothing gives the resampled prompt's.) If the hypothesis is the whole story the scrubbed
decision is the new run's. With s the sign of the trial's effect, over every trial and
resampled prompt:

    preserved = mean[s·(ld_scrubbed - ld_resampled)] / mean[s·(ld_new - ld_resampled)]

normalised once over the whole set (the fraction of the effect recovered, as causal scrubbing
reports it): a base model's decision varies from prompt to prompt by as much as the field
moves it, so a per-prompt ratio can divide by nearly zero. Per-trial values are each trial's
numerator over that shared denominator, so their mean is the figure.

The control is a random circuit of the same size (as many random slots and random heads).
Variants separate the two halves: notes with every head live, heads with no note slots, and
the hypothesis plus the field's own slots (for models that read the field directly).

All of these are in-sample: each pair's note slots are ranked on that pair, and the read heads
on every pair, that one included. Out of sample, `hypothesis_xfit` keeps, for each pair, the
read heads and note slots ranked on the other half of the pairs (`cross_fitted_heads`,
`cross_fitted_notes`), and `matched_circuit` is its control: as many slots matched to those in
region and token class (`matched_slots`) and as many heads in each of the same layers
(`matched_heads`).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from circuits.heads import Head, all_heads, cross_fitted_heads, masks_for
from kvnotes.analysis.registry import Context, Need, analysis, option
from kvnotes.analysis.results import TaskResult
from kvnotes.analysis.stats import Estimate
from kvnotes.analysis.trials import (
    MIN_EFFECT,
    PairOptions,
    Trial,
    effect_estimate,
    shared_trials,
    split_by_effect,
    with_progress,
)
from kvnotes.engine import run
from kvnotes.hooks import hook_name
from kvnotes.ops import Patch, decide, patch_batch, prefill, query_tokens
from kvnotes.tasks import Task, TaskSource, load_task, sample
from probes.causal import top_notes
from probes.controls import cross_fitted_notes, matched_slots, paired, random_slots

VARIANTS = ("hypothesis", "random_circuit", "notes_only", "heads_only", "with_field")
OUT_OF_SAMPLE = ("hypothesis_xfit", "matched_circuit")
# what each trial kept, one value per trial under each of these `Scrubbing` fields
_KEPT = ("note_tokens", "note_tokens_xfit", "heads_xfit", "cross_fitted_pairs", "resamples_per_trial")


def matched_heads(n_heads: int, heads: Sequence[Head], rng: random.Random) -> list[Head]:
    """A random control for `heads`: in each of their layers, as many heads drawn from that
    layer's `n_heads`.

    Drawn from the whole layer, the hypothesis's own heads included (as `random_circuit` draws
    from the whole model): a read-head hypothesis often fills a layer (on the notes organism the
    default 12 heads are every head), and a control that had to avoid them would leave the layer
    or shrink, matching neither size nor depth.

    >>> matched_heads(4, [(2, 0), (2, 3), (0, 1)], random.Random(0))
    [(0, 3), (2, 0), (2, 3)]
    """
    per_layer = Counter(l for l, _ in heads)
    return [(l, h) for l, n in sorted(per_layer.items()) for h in sorted(rng.sample(range(n_heads), n))]


def resamples(t: Trial, task: TaskSource, n: int, *, seed: int) -> list:
    """Up to `n` other prompts of `task` laid out token for token like the trial's (same length,
    spans and query tokens) whose conclusion is the trial's old one."""
    want = t.pair.expected[0]
    new = t.pair.new
    q = new.span("decision")
    out = []
    for pair in sample(task, t.model, 4 * n + 8, seed=seed, template=t.pair.template):
        for prompt, expected in ((pair.old, pair.expected[0]), (pair.new, pair.expected[1])):
            if (
                expected == want
                and len(prompt) == len(new)
                and dict(prompt.spans) == dict(new.spans)
                and prompt.ids[q.start :] == new.ids[q.start :]
                and prompt.ids != t.pair.old.ids
            ):
                out.append(prompt)
                break
        if len(out) == n:
            break
    return out


def _scrub_rows(
    t: Trial, prompt, rows: Sequence[tuple[Sequence[int], Sequence[Head]]]
) -> tuple[torch.Tensor, float]:
    """The trial's decision metric (logit difference by default) of each scrubbed row (slots kept
    from the new run, heads kept live), and of the resampled prompt itself."""
    model = t.model
    res_nb = prefill(model, prompt)
    names = [hook_name(l, "attn.hook_z") for l in range(model.n_layers)]
    ids, pos = query_tokens(model, res_nb, prompt)
    res = decide(model, res_nb, prompt, capture=names, vocab=t.vocab)
    z_res = [res.activations[n] for n in names]  # [1, query, head, d_head]
    ld_res = float(t.score(res.last)[0])
    nb = patch_batch(
        res_nb, t.new_nb, [Patch(positions=tuple(s)) if s else Patch(positions=()) for s, _ in rows]
    )
    live = masks_for(model, [h for _, h in rows])  # [B, layer, head]

    def make(l: int):
        def hook(z, hook):  # noqa: ARG001 - TransformerLens passes hook= by keyword
            return torch.where(live[:, l][:, None, :, None].to(z.device), z, z_res[l])

        return hook

    _, out = run(
        model,
        nb,
        torch.tensor([ids]).expand(len(rows), -1),
        pos,
        write=False,
        hooks=[(n, make(l)) for l, n in enumerate(names)],
        vocab=t.vocab,
    )
    return t.score(out.last).cpu(), ld_res


@dataclass(frozen=True, kw_only=True)
class Scrubbing(TaskResult):
    """The effect preserved when only the hypothesis (top notes and read heads) keeps the new run's
    values, against a random circuit of the same size and the hypothesis's halves; out of sample,
    the cross-fitted hypothesis (`hypothesis_xfit`) against a circuit matched to it
    (`matched_circuit`)."""

    PARTS = (
        "hypothesis",
        "random_circuit",
        "notes_only",
        "heads_only",
        "with_field",
        "effect",
        "scrubbed_effect",
    )
    PART_PATTERNS = OUT_OF_SAMPLE  # optional: reports written before them load too
    heads: tuple[str, ...]
    n_notes: int
    note_tokens: tuple[tuple[str, ...], ...]
    resamples_per_trial: tuple[int, ...]
    draws: int
    normalisation: str
    undefined: str | None = None  # why the preserved share is undefined here (no effect to preserve)
    # True: every trial's hypothesis_xfit notes ranked on the other half (False: some by position,
    # or one trial); per trial that ran, `cross_fitted_pairs`
    cross_fitted: bool | None = None
    cross_fitted_pairs: tuple[bool, ...] | None = None
    heads_xfit: tuple[tuple[str, ...], ...] | None = None  # per trial, the cross-fitted read heads
    note_tokens_xfit: tuple[tuple[str, ...], ...] | None = None  # per trial, the cross-fitted note slots


def scrubbing(
    trials: Sequence[Trial],
    task: Task | str,
    heads: Sequence[Head],
    *,
    n_notes: int = 4,
    n_resamples: int = 4,
    draws: int = 8,
    seed: int = 0,
    min_effect: float = MIN_EFFECT,
) -> TaskResult:
    """Scrub everything but `heads` (the read heads) and each trial's top `n_notes` note slots.

    Parts (fraction of the effect preserved, over `n_resamples` resampled prompts per trial):
    `hypothesis` (headline), `random_circuit` (as many random slots and heads, `draws` draws),
    `notes_only` (the note slots, every head live at the decision), `heads_only` (the heads,
    no slot kept), `with_field` (the hypothesis plus the field's slots). These are in-sample:
    the slots are ranked on the trial itself and `heads` (from `read_heads`) on every trial.

    Out of sample: `hypothesis_xfit` keeps, per trial, the top `len(heads)` read heads and top
    `n_notes` note slots ranked on the other half of the trials (`cross_fitted_heads`,
    `cross_fitted_notes`; `cross_fitted` False, with `cross_fitted_pairs` per trial, where some
    trial's slots were ranked by position or there was one trial); `matched_circuit`, its control,
    as many slots matched in region and token class (`matched_slots`) and heads in the same
    layers (`matched_heads`), `draws` draws. On a trial whose region has fewer than 2·`n_notes`
    slots there is no matched circuit, and the trial is left out of both (counted in their
    `dropped`). Compare `hypothesis_xfit` with `matched_circuit`.

    >>> from kvnotes import load_model
    >>> from probes import make_trials
    >>> trials = make_trials(load_model("tiny-llama"), "order-cancel", 2, progress=False)
    >>> r = scrubbing(trials, "order-cancel", [(1, 0)], n_resamples=1, draws=1, min_effect=0.0)
    >>> r.cross_fitted, len(r.heads_xfit[0])  # one pair of each of two templates: nothing lines up
    (False, 1)
    """
    task = load_task(task)
    used, excluded = split_by_effect(trials, min_effect)
    heads = [cast(Head, tuple(h)) for h in heads]  # a (layer, head) pair, a list (JSON's) made a tuple
    xnotes, crossed = cross_fitted_notes(used, n_notes)
    xheads, _ = cross_fitted_heads(used, len(heads))  # the same halves, so the same fallback
    nums = {v: [] for v in VARIANTS + OUT_OF_SAMPLE}
    dens, templates = [], []
    kept = {k: [] for k in _KEPT}
    for i, t in enumerate(with_progress(used, "scrubbing")):
        prompts = resamples(t, task, n_resamples, seed=seed + 7919 * (i + 1))
        if not prompts:
            excluded.append({"index": i, "reason": "no other prompt of the task has the same token layout"})
            continue
        notes = top_notes(t, n_notes)
        rows, matched = _circuits(t, i, notes, heads, xnotes[i], xheads[i], draws=draws, seed=seed)
        per, den = _preserved(t, prompts, rows)
        dens.append(den)
        templates.append(t.pair.template)
        whole = all(len(s) == len(xnotes[i]) for s, _ in matched)  # else the region is too small to match
        for name, value in _variant_values(per, draws, whole).items():
            nums[name].append(value)
        kept["note_tokens"].append(t.token_strings(notes))
        kept["note_tokens_xfit"].append(t.token_strings(xnotes[i]))
        kept["heads_xfit"].append([f"L{l}H{h}" for l, h in xheads[i]])
        kept["cross_fitted_pairs"].append(crossed.pairs[i])
        kept["resamples_per_trial"].append(len(prompts))
    parts, undefined = _normalised(nums, dens, templates, min_effect)
    parts["effect"] = effect_estimate(used)
    parts["scrubbed_effect"] = Estimate.of(dens, clusters=templates)  # logits: new run vs resampled prompts
    return Scrubbing.of(
        name="scrubbing",
        headline="hypothesis",
        parts=parts,
        excluded=excluded,
        heads=[f"L{l}H{h}" for l, h in heads],
        n_notes=n_notes,
        cross_fitted=bool(crossed),
        **kept,
        draws=draws,
        normalisation="each value is a trial's s·(ld_scrubbed - ld_resampled) over the mean "
        "s·(ld_new - ld_resampled) of all trials (part scrubbed_effect)",
        undefined=undefined,
        description="keep the note slots and read heads from the new run, resample everything else",
    )


def _circuits(
    t: Trial,
    i: int,
    notes: Sequence[int],
    heads: Sequence[Head],
    xnotes: Sequence[int],
    xheads: Sequence[Head],
    *,
    draws: int,
    seed: int,
) -> tuple[list, list]:
    """The (kept slots, kept heads) rows trial i is scrubbed with, in `scrubbing`'s order: the
    hypothesis, `draws` random circuits, its halves and the field, then out of sample the
    cross-fitted hypothesis and `draws` matched circuits (also returned alone)."""
    field = list(t.pair.field_span)
    rng = random.Random(f"scrub/{seed}/{i}")
    every = all_heads(t.model)
    rand = [(random_slots(t, len(notes), notes, rng), rng.sample(every, len(heads))) for _ in range(draws)]
    mrng = random.Random(f"scrub-matched/{seed}/{i}")
    matched = [
        (matched_slots(t, xnotes, mrng), matched_heads(t.model.n_heads, xheads, mrng)) for _ in range(draws)
    ]
    rows = [(notes, heads), *rand, (notes, every), ([], heads), (notes + field, heads)]
    rows += [(xnotes, xheads), *matched]
    return rows, matched


def _variant_values(per: np.ndarray, draws: int, whole: bool) -> dict[str, float | None]:
    """Each variant's value from one trial's rows (in `_circuits`' order; random and matched
    circuits averaged over their draws, the matched one None where the region was too small)."""
    values = {"hypothesis": per[0], "random_circuit": float(np.mean(per[1 : 1 + draws]))}
    for j, name in enumerate(VARIANTS[2:]):
        values[name] = per[1 + draws + j]
    x = 1 + draws + len(VARIANTS[2:])  # the out-of-sample rows
    values["hypothesis_xfit"] = per[x]
    values["matched_circuit"] = float(np.mean(per[x + 1 : x + 1 + draws])) if whole else None
    return values


def _preserved(t: Trial, prompts: Sequence, rows: Sequence) -> tuple[np.ndarray, float]:
    """Per row, the signed shift s·(ld_scrubbed − ld_resampled) averaged over the resampled
    prompts, and the effect there is to preserve, s·(ld_new − ld_resampled), averaged too."""
    sign = 1.0 if t.ld_new >= t.ld_old else -1.0
    num, den = [], []
    for p in prompts:
        ld_scrubbed, ld_res = _scrub_rows(t, p, rows)
        num.append(sign * (ld_scrubbed.numpy() - ld_res))
        den.append(sign * (t.ld_new - ld_res))
    return np.mean(num, axis=0), float(np.mean(den))


def _normalised(
    nums: dict[str, list], dens: Sequence[float], templates: Sequence, min_effect: float
) -> tuple[dict[str, Estimate], str | None]:
    """Each variant's values over the mean effect to preserve, and why that is undefined where the
    resampled prompts leave no effect (then every variant is empty). The cross-fitted hypothesis
    and the matched circuit are compared with each other, so over the same trials: one without a
    matched circuit leaves both."""
    nums = dict(nums)
    nums["hypothesis_xfit"], nums["matched_circuit"], _ = paired(
        nums["hypothesis_xfit"], nums["matched_circuit"]
    )
    scale = float(np.mean(dens)) if dens else float("nan")
    undefined = None
    if not abs(scale) >= min_effect or scale == 0.0:  # (also with min_effect 0: never divide by zero)
        undefined = (
            f"the resampled prompts' decisions differ from the new run's by {scale:+.3f} logits on "
            f"average (less than min_effect {min_effect}): there is no effect to preserve, "
            "because the decision varies from prompt to prompt as much as the field moves it"
        )
        nums = {k: [] for k in nums}
    parts = {
        k: Estimate.of([None if x is None else x / scale for x in v], clusters=templates[: len(v)])
        for k, v in nums.items()
    }
    return parts, undefined


@dataclass(frozen=True)
class ScrubbingConfig(PairOptions):
    k_max: int = option(
        12, "read heads in the hypothesis (the top of read_heads' ranking)", least=1, heads=True
    )


@analysis(
    "scrubbing",
    "circuits",
    ScrubbingConfig,
    Scrubbing,
    needs=("read_heads",),
    quick={"n": 6, "k_max": 8},
    order=3,
    requires=(Need.TEMPLATE,),
)
def _run_scrubbing(ctx: Context, cfg: ScrubbingConfig) -> Scrubbing:
    """Causal scrubbing: keep the note slots and read heads from the new run, resample everything else."""
    ranking = ctx.results["read_heads"].tables.get("ranking", [])
    heads = [(r["layer"], r["head"]) for r in ranking[: cfg.k_max]]
    return scrubbing(
        cfg.call(shared_trials, ctx),
        ctx.task,
        heads,
        seed=ctx.seed,
        min_effect=ctx.min_effect,
    )
