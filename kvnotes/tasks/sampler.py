"""Prompt pairs from a task: two renderings that differ in one field and align token for token."""

from __future__ import annotations

import random
from collections.abc import Callable

from kvnotes.errors import BadArgument, NeedUnmet
from kvnotes.prompt import Prompt, Template
from kvnotes.tasks.pair import Pair
from kvnotes.tasks.pairs import PAIRS, PairSet
from kvnotes.tasks.task import Digits, Task, TaskError

GATE, RULE = "gate", "rule"


def values_for(task: Task, rng: random.Random) -> dict[str, str]:
    """One draw of every [vary] field."""
    out = {}
    for k, v in task.vary.items():
        if isinstance(v, Digits):
            out[k] = str(rng.randint(10 ** (v.n - 1), 10**v.n - 1))
        else:
            out[k] = rng.choice(v)
    return out


NEUTRAL = (
    "The warehouse restocks its shelves every morning before the doors open.",
    "Parcels are weighed and labelled at the packing station near the loading dock.",
    "Our support team answers messages from nine in the morning until five in the evening.",
    "Gift wrapping is available for most items at a small extra charge.",
    "Seasonal catalogues are printed twice a year and mailed to subscribers.",
    "The loyalty programme awards one point for every dollar spent in the store.",
    "Store managers review the inventory reports at the end of each week.",
    "Delivery vans leave the depot in the afternoon and return by nightfall.",
)


def neutral_notes(n_lines: int) -> str:
    """`n_lines` lines of neutral store notes ("Note 1: ...\\n"), for filler that decides nothing."""
    return "".join(f"Note {i + 1}: {NEUTRAL[i % len(NEUTRAL)]}\n" for i in range(n_lines))


def fit_notes(measure: Callable[[str], int], n_tokens: int) -> str:
    """The fewest neutral notes for which `measure(notes) >= n_tokens` ("" when "" already does).
    `measure` must grow with the notes; it is called O(log n) times (it may be a server round trip).

    >>> fit_notes(lambda s: len(s.split()), 25).count("\\n")
    2
    """
    if measure("") >= n_tokens:
        return ""
    hi = 1
    while measure(neutral_notes(hi)) < n_tokens:
        hi *= 2
    lo = hi // 2  # measure(neutral_notes(lo)) < n_tokens, or lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if measure(neutral_notes(mid)) >= n_tokens:
            hi = mid
        else:
            lo = mid
    return neutral_notes(hi)


def shots_text(task: Task, rng: random.Random, filler: str = "") -> str:
    """The few-shot block: gate values balanced across the shots, each with its own [vary]
    draws and its answer under the rule as written; order shuffled."""
    if task.shots is None:
        return ""
    tpl = Template(task.shots.template)
    values = [task.gate.values[i % len(task.gate.values)] for i in range(task.shots.count)]
    rng.shuffle(values)
    parts = []
    for v in values:
        vals = {
            **values_for(task, rng),
            task.gate.field: v,
            "answer": task.answers[task.outcome(v)],
            "filler": filler,
        }
        parts.append(tpl.fill(**vals))
    return "".join(parts)


def render(task: Task, model, values: dict[str, str]) -> Prompt:
    """Render the task's template with `values` (filler defaults to empty)."""
    vals = {"filler": "", **values}
    return task.template.render(model, **{f: vals[f] for f in task.template.fields})


def template_of(i: int, n_templates: int) -> int:
    """Which of `n_templates` templates pair `i` of a sample uses: i mod n_templates, shifted by
    one each round when n_templates is even, so that every template's pairs fall on both even
    and odd indices (both directions of the change, both halves of an even/odd cross-fit).

    >>> [template_of(i, 3) for i in range(6)], [template_of(i, 2) for i in range(6)]
    ([0, 1, 2, 0, 1, 2], [0, 1, 1, 0, 0, 1])
    """
    shift = i // n_templates if n_templates % 2 == 0 else 0
    return (i + shift) % n_templates


