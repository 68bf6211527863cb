"""Attribution patching: a first-order estimate of every slot's and head's patching effect
from one forward and one backward pass, set beside exact activation patching.

For a patch that moves activation a from a_old to a_new, attribution patching estimates the
change in the decision's logit difference as (a_new - a_old) · ∂ld/∂a, the gradient taken once
on the old-value run. For slots the activations are the notebook's keys and values (every
layer), so one backward pass scores all slots × layers; for heads it is `hook_z` at the
decision position. The analysis reports how well the estimate ranks what activation patching
measures (Spearman's rho per prompt) and the time of each, side by side in one process.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from circuits.heads import all_heads, read_sweep
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
from kvnotes.engine import run
from kvnotes.errors import BadArgument
from kvnotes.hooks import hook_name
from kvnotes.metrics import Metric, answer_columns, logit_diff, spearman
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook
from kvnotes.ops import Patch, PromptLike, query_tokens
from kvnotes.types import Float, Tensor


@dataclass(frozen=True, eq=False)
class Attribution:
    """First-order effects on the decision's logit difference of moving each slot × layer's K/V
    (`slot_layer`) and each head's output at the decision (`heads`) from the old run to the new."""

    slot_layer: Float[Tensor, "layer slot"]
    heads: Float[Tensor, "layer n_heads"]
    positions: tuple[int, ...]

    @property
    def slots(self) -> Float[Tensor, " slot"]:
        return self.slot_layer.sum(0)


@dataclass(frozen=True, eq=False)
class SlotAttribution:
    """First-order effects on the decision's logit difference of moving each slot × layer's keys
    (`keys`) and values (`values`) from one notebook to another; `ld` is the first's logit difference."""

    keys: Float[Tensor, "layer slot"]
    values: Float[Tensor, "layer slot"]
    ld: float
    positions: tuple[int, ...]

    @property
    def slot_layer(self) -> Float[Tensor, "layer slot"]:
        return self.keys + self.values


def _backward(
    model: KVModel,
    nb: Notebook,
    ids: list[int],
    pos: Tensor,
    answers: Sequence[int],
    keep: Sequence[str] = (),
    metric: Metric = logit_diff,
) -> tuple[Tensor, tuple[Tensor, ...], tuple[Tensor, ...], list[Tensor], tuple[Tensor, ...]]:
    """One forward and one backward on `nb`: the decision `metric` (logit difference by default),
    its gradients with respect to every layer's keys and values, and the activations named in
    `keep` with their gradients."""
    vocab, columns = answer_columns(metric, answers)
    with torch.enable_grad():
        keys = tuple(k.detach().clone().requires_grad_(True) for k in nb.keys)
        values = tuple(v.detach().clone().requires_grad_(True) for v in nb.values)
        leaf = replace(nb, keys=keys, values=values)
        kept: dict[str, Tensor] = {}

        def hold(act, hook):
            kept[hook.name] = act
            return act

        _, out = run(model, leaf, ids, pos, write=False, hooks=[(n, hold) for n in keep], vocab=vocab)
        score = metric(out.last, columns)[0]
        acts = [kept[n] for n in keep]
        grads = torch.autograd.grad(score, [*keys, *values, *acts])
    L = nb.n_layers
    return score.detach(), grads[:L], grads[L : 2 * L], [a.detach() for a in acts], grads[2 * L :]


def _kv_effects(
    old: Notebook, new: Notebook, g_k: Sequence[Tensor], g_v: Sequence[Tensor]
) -> tuple[Tensor, Tensor]:
    """(new - old) · gradient per layer and slot, summed over batch, KV heads and d_head: keys, values."""
    new = new.select(old.positions)
    keys = torch.stack([((nk - ok) * g).sum((0, 1, 3)) for nk, ok, g in zip(new.keys, old.keys, g_k)])
    values = torch.stack([((nv - ov) * g).sum((0, 1, 3)) for nv, ov, g in zip(new.values, old.values, g_v)])
    return keys.detach().cpu(), values.detach().cpu()


