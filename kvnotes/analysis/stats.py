"""The statistics every result reports: `Estimate` (per-prompt values, their mean and a bootstrap 95%
CI, clustered by template where pairs share one) and `Curve` (an Estimate at each x of a sweep), with
the percentile and cluster bootstraps behind them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

N_RESAMPLES = 2000
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Estimate:
    """Per-prompt `values`, their `mean` and a bootstrap 95% CI of the mean.

    Undefined figures (no values; a CI from fewer than two values) are None, never NaN. Values
    that are None, NaN or infinite (a recovery whose pair has no effect) are left out of the mean
    and counted in `dropped`, which tables and pages show whenever it is not 0.

    `clusters` labels each value with the group it came from (the template of its prompt pair):
    pairs of one template are not independent, so with two or more clusters the CI resamples
    clusters, then values within them (`cluster_bootstrap_ci`); otherwise it is the percentile
    bootstrap over values (`bootstrap_ci`).

    >>> e = Estimate.of([0.9, 1.0, 1.1, 1.0, float("nan")])
    >>> round(e.mean, 3), e.n, e.dropped, e.ci[0] <= e.mean <= e.ci[1]
    (1.0, 4, 1, True)
    >>> c = Estimate.of([0.9, 1.0, None, 1.9, 2.0], clusters=[0, 0, 1, 1, 1])
    >>> c.values, c.clusters, c.dropped  # exact: the values given
    ((0.9, 1.0, 1.9, 2.0), (0, 0, 1, 1), 1)
    """

    values: tuple[float, ...]
    mean: float | None
    ci: tuple[float, float] | None
    dropped: int = 0  # values given that were None or not finite
    clusters: tuple[int, ...] | None = None  # one label per value (its pair's template), if given

    @classmethod
    def of(
        cls, values: Sequence[float | None], *, seed: int = 0, clusters: Sequence[int] | None = None
    ) -> Estimate:
        given = list(values)
        if clusters is not None and len(clusters) != len(given):
            raise ValueError(f"{len(clusters)} cluster labels for {len(given)} values; give one per value")
        finite = [(i, float(v)) for i, v in enumerate(given) if v is not None and math.isfinite(float(v))]
        keep = [i for i, _ in finite]
        vals = tuple(v for _, v in finite)
        labels = None if clusters is None else tuple(int(clusters[i]) for i in keep)
        dropped = len(given) - len(vals)
        if not vals:
            return cls(values=(), mean=None, ci=None, dropped=dropped, clusters=labels)
        if labels is not None and len(set(labels)) >= 2:
            ci = cluster_bootstrap_ci(vals, labels, seed=seed)
        else:
            ci = bootstrap_ci(vals, seed=seed)
        return cls(values=vals, mean=float(np.mean(vals)), ci=ci, dropped=dropped, clusters=labels)

    @property
    def n(self) -> int:
        return len(self.values)

    def to_dict(self) -> dict:
        out = {"mean": self.mean, "ci": list(self.ci) if self.ci else None, "values": list(self.values)}
        if self.dropped:
            out["dropped"] = self.dropped
        if self.clusters is not None:
            out["clusters"] = list(self.clusters)
        return out

    @classmethod
    def from_dict(cls, d: Mapping) -> Estimate:
        ci = tuple(d["ci"]) if d["ci"] else None
        clusters = d.get("clusters")
        return cls(
            values=tuple(d["values"]),
            mean=d["mean"],
            ci=ci,
            dropped=d.get("dropped", 0),
            clusters=None if clusters is None else tuple(int(c) for c in clusters),
        )

    def __str__(self) -> str:
        dropped = f" ({self.dropped} undefined or non-finite left out)" if self.dropped else ""
        if self.mean is None:
            return "undefined (no usable prompts)" + dropped
        ci = f"[{self.ci[0]:+.3f}, {self.ci[1]:+.3f}]" if self.ci else "[n<2]"
        return f"{self.mean:+.3f} {ci} n={self.n}" + dropped


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


def cluster_bootstrap_ci(
    values: Sequence[float], clusters: Sequence[int], *, seed: int = 0, confidence: float = CONFIDENCE
) -> tuple[float, float] | None:
    """Two-stage percentile bootstrap CI of the mean of `values` grouped by `clusters`: each of
    `N_RESAMPLES` resamples draws as many clusters as there are, with replacement, then within each
    drawn cluster as many of its values as it has, with replacement, and takes the mean of all
    values drawn. None for fewer than 2 values.

    Values that agree within clusters and differ between them make it wider than `bootstrap_ci`,
    which takes them as independent:

    >>> x = [0.0, 0.0, 0.1, 1.0, 1.0, 1.1]
    >>> lo, hi = cluster_bootstrap_ci(x, [0, 0, 0, 1, 1, 1])
    >>> naive = bootstrap_ci(x)
    >>> round(lo, 2), round(hi, 2), hi - lo > naive[1] - naive[0]
    (0.02, 1.05, True)
    """
    x = np.asarray(values, dtype=np.float64)
    if x.size < 2:
        return None
    if np.all(x == x[0]):
        return (float(x[0]), float(x[0]))
    _, label = np.unique(np.asarray(clusters), return_inverse=True)
    sizes = np.bincount(label)  # [g]
    g, width = len(sizes), int(sizes.max())
    table = np.zeros((g, width))  # cluster c's values, left-aligned, padded
    table[label, _rank_within(label)] = x
    rng = np.random.default_rng(seed)
    picked = rng.integers(0, g, size=(N_RESAMPLES, g))  # stage 1: clusters
    n = sizes[picked]  # [r, g] values to draw from each picked cluster
    idx = (rng.random((N_RESAMPLES, g, width)) * n[..., None]).astype(np.int64)  # stage 2
    drawn = table[picked[..., None], idx] * (np.arange(width) < n[..., None])
    means = drawn.sum((1, 2)) / n.sum(1)
    tail = (1 - confidence) / 2
    lo, hi = np.quantile(means, [tail, 1 - tail])
    return (float(lo), float(hi))


def _rank_within(label: np.ndarray) -> np.ndarray:
    """For each element, how many earlier elements share its label (its column in a padded table)."""
    out = np.zeros(len(label), dtype=np.int64)
    seen: dict[int, int] = {}
    for i, c in enumerate(label.tolist()):
        out[i] = seen.get(c, 0)
        seen[c] = out[i] + 1
    return out


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
        cls,
        x_name: str,
        x: Sequence[int | float],
        values: Sequence[Sequence[float | None]],
        *,
        seed: int = 0,
        clusters: Sequence[int] | None = None,
    ) -> Curve:
        """`clusters`: one label per value of each list (every list runs over the same prompts);
        a None value (a pair that could not be measured) is dropped, as `Estimate.of` drops it."""
        if len(x) != len(values):
            raise ValueError(f"{len(x)} x values but {len(values)} lists of values")
        points = tuple(Estimate.of(v, seed=seed, clusters=clusters) for v in values)
        return cls(x_name=x_name, x=tuple(x), points=points)

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
            **({"dropped": [p.dropped for p in self.points]} if any(p.dropped for p in self.points) else {}),
            **(
                {"clusters": [None if p.clusters is None else list(p.clusters) for p in self.points]}
                if any(p.clusters is not None for p in self.points)
                else {}
            ),
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> Curve:
        dropped = d.get("dropped") or [0] * len(d["mean"])
        clusters = d.get("clusters") or [None] * len(d["mean"])
        pts = tuple(
            Estimate.from_dict({"mean": m, "ci": c, "values": v, "dropped": k, "clusters": g})
            for m, c, v, k, g in zip(d["mean"], d["ci"], d["values"], dropped, clusters)
        )
        return cls(x_name=d["x_name"], x=tuple(d["x"]), points=pts)

    def __str__(self) -> str:
        """One line: the x name, then each x (3 significant figures) and its mean."""
        pts = ", ".join(
            f"{x:.3g} → {'n/a' if p.mean is None else f'{p.mean:+.2f}'}" for x, p in zip(self.x, self.points)
        )
        return f"{self.x_name}: {pts}" if pts else f"{self.x_name}: no points"
