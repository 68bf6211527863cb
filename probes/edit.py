"""Editing: one changed field, every way to fix a stale notebook, side by side.

For each pair (old prompt prefilled; the field then changes to the new value) every method
produces a decision that is compared with full recompute of the new prompt (the reference):
recovery toward it, agreement on the answer, the number of tokens the method computed, and its
wall time. Methods:

- `refresh`      in-place field refresh: recompute the field's tokens only
- `selective@K`  the field plus the top-K downstream slots, ranked by causal effect (the note map)
                 or by KV deviation between the old and new notebooks (CacheBlend's rule, here with
                 the true deviation: the most favourable version of it)
- `suffix`       recompute everything from the field to the decision
- `erratum`      append one correction line before the decision, nothing recomputed
- `hoist`        oracle: the field's line moved to just before the decision, prefilled fresh
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvnotes.analysis.registry import Context, Need, Section, analysis, option, register_section
from kvnotes.analysis.results import TaskResult
from kvnotes.analysis.stats import Estimate
from kvnotes.analysis.trials import PairOptions, Trial, shared_trials, with_progress
from kvnotes.ops import append, decide, prefill, recompute, recompute_suffix, refresh
from kvnotes.serving.manager import ERRATUM  # the one erratum line, shared with the serving prompt manager
from probes.causal import single_slot_map

KS = (1, 2, 4, 8, 16, 32, 64)


def hoisted_text(t: Trial) -> str:
    """The new prompt's text with the changed field's line moved to just before the decision."""
    p = t.pair.new
    cs, ce = p.char_spans[t.pair.changed]
    d0 = p.char_spans["decision"][0]
    start = p.text.rfind("\n", 0, cs) + 1
    end = p.text.find("\n", ce)
    end = len(p.text) if end < 0 else end + 1
    if end > d0:
        return p.text  # the field's line is the decision's own: already at the end
    line = p.text[start:end]
    return p.text[:start] + p.text[end:d0] + line + p.text[d0:]


def methods(t: Trial, ks: Sequence[int], erratum: str) -> dict[str, tuple[float, int, float]]:
    """method -> (logit difference, tokens computed, seconds) for one trial."""
    m, new = t.model, t.pair.new
    field = list(t.pair.field_span)
    down = t.pair.downstream()
    out: dict[str, tuple[float, int, float]] = {}

    def timed(name, fn, n_tokens):
        s = time.perf_counter()
        logit_diff = fn()
        out[name] = (logit_diff, n_tokens, time.perf_counter() - s)

    def read(nb):
        return float(t.ld(nb)[0])

    n_dec = len(new) - new.span("decision").start
    timed("refresh", lambda: read(refresh(m, t.old_nb, new, t.pair.changed)), len(field) + n_dec)
    smap = single_slot_map(t, 1)
    causal = [
        p
        for _, p, role in sorted(zip(smap["recovery"], smap["positions"], smap["role"]), key=lambda x: -x[0])
        if role == "note"
    ]
    deviation = [
        p
        for _, p, role in sorted(zip(smap["deviation"], smap["positions"], smap["role"]), key=lambda x: -x[0])
        if role == "note"
    ]
    for k in ks:
        if k > len(down):
            continue
        for rank, order in (("causal", causal), ("deviation", deviation)):
            pos = field + order[:k]
            timed(
                f"selective_{rank}@{k}",
                lambda pos=pos: read(recompute(m, t.old_nb, new, pos)),
                len(pos) + n_dec,
            )
    timed(
        "suffix",
        lambda: read(recompute_suffix(m, t.old_nb, new, t.pair.changed)),
        len(field) + len(down) + n_dec,
    )
    text = erratum.format(field=t.pair.changed, value=new.values[t.pair.changed])
    n_err = len(m.encode(text, bos=False))
    timed("erratum", lambda: read(append(m, t.old_nb, text)), n_err + n_dec)
    hoisted = m.encode(hoisted_text(t))

    def hoist():
        out = decide(m, prefill(m, hoisted[:-n_dec]), hoisted[-n_dec:], vocab=t.vocab).last
        return float(t.score(out)[0])

    timed("hoist", hoist, len(hoisted))
    timed("full", lambda: read(prefill(m, new)), len(new))
    return out


@dataclass(frozen=True, kw_only=True)
class EditMethods(TaskResult):
    """Per method m: recovery (`m`), same answer as full recompute (`m.agree`), tokens recomputed
    (`m.tokens`) and wall time (`m.seconds`)."""

    PART_PATTERNS = (r"[a-z_]+(@\d+)?(\.(agree|tokens|seconds))?",)
    erratum: str
    ks: tuple[int, ...]  # slot budgets of the selective methods

    def cell(self, part: str) -> tuple[str, str] | None:
        """Each method a row; its recovery, agreement, tokens and seconds the columns."""
        method, _, what = part.partition(".")
        return (method, what or "recovery")


def edit_methods(trials: Sequence[Trial], *, ks: Sequence[int] = KS, erratum: str = ERRATUM) -> TaskResult:
    """Every editing method on every pair: parts `{method}` (recovery), `{method}.agree` (same
    answer as full recompute), `{method}.tokens` and `{method}.seconds`. Headline: erratum."""
    acc: dict[str, list[float]] = {}
    labels: dict[str, list[int]] = {}  # the template of the pair behind each value in acc
    for t in with_progress(trials, "edit methods"):
        res = methods(t, ks, erratum)
        ref_choice = t.ld_new > 0
        for name, (logit_diff, n_tok, sec) in res.items():
            got = {
                name: float(t.recovery(logit_diff)),
                f"{name}.agree": float((logit_diff > 0) == ref_choice),
                f"{name}.tokens": float(n_tok),
                f"{name}.seconds": sec,
            }
            for k, v in got.items():  # a selective@k that this pair has too few slots for is skipped
                acc.setdefault(k, []).append(v)
                labels.setdefault(k, []).append(t.pair.template)
    return EditMethods.of(
        name="edit_methods",
        headline="erratum",
        parts={k: Estimate.of(v, clusters=labels[k]) for k, v in acc.items()},
        erratum=erratum,
        ks=ks,
        description="one changed field: every way to bring the stale notebook up to date",
    )


@dataclass(frozen=True)
class EditConfig(PairOptions):
    erratum: str = option(ERRATUM, "correction line; {field} and {value} are filled in")


register_section(
    Section(
        "edit",
        "Editing",
        order=40,
        command="edit",
        help="one changed field: every editing method against full recompute",
        intro=("One changed field: every way to update a stale cache, against full recompute."),
    )
)


@analysis("edit_methods", "edit", EditConfig, EditMethods, quick={"n": 6}, order=1, requires=(Need.RULE,))
def _run_edit_methods(ctx: Context, cfg: EditConfig) -> EditMethods:
    """One changed field: every editing method against full recompute."""
    return cfg.call(edit_methods, cfg.call(shared_trials, ctx))