def slot_attribution(
    model: KVModel,
    old: Notebook,
    new: Notebook,
    query: PromptLike,
    answers: tuple[int, int],
    *,
    steps: int = 1,
    metric: Metric = logit_diff,
) -> SlotAttribution:
    """Attribution patching of `new`'s K/V into `old`, slot × layer, for the decision read by
    `query`: one forward and one backward on `old` (no head part, so no forward on `new`).

    With `steps` > 1 the gradient is averaged at the midpoints of `steps` equal pieces of the
    straight path from `old` to `new` (integrated gradients): `steps` passes instead of one, and
    the estimates of all slots together then sum to the whole change up to the Riemann error.
    `ld` is always `old`'s; all values are in units of `metric` (default: the logit difference)."""
    if steps < 1:
        raise BadArgument(f"steps must be at least 1 (1: plain attribution patching), got {steps}")
    ids, pos = query_tokens(model, old, query)
    if steps == 1:
        score, g_k, g_v, _, _ = _backward(model, old, ids, pos, answers, metric=metric)
    else:  # old's score from a forward alone; the gradients from the midpoints
        vocab, columns = answer_columns(metric, answers)
        _, out = run(model, old, ids, pos, write=False, vocab=vocab)
        score = metric(out.last, columns)[0]
        src = new.select(old.positions)
        g_k, g_v = [torch.zeros_like(k) for k in old.keys], [torch.zeros_like(v) for v in old.values]
        for i in range(steps):
            a = (i + 0.5) / steps
            mid = replace(
                old,
                keys=tuple(o + a * (n - o) for o, n in zip(old.keys, src.keys)),
                values=tuple(o + a * (n - o) for o, n in zip(old.values, src.values)),
            )
            _, gk, gv, _, _ = _backward(model, mid, ids, pos, answers, metric=metric)
            for acc, g in zip(g_k + g_v, gk + gv):
                acc += g / steps
    keys, values = _kv_effects(old, new, g_k, g_v)
    return SlotAttribution(keys=keys, values=values, ld=float(score), positions=tuple(old.positions.tolist()))


def attribute(
    model: KVModel,
    old: Notebook,
    new: Notebook,
    query: PromptLike,
    answers: tuple[int, int],
    *,
    metric: Metric = logit_diff,
) -> Attribution:
    """Attribution patching of `new` into `old` for the decision read by `query` as `metric` (by
    default the logit difference logit[answers[0]] - logit[answers[1]]): one forward on `new`
    (its head outputs), one forward and one backward on `old`."""
    ids, pos = query_tokens(model, old, query)
    names = [hook_name(l, "attn.hook_z") for l in range(model.n_layers)]
    _, ref = run(model, new, ids, pos, write=False, capture=names, vocab=answers)
    _, g_k, g_v, zs, g_z = _backward(model, old, ids, pos, answers, keep=names, metric=metric)
    keys, values = _kv_effects(old, new, g_k, g_v)
    heads = torch.stack(
        [((ref.activations[n][0, -1] - zs[l][0, -1]) * g_z[l][0, -1]).sum(-1) for l, n in enumerate(names)]
    )
    return Attribution(
        slot_layer=keys + values, heads=heads.detach().cpu(), positions=tuple(old.positions.tolist())
    )


@dataclass(frozen=True, kw_only=True)
class AttributionPatching(TaskResult):
    """Gradient attribution against activation patching: rank agreement (heads, slots), overlap of
    the top heads, and speed; table `heads` with both scores per head."""

    PARTS = (
        "rank_correlation",
        "slot_rank_correlation",
        "top_overlap",
        "speedup",
        "attribution_seconds",
        "activation_seconds",
        "effect",
    )
    TABLES = ("heads",)
    slots: tuple[SlotScores, ...]
    top: int
    timing: str


