"""Where an engine call's seconds go, phase by phase.

The engine marks its phases with `phase(name)` (`PHASES`): the plan, the overlay of patched slots,
the embedding, each layer's keys (window and mask) and slots taken, its attention and MLP, the
readout and the write-back. `phases(fn)` runs `fn()` once under torch's profiler with the marks on
and returns, per phase, its wall seconds and how much of them ran inside torch operators: the rest
is Python, dispatch and allocation between operators, the part of the engine that is not compute.
What ran outside every phase (the batching, the loops around them) is reported apart.

    from kvnotes.engine.phases import phases
    report = phases(lambda: decide_patched(model, nb_old, nb_new, specs, prompt))
    print(report.table())

Off (the default), a mark is one global test and a shared no-op context. Under the profiler each
operator costs a few microseconds more, so shares are read within one report, and seconds against
the unprofiled timings beside them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

PHASES = ("plan", "overlay", "embed", "keys", "slots", "attention", "mlp", "readout", "write_back")
PREFIX = "kvnotes."  # a phase's name in the profiler's events
_NULL = nullcontext()
_on = False


def phase(name: str) -> AbstractContextManager:
    """Mark the block as the engine's phase `name` (one of `PHASES`) for `phases()`."""
    if not _on:
        return _NULL
    import torch

    return torch.profiler.record_function(PREFIX + name)


@dataclass(frozen=True)
class PhaseTime:
    """One phase over a `phases()` run: wall seconds inside it (every occurrence), the part inside
    torch operators, and its occurrences."""

    name: str
    seconds: float
    ops: float
    calls: int

    @property
    def other(self) -> float:
        """Seconds in the phase outside torch operators: Python, dispatch, allocation."""
        return self.seconds - self.ops

    def to_dict(self) -> dict:
        return {"seconds": self.seconds, "ops": self.ops, "calls": self.calls}


@dataclass(frozen=True)
class PhaseReport:
    """A `phases()` run: its wall seconds, each phase's, and the operators that ran outside every
    phase."""

    wall: float
    phases: tuple[PhaseTime, ...]
    ops_outside: float

    @property
    def outside(self) -> float:
        """Wall seconds outside every phase."""
        return self.wall - sum(p.seconds for p in self.phases)

    def to_dict(self) -> dict:
        return {
            "wall": self.wall,
            "phases": {p.name: p.to_dict() for p in self.phases},
            "ops_outside": self.ops_outside,
        }

    @classmethod
    def from_dict(cls, d: dict) -> PhaseReport:
        got = tuple(PhaseTime(name=k, **v) for k, v in d["phases"].items())
        return cls(wall=d["wall"], phases=got, ops_outside=d["ops_outside"])

    def rows(self) -> list[tuple[str, float, float, float]]:
        """(phase, seconds, in operators, outside them), slowest first, then what ran outside the
        phases."""
        out = [(p.name, p.seconds, p.ops, p.other) for p in sorted(self.phases, key=lambda p: -p.seconds)]
        rest = self.outside - self.ops_outside
        return [*out, ("(outside the phases)", self.outside, self.ops_outside, rest)]

    def table(self, title: str = "") -> str:
        wall = self.wall or 1.0
        head = f"  {title + ' phase':<24}{'seconds':>9}{'share':>8}{'in ops':>9}{'not ops':>9}"
        lines = [head]
        for name, s, ops, other in self.rows():
            lines.append(f"  {name:<24}{s:>9.4f}{s / wall:>8.1%}{ops:>9.4f}{other:>9.4f}")
        return "\n".join(lines)


def phases(fn: Callable[[], Any]) -> PhaseReport:
    """Run `fn()` once under torch's CPU profiler with the engine's phase marks on."""
    import torch

    global _on
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        _on = True
        try:
            start = time.perf_counter()
            fn()
            wall = time.perf_counter() - start
        finally:
            _on = False
    totals: dict[str, list[float]] = {}
    ops_outside = 0.0
    for ev in prof.events():
        if ev.name.startswith(PREFIX):
            t = totals.setdefault(ev.name[len(PREFIX) :], [0.0, 0.0, 0])
            t[0] += ev.cpu_time_total / 1e6
            t[1] += (ev.cpu_time_total - ev.self_cpu_time_total) / 1e6
            t[2] += 1
        elif ev.cpu_parent is None:  # a top-level operator, in no phase
            ops_outside += ev.cpu_time_total / 1e6
    got = tuple(PhaseTime(name=k, seconds=s, ops=o, calls=int(c)) for k, (s, o, c) in totals.items())
    return PhaseReport(wall=wall, phases=got, ops_outside=ops_outside)
