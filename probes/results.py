"""Typed, JSON-serialisable probe results: per-prompt values, their mean, a bootstrap 95% CI.

A `ProbeResult` holds one or more named `Estimate`s ("parts") and says which one is its
headline; `to_dict()` puts the headline's `mean`/`ci`/`values` at the top level and every part
under its own name in the same shape, so `{"mean", "ci", "values"}` reads the same everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvnotes.display import Displayable

N_RESAMPLES = 2000
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Estimate:
    """Per-prompt `values`, their `mean` and a percentile-bootstrap 95% CI of the mean.

    Undefined figures (no values; a CI from fewer than two values) are None, never NaN.

    >>> e = Estimate.of([0.9, 1.0, 1.1, 1.0])
    >>> round(e.mean, 3), e.n, e.ci[0] <= e.mean <= e.ci[1]
    (1.0, 4, True)
    """

    values: tuple[float, ...]
    mean: float | None
    ci: tuple[float, float] | None

    @classmethod
    def of(cls, values: Sequence[float], *, seed: int = 0) -> Estimate:
        vals = tuple(float(v) for v in values if v is not None and math.isfinite(float(v)))
        if not vals:
            return cls(values=(), mean=None, ci=None)
        return cls(values=vals, mean=float(np.mean(vals)), ci=bootstrap_ci(vals, seed=seed))

    @property
    def n(self) -> int:
        return len(self.values)

    def to_dict(self) -> dict:
        return {"mean": self.mean, "ci": list(self.ci) if self.ci else None, "values": list(self.values)}

    @classmethod
    def from_dict(cls, d: Mapping) -> Estimate:
        return cls(values=tuple(d["values"]), mean=d["mean"], ci=tuple(d["ci"]) if d["ci"] else None)

    def __str__(self) -> str:
        if self.mean is None:
            return "undefined (no usable prompts)"
        ci = f"[{self.ci[0]:+.3f}, {self.ci[1]:+.3f}]" if self.ci else "[n<2]"
        return f"{self.mean:+.3f} {ci} n={self.n}"


def bootstrap_ci(
    values: Sequence[float], *, seed: int = 0, confidence: float = CONFIDENCE
) -> tuple[float, float] | None:
    """Percentile bootstrap CI of the mean (scipy.stats.bootstrap), None for fewer than 2 values."""
    from scipy.stats import bootstrap

    x = np.asarray(values, dtype=np.float64)
    if x.size < 2:
        return None
    if np.all(x == x[0]):  # every resample has the same mean
        return (float(x[0]), float(x[0]))
    res = bootstrap(
        (x,),
        np.mean,
        n_resamples=N_RESAMPLES,
        confidence_level=confidence,
        method="percentile",
        random_state=np.random.default_rng(seed),
    )
    return (float(res.confidence_interval.low), float(res.confidence_interval.high))


@dataclass(frozen=True)
class Curve:
    """One Estimate per value of `x` (e.g. recovery against the number of heads patched, k).

    >>> c = Curve.of("k", [1, 2], [[0.1, 0.3], [0.5, 0.7]])
    >>> c.x, [round(e.mean, 2) for e in c.points]
    ((1, 2), [0.2, 0.6])
    """

    x_name: str
    x: tuple[int | float, ...]
    points: tuple[Estimate, ...]

    @classmethod
    def of(
        cls, x_name: str, x: Sequence[int | float], values: Sequence[Sequence[float]], *, seed: int = 0
    ) -> Curve:
        if len(x) != len(values):
            raise ValueError(f"{len(x)} x values but {len(values)} lists of values")
        return cls(x_name=x_name, x=tuple(x), points=tuple(Estimate.of(v, seed=seed) for v in values))

    @property
    def means(self) -> list[float | None]:
        return [p.mean for p in self.points]

    def to_dict(self) -> dict:
        return {
            "x_name": self.x_name,
            "x": list(self.x),
            "mean": self.means,
            "ci": [list(p.ci) if p.ci else None for p in self.points],
            "values": [list(p.values) for p in self.points],
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> Curve:
        pts = tuple(
            Estimate.from_dict({"mean": m, "ci": c, "values": v})
            for m, c, v in zip(d["mean"], d["ci"], d["values"])
        )
        return cls(x_name=d["x_name"], x=tuple(d["x"]), points=pts)

    def __str__(self) -> str:
        return "  ".join(
            f"{self.x_name}={x:g}: {'n/a' if p.mean is None else f'{p.mean:+.2f}'}"
            for x, p in zip(self.x, self.points)
        )


@dataclass(frozen=True)
class ProbeResult(Displayable):
    """One probe's figures: named `parts` (each an Estimate over prompts), with `headline` the
    part whose mean is the probe's `mean`. `details` holds JSON-safe extras (per-prompt maps,
    token strings, excluded prompts) for reports and dashboards."""

    name: str
    headline: str
    parts: Mapping[str, Estimate]
    details: Mapping = field(default_factory=dict)
    description: str = ""
    curves: Mapping[str, Curve] = field(default_factory=dict)
    tables: Mapping[str, list] = field(default_factory=dict)

    def __post_init__(self):
        if self.headline not in self.parts:
            raise ValueError(f"headline {self.headline!r} is not one of the parts {list(self.parts)}")
        names = [*self.parts, *self.curves, *self.tables]
        clash = {n for n in names if names.count(n) > 1} | (set(names) & _RESERVED)
        if clash:
            raise ValueError(
                f"part, curve and table names must be distinct and not reserved: {sorted(clash)}"
            )

    @property
    def estimate(self) -> Estimate:
        return self.parts[self.headline]

    @property
    def mean(self) -> float | None:
        return self.estimate.mean

    def __getitem__(self, part: str) -> Estimate:
        return self.parts[part]

    def to_dict(self) -> dict:
        return {
            **self.estimate.to_dict(),
            "headline": self.headline,
            "description": self.description,
            **{k: v.to_dict() for k, v in self.parts.items()},
            **{k: v.to_dict() for k, v in self.curves.items()},
            **{k: list(v) for k, v in self.tables.items()},
            "details": dict(self.details),
        }

    @classmethod
    def from_dict(cls, name: str, d: Mapping) -> ProbeResult:
        rest = {k: v for k, v in d.items() if k not in _RESERVED}
        parts = {k: Estimate.from_dict(v) for k, v in rest.items() if isinstance(v, Mapping) and "x" not in v}
        curves = {k: Curve.from_dict(v) for k, v in rest.items() if isinstance(v, Mapping) and "x" in v}
        tables = {k: list(v) for k, v in rest.items() if isinstance(v, list)}
        return cls(
            name=name,
            headline=d["headline"],
            parts=parts,
            details=d.get("details", {}),
            description=d.get("description", ""),
            curves=curves,
            tables=tables,
        )

    def __repr__(self) -> str:
        return f"ProbeResult({self.name}: {self.headline} {self.estimate}; parts {list(self.parts)})"

    def rows(self) -> list[tuple[str, str]]:
        return [
            (f"{self.name}.{k}" + (" *" if k == self.headline else ""), str(v)) for k, v in self.parts.items()
        ] + [(f"{self.name}.{k}", str(v)) for k, v in self.curves.items()]


_RESERVED = {"mean", "ci", "values", "headline", "description", "details"}


@dataclass(frozen=True)
class ProbeReport(Displayable):
    """Every probe run on one model and task, with the run's sizes and seed."""

    model: str
    task: str
    n: int
    seed: int
    probes: Mapping[str, ProbeResult]
    meta: Mapping = field(default_factory=dict)  # versions, machine, timings, min_effect, ...

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "task": self.task,
            "n": self.n,
            "seed": self.seed,
            "probes": {k: v.to_dict() for k, v in self.probes.items()},
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> ProbeReport:
        return cls(
            model=d["model"],
            task=d["task"],
            n=d["n"],
            seed=d["seed"],
            probes={k: ProbeResult.from_dict(k, v) for k, v in d["probes"].items()},
            meta=d.get("meta", {}),
        )

    def __repr__(self) -> str:
        return self.table()

    def table(self) -> str:
        """A readable table: one row per figure, the headline of each probe starred."""
        rows = [r for p in self.probes.values() for r in p.rows()]
        width = max([len(a) for a, _ in rows] + [10])
        head = f"{self.model} · task {self.task} · n={self.n} · seed {self.seed}   (mean [95% CI] n)"
        lines = [head, "-" * len(head)]
        lines += [f"{a:<{width}}  {b}" for a, b in rows]
        return "\n".join(lines)
