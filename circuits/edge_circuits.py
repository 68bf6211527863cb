"""The `edges` analysis: edge scores by EAP, EAP-IG and AtP* set against exact edge patching, and
circuits chosen on half the pairs, evaluated on the other half as faithfulness curves beside random
circuits matched in layers and region.

Per pair (`circuits.edges.edge_site`): every edge scored by each method, timed; exact patching of
every edge when the graph has at most `exhaustive` edges (default `EXHAUSTIVE`), else of a random
sample (for Spearman's rho) plus each method's top edges (for recall@k: then the exact top-k is the
top-k of what was patched, which can only flatter the methods: said in `details.recall_over`).
Then, cross-fitted: each pair's circuits of each size are the top edges by the *other* half's mean
|score| (and a connected circuit grown from the logit, `greedy`), and each is patched on that pair:
recovery toward the new decision with every edge outside the circuit carrying the old run's value.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from circuits.edges import ATTENTION, GROUPS, METHODS, EdgeGraph, EdgeSite, edge_site, score_edges
from kvnotes.analysis.registry import Context, analysis, option
from kvnotes.analysis.results import Curve, Estimate, ProbeResult
from kvnotes.errors import BadOption
from kvnotes.metrics import spearman
from probes.causal import effect_estimate, split_by_effect
from probes.trials import MIN_EFFECT, Pairs, Trial, clusters_of, shared_trials

EXHAUSTIVE = 4096  # graphs up to this many edges are patched edge by edge in full
FRACTIONS = (0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # circuit sizes (MIB's grid)
STEP_CHOICES = (2, 4, 8, 16, 32)
CONVERGED = 0.01  # IG steps are enough when doubling them moves no edge's score by more than this
_KEY = {"eap": "eap", "eap-ig": "eap_ig", "atp*": "atp"}
GRAPH_EDGES = 200  # edges the graph table keeps for drawing (the strongest by mean |score|)
GROUP_TOKENS = 48  # tokens of each position group the result keeps for reading the graph


def converged_steps(site: EdgeSite, *, tol: float = CONVERGED) -> tuple[int, list[dict]]:
    """The fewest EAP-IG steps of `STEP_CHOICES` whose scores move by less than `tol` (recovery units,
    the largest over edges) when the steps are doubled, and the table of every comparison."""
    prev, rows, chosen = None, [], None
    for s in STEP_CHOICES:
        sc = score_edges(site, "eap-ig", steps=s).scores
        if prev is not None:
            change = float(np.abs(sc - prev[1]).max())
            rows.append({"steps": prev[0], "doubled": s, "max_change": change})
            if chosen is None and change < tol:
                chosen = prev[0]
        prev = (s, sc)
    return (chosen if chosen is not None else STEP_CHOICES[-1]), rows


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
    logit = graph.logit
    reached = np.zeros(len(graph.nodes), dtype=bool)
    heap: list[tuple[float, int]] = []

    def reach(node: int) -> None:
        reached[node] = True
        for e in into[starts[node] : starts[node + 1]]:
            heapq.heappush(heap, (-float(mag[e]), int(e)))

    reach(logit)
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
    """As many edges as `circuit`, each drawn from the edges of the same kind, source and destination
    layer and source and destination group as one of the circuit's, outside the circuit where that bin
    has edges to spare (then from the same destination layer, then from any edge): so the random
    circuit of the whole graph is the whole graph. Drawn bin by bin (without replacement), not edge by
    edge."""
    bin_id, dl = _match_bins(graph)
    every = np.zeros(len(graph), dtype=np.int64)
    # each level: what a drawn edge must share with the circuit's edge, and whether it may be in the circuit
    levels = ((bin_id, False), (dl, False), (bin_id, True), (dl, True), (every, True))
    out = np.zeros(len(graph), dtype=bool)
    pending = np.flatnonzero(circuit)
    for key, inside in levels:
        if not len(pending):
            break
        order = np.argsort(key, kind="stable")
        sorted_keys = key[order]
        left = []
        groups, need = np.unique(key[pending], return_counts=True)
        for k, n in zip(groups, need):
            lo, hi = np.searchsorted(sorted_keys, [k, k + 1])
            pool = order[lo:hi]
            pool = pool[~out[pool] & (inside | ~circuit[pool])]
            take = min(int(n), len(pool))
            if take:
                out[rng.choice(pool, size=take, replace=False)] = True
            left += [k] * (int(n) - take)
        pending = _owners(key, pending, left)
    return out


def _match_bins(graph: EdgeGraph) -> tuple[np.ndarray, np.ndarray]:
    """Each edge's bin (kind, source and destination layer and group) and destination layer, kept
    on the graph: a report draws a matched circuit per size, draw and pair from the same graph."""
    if "_match_bins" not in graph.__dict__:
        sl, dl = graph.layers()
        sg, dg = graph.regions()
        _, bin_id = np.unique(np.stack([graph.kind, sl, dl, sg, dg], 1), axis=0, return_inverse=True)
        object.__setattr__(graph, "_match_bins", (bin_id.reshape(-1), dl))
    return graph.__dict__["_match_bins"]


def _owners(key: np.ndarray, pending: np.ndarray, left: list) -> np.ndarray:
    """Circuit edges still unmatched: for each key in `left` (ascending, with repeats), the next
    pending edge with it, in pending order (the first `count` pending edges of each key)."""
    if not left:
        return np.zeros(0, dtype=np.int64)
    keys, count = np.unique(np.asarray(left), return_counts=True)
    kp = key[pending]
    order = np.argsort(kp, kind="stable")  # pending grouped by key, each group in pending order
    starts = np.searchsorted(kp[order], keys)
    return pending[np.concatenate([order[a : a + c] for a, c in zip(starts, count)])].astype(np.int64)


def area(sizes: Sequence[int], values: Sequence[float], n_edges: int) -> tuple[float, float]:
    """(CPR, CMD): the area under the faithfulness curve over the fraction of edges kept, and the
    area between it and 1 (MIB's two summaries; trapezoids)."""
    x = np.asarray(sizes, dtype=float) / n_edges
    f = np.asarray(values, dtype=float)
    return float(np.trapezoid(f, x)), float(np.trapezoid(np.abs(1 - f), x))


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
    site: EdgeSite, scores: np.ndarray, verified: int, rng: np.random.Generator, *, levels: int = 5
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
        joint = np.abs(1.0 - site.patch(np.stack(keep)))
        for block, e in zip(members, joint):
            bound[block] = np.minimum(bound[block], e)
    return BlockBound(verified=top, unverified=rest, bound=bound[rest], rows=len(keep))


@dataclass(frozen=True, kw_only=True)
class EdgeCircuits(ProbeResult):
    """Edge scores against exact edge patching, and cross-fitted circuits' faithfulness."""

    PARTS = (
        "faithfulness_auc",
        "random_auc",
        "greedy_auc",
        "faithfulness_cmd",
        *(f"rho_{k}" for k in _KEY.values()),
        *(f"recall_{k}" for k in _KEY.values()),
        *(f"{k}_seconds" for k in _KEY.values()),
        "exact_seconds",
        "exhaustive_seconds",
        "speedup",
        "effect",
    )
    CURVES = ("faithfulness", "random", "greedy")
    TABLES = ("edges", "convergence", "graph", "nodes")
    n_edges: int
    steps: int
    method: str
    top: int
    recall_over: str
    cost: dict
    groups: tuple[str, ...]
    # the first pair's tokens in each group (new prompt; at most `GROUP_TOKENS` each), for reading the graph
    group_tokens: dict[str, list[str]] = field(default_factory=dict)


def analyse_edges(
    trials: Sequence[Trial],
    *,
    steps: int = 0,
    method: str = "eap-ig",
    exact: int = 512,
    exhaustive: int = EXHAUSTIVE,
    top: int = 20,
    draws: int = 4,
    seed: int = 0,
    min_effect: float = MIN_EFFECT,
) -> EdgeCircuits:
    """Edge scores (EAP, EAP-IG, AtP*) against exact patching, and circuits chosen by `method`'s
    scores on half the pairs, evaluated on the other half. `steps` 0: chosen by `converged_steps`."""
    used, excluded = split_by_effect(trials, min_effect)
    rng = np.random.default_rng(seed)
    sites = [edge_site(t.model, t.pair, metric=t.metric) for t in used]
    graph = sites[0].graph if sites else None
    convergence: list[dict] = []
    if sites and steps == 0:
        steps, convergence = converged_steps(sites[0])
    steps = steps or STEP_CHOICES[-1]
    parts: dict[str, list] = {k: [] for k in EdgeCircuits.PARTS if k not in ("effect",)}
    scores: dict[str, list[np.ndarray]] = {m: [] for m in METHODS}
    exact_rows: list[tuple[np.ndarray, np.ndarray]] = []
    cost: dict[str, dict] = {}
    patch_all = bool(graph is not None and len(graph) <= exhaustive)
    for site in _progress(sites, used, "edges"):
        for m in METHODS:
            t0 = time.perf_counter()
            sc = score_edges(site, m, steps=steps)
            parts[f"{_KEY[m]}_seconds"].append(time.perf_counter() - t0)
            scores[m].append(sc.scores)
            cost[m] = {"forwards": sc.forwards, "backwards": sc.backwards, "steps": sc.steps}
        E = len(site.graph)
        if patch_all:
            idx = np.arange(E)
            sample = idx
        else:
            sample = rng.choice(E, size=min(exact, E), replace=False)
            tops = [np.argsort(-np.abs(scores[m][-1]))[: 2 * top] for m in METHODS]
            idx = np.unique(np.concatenate([sample, *tops]))
        f0 = site.forwards
        t0 = time.perf_counter()
        ex = site.exact(idx)
        t_exact = time.perf_counter() - t0
        cost["exact"] = {"forwards": site.forwards - f0, "edges": int(len(idx))}
        parts["exact_seconds"].append(t_exact)
        full = t_exact / len(idx) * E
        parts["exhaustive_seconds"].append(full)
        parts["speedup"].append(full / parts["eap_ig_seconds"][-1])
        exact_rows.append((idx, ex))
        in_sample = np.isin(idx, sample)
        k = min(top, len(idx))
        best = set(idx[np.argsort(-np.abs(ex), kind="stable")[:k]])
        for m in METHODS:
            s = scores[m][-1]
            parts[f"rho_{_KEY[m]}"].append(spearman(s[idx[in_sample]].tolist(), ex[in_sample].tolist()))
            mine = set(np.argsort(-np.abs(s), kind="stable")[:k])
            parts[f"recall_{_KEY[m]}"].append(len(mine & best) / k)
    # cross-fitted circuits: chosen on the other half of the pairs, patched on this one
    curves: dict[str, list[list[float]]] = {}
    sizes = sizes_for(len(graph)) if graph is not None else []
    if sites:
        chosen = np.array(scores[method])
        halves = np.arange(len(sites)) % 2
        for name in ("faithfulness", "random", "greedy"):
            curves[name] = [[] for _ in sizes]
        for i, site in enumerate(_progress(sites, used, "edge circuits")):
            other = halves != halves[i] if len(sites) > 1 else np.ones(len(sites), dtype=bool)
            mean = chosen[other].mean(0)
            grown = greedy_order(graph, mean)
            rows, tags = [], []
            for j, k in enumerate(sizes):
                c = top_circuit(mean, k)
                rows += [c, greedy_circuit(graph, mean, k, grown)]
                tags += [("faithfulness", j), ("greedy", j)]
                for _ in range(draws):
                    rows.append(matched_random(graph, c, rng))
                    tags.append(("random", j))
            rec = site.patch(np.stack(rows))
            got: dict[tuple[str, int], list[float]] = {}
            for (name, j), r in zip(tags, rec):
                got.setdefault((name, j), []).append(float(r))
            for (name, j), v in got.items():
                curves[name][j].append(float(np.mean(v)))
            for name, part in (
                ("faithfulness", "faithfulness_auc"),
                ("random", "random_auc"),
                ("greedy", "greedy_auc"),
            ):
                cpr, cmd = area(sizes, [curves[name][j][-1] for j in range(len(sizes))], len(graph))
                parts[part].append(cpr)
                if name == "faithfulness":
                    parts["faithfulness_cmd"].append(cmd)
    clusters = clusters_of(used)
    est = {
        k: Estimate.of(v, seed=seed, clusters=clusters if len(v) == len(clusters) else None)
        for k, v in parts.items()
    }
    est["effect"] = effect_estimate(used)
    x = [k / len(graph) for k in sizes] if graph is not None else []
    made = {n: Curve.of("fraction of edges", x, v, seed=seed, clusters=clusters) for n, v in curves.items()}
    if not made:
        made = {n: Curve.of("fraction of edges", [], []) for n in EdgeCircuits.CURVES}
    table, graph_rows = _tables(graph, scores[method], exact_rows) if graph is not None else ([], [])
    node_rows = _node_table(graph, scores[method], graph_rows) if graph is not None else []
    return EdgeCircuits.of(
        name="edges",
        headline="faithfulness_auc",
        parts=est,
        curves=made,
        tables={"edges": table, "convergence": convergence, "graph": graph_rows, "nodes": node_rows},
        excluded=excluded,
        n_edges=len(graph) if graph is not None else 0,
        steps=steps,
        method=method,
        top=top,
        recall_over="every edge"
        if patch_all
        else f"a random {exact} per pair and each method's top {2 * top}",
        cost=cost,
        groups=GROUPS,
        group_tokens=_group_tokens(sites[0]) if sites else {},
        description="edge-level circuits over the notebook: EAP, EAP-IG and AtP* against exact edge "
        "patching; cross-fitted circuits' faithfulness against matched random circuits",
    )


def _progress(sites: list, trials: Sequence[Trial], desc: str):
    """`sites` with a progress bar unless the trials were made quiet."""
    from tqdm.auto import tqdm

    return tqdm(sites, desc=desc, unit="pair", disable=not (trials and trials[0].progress))


def _tables(graph: EdgeGraph, scores: list[np.ndarray], exact_rows) -> tuple[list, list]:
    """The top edges by mean |score| with their CIs and exact means, and the graph's edges for
    drawing (the top `GRAPH_EDGES`)."""
    if not scores:
        return [], []
    s = np.array(scores)
    mean = s.mean(0)
    order = np.argsort(-np.abs(mean), kind="stable")
    exact_sum = np.zeros(len(graph))
    exact_n = np.zeros(len(graph))
    for idx, ex in exact_rows:
        exact_sum[idx] += ex
        exact_n[idx] += 1
    labels = graph.labels
    nodes = graph.nodes
    table, rows = [], []
    for e in order[:GRAPH_EDGES]:
        est = Estimate.of(s[:, e].tolist())
        src, dst = nodes[graph.src[e]], nodes[graph.dst[e]]
        row = {
            "edge": labels[e],
            "kind": "attention" if graph.kind[e] == ATTENTION else "residual",
            "score": float(mean[e]),
            "ci": list(est.ci) if est.ci else None,
            "exact": float(exact_sum[e] / exact_n[e]) if exact_n[e] else None,
            "src": src.label,
            "dst": dst.label,
            "src_layer": src.layer,
            "dst_layer": dst.layer,
            "src_group": GROUPS[src.group],
            "dst_group": GROUPS[dst.group],
        }
        rows.append(row)
        if len(table) < 50:
            table.append(row)
    return table, rows


def _node_table(graph: EdgeGraph, scores: list[np.ndarray], graph_rows: list[dict]) -> list[dict]:
    """Every node an edge of the graph table touches, with its score per pair summed over its
    outgoing edges (the logit: over its incoming ones), as a mean with a CI over pairs."""
    if not scores:
        return []
    s = np.array(scores)  # [pairs, edges]
    n = len(graph.nodes)
    out = np.zeros((len(s), n))
    for i in range(len(s)):
        np.add.at(out[i], graph.src, s[i])
    out[:, graph.logit] = s[:, graph.dst == graph.logit].sum(1)
    shown = {r["src"] for r in graph_rows} | {r["dst"] for r in graph_rows}
    rows = []
    for i, nd in enumerate(graph.nodes):
        if nd.label not in shown:
            continue
        est = Estimate.of(out[:, i].tolist())
        rows.append(
            {
                "node": nd.label,
                "kind": nd.kind,
                "layer": nd.layer,
                "index": nd.index,
                "group": GROUPS[nd.group],
                "score": float(out[:, i].mean()),
                "ci": list(est.ci) if est.ci else None,
            }
        )
    return sorted(rows, key=lambda r: -abs(r["score"]))


def _group_tokens(site: EdgeSite) -> dict[str, list[str]]:
    """The new prompt's tokens in each position group of `site` (the first `GROUP_TOKENS`)."""
    strings = site.model.token_strings(site.ids_new)
    out: dict[str, list[str]] = {}
    for t, g in zip(strings, site.groups.tolist()):
        got = out.setdefault(GROUPS[g], [])
        if len(got) < GROUP_TOKENS:
            got.append(t)
    return out


@dataclass(frozen=True)
class EdgesConfig(Pairs):
    ig_steps: int = option(
        0, "EAP-IG steps (0: the fewest of 2-32 whose scores doubling moves < 0.01)", least=0
    )
    edge_method: str = option("eap-ig", "the edge scores circuits are chosen by", choices=METHODS)
    exact_edges: int = option(
        512, "edges patched exactly per pair when the graph is too large for all", least=1
    )
    exhaustive_edges: int = option(
        EXHAUSTIVE, "graphs with at most this many edges are patched edge by edge in full", least=0
    )
    recall_k: int = option(20, "k of recall@k against exact edge patching", least=1)
    circuit_draws: int = option(4, "matched random circuits per circuit size", least=1)

    def __post_init__(self):
        super().__post_init__()
        if self.edge_method not in METHODS:
            raise BadOption(f"edge_method must be one of {', '.join(METHODS)}, got {self.edge_method!r}")


@analysis(
    "edges",
    "circuits",
    EdgesConfig,
    EdgeCircuits,
    quick={"n": 4, "ig_steps": 4, "exact_edges": 64, "exhaustive_edges": 0, "recall_k": 10},
    order=6,
    default=False,  # `kvnotes circuits` runs it when named (~15 s a pair on Gemma, quick sizes); reports do
)
def _run_edges(ctx: Context, cfg: EdgesConfig) -> EdgeCircuits:
    """Edge-level circuits over the notebook: EAP-IG and AtP* against exact edge patching, faithfulness."""
    return analyse_edges(
        shared_trials(ctx, cfg.n, template=cfg.template),
        steps=cfg.ig_steps,
        method=cfg.edge_method,
        exact=cfg.exact_edges,
        exhaustive=cfg.exhaustive_edges,
        top=cfg.recall_k,
        draws=cfg.circuit_draws,
        seed=ctx.seed,
        min_effect=ctx.min_effect,
    )