def sample(
    task: Task | PairSet,
    model,
    n: int,
    *,
    seed: int = 0,
    kind: str = GATE,
    filler: str = "",
    template: int | None = None,
) -> list[Pair]:
    """`n` aligned prompt pairs: shot order, names and ids vary with `seed`.

    kind="gate": old and new differ in the gating field (values with different answers; the
    direction alternates from pair to pair). kind="rule": the gating field is held fixed and the
    rule flips from as-written to flipped. `filler` goes into the template's {filler} field.
    `template=None` cycles the pairs through the task's templates (`template_of`: every run of
    `task.n_templates` pairs uses each template once, and each template's pairs fall on even and
    odd indices, so they alternate in direction too); `template=i` renders every pair from
    template i (the pairs a one-template task gives). `pair.template` says which.
    Raises TokenCountChanged (naming the field) if a pair's prompts do not align.

    >>> from kvnotes import load_model
    >>> from kvnotes.tasks import load_task
    >>> pairs = sample(load_task("order-cancel"), load_model("tiny-llama"), 2)
    >>> [(p.old.values["order_status"], p.new.values["order_status"]) for p in pairs]
    [('pending', 'shipped'), ('shipped', 'pending')]
    >>> [p.template for p in pairs], [p.template for p in sample(load_task("order-cancel"),
    ...     load_model("tiny-llama"), 2, template=1)]
    ([0, 1], [1, 1])
    """
    if isinstance(task, PairSet):  # a pair dataset's pairs are its lines (kvnotes.tasks.pairs)
        return _pairs_of(task, model, n, seed=seed, kind=kind, filler=filler, template=template)
    _check_request(task, n, kind, filler)
    cycle = list(range(task.n_templates)) if template is None else [template]
    wordings = [task.with_template(k) for k in cycle]  # a bad index fails here, naming the count
    try:
        answers = tuple(model.answer_token(a) for a in task.answers)
    except ValueError as e:
        raise TaskError(f"task {task.name!r}: answers: {e}") from None
    pairs = []
    for i in range(n):
        turn = template_of(i, len(cycle))
        rng = random.Random(f"{task.name}/{kind}/{seed}/{i}")
        old_vals, new_vals, expected, inputs = _values(wordings[turn], rng, i, kind, filler)
        old, new = render(wordings[turn], model, old_vals), render(wordings[turn], model, new_vals)
        old.check_aligned(new)
        pairs.append(
            Pair(
                task=task.name,
                kind=kind,
                changed=inputs[0],
                old=old,
                new=new,
                answers=answers,
                expected=expected,
                seed=seed,
                inputs=inputs,
                template=cycle[turn],
            )
        )
    return pairs


def _pairs_of(
    ps: PairSet, model, n: int, *, seed: int, kind: str, filler: str, template: int | None
) -> list[Pair]:
    """`n` pairs of a pair dataset: it has no rule to flip and no {filler} to fill."""
    if kind not in (GATE, PAIRS):
        raise NeedUnmet(
            f"{ps.source} is a pair dataset: it has no rule to flip (kind={kind!r}); "
            "run what needs a rule with a task (--task NAME or a task .toml)"
        )
    if filler:
        raise NeedUnmet(
            f"{ps.source} is a pair dataset: it has no {{filler}} field to put text into; "
            "run what needs one with a task (--task NAME or a task .toml)"
        )
    return ps.sample(model, n, seed=seed, template=template)


def _check_request(task: Task, n: int, kind: str, filler: str) -> None:
    """Fail early, naming the fix, on a sample the task cannot give."""
    if kind not in (GATE, RULE):
        raise BadArgument(f"kind must be {GATE!r} or {RULE!r}, got {kind!r}")
    if kind == RULE and task.rule is None:
        raise TaskError(
            f"task {task.name!r} has no [rule] table, so it has no rule to flip; add "
            "one (a field whose one-token flip inverts the answer) for the dissociation probe"
        )
    if n < 1:
        raise BadArgument(f"n must be at least 1, got {n}; ask for one pair or more")
    if filler and not task.has_filler:
        raise TaskError(
            f"task {task.name!r} has no {{filler}} field to put intervening text into; "
            "add one to its template between the gating field and the query"
        )


def _values(
    t: Task, rng: random.Random, i: int, kind: str, filler: str
) -> tuple[dict[str, str], dict[str, str], tuple[int, int], tuple[str, ...]]:
    """Pair i's old and new field values, its expected answers and the fields it changes: the
    gate (its direction alternating with i) or, the gate held fixed, the rule flipped."""
    gate = t.gate
    base = {**values_for(t, rng), "shots": shots_text(t, rng, filler), "filler": filler}
    written = t.rule.values[0] if t.rule else None
    if t.rule:
        base[t.rule.field] = written
    if kind == GATE:
        by_outcome = {o: [v for v, oo in zip(gate.values, gate.outcomes) if oo == o] for o in (0, 1)}
        a, b = rng.choice(by_outcome[0]), rng.choice(by_outcome[1])
        old_v, new_v = (a, b) if i % 2 == 0 else (b, a)
        expected = (t.outcome(old_v, written), t.outcome(new_v, written))
        return {**base, gate.field: old_v}, {**base, gate.field: new_v}, expected, (gate.field,)
    v = rng.choice(gate.values)
    flipped = t.rule.values[1]
    old_vals = {**base, gate.field: v, t.rule.field: written}
    new_vals = {**base, gate.field: v, t.rule.field: flipped}
    return old_vals, new_vals, (t.outcome(v, written), t.outcome(v, flipped)), (t.rule.field, gate.field)
