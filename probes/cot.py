"""Chain of thought from an edited cache: does a reasoning chain re-read the refreshed field?

Per pair, three notebooks that end where the decision would start: the stale one (old value),
the in-place refreshed one (only the field's K/V recomputed with the new value), and a clean
prefill of the new prompt. From each, a reasoning cue is appended and a chain is decoded greedily
(until a blank line, the decision's own text, or `max_tokens`); then the decision span is appended
and the answer read. Recovery of the refreshed chain is measured between the stale and clean
chains' decisions, next to the same refresh without a chain. The chain lengths are reported too:
if recomputation moves into the chain, the edited chain is the longer one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvnotes.analysis.registry import Context, Need, analysis, option
from kvnotes.analysis.results import TaskResult
from kvnotes.analysis.stats import Estimate
from kvnotes.analysis.trials import MIN_EFFECT, PairOptions, Trial, shared_trials, with_progress
from kvnotes.engine import run
from kvnotes.metrics import recovery
from kvnotes.notebook import Notebook
from kvnotes.ops import decide, prefill, refresh

CUE = "reasoning:"


def chain(t: Trial, nb: Notebook, *, cue: str, max_tokens: int) -> tuple[Notebook, list[int]]:
    """Append `cue`, then greedy-decode until a blank line, the decision's text, or `max_tokens`."""
    m = t.model
    decision_text = m.tokenizer.decode(list(t.pair.new.ids[t.pair.new.span("decision").start :])).strip()
    nb, out = run(m, nb, m.encode(cue, bos=False))
    generated: list[int] = []
    for _ in range(max_tokens):
        tok = int(out.last[0].argmax())
        generated.append(tok)
        nb, out = run(m, nb, [tok])
        text = m.tokenizer.decode(generated)
        if "\n\n" in text or (decision_text and decision_text in text):
            break
    return nb, generated


def _decision_ld(t: Trial, nb: Notebook) -> float:
    d = t.pair.new
    query = list(d.ids[d.span("decision").start :])
    out = decide(t.model, nb, [*t.model.encode("\n", bos=False), *query], vocab=t.vocab).last
    return float(t.score(out)[0])


@dataclass(frozen=True, kw_only=True)
class CotRefresh(TaskResult):
    """A greedy reasoning chain after an in-place refresh, against a clean prefill's chain."""

    PARTS = ("recovery", "no_cot_recovery", "edited_tokens", "clean_tokens", "same_chain", "chain_effect")
    cue: str
    max_tokens: int
    examples: tuple[dict[str, str], ...]  # decoded chains (stale, edited, clean) of the first pairs


def cot_refresh(
    trials: Sequence[Trial], *, cue: str = CUE, max_tokens: int = 48, min_effect: float = MIN_EFFECT
) -> TaskResult:
    """Parts: `recovery` (refreshed chain, between the stale and clean chains; headline),
    `no_cot_recovery` (the same refresh read directly), `edited_tokens` / `clean_tokens` (chain
    lengths), `same_chain` (the refreshed chain's text equals the clean one's), `chain_effect`
    (logits between the stale and clean chains' decisions)."""
    acc: dict[str, list[float]] = {}
    labels: dict[str, list[int]] = {}  # the template of the pair behind each value in acc

    def add(name: str, value: float) -> None:
        acc.setdefault(name, []).append(value)
        labels.setdefault(name, []).append(t.pair.template)

    examples = []
    for t in with_progress(trials, "chain of thought"):
        m = t.model
        edited = refresh(m, t.old_nb, t.pair.new, t.pair.changed)
        runs = {}
        for name, nb in (("stale", t.old_nb), ("edited", edited), ("clean", prefill(m, t.pair.new))):
            end, gen = chain(t, nb, cue=cue, max_tokens=max_tokens)
            runs[name] = (_decision_ld(t, end), gen)
        s, e, c = runs["stale"][0], runs["edited"][0], runs["clean"][0]
        add("chain_effect", c - s)
        if abs(c - s) >= min_effect:
            add("recovery", float(recovery(e, s, c, min_effect=0)))
        add("no_cot_recovery", float(t.recovery(t.ld(edited))))
        add("edited_tokens", float(len(runs["edited"][1])))
        add("clean_tokens", float(len(runs["clean"][1])))
        add("same_chain", float(runs["edited"][1] == runs["clean"][1]))
        if len(examples) < 2:
            examples.append({k: m.tokenizer.decode(v[1]) for k, v in runs.items()})
    order = ["recovery", "no_cot_recovery", "edited_tokens", "clean_tokens", "same_chain", "chain_effect"]
    return CotRefresh.of(
        name="cot_refresh",
        headline="recovery",
        parts={k: Estimate.of(acc.get(k, []), clusters=labels.get(k, [])) for k in order},
        cue=cue,
        max_tokens=max_tokens,
        examples=examples,
        description="in-place field refresh, then a greedy reasoning chain, vs a clean prefill's chain",
    )


@dataclass(frozen=True)
class CotConfig(PairOptions):
    cot_tokens: int = option(48, "longest reasoning chain (tokens)", least=1, tokens=True, arg="max_tokens")


@analysis(
    "cot_refresh",
    "edit",
    CotConfig,
    CotRefresh,
    default=False,
    in_report=False,
    flag="cot",
    order=3,
    requires=(Need.RULE,),
)
def _run_cot_refresh(ctx: Context, cfg: CotConfig) -> CotRefresh:
    """Decode a greedy reasoning chain from the refreshed and a clean cache."""
    return cfg.call(cot_refresh, cfg.call(shared_trials, ctx), min_effect=ctx.min_effect)
