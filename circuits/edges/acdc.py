"""ACDC (Conmy et al. 2023, "Towards Automated Circuit Discovery for Mechanistic Interpretability") on
the notebook's edge graph: prune edges from the logit backwards, removing an edge for good where
corrupting it (on top of every edge already removed) moves the decision less than a threshold tau.

- **Order.** ACDC visits the graph's nodes in reverse topological order (the logit first, then each
  layer from the last: its MLP, its query heads, then its KV heads) and, at each node, the edges
  into it, latest source first (`visiting_order`).
- **Metric.** The decision's recovery toward the clean (new) prompt, averaged over the pairs: 1 with
  every edge, 0 with none (`EdgePatcher.patch`). An edge goes where |recovery without it - recovery
  now| < tau; tau is in units of the pair's effect.
- **A threshold sweep** (`acdc_scores`) runs ACDC at each tau of a grid and gives each edge the
  largest tau at which it survives (0: removed at every tau of the grid), the score InterpBench's
  ROC over ACDC's thresholds ranks by.

The engine's part: every candidate is a forward of the computed tokens only, against the shared
prefix's notebook, and starts at the lowest block that reads a removed edge, from the clean run's
residual there (`EdgePatcher.first_layer`): visiting from the logit down, most candidates run only
the last blocks. Candidates are evaluated a chunk at a time, row j removing the chunk's first j + 1
edges (what ACDC computes if each of them goes); the first edge that stays ends the chunk, and the
next chunk starts after it, so the decisions are ACDC's own, one by one (a chunk is twice the last
run of decisions, 8 to 256 rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
from tqdm.auto import tqdm

from circuits.edges.graph import EdgeGraph
from kvnotes.errors import BadArgument

THRESHOLDS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3)  # tau, in units of the pair's effect
CHUNK = 32  # candidates evaluated in the first forward (rows); then twice the last run of removals
MAX_CHUNK = 256

# a node's place in a topological order within its layer: the KV heads feed the query heads
# (attention edges), which feed the MLP; the embeddings come before every layer, the logit after
_RANK = {"emb": 0, "kv": 1, "head": 2, "mlp": 3, "logit": 4}


def visiting_order(graph) -> np.ndarray:
    """Every edge in ACDC's order: destinations in reverse topological order, and each destination's
    incoming edges latest source first (ties: by index, highest first, then by position group)."""

    def place(n: int) -> tuple:
        node = graph.nodes[n]
        return (node.layer, _RANK[node.kind], node.index, node.group)

    key = [(place(int(d)), place(int(s))) for s, d in zip(graph.src, graph.dst)]
    return np.array(sorted(range(len(graph)), key=lambda e: key[e], reverse=True), dtype=np.int64)


@runtime_checkable
class Patching(Protocol):
    """What ACDC needs of a pair: its edge graph and each circuit's recovery (`EdgePatcher`, or the
    plain TransformerLens way it is benched against, `circuits.acdc_peer.TLEdgePatch`)."""

    graph: EdgeGraph

    def patch(self, circuits: np.ndarray, *, batch: int) -> np.ndarray: ...


@dataclass(frozen=True)
class ACDCRun:
    """One ACDC run: the edges kept at `tau`, the recovery of that circuit, and the forwards it took."""

    tau: float
    kept: np.ndarray  # bool per edge
    recovery: float
    forwards: int
    visited: int  # edges decided (all of them unless the run was stopped at a forward limit)

    @property
    def size(self) -> int:
        return int(self.kept.sum())


def _recovery(patchers: Sequence[Patching], circuits: np.ndarray) -> np.ndarray:
    """Each row's recovery, averaged over the pairs."""
    return np.mean([p.patch(circuits, batch=len(circuits)) for p in patchers], axis=0)


def acdc(
    patchers: Sequence[Patching],
    tau: float,
    *,
    order: np.ndarray | None = None,
    chunk: int = CHUNK,
    limit: int | None = None,
    progress: bool = False,
) -> ACDCRun:
    """ACDC at threshold `tau` over `patchers` (one pair each, the same model): the circuit it keeps.
    `limit`: stop after that many forwards, the edges not yet visited kept (a bench's sample of a
    long run); `progress`: a bar over the edges visited (a large model's run takes minutes)."""
    if not patchers:
        raise BadArgument("ACDC needs at least one pair's EdgePatcher")
    if not tau >= 0:
        raise BadArgument(f"tau must be a threshold of at least 0 (units of the pair's effect), got {tau}")
    graph = patchers[0].graph
    order = visiting_order(graph) if order is None else np.asarray(order, dtype=np.int64)
    keep = np.ones(len(graph), dtype=bool)
    now = float(_recovery(patchers, keep[None])[0])
    forwards, i = 1, 0
    bar = tqdm(
        total=len(order), desc=f"ACDC tau {tau:g}", unit="edge", disable=not progress or None, leave=False
    )
    while i < len(order) and (limit is None or forwards < limit):
        cand, first = order[i : i + chunk], i
        rows = np.repeat(keep[None], len(cand), axis=0)
        for j, e in enumerate(cand):
            rows[j:, e] = False  # row j: the chunk's first j + 1 edges removed
        got = _recovery(patchers, rows)
        forwards += 1
        for j, e in enumerate(cand):
            i += 1
            if abs(float(got[j]) - now) < tau:  # corrupting it moves the decision less than tau
                keep[e], now = False, float(got[j])
            else:  # it stays; the rows after j assumed it gone
                break
        chunk = min(MAX_CHUNK, max(8, 2 * (i - first)))  # long runs of removals: longer chunks
        bar.update(i - first)
    bar.close()
    return ACDCRun(tau=float(tau), kept=keep, recovery=now, forwards=forwards, visited=i)


def acdc_scores(
    patchers: Sequence[Patching], thresholds: Sequence[float] = THRESHOLDS
) -> tuple[np.ndarray, list[ACDCRun]]:
    """ACDC at every threshold: each edge's score is the largest tau at which it survives (0 where
    it is removed at every tau), and the runs themselves."""
    taus = sorted(float(t) for t in thresholds)
    if not taus or taus[0] <= 0:
        raise BadArgument(f"the thresholds must be positive (at 0 every edge survives), got {thresholds}")
    runs = [acdc(patchers, t) for t in taus]
    score = np.zeros(len(patchers[0].graph))
    for run in runs:  # ascending: the last tau an edge survives is its largest
        score[run.kept] = run.tau
    return score, runs