def attribution(trials: Sequence[Trial], *, top: int = 5, min_effect: float = MIN_EFFECT) -> TaskResult:
    """Attribution patching against activation patching, for slots (the field's and the note
    slots, all layers at once) and heads (output at the decision).

    Parts: `rank_correlation` (headline: Spearman's rho between the two head rankings, per
    prompt), `slot_rank_correlation`, `top_overlap` (share of the top-`top` heads both methods
    agree on), `speedup` (activation-patching time / attribution time, per prompt, both
    computed from scratch in this process), `attribution_seconds`, `activation_seconds`.
    """
    used, excluded = split_by_effect(trials, min_effect)
    parts: dict[str, list] = {k: [] for k in AttributionPatching.PARTS if k != "effect"}
    per_slot, head_attr, head_act = [], [], []
    for t in with_progress(used, "attribution"):
        model = t.model
        heads = all_heads(model)
        t.cache.pop("read_capture", None)  # time activation patching from scratch
        s = time.perf_counter()
        a = attribute(model, t.old_nb, t.new_nb, t.pair.new, t.pair.answers, metric=t.metric)
        t_attr = time.perf_counter() - s
        slots = list(t.pair.field_span) + t.pair.downstream()
        s = time.perf_counter()
        act_slots = t.sweep([Patch(positions=(p,)) for p in slots]).cpu().numpy()
        act_heads = read_sweep(t, [[h] for h in heads]).numpy()
        t_act = time.perf_counter() - s
        scale = t.ld_new - t.ld_old  # attribution in recovery units, like activation patching
        attr_slots = (a.slots[t.old_nb.slot_index(slots)] / scale).numpy()
        attr_heads = (a.heads.flatten() / scale).numpy()
        parts["rank_correlation"].append(spearman(attr_heads.tolist(), act_heads.tolist()))
        parts["slot_rank_correlation"].append(spearman(attr_slots.tolist(), act_slots.tolist()))
        k = min(top, len(heads))
        both = set(np.argsort(-attr_heads)[:k]) & set(np.argsort(-act_heads)[:k])
        parts["top_overlap"].append(len(both) / k)
        parts["speedup"].append(t_act / t_attr)
        parts["attribution_seconds"].append(t_attr)
        parts["activation_seconds"].append(t_act)
        per_slot.append(
            {
                "positions": slots,
                "tokens": t.token_strings(slots),
                "attribution": attr_slots.tolist(),
                "activation": act_slots.tolist(),
            }
        )
        head_attr.append(attr_heads)
        head_act.append(act_heads)
    table = []
    if used:
        ha, hp = np.array(head_attr), np.array(head_act)
        for i, (l, h) in enumerate(all_heads(used[0].model)):
            table.append(
                {
                    "layer": l,
                    "head": h,
                    "label": f"L{l}H{h}",
                    "attribution": float(ha[:, i].mean()),
                    "activation": float(hp[:, i].mean()),
                }
            )
        table.sort(key=lambda r: -r["activation"])
    every = clusters_of(used)  # each part holds one value (None: an undefined rho) per used trial
    est = {
        k: Estimate.of(
            [x for x in v if x is not None], clusters=[c for x, c in zip(v, every) if x is not None]
        )
        for k, v in parts.items()
    }
    est["effect"] = effect_estimate(used)
    return AttributionPatching.of(
        name="attribution",
        headline="rank_correlation",
        parts=est,
        tables={"heads": table},
        excluded=excluded,
        slots=per_slot,
        top=top,
        timing="per prompt: one attribution pass (a forward on the new run, a forward and "
        "backward on the old) against single-slot and single-head activation patching",
        description="gradient attribution patching vs activation patching: rank agreement and speed",
    )


@dataclass(frozen=True)
class SlotScores:
    """One pair's slots scored both ways (recovery): exact transplant and gradient estimate."""

    positions: tuple[int, ...]
    tokens: tuple[str, ...]
    attribution: tuple[float, ...]
    activation: tuple[float, ...]


@dataclass(frozen=True)
class AttributionConfig(PairOptions):
    top: int = option(5, "top heads compared between the two rankings", least=1, heads=True)


@analysis("attribution", "circuits", AttributionConfig, AttributionPatching, quick={"n": 6}, order=4)
def _run_attribution(ctx: Context, cfg: AttributionConfig) -> AttributionPatching:
    """Attribution patching (one backward pass) against activation patching."""
    return cfg.call(attribution, cfg.call(shared_trials, ctx), min_effect=ctx.min_effect)
