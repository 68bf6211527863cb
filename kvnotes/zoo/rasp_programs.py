"""Random small RASP programs that no one chose: the inputs the known-circuit builder is proven on.

`random_program(seed)` draws one program over categorical values: a few steps, each a `Map` or a
`SequenceMap` with a random table, an `Aggregate` that moves one value (its selector compares
indices with a random function of a value, or two random values by a random comparison), or a
`SelectorWidth` of a random selector; the answer is the last step, which reads the input tokens.
The same seed gives the same program. `programs(n, seed)` keeps drawing until it has `n` that
pass the checks a program needs before compiling (`screen`): it reads the tokens, its answer moves
when one token changes, every Aggregate moves one value (tracr cannot average categories), and its
answer at the last position needs no later position (`check_causal`). Compiling then decides the
rest (2 to 5 layers); `circuits.random_programs` scores the known circuits on them.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvnotes.errors import BadArgument
from kvnotes.zoo.tracr import MIXED, check_causal, make_evaluator, tracr_rasp

VOCAB = (0, 1, 2)
MAX_SEQ_LEN = 5
COMPARISONS = ("EQ", "LT", "LEQ", "GT", "GEQ", "NEQ", "TRUE")


@dataclass(frozen=True)
class Drawn:
    """One random program, its input values and the longest input it is compiled for."""

    seed: int
    program: Any
    vocab: tuple[int, ...]
    max_seq_len: int
    ops: tuple[str, ...]  # the steps' operations, in order

    @property
    def name(self) -> str:
        return f"random-{self.seed}"


class _Builder:
    def __init__(self, rng: random.Random, vocab: tuple[int, ...], max_seq_len: int):
        self.rasp = tracr_rasp()
        self.rng = rng
        self.n = max_seq_len
        # each available SOp with the values it can take
        self.pool: list[tuple[Any, frozenset]] = [
            (self.rasp.tokens, frozenset(vocab)),
            (self.rasp.indices, frozenset(range(max_seq_len))),
        ]
        self.ops: list[str] = []

    def pick(self, recent: bool = False):
        # lean on the newest steps, so that programs compose rather than fan out
        if recent or self.rng.random() < 0.6:
            return self.pool[-1] if len(self.pool) > 2 else self.rng.choice(self.pool[:1] + self.pool[2:])
        return self.rng.choice(self.pool)

    def table(self, domain, k: int) -> dict:
        return {x: self.rng.randrange(k) for x in sorted(domain, key=repr)}

    def add(self, sop, values) -> None:
        self.pool.append((self.rasp.categorical(sop), frozenset(values)))

    def map(self) -> None:
        sop, values = self.pick(recent=True)
        t = self.table(values, self.rng.choice((2, 3)))
        self.add(self.rasp.Map(lambda x, t=t: t.get(x, 0), sop, simplify=False), set(t.values()))
        self.ops.append("Map")

    def sequence_map(self) -> None:
        (a, va), (b, vb) = self.pick(recent=True), self.rng.choice(self.pool)
        if a is b:
            b, vb = self.pool[0] if a is not self.pool[0][0] else self.pool[1]
        k = self.rng.choice((2, 3))
        t = {(x, y): self.rng.randrange(k) for x in sorted(va, key=repr) for y in sorted(vb, key=repr)}
        self.add(self.rasp.SequenceMap(lambda x, y, t=t: t.get((x, y), 0), a, b), set(t.values()))
        self.ops.append("SequenceMap")

    def selector(self):
        (k, _), (q, _) = self.pick(), self.pick(recent=True)
        cmp = getattr(self.rasp.Comparison, self.rng.choice(COMPARISONS))
        return self.rasp.Select(k, q, cmp)

    def aggregate(self) -> None:
        sop, values = self.rng.choice(self.pool)
        if self.rng.random() < 0.7:  # each query names one key at or before it: a moved value
            src, vs = self.pick(recent=True)
            back = {x: self.rng.randrange(self.n) for x in sorted(vs, key=repr)}
            where = self.rasp.categorical(
                self.rasp.SequenceMap(lambda i, x, b=back: max(0, i - b.get(x, 0)), self.rasp.indices, src)
            )
            sel = self.rasp.Select(self.rasp.indices, where, self.rasp.Comparison.EQ)
            self.ops.append("SequenceMap")
        else:
            sel = self.selector()
        self.add(self.rasp.Aggregate(sel, sop), values)
        self.ops.append("Aggregate")

    def width(self) -> None:
        self.add(self.rasp.SelectorWidth(self.selector()), range(self.n + 1))
        self.ops.append("SelectorWidth")


def random_program(seed: int, *, vocab: tuple[int, ...] = VOCAB, max_seq_len: int = MAX_SEQ_LEN) -> Drawn:
    """One random program (2 to 5 steps, at least one an attention step), by seed."""
    rng = random.Random(seed)
    b = _Builder(rng, vocab, max_seq_len)
    steps = rng.randint(2, 5)
    kinds = [rng.choice(("map", "sequence_map", "aggregate", "width")) for _ in range(steps)]
    if not {"aggregate", "width"} & set(kinds):
        kinds[rng.randrange(steps)] = rng.choice(("aggregate", "width"))
    for kind in kinds:
        getattr(b, kind)()
    program = b.pool[-1][0].named(f"random_{seed}")
    return Drawn(seed, program, tuple(vocab), max_seq_len, tuple(b.ops))


def screen(d: Drawn, *, inputs: int = 64) -> str | None:
    """Why `d` cannot be a pair task's program, before compiling (None: it may be): it ignores the
    tokens, its answer never moves, an Aggregate would average categories, or it is not causal."""
    if "tokens" not in _reads(d.program):
        return "it ignores the tokens"
    rng = random.Random(d.seed)
    moved = False
    for _ in range(inputs):
        xs = [rng.choice(d.vocab) for _ in range(rng.randint(1, d.max_seq_len))]
        run = make_evaluator(causal=True)
        try:
            a = run.evaluate(d.program, xs)[-1]
        except (ValueError, TypeError):  # a Select compared an empty or mixed Aggregate's value
            return "a Select compares an empty or mixed Aggregate's value"
        flat = [v for vals in run.memo.values() for v in vals if not isinstance(v, list)]
        if any(v is MIXED for v in flat):
            return "an Aggregate would average different categories"
        if any(v is None for v in flat):
            return "an Aggregate selects no key"
        if len(xs) < 2:
            continue
        ys = list(xs)
        i = rng.randrange(len(xs) - 1)
        ys[i] = rng.choice([v for v in d.vocab if v != xs[i]])
        try:
            b = make_evaluator(causal=True).evaluate(d.program, ys)[-1]
        except (ValueError, TypeError):
            return "a Select compares an empty or mixed Aggregate's value"
        moved |= a is not None and b is not None and a != b
    if not moved:
        return "its answer never moves"
    try:
        check_causal(d.program, d.vocab, d.max_seq_len, seed=d.seed)
    except BadArgument:
        return "it is not causal"
    return None


def _reads(expr, seen: set | None = None) -> set[str]:
    seen = set() if seen is None else seen
    if expr.unique_id in seen:
        return set()
    seen.add(expr.unique_id)
    out = {expr.label}
    for c in expr.children:
        out |= _reads(c, seen)
    return out


def programs(n: int, *, seed: int = 0, tries: int = 100_000) -> Iterator[tuple[Drawn, dict[str, int]]]:
    """Random programs that pass `screen`, `n` of them, from seed `seed` on; each with the count of
    programs refused before it, by reason (a running total)."""
    refused: dict[str, int] = {}
    found = 0
    for s in range(seed, seed + tries):
        if found == n:
            return
        d = random_program(s)
        why = screen(d)
        if why is None:
            found += 1
            yield d, dict(refused)
        else:
            refused[why] = refused.get(why, 0) + 1


__all__ = ["COMPARISONS", "Drawn", "MAX_SEQ_LEN", "VOCAB", "programs", "random_program", "screen"]
