"""Which slots of an arbitrary prompt's notebook carry its decision: attribution patching of every
slot × layer from one forward and one backward, then exact transplants of the top slots.

No task template is needed: the prompt's last token is the decision token, its other tokens are
the notebook, and the metric is the logit difference of two answer tokens. What replaces a slot
is either a counterfactual prompt's K/V (same token count) or, without one, the notebook's own
mean value (`value_mean_ablation`), which removes a slot's content but keeps its key. Both are
ordinary notebooks, so the exact step is an ordinary transplant.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace

import torch

from circuits.attribution import SlotAttribution, slot_attribution
from kvnotes.analysis.registry import MIN_EFFECT, Context, Options, analysis, option
from kvnotes.display import Displayable
from kvnotes.errors import OutOfRange, PromptAttributionError, TokenCountChanged
from kvnotes.metrics import logit_diff, spearman
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook
from kvnotes.ops import Patch, decide, decide_patched, prefill

SCHEMA = "kvnotes.prompt_attribution/1"
COUNTERFACTUAL = "counterfactual"
MEAN_ABLATION = "value-mean-ablation"


@dataclass(frozen=True)
class PromptAttribution(Displayable):
    """Slot attribution of one decision: the gradient estimate for every layer × slot and exact
    transplants of the top slots, all in logit units of ld = logit[answers[0]] - logit[answers[1]].

    Effects are changes of ld when a slot's K/V (all layers, or one layer) is replaced by the
    source's (the counterfactual's, or the value mean). JSON-safe: lists, strings and numbers.
    `exact` rows: {position, token, estimate (summed over layers), total, per_layer}.
    """

    model: str
    prompt: str
    answers: tuple[str, str]
    answer_ids: tuple[int, int]
    baseline: str  # "counterfactual" or "value-mean-ablation"
    counterfactual: str | None
    decision_token: str
    tokens: list[str]  # one per notebook slot, in slot order
    positions: list[int]
    ld: float  # the prompt's logit difference
    ld_source: float  # the source notebook's, read by the same decision token
    estimate: list[list[float]]  # [layer][slot], keys + values
    estimate_keys: list[list[float]]  # [layer][slot], the keys' part
    estimate_values: list[list[float]]  # [layer][slot], the values' part
    exact: list[dict]
    rank_correlation: float | None  # Spearman, estimate vs exact totals over the top slots
    gradient_seconds: float
    exact_seconds: float
    meta: Mapping = field(default_factory=dict)
    min_effect: float = MIN_EFFECT  # the probes' floor: a source that moves ld less ranks noise

    @property
    def effect(self) -> float:
        """How far the source moves the decision: ld_source - ld (logits)."""
        return self.ld_source - self.ld

    @property
    def small_effect(self) -> str | None:
        """A warning where the source moves the decision less than `min_effect`, else None."""
        if abs(self.effect) >= self.min_effect:
            return None
        return (
            f"small effect: the source moves the decision by {self.effect:+.3f} logits, under the "
            f"{self.min_effect} the probes require (min_effect); slot effects and their ranking are "
            "within that of nothing: choose a counterfactual that changes the answer more"
        )

    @property
    def slot_estimate(self) -> list[float]:
        """The estimate of each slot summed over layers (what ranks the top slots)."""
        return [sum(col) for col in zip(*self.estimate)]

    def table(self) -> str:
        """A short readable summary: the decision, the baseline, and the top slots."""
        yes, no = self.answers
        lines = [
            f"{self.model}: ld = logit[{yes!r}] - logit[{no!r}] = {self.ld:+.3f} "
            f"at {self.decision_token!r}; source ({self.baseline}) ld = {self.ld_source:+.3f}",
            f"{'position':>8}  {'token':<16} {'estimate':>9} {'exact':>9}",
        ]
        for r in self.exact:
            lines.append(
                f"{r['position']:>8}  {repr(r['token'])[:16]:<16} {r['estimate']:>+9.3f} {r['total']:>+9.3f}"
            )
        rho = "undefined" if self.rank_correlation is None else f"{self.rank_correlation:+.2f}"
        lines.append(
            f"Spearman rho (estimate vs exact, top {len(self.exact)}): {rho}; gradient pass "
            f"{self.gradient_seconds:.2f} s, exact pass {self.exact_seconds:.2f} s"
        )
        if self.small_effect:
            lines.insert(1, "WARNING " + self.small_effect)
        return "\n".join(lines)

    def to_dict(self) -> dict:
        d = copy.deepcopy({f.name: getattr(self, f.name) for f in fields(self)})
        d.update(answers=list(self.answers), answer_ids=list(self.answer_ids), meta=dict(d["meta"]))
        return {"schema": SCHEMA, **d}

    @classmethod
    def from_dict(cls, d: Mapping) -> PromptAttribution:
        if d.get("schema") != SCHEMA:
            raise PromptAttributionError(
                f"not a prompt attribution (schema {d.get('schema')!r}, expected "
                f"{SCHEMA!r}); write one with `kvnotes attribute --json FILE`"
            )
        kw = copy.deepcopy({f.name: d[f.name] for f in fields(cls) if f.name in d})
        kw.update(answers=tuple(kw["answers"]), answer_ids=tuple(kw["answer_ids"]), meta=kw.get("meta", {}))
        return cls(**kw)


def value_mean_ablation(notebook: Notebook) -> Notebook:
    """`notebook` with every slot's value, at every layer and KV head, replaced by the mean value
    over its slots other than position 0 (the BOS attention sink, whose value is an outlier and is
    left as it is: ablating the sink measures the sink, not the prompt).
    Keys are kept, so each slot is matched as before (scores change only through the decision's own
    queries, at layers after the first) and only what it carries is removed."""
    keep = notebook.positions != 0
    if not bool(keep.any()):
        raise PromptAttributionError("the value mean needs a slot besides position 0; use a longer prompt")
    m = keep.to(notebook.values[0].device)[None, None, :, None]
    values = tuple(
        torch.where(m, v[:, :, keep].mean(2, keepdim=True), v).contiguous() for v in notebook.values
    )
    return replace(notebook, values=values)


def _answer_ids(model: KVModel, answers: Sequence[str]) -> tuple[int, int]:
    if len(answers) != 2:
        raise PromptAttributionError(f"give exactly two answers (e.g. (' yes', ' no')), got {len(answers)}")
    try:
        ids = tuple(model.answer_token(a) for a in answers)
    except ValueError as e:
        raise PromptAttributionError(str(e)) from e
    if ids[0] == ids[1]:
        raise PromptAttributionError(
            f"answers {answers[0]!r} and {answers[1]!r} are the same token; the logit difference would be 0"
        )
    return ids


def _source(model: KVModel, nb: Notebook, ids: list[int], counterfactual: str | None) -> Notebook:
    """The notebook whose K/V replace the prompt's: the counterfactual's prefill, or the value mean."""
    if counterfactual is None:
        return value_mean_ablation(nb)
    cf = model.encode(counterfactual)
    if len(cf) != len(ids):
        raise TokenCountChanged(
            f"the counterfactual is {len(cf)} tokens but the prompt is {len(ids)}; slots must line up, so "
            "edit the counterfactual so that its changed words keep the token count (e.g. swap a word "
            "for one of the same length in tokens)"
        )
    if cf[-1] != ids[-1]:
        raise PromptAttributionError(
            f"the counterfactual ends in {model.token_strings(cf[-1:])[0]!r} but the prompt in "
            f"{model.token_strings(ids[-1:])[0]!r}; the last token is the decision token, which no slot "
            "transplant can change, so make both prompts end in the same token"
        )
    return prefill(model, cf[:-1])


def attribute_prompt(
    model: KVModel,
    prompt: str,
    answers: tuple[str, str],
    *,
    counterfactual: str | None = None,
    top: int = 8,
    steps: int = 4,
    min_effect: float = MIN_EFFECT,
    progress: bool = True,
) -> PromptAttribution:
    """Which slots carry the decision at `prompt`'s last token, read as the logit difference of
    the two `answers`: a gradient estimate for every slot × layer, then exact transplants (all
    layers and each layer alone) of the `top` slots by |estimate summed over layers|.

    The source is `counterfactual`'s notebook (same token count) or else the value mean-ablation.
    `steps` > 1 averages the gradient along the path from the prompt's K/V to the source's
    (integrated gradients, `steps` backward passes): replacing a slot is a large change, and one
    gradient at the start can misrank it. A source that moves the decision less than `min_effect`
    is flagged (`small_effect`, and a warning line in the table and on the page).

    >>> from kvnotes import load_model
    >>> model = load_model("tiny-llama")
    >>> r = attribute_prompt(model, "order_status: shipped.\\nQ: Can the order be cancelled? A:",
    ...                      (" yes", " no"), top=3, progress=False)
    >>> r.baseline, len(r.tokens) == len(r.estimate[0]), len(r.estimate) == model.n_layers
    ('value-mean-ablation', True, True)
    >>> [len(row["per_layer"]) for row in r.exact]
    [3, 3, 3]
    """
    if top < 1:
        raise OutOfRange(f"top={top}: ask for at least one slot to transplant exactly")
    vocab = _answer_ids(model, answers)
    ids = model.encode(prompt)
    if len(ids) < 2:
        raise PromptAttributionError(
            f"the prompt is {len(ids)} token(s); it needs a notebook before its last (decision) token"
        )
    nb = prefill(model, ids[:-1])
    src = _source(model, nb, ids, counterfactual)
    query = ids[-1:]

    t0 = time.perf_counter()
    a = slot_attribution(model, nb, src, query, vocab, steps=steps)
    gradient_seconds = time.perf_counter() - t0

    t0 = time.perf_counter()
    ld_source = float(_ld(decide(model, src, query, vocab=vocab).last)[0])
    tokens = model.token_strings(nb.tokens[0].tolist())
    exact, n_specs = _exact(model, nb, src, query, vocab, a, tokens, top=top, progress=progress)
    exact_seconds = time.perf_counter() - t0
    L, k = model.n_layers, len(exact)
    return PromptAttribution(
        model=model.name,
        prompt=prompt,
        answers=(answers[0], answers[1]),
        answer_ids=vocab,
        baseline=MEAN_ABLATION if counterfactual is None else COUNTERFACTUAL,
        counterfactual=counterfactual,
        decision_token=model.token_strings(query)[0],
        tokens=tokens,
        positions=nb.positions.tolist(),
        ld=a.ld,
        ld_source=ld_source,
        estimate=a.slot_layer.tolist(),
        estimate_keys=a.keys.tolist(),
        estimate_values=a.values.tolist(),
        exact=exact,
        rank_correlation=spearman([r["estimate"] for r in exact], [r["total"] for r in exact]),
        gradient_seconds=gradient_seconds,
        exact_seconds=exact_seconds,
        min_effect=min_effect,
        meta={
            "n_layers": L,
            "top": k,
            "steps": steps,
            "units": "logits (change of ld)",
            "timing": "gradient: one forward and one backward over the decision token; exact: "
            f"{n_specs} transplants (top slots x (all layers + each layer)), batched",
        },
    )


def _exact(
    model: KVModel,
    nb: Notebook,
    src: Notebook,
    query: Sequence[int],
    vocab: tuple[int, int],
    a: SlotAttribution,
    tokens: Sequence[str],
    *,
    top: int,
    progress: bool,
) -> tuple[list[dict], int]:
    """Exact transplants from `src` of the `top` slots by |estimate summed over layers|, over all
    layers and each layer alone: per slot its change of ld beside the estimate, and the count."""
    k = min(top, nb.n_slots)
    total = a.slot_layer.sum(0)
    order = torch.argsort(total.abs(), descending=True, stable=True)[:k].tolist()
    chosen = [int(nb.positions[i]) for i in order]
    L = model.n_layers
    specs = [
        spec
        for p in chosen
        for spec in (Patch(positions=(p,)), *(Patch(positions=(p,), layers=(l,)) for l in range(L)))
    ]
    lds = _ld(decide_patched(model, nb, src, specs, query, vocab=vocab, progress=progress).last).view(
        k, L + 1
    )
    delta = (lds - a.ld).tolist()
    exact = [
        {"position": p, "token": tokens[i], "estimate": float(total[i]), "total": d[0], "per_layer": d[1:]}
        for p, i, d in zip(chosen, order, delta)
    ]
    return exact, len(specs)


def _ld(logits: torch.Tensor) -> torch.Tensor:
    return logit_diff(logits, (0, 1))


@dataclass(frozen=True)
class PromptAttributionConfig(Options):
    prompt: str = option("", "the prompt text; its last token is the decision")
    answers: tuple[str, ...] = option((), "the two answer strings: ld = logit[first] - logit[second]")
    counterfactual: str | None = option(None, "a prompt of the same token count whose K/V replace the slots")
    top: int = option(8, "slots transplanted exactly", least=1)
    steps: int = option(
        4, "gradient passes along the path to the source (1: plain attribution patching)", least=1
    )


@analysis(
    "prompt_attribution",
    "tools",
    PromptAttributionConfig,
    PromptAttribution,
    in_report=False,
    default=False,
    order=2,
)
def _run_prompt_attribution(ctx: Context, cfg: PromptAttributionConfig) -> PromptAttribution:
    """Which slots of any prompt's notebook carry the decision at its last token (`kvnotes attribute`)."""
    if len(cfg.answers) != 2:
        raise PromptAttributionError(
            f"give exactly two answers, the decision's two outcomes; got {list(cfg.answers)}"
        )
    first, second = cfg.answers
    return cfg.call(
        attribute_prompt,
        ctx.model,
        cfg.prompt,
        (first, second),
        min_effect=ctx.min_effect,
        progress=ctx.progress,
    )
