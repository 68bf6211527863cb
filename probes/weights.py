"""The weight-edit baseline: a ROME-style rank-one edit of one MLP, measured against the erratum.

The paper argues that per-request state belongs in the KV cache, not in the weights. A weight
edit can flip the edited request's decision, but it is global: a concurrent request that still
holds the old value is pushed too, unrelated decisions drift, and every cached notebook above
the edited layer goes stale. This module builds that baseline and measures those costs side by
side with the one-line erratum (`probes.edit.ERRATUM`).

The edits themselves (the rank-one update, its three targets, ROME's key covariance) are in
`probes.rank_one`; this module applies them pair by pair and measures what they cost.

The registered analyses run one each: `weight_edit` (`--weights`) and `weight_edit_rome` (`--rome`).
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from kvnotes.analysis.registry import Context, Need, analysis, option
from kvnotes.analysis.results import TaskResult
from kvnotes.analysis.stats import Estimate
from kvnotes.analysis.trials import (
    MIN_EFFECT,
    PairOptions,
    Trial,
    make_trials,
    shared_trials,
    split_by_effect,
    with_progress,
)
from kvnotes.engine import Readout, hooked
from kvnotes.errors import KVNotesError
from kvnotes.hooks import hook_name
from kvnotes.metrics import recovery
from kvnotes.models.model import KVModel
from kvnotes.ops import append, decide, prefill
from kvnotes.prompt import Prompt
from kvnotes.tasks import Task, load_task
from kvnotes.types import Tensor
from probes.edit import ERRATUM
from probes.rank_one import (
    COV_PROMPTS,
    COV_SEED,
    RIDGE,
    EditTarget,
    KeyCovariance,
    RankOneEdit,
    applied,
    check_layer,
    decision_ld,
    key_covariance,
    match_decision,
    rome,
)
from probes.rank_one import edit_hooks as edit_hooks  # the old addresses
from probes.rank_one import match_residual as match_residual
from probes.rank_one import pre_norm_value as pre_norm_value

# Drift is read on another task's decisions: unrelated to the edited one, same tokenizer.
DRIFT_TASKS = {
    "order-cancel": "account-access",
    "account-access": "order-cancel",
    "refund-window": "order-cancel",
    "notes-organism": "lookup-organism",
    "lookup-organism": "notes-organism",
}


def concurrent(trials: Sequence[Trial], i: int) -> tuple[int, Prompt, float, float]:
    """Another request of the same task that still holds trial i's OLD value: (its pair's index,
    its prompt, its unedited ld, the ld of the same prompt with the NEW value). It is the next
    pair (cyclically) whose prompt with that value is a different text (other names and ids)."""
    t = trials[i]
    field, value = t.pair.changed, t.pair.old.values[t.pair.changed]
    for j in [*range(i + 1, len(trials)), *range(i)]:
        u = trials[j]
        c, ld_c, ld_alt = (
            (u.pair.old, u.ld_old, u.ld_new)
            if u.pair.old.values[field] == value
            else (u.pair.new, u.ld_new, u.ld_old)
        )
        if c.text != t.pair.old.text:
            return j, c, ld_c, ld_alt
    raise KVNotesError(
        f"contamination needs another request holding {field}={value!r} with other "
        f"names and ids, and the {len(trials)} pair(s) given have none; sample n >= 2"
    )


@dataclass(frozen=True, kw_only=True)
class WeightEdit(TaskResult):
    """A rank-one MLP edit per pair: its `target` recovery, `contamination` of a concurrent request,
    `drift` of other decisions and its cost (`seconds`, ...) beside the `erratum` (see `weight_edit`)."""

    PARTS = (
        "target",
        "target.agree",
        "target.stale_cache",
        "contamination",
        "contamination.flips",
        "drift",
        "drift.dld",
        "seconds",
        "reprefill_seconds",
        "erratum",
        "erratum_seconds",
        "update_error",
    )
    layer: int
    n_layers: int
    target: str  # how the edit was aimed: match_decision, match_residual or rome
    covariance: str  # "identity (covariance-free ROME)" or the second moment's sample and ridge
    pairs: tuple[dict, ...]  # per pair: the concurrent request and every logit difference read
    drift_task: str | None
    drift_decisions: int
    erratum: str
    method: str = "decision"  # "decision": decision-keyed, identity covariance; "rome": `rome`
    key_position: str = "decision"  # the key's token: the decision's last one, or the changed "field"'s last
    covariance_seconds: float | None = None  # computing ROME's covariance, once per run (not in `seconds`)


def weight_edit(
    trials: Sequence[Trial],
    *,
    layer: int | None = None,
    other_trials: Sequence[Trial] | None = None,
    target: EditTarget = match_decision,
    erratum: str = ERRATUM,
    min_effect: float = MIN_EFFECT,
    covariance: KeyCovariance | None = None,
) -> TaskResult:
    """Edit the weights for each pair (one rank-one MLP edit at `layer`, default the middle one,
    aimed by `target`: `match_decision` or `match_residual`, keyed at the decision token with
    identity covariance, or `rome`, keyed at the changed field's last token and whitened by
    `covariance`, computed once here from the trials' task when None) and measure, with the edit
    applied and the original weights restored after each pair:

    - `target`: recovery of the edited model's decision on the OLD prompt, prefilled again with
      the edited weights, toward the new one; `target.agree`: same answer as the new prompt;
      `target.stale_cache`: the same read from the old notebook kept as it was.
    - `contamination` (headline): the same recovery-like shift on a concurrent request of the
      same task that still holds the old value (another pair's prompt, other names and ids);
      `contamination.flips`: the fraction of those whose answer switches to the new value's,
      over concurrent requests whose two values give different answers.
    - `drift`: on the decisions of `other_trials` (both prompts of each; another task), the
      fraction whose answer changes; `drift.dld`: their mean |Δld| in logits. Undefined (no
      values) when `other_trials` is None.
    - `seconds`: one edit's wall time (k and v*, the new prompt's prefill for v* included, and
      the update); `reprefill_seconds`: prefilling the edited request again, which every cached
      notebook above the layer now needs; `erratum_seconds` and `erratum` (recovery): appending
      the erratum line to the stale notebook and deciding, timed in the same loop.
    - `update_error`: |achieved − wanted| / |wanted − old| of the layer's MLP output at the key
      (0 up to rounding unless a post-MLP norm keeps the wanted output out of reach).

    `method` ("decision" or "rome"), `key_position`, `covariance` and `covariance_seconds` (the
    once-per-run statistics, outside `seconds`) say which edit it was.

    The headline is contamination: the target can be reached by construction, and a notebook edit
    has no contamination by construction; it is what a weight edit costs that the cache does not.

    >>> from kvnotes import load_model
    >>> trials = make_trials(load_model("tiny-llama"), "order-cancel", 2, progress=False)
    >>> r = weight_edit(trials, layer=1, min_effect=0.0)
    >>> r.headline, r.layer, r.target, r["target.agree"].mean  # exact: a fraction
    ('contamination', 1, 'match_decision', 1.0)
    """
    if len(trials) < 2:
        raise KVNotesError(
            f"weight_edit needs at least 2 pairs (contamination is read on another "
            f"pair's prompt), got {len(trials)}; sample n >= 2"
        )
    layer = check_layer(trials[0].model, layer)
    aim, how = _method(trials, layer, target, covariance)
    used, excluded = split_by_effect(trials, min_effect)
    acc: dict[str, list] = {k: [] for k in WeightEdit.PARTS}
    labels: dict[str, list[int]] = {k: [] for k in WeightEdit.PARTS}  # each value's pair's template
    per_pair = []
    other = list(other_trials or [])
    index = {id(t): i for i, t in enumerate(trials)}
    for t in with_progress(used, "weight edit"):
        values, row = _edit_pair(trials, index[id(t)], layer, aim, other, erratum, min_effect)
        for k, v in values.items():  # None values are left out below, with their labels
            acc[k].append(v)
            labels[k].append(t.pair.template)
        per_pair.append(row)
    return WeightEdit.of(
        name="weight_edit_rome" if target is rome else "weight_edit",
        headline="contamination",
        parts={k: _estimate(v, labels[k]) for k, v in acc.items()},
        layer=layer,
        n_layers=trials[0].model.n_layers,
        target=target.__name__,
        **how,
        excluded=excluded,
        pairs=per_pair,
        drift_task=other[0].pair.task if other else None,
        drift_decisions=2 * len(other),
        erratum=erratum,
        description="a rank-one MLP weight edit per pair: target recovery, contamination of a concurrent "
        "request, drift of other decisions, and its cost beside the erratum",
    )


def _estimate(values: list, templates: list[int]) -> Estimate:
    """One part's estimate over the pairs where it is defined, clustered by template."""
    return Estimate.of(
        [x for x in values if x is not None],
        clusters=[c for x, c in zip(values, templates) if x is not None],
    )


def _method(
    trials: Sequence[Trial], layer: int, target: EditTarget, covariance: KeyCovariance | None
) -> tuple[EditTarget, dict]:
    """The edit each pair gets (`target`, with ROME's covariance bound in) and how to describe it."""
    if target is not rome:
        return target, {
            "method": "decision",
            "key_position": "decision",
            "covariance": "identity (covariance-free ROME)",
        }
    model = trials[0].model
    cov = key_covariance(model, trials[0].pair.task, layer) if covariance is None else covariance
    how = {
        "method": "rome",
        "key_position": "field",
        "covariance": cov.describe(),
        "covariance_seconds": cov.seconds,
    }
    return functools.partial(rome, covariance=cov), how


@dataclass(frozen=True)
class _Edited:
    """What is read while one pair's edit is applied."""

    stale: Readout  # the old notebook's decision, as it was cached before the edit (the MLP output captured)
    ld_edited: float  # the old prompt prefilled again with the edited weights
    reprefill_seconds: float
    ld_concurrent: float  # the concurrent request, edited
    drift: list[tuple[float, float]]  # (edited, unedited) ld of each other decision
    achieved: Tensor  # the layer's MLP output at the key, edited


def _read_edited(
    trials: Sequence[Trial], i: int, j: int, c: Prompt, edit: RankOneEdit, layer: int, other: list
) -> _Edited:
    """Every read of trial i's edit, made while it is applied (`applied`)."""
    t = trials[i]
    m, pair = t.model, t.pair
    out_name = hook_name(layer, "hook_mlp_out")
    stale = decide(m, t.old_nb, pair.old, capture=[out_name], vocab=t.vocab)
    s = time.perf_counter()
    ld_edited = decision_ld(m, pair.old, pair.answers, metric=t.metric)
    reprefill = time.perf_counter() - s
    ld_c_edit = decision_ld(m, c, trials[j].pair.answers, metric=trials[j].metric)
    drift = [(decision_ld(m, o.pair.old, o.pair.answers, metric=o.metric), o.ld_old) for o in other]
    drift += [(decision_ld(m, o.pair.new, o.pair.answers, metric=o.metric), o.ld_new) for o in other]
    achieved = stale.activations[out_name][0, -1]
    if edit.position is not None:  # the key is in the prompt: its token computed again, edited
        prefix = prefill(m, pair.old, upto=edit.position)
        rest = list(pair.old.ids[edit.position :])
        achieved = decide(m, prefix, rest, capture=[out_name]).activations[out_name][0, 0]
    return _Edited(stale, ld_edited, reprefill, ld_c_edit, drift, achieved)


def _edit_pair(
    trials: Sequence[Trial],
    i: int,
    layer: int,
    aim: EditTarget,
    other: list,
    erratum: str,
    min_effect: float,
) -> tuple[dict[str, float | None], dict]:
    """Edit for trial i, read it, restore the weights, and time the erratum on the stale notebook:
    this pair's value of each part (None where undefined) and its row of `WeightEdit.pairs`."""
    t = trials[i]
    m, pair = t.model, t.pair
    j, c, ld_c, ld_alt = concurrent(trials, i)
    s = time.perf_counter()
    edit = aim(t, layer, new_nb=prefill(m, pair.new))
    with applied(m, edit):
        seconds = time.perf_counter() - s
        r = _read_edited(trials, i, j, c, edit, layer, other)
    s = time.perf_counter()
    text = erratum.format(field=pair.changed, value=pair.new.values[pair.changed])
    ld_err = decision_ld(m, pair.new, pair.answers, append(m, t.old_nb, text), metric=t.metric)
    erratum_seconds = time.perf_counter() - s

    wanted = float((edit.target - edit.old).norm())
    values = {
        "seconds": seconds,
        "reprefill_seconds": r.reprefill_seconds,
        "erratum_seconds": erratum_seconds,
        # an edit that wants no change (rome where no path leads to the decision) has no error to read
        "update_error": (
            float((r.achieved - edit.target).norm()) / wanted
            if wanted > 1e-5 * float(edit.old.norm())
            else None
        ),
        "target": float(t.recovery(r.ld_edited)),
        "target.agree": float((r.ld_edited > 0) == (t.ld_new > 0)),
        "target.stale_cache": float(t.recovery(t.score(r.stale.last)[0])),
        "erratum": float(t.recovery(ld_err)),
        "contamination": (
            float(recovery(r.ld_concurrent, ld_c, ld_alt, min_effect=0))
            if abs(ld_alt - ld_c) >= min_effect
            else None
        ),
        "contamination.flips": (
            float((r.ld_concurrent > 0) == (ld_alt > 0)) if (ld_c > 0) != (ld_alt > 0) else None
        ),
    }
    if r.drift:
        values["drift"] = sum((a > 0) != (b > 0) for a, b in r.drift) / len(r.drift)
        values["drift.dld"] = sum(abs(a - b) for a, b in r.drift) / len(r.drift)
    row = {
        "index": i,
        "key_position": len(pair.old.ids) - 1 if edit.position is None else edit.position,
        "concurrent": j,
        "concurrent_text": c.text,
        "ld_edited": r.ld_edited,
        "ld_concurrent": ld_c,
        "ld_concurrent_edited": r.ld_concurrent,
        "ld_concurrent_new_value": ld_alt,
        "wanted_norm": wanted,
        "update_norm": float(edit.delta(m).norm() / hooked(m).blocks[layer].mlp.W_out.norm()),
    }
    return values, row


def drift_trials(model: KVModel, task: Task | str, n: int, *, seed: int = 0) -> list[Trial]:
    """Trials on which to read drift: `n` pairs of another built-in task (`DRIFT_TASKS`; order-cancel
    for a task without an entry), unrelated to the edited decision but in the same tokenizer. If
    that task cannot be rendered for this model, other pairs of the same task (seed + 1) instead;
    `trials[0].pair.task` says which.

    >>> from kvnotes import load_model
    >>> drift_trials(load_model("tiny-llama"), "refund-window", 1)[0].pair.task
    'order-cancel'
    """
    task = load_task(task)
    other = DRIFT_TASKS.get(task.name, "account-access" if task.name == "order-cancel" else "order-cancel")
    try:
        with warnings.catch_warnings():  # an organism's task run on the other organism: wanted here
            warnings.filterwarnings("ignore", message="task .* was made for", category=UserWarning)
            return make_trials(model, other, n, seed=seed, progress=False)
    except KVNotesError:
        return make_trials(model, task, n, seed=seed + 1, progress=False)


@dataclass(frozen=True)
class WeightConfig(PairOptions):
    n: int = option(8, "prompt pairs (contamination is read on another pair's prompt)", least=2)
    layer: int | None = option(None, "the MLP layer edited (default: the middle one)", least=0, layer=True)
    erratum: str = option(ERRATUM, "correction line; {field} and {value} are filled in")


@analysis(
    "weight_edit",
    "edit",
    WeightConfig,
    WeightEdit,
    default=False,
    in_report=False,
    flag="weights",
    order=2,
    requires=(Need.RULE,),
)
def _run_weight_edit(ctx: Context, cfg: WeightConfig) -> WeightEdit:
    """The weight-edit baseline: a rank-one MLP edit per pair, its contamination, drift and cost."""
    # another built-in task's decisions, shared with weight_edit_rome
    other = ctx.shared(
        ("drift_trials", cfg.n), lambda: drift_trials(ctx.model, ctx.task, cfg.n, seed=ctx.seed)
    )
    return cfg.call(weight_edit, cfg.call(shared_trials, ctx), other_trials=other, min_effect=ctx.min_effect)


@dataclass(frozen=True)
class RomeConfig(WeightConfig):
    cov_prompts: int = option(
        COV_PROMPTS,
        "prompts of the task whose every token gives ROME's key covariance",
        least=2,
        arg="prompts",
    )
    cov_ridge: float = option(
        RIDGE, "ridge added to ROME's key covariance, as a fraction of trace(C)/d_mlp", least=0.0, arg="ridge"
    )


@analysis(
    "weight_edit_rome",
    "edit",
    RomeConfig,
    WeightEdit,
    default=False,
    in_report=False,
    flag="rome",
    order=2,
    requires=(Need.RULE,),
)
def _run_weight_edit_rome(ctx: Context, cfg: RomeConfig) -> WeightEdit:
    """ROME beside the weight-edit baseline: keyed at the changed field, data covariance, optimised value."""
    layer = check_layer(ctx.model, cfg.layer)
    cov = ctx.shared(
        ("rome_covariance", layer, cfg.cov_prompts, cfg.cov_ridge),
        lambda: cfg.call(key_covariance, ctx.model, ctx.task, layer, seed=ctx.seed + COV_SEED),
    )
    other = ctx.shared(
        ("drift_trials", cfg.n), lambda: drift_trials(ctx.model, ctx.task, cfg.n, seed=ctx.seed)
    )
    return cfg.call(
        weight_edit,
        cfg.call(shared_trials, ctx),
        layer=layer,
        other_trials=other,
        target=rome,
        covariance=cov,
        min_effect=ctx.min_effect,
    )
