"""Where an analysis's seconds go: every `run()` call inside `with profile() as p:`, by operation.

    from kvnotes.engine.profile import profile
    with profile() as p:
        run_probes(model, "order-cancel", n=8)
    print(p.table())          # per analysis and operation: calls, rows, tokens computed, seconds

Each record is one top-level `run()` (a chunked prefill counts once): the operation that called it
(`prefill`, `decide`, `recompute`, ...), the analysis it ran under (`label`), its batch rows,
computed tokens, slots read, seconds and the floating-point work of its matmuls (`gflop`, counted
from the model's widths by `matmul_flops`): the table's GFLOP/s is how near a call ran to the
machine's matmul rate, so what is left to gain by doing the same work faster can be read off.
Off (the default), `run()` pays one `is None` test.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType

_WRAPPERS = {"contextlib", "jaxtyping", "beartype"}  # their frames wrap a call: the caller is above them
# a module whose globals set this true wraps the calls it passes on (the tests' run-time type checks,
# tests/typechecks.py): the engine's stack readers pass over its frames, as over jaxtyping's
WRAPPER_MARK = "__kvnotes_wrapper__"


def wraps_calls(frame: FrameType) -> bool:
    """Whether `frame` belongs to a module that declares itself a wrapper (`WRAPPER_MARK`)."""
    return frame.f_globals.get(WRAPPER_MARK) is True


_active: Profile | None = None
_label: str = ""
_depth = 0  # nested run() calls (a chunked prefill) are inside their caller's record


@dataclass(frozen=True)
class Call:
    """One top-level `run()`: who called it, under which analysis, its size and its seconds."""

    op: str
    label: str
    rows: int  # batch rows computed
    tokens: int  # tokens computed per row
    slots: int  # notebook slots read (plus overlay slots)
    seconds: float
    gflop: float = 0.0  # its matmuls' work (`matmul_flops`), 1e9 floating-point operations


def matmul_flops(facts, rows: int, tokens: int, slots: int, blocks: int, reads: int, cols: int) -> float:
    """Floating-point operations of one forward's matmuls: per computed token and block run, the
    Q/K/V and output projections, the MLP (three matrices when gated, else two; none in an
    attention-only model, `d_mlp` None) and attention's
    scores and mix over the slots and the causal half of the computed tokens; per read position,
    the unembedding of `cols` columns. Norms, RoPE and elementwise work are left out (a few percent
    of a block). `facts`: a `ModelFacts`.

    >>> from types import SimpleNamespace as F
    >>> f = F(d_model=4, n_heads=2, n_kv_heads=1, d_head=2, d_mlp=8, gated_mlp=True)
    >>> # 2 x (48 + 96 + 8 + 40): a sum of small integers, exact in floating point
    >>> matmul_flops(f, rows=1, tokens=1, slots=0, blocks=1, reads=1, cols=10)  # exact: small integers
    384.0
    """
    f = facts
    proj = f.d_model * (f.n_heads + 2 * f.n_kv_heads) * f.d_head + f.n_heads * f.d_head * f.d_model
    mlp = 0 if f.d_mlp is None else (3 if f.gated_mlp else 2) * f.d_model * f.d_mlp  # None: attention-only
    attn = 2 * f.n_heads * f.d_head * (slots + (tokens + 1) / 2)
    return 2.0 * rows * (tokens * blocks * (proj + mlp + attn) + reads * cols * f.d_model)


@dataclass
class Profile:
    """The `Call`s recorded inside one `profile()` block, and tables of them."""

    calls: list[Call] = field(default_factory=list)

    def by(self, *keys: str) -> dict[tuple, dict[str, int | float]]:
        """Totals (calls, rows, tokens as rows x tokens, seconds, gflop) grouped by the `Call`
        fields `keys`."""
        out: dict[tuple, dict[str, int | float]] = defaultdict(
            lambda: dict(calls=0, rows=0, tokens=0, seconds=0.0, gflop=0.0)
        )
        for c in self.calls:
            row = out[tuple(getattr(c, k) for k in keys)]
            row["calls"] += 1
            row["rows"] += c.rows
            row["tokens"] += c.rows * c.tokens
            row["seconds"] += c.seconds
            row["gflop"] += c.gflop
        return dict(out)

    @property
    def seconds(self) -> float:
        return sum(c.seconds for c in self.calls)

    @property
    def gflop(self) -> float:
        return sum(c.gflop for c in self.calls)

    def table(self, keys: tuple[str, ...] = ("label", "op")) -> str:
        """A plain-text table of `by(*keys)`, slowest first, with each group's share of the time,
        its matmuls' work and the rate it ran them at."""
        rows = sorted(self.by(*keys).items(), key=lambda kv: -kv[1]["seconds"])
        total = self.seconds or 1.0
        head = (
            f"{' / '.join(keys):<40} {'calls':>7} {'rows':>8} {'tokens':>10} {'seconds':>9} {'share':>6}"
            f" {'GFLOP':>8} {'GFLOP/s':>8}"
        )
        lines = [head, "-" * len(head)]
        for k, r in rows:
            name = " / ".join(str(x) for x in k)
            rate = r["gflop"] / r["seconds"] if r["seconds"] > 0 else 0.0
            lines.append(
                f"{name:<40} {r['calls']:>7} {r['rows']:>8} {r['tokens']:>10} "
                f"{r['seconds']:>9.2f} {r['seconds'] / total:>6.1%} {r['gflop']:>8.1f} {rate:>8.1f}"
            )
        return "\n".join(lines)


@contextmanager
def profile() -> Iterator[Profile]:
    """Record every top-level `run()` inside the block (see the module docstring)."""
    global _active
    before, _active = _active, Profile()
    try:
        yield _active
    finally:
        _active = before


@contextmanager
def label(name: str) -> Iterator[None]:
    """Attribute the `run()` calls inside the block to `name` (the analysis runner labels each analysis)."""
    global _label
    before, _label = _label, name
    try:
        yield
    finally:
        _label = before


@contextmanager
def record(rows: int, tokens: int, slots: int, gflop: float = 0.0) -> Iterator[None]:
    """Time one `run()` (called from outside the engine) into the active profile; a nested run
    (a chunk of a long prefill) is part of its caller's record."""
    global _depth
    if _active is None or _depth:
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return
    op = _caller()
    _depth += 1
    start = time.perf_counter()
    try:
        yield
    finally:
        _depth -= 1
        _active.calls.append(Call(op, _label, rows, tokens, slots, time.perf_counter() - start, gflop))


def active() -> bool:
    return _active is not None


def _caller() -> str:
    """The first function on the stack outside the engine and the wrappers around calls (context
    managers, run-time type checkers): the operation that called `run`."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and (_passes_through(frame.f_globals.get("__name__", "")) or wraps_calls(frame)):
        frame = frame.f_back
    return frame.f_code.co_name if frame is not None else "?"


def _passes_through(module: str) -> bool:
    engine = module == "kvnotes.engine" or module.startswith("kvnotes.engine.")
    return engine or module.split(".")[0] in _WRAPPERS


__all__ = [
    "WRAPPER_MARK",
    "Call",
    "Profile",
    "active",
    "label",
    "matmul_flops",
    "profile",
    "record",
    "wraps_calls",
]
