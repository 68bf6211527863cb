"""The serve bench's workload: sessions that share one long policy rendered from a task, each with
its own state, and the schedule of a run (Poisson arrivals, each changing one session's gating field,
and the prompt each strategy sends for it). Depends only on seeds: every strategy answers the same
stream of changes."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvnotes.errors import KVNotesError
from kvnotes.serving.manager import DEFAULT_COMPACTION, Compaction, PromptManager, approx_tokens, escape
from kvnotes.tasks import Task
from kvnotes.tasks.sampler import fit_notes, shots_text, values_for


@dataclass(frozen=True)
class Session:
    """One session's prompt: a manager template whose only field is the task's gating field."""

    template: str
    tail: str
    field: str
    initial: str


class Values:
    """A session's new values for the gating field, alternating between the two outcomes.

    Numeric fields whose outcomes sit on either side of a threshold draw fresh numbers from each
    side (the low side from 1 to its largest listed value, the high side from its smallest to five
    times its largest), never repeating within a session while a side has numbers left. Other
    fields toggle among the task's listed values."""

    def __init__(self, task: Task, rng: random.Random):
        self.task, self.rng = task, rng
        gate = task.gate
        sides = {o: [v for v, oo in zip(gate.values, gate.outcomes) if oo == o] for o in (0, 1)}
        self.ranges: dict[int, range] | None = None
        if all(v.isdigit() for v in gate.values) and all(sides.values()):
            lo, hi = sorted((0, 1), key=lambda o: max(int(v) for v in sides[o]))
            top_lo = max(int(v) for v in sides[lo])
            bottom_hi = min(int(v) for v in sides[hi])
            if top_lo < bottom_hi:
                self.ranges = {
                    lo: range(1, top_lo + 1),
                    hi: range(bottom_hi, 5 * max(int(v) for v in sides[hi]) + 1),
                }
                self.threshold, self.low = top_lo, lo
        self.sides = sides
        self.used: set[str] = set()

    def outcome(self, value: str) -> int:
        if self.ranges is not None:
            return self.low if int(value) <= self.threshold else 1 - self.low
        return self.task.outcome(value)

    def draw(self, side: int) -> str:
        if self.ranges is None:
            return self.rng.choice(self.sides[side])
        pool = [str(v) for v in self.ranges[side] if str(v) not in self.used] or [
            str(v) for v in self.ranges[side]
        ]
        v = self.rng.choice(pool)
        self.used.add(v)
        return v

    def first(self) -> str:
        return self.draw(self.rng.randrange(2))

    def next(self, current: str) -> str:
        return self.draw(1 - self.outcome(current))


def sessions(
    task: Task, count_tokens: Callable[[str], int], tokens: int, n: int, *, seed: int = 0
) -> list[Session]:
    """`n` sessions of about `tokens` tokens each: shared rule, examples and notes, each with its
    own state block (names, ids, the gating field's first value)."""
    if not task.has_filler:
        raise KVNotesError(
            f"task {task.name!r} has no {{filler}} field to hold the long policy; add one after the "
            "gating field"
        )
    t = task.with_template(0)
    field_name = t.gate.field
    shared = random.Random(f"serve/{t.name}/{seed}")
    shots = shots_text(t, shared)
    written = {t.rule.field: t.rule.values[0]} if t.rule else {}
    out, states = [], set()
    for s in range(n):
        rng = random.Random(f"serve/{t.name}/{seed}/session/{s}")
        first = Values(t, rng).first()
        for _ in range(1000):  # each session is its own customer: redraw a state another one has
            vals = {**values_for(t, rng), **written, "shots": shots, field_name: first}
            if tuple(vals[k] for k in t.vary) not in states:
                break
        states.add(tuple(vals[k] for k in t.vary))

        def layout(filler: str, vals=vals):
            return t.template.layout(**{**vals, "filler": filler})

        text, spans = layout(fit_notes(lambda f: count_tokens(layout(f)[0]), tokens))
        fs, fe = spans[field_name]
        d0 = spans["decision"][0] if "decision" in spans else len(text)
        template = escape(text[:fs]) + "{" + field_name + "}" + escape(text[fe:d0])
        out.append(Session(template=template, tail=text[d0:], field=field_name, initial=first))
    return out


@dataclass(frozen=True)
class Planned:
    """One request of a run: when it arrives, whose it is, what it sends, what it should match."""

    at: float
    session: int
    prompt: str
    fresh: str
    value: str
    expected: int
    action: str


def schedule(
    task: Task,
    the_sessions: Sequence[Session],
    strategy: str,
    rate: float,
    requests: int,
    *,
    seed: int = 0,
    compaction: Compaction = DEFAULT_COMPACTION,
    count_tokens: Callable[[str], int] | None = None,
) -> tuple[list[str], list[Planned]]:
    """(each session's first prompt, the run's requests). Arrival times, sessions and values depend
    only on `seed` and `rate`, so every strategy answers the same stream of changes."""
    rng = random.Random(f"serve/plan/{seed}/{rate}")
    streams = [
        Values(task.with_template(0), random.Random(f"serve/values/{seed}/{s}"))
        for s in range(len(the_sessions))
    ]
    managers = [
        PromptManager(
            s.template,
            {s.field: s.initial},
            tail=s.tail,
            strategy=strategy,
            compaction=compaction,
            count_tokens=count_tokens or approx_tokens,  # the manager's own default where none is given
        )
        for s in the_sessions
    ]
    firsts = [m.render() for m in managers]
    out, t = [], 0.0
    for _ in range(requests):
        t += rng.expovariate(rate)
        s = rng.randrange(len(managers))
        m, sess = managers[s], the_sessions[s]
        value = streams[s].next(m.values[sess.field])
        action = m.update(sess.field, value)
        out.append(Planned(t, s, m.render(), m.fresh(), value, streams[s].outcome(value), action))
    return firsts, out
