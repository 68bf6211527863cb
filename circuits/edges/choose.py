"""Circuits of a given size from edge scores: the top edges, a connected circuit grown from the
logit, and random circuits matched to a circuit bin by bin (the baseline its faithfulness is read
against)."""

from __future__ import annotations

import heapq

import numpy as np

from circuits.edges.graph import EdgeGraph

FRACTIONS = (0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # circuit sizes (MIB's grid)


def sizes_for(n_edges: int) -> list[int]:
    """Circuit sizes: `FRACTIONS` of the graph's edges (at least one edge where the fraction is > 0)."""
    out = []
    for f in FRACTIONS:
        k = n_edges if f == 1.0 else max(1, round(f * n_edges)) if f > 0 else 0
        if k not in out:
            out.append(k)
    return out


def top_circuit(scores: np.ndarray, k: int) -> np.ndarray:
    """The `k` edges of largest |score|."""
    keep = np.zeros(len(scores), dtype=bool)
    keep[np.argsort(-np.abs(scores), kind="stable")[:k]] = True
    return keep


def greedy_order(graph: EdgeGraph, scores: np.ndarray) -> np.ndarray:
    """The edges in the order a circuit grown from the logit adds them: each step the edge of largest
    |score| (the lowest index among ties) whose destination the circuit already reaches. Every
    greedy circuit is a prefix of it (a heap of the reachable edges: O(E log E), not O(E^2))."""
    mag = np.abs(scores)
    into = np.argsort(graph.dst, kind="stable")
    starts = np.searchsorted(graph.dst[into], np.arange(len(graph.nodes) + 1))
    reached = np.zeros(len(graph.nodes), dtype=bool)
    heap: list[tuple[float, int]] = []

    def reach(node: int) -> None:
        reached[node] = True
        for e in into[starts[node] : starts[node + 1]]:
            heapq.heappush(heap, (-float(mag[e]), int(e)))

    reach(graph.logit)
    order = []
    while heap:
        _, e = heapq.heappop(heap)
        order.append(e)
        if not reached[graph.src[e]]:
            reach(int(graph.src[e]))
    return np.asarray(order, dtype=np.int64)


def greedy_circuit(
    graph: EdgeGraph, scores: np.ndarray, k: int, order: np.ndarray | None = None
) -> np.ndarray:
    """A connected circuit of `k` edges grown from the logit (the first `k` of `greedy_order`)."""
    order = greedy_order(graph, scores) if order is None else order
    keep = np.zeros(len(graph), dtype=bool)
    keep[order[:k]] = True
    return keep


def matched_random(graph: EdgeGraph, circuit: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A random circuit matched to `circuit`: in each bin (edge kind, source and destination layer,
    source and destination group) as many edges as the circuit has there, drawn uniformly from the
    whole bin without replacement, the circuit's own edges allowed. So its size and make-up are the
    circuit's, only the choice of edges within each bin is random; the whole graph's match is the
    whole graph, and a bin the circuit fills is filled alike."""
    bin_id = match_bins(graph)
    out = np.zeros(len(graph), dtype=bool)
    chosen = np.flatnonzero(circuit)
    if not len(chosen):
        return out
    order = np.argsort(bin_id, kind="stable")
    sorted_bins = bin_id[order]
    bins, need = np.unique(bin_id[chosen], return_counts=True)
    lo = np.searchsorted(sorted_bins, bins, side="left")
    hi = np.searchsorted(sorted_bins, bins, side="right")
    for a, b, n in zip(lo, hi, need):
        out[rng.choice(order[a:b], size=int(n), replace=False)] = True
    return out


def match_bins(graph: EdgeGraph) -> np.ndarray:
    """Each edge's bin (kind, source and destination layer and group), kept on the graph: a report
    draws a matched circuit per size, draw and pair from the same graph."""
    if "_match_bins" not in graph.__dict__:
        sl, dl = graph.layers()
        sg, dg = graph.regions()
        _, bin_id = np.unique(np.stack([graph.kind, sl, dl, sg, dg], 1), axis=0, return_inverse=True)
        object.__setattr__(graph, "_match_bins", bin_id.reshape(-1))
    return graph.__dict__["_match_bins"]
