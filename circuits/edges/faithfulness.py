"""How faithful a circuit is, measured out of sample: each pair's circuits are chosen on the other
half of the pairs (`cross_fit`), patched on that pair, and summarised over the sizes as CPR (the
area under the faithfulness curve) and CMD (the area between it and 1), both ways: per pair and
then averaged (our headline), and on the dataset's means as MIB does (Mueller et al. 2025). Also
AtP*'s false-negative diagnostic for the edges a method left unverified (`block_bound`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from circuits.edges.patcher import EdgePatcher
from kvnotes.analysis.stats import Estimate

BOOTSTRAP = 2000  # resamples of the pairs behind a dataset-mean figure's CI


def cross_fit(n_pairs: int) -> list[np.ndarray]:
    """For each pair, the pairs its circuits are chosen on: the other half (pairs alternate
    between two halves), never itself. Empty when there are fewer than two pairs: then no pair has
    another to be chosen on, and an in-sample figure would flatter the method."""
    if n_pairs < 2:
        return []
    half = np.arange(n_pairs) % 2
    return [np.flatnonzero(half != half[i]) for i in range(n_pairs)]


def area(sizes: Sequence[int], values: Sequence[float] | np.ndarray, n_edges: int) -> tuple[float, float]:
    """(CPR, CMD) of one faithfulness curve: the area under it over the fraction of edges kept, and
    the area between it and 1 (MIB's two summaries; trapezoids)."""
    x = np.asarray(sizes, dtype=float) / n_edges
    f = np.asarray(values, dtype=float)
    return float(np.trapezoid(f, x)), float(np.trapezoid(np.abs(1 - f), x))


def dataset_curve(recovery: np.ndarray, effects: np.ndarray) -> np.ndarray:
    """MIB's faithfulness at each size, (mean m(C) - mean m(empty)) / (mean m(full) - mean m(empty)),
    from each pair's recovery [pairs, sizes] and effect m(full) - m(empty) [pairs]: the recoveries
    weighted by the effects. Each pair's metric is oriented toward its new answer (MIB's logit
    difference of the clean answer over the counterfactual's), so the weights are |effect|: a
    pair's recovery does not depend on the orientation, its effect's sign does."""
    w = np.abs(effects)
    return (recovery * w[:, None]).sum(0) / w.sum()


def dataset_areas(
    sizes: Sequence[int], recovery: np.ndarray, effects: np.ndarray, n_edges: int, *, seed: int = 0
) -> tuple[Estimate, Estimate]:
    """CPR and CMD on the dataset's means (MIB's definitions), with percentile-bootstrap CIs over
    resampled pairs (each resample's curve from its own means)."""
    recovery, effects = np.asarray(recovery, dtype=float), np.asarray(effects, dtype=float)
    if not len(effects):
        return Estimate.of([]), Estimate.of([])
    point = area(sizes, dataset_curve(recovery, effects), n_edges)
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(BOOTSTRAP if len(effects) > 1 else 0):
        i = rng.integers(0, len(effects), len(effects))
        if np.abs(effects[i]).sum() > 0:
            draws.append(area(sizes, dataset_curve(recovery[i], effects[i]), n_edges))
    out = []
    for j in range(2):
        q = np.percentile([d[j] for d in draws], [2.5, 97.5]) if draws else None
        ci = (float(q[0]), float(q[1])) if q is not None else None
        out.append(Estimate(values=(point[j],), mean=point[j], ci=ci))
    return out[0], out[1]


@dataclass(frozen=True)
class BlockBound:
    """AtP*'s diagnostic for the edges a method left unverified: the unverified edges cut into 2, 4,
    ..., 2**levels random blocks (a fresh random partition per level), each block corrupted jointly
    and exactly. If effects within a block do not cancel, no edge's |effect| exceeds its block's, so
    an edge's `bound` is the least |joint effect| of its blocks (recovery units)."""

    verified: np.ndarray  # edge indices patched one by one (the method's top edges)
    unverified: np.ndarray  # the others
    bound: np.ndarray  # per unverified edge
    rows: int  # joint patches it cost

    def ruled_out(self, theta: float) -> float:
        """The share of unverified edges whose bound is below `theta`: ruled out of effect `theta`."""
        return float(np.mean(self.bound < theta)) if len(self.bound) else 1.0


def block_bound(
    patcher: EdgePatcher, scores: np.ndarray, verified: int, rng: np.random.Generator, *, levels: int = 5
) -> BlockBound:
    """`BlockBound` of the edges outside the `verified` largest |scores|."""
    order = np.argsort(-np.abs(scores), kind="stable")
    top, rest = order[:verified], order[verified:]
    keep, members = [], []
    for j in range(1, levels + 1):
        for block in np.array_split(rng.permutation(rest), min(2**j, max(1, len(rest)))):
            row = np.ones(len(scores), dtype=bool)
            row[block] = False
            keep.append(row)
            members.append(block)
    bound = np.full(len(scores), np.inf)
    if keep:
        joint = np.abs(1.0 - patcher.patch(np.stack(keep)))
        for block, e in zip(members, joint):
            bound[block] = np.minimum(bound[block], e)
    return BlockBound(verified=top, unverified=rest, bound=bound[rest], rows=len(keep))
