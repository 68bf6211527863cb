"""The `edges` analysis: edge scores by EAP, EAP-IG and AtP* set against exact edge patching, and
circuits chosen on half the pairs, evaluated on the other half as faithfulness curves beside random
circuits matched bin by bin (`circuits.edges.choose.matched_random`).

Per pair (`circuits.edges.edge_patcher`): every edge scored by each method, timed; exact patching of
every edge when the graph has at most `exhaustive` edges (default `EXHAUSTIVE`), else of a random
sample (for Spearman's rho) plus each method's top edges (for recall@k: then the exact top-k is the
top-k of what was patched, which can only flatter the methods: said in `details.recall_over`).
Then, cross-fitted (`circuits.edges.faithfulness.cross_fit`): each pair's circuits of each size are
the top edges by the *other* half's mean |score| (and a connected circuit grown from the logit,
`greedy`), and each is patched on that pair: recovery toward the new decision with every edge
outside the circuit carrying the old run's value. With fewer than two usable pairs no pair has
another half to be chosen on, so no circuit is scored and the result says so (`circuits_note`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from circuits.edges import (
    ATTENTION,
    ATTRIBUTION_METHODS,
    GROUPS,
    EdgeGraph,
    EdgePatcher,
    edge_graph,
    edge_patcher,
    score_edges,
)
from circuits.edges.choose import greedy_circuit, greedy_order, matched_random, sizes_for, top_circuit
from circuits.edges.faithfulness import area, cross_fit, dataset_areas
from circuits.edges.methods import PRUNING, method_scores
from kvnotes.analysis.registry import Context, analysis, option
from kvnotes.analysis.results import TaskResult
from kvnotes.analysis.stats import Curve, Estimate
from kvnotes.analysis.trials import (
    MIN_EFFECT,
    PairOptions,
    Trial,
    clusters_of,
    effect_estimate,
    shared_trials,
    split_by_effect,
)
from kvnotes.errors import BadOption
from kvnotes.metrics import spearman

EXHAUSTIVE = 4096  # graphs up to this many edges are patched edge by edge in full
STEP_CHOICES = (2, 4, 8, 16, 32)
CONVERGED = 0.01  # IG steps are enough when doubling them moves no edge's score by more than this
# every run: ATTRIBUTION_METHODS, each with its parts' key
_KEY = {"eap": "eap", "eap-ig": "eap_ig", "atp*": "atp"}
# asked for by name (`--methods`): EAP-IG on the activations, ACDC's sweep, edge pruning, the ensemble
EXTRA = {
    "eap-ig-act": "eap_ig_act",
    "acdc": "acdc",
    "pruning": "pruning",
    "ensemble": "ensemble",
    "eap-ig+acdc": "eap_ig_acdc",
}
KEYS = {**_KEY, **EXTRA}
GRAPH_EDGES = 200  # edges the graph table keeps for drawing (the strongest by mean |score|)
GROUP_TOKENS = 48  # tokens of each position group the result keeps for reading the graph
CURVES = ("faithfulness", "random", "greedy")


def converged_steps(patcher: EdgePatcher, *, tol: float = CONVERGED) -> tuple[int, list[dict]]:
    """The fewest EAP-IG steps of `STEP_CHOICES` whose scores move by less than `tol` (recovery units,
    the largest over edges) when the steps are doubled, and the table of every comparison."""
    prev, rows, chosen = None, [], None
    for s in STEP_CHOICES:
        sc = score_edges(patcher, "eap-ig", steps=s).scores
        if prev is not None:
            change = float(np.abs(sc - prev[1]).max())
            rows.append({"steps": prev[0], "doubled": s, "max_change": change})
            if chosen is None and change < tol:
                chosen = prev[0]
        prev = (s, sc)
    return (chosen if chosen is not None else STEP_CHOICES[-1]), rows


@dataclass(frozen=True, kw_only=True)
class EdgeCircuits(TaskResult):
    """Edge scores against exact edge patching, and cross-fitted circuits' faithfulness."""

    PARTS = (
        "faithfulness_auc",
        "random_auc",
        "greedy_auc",
        "faithfulness_cmd",
        "random_cmd",
        "faithfulness_auc_mib",
        "faithfulness_cmd_mib",
        "random_auc_mib",
        "random_cmd_mib",
        *(f"rho_{k}" for k in _KEY.values()),
        *(f"recall_{k}" for k in _KEY.values()),
        *(f"{k}_seconds" for k in _KEY.values()),
        "exact_seconds",
        "exhaustive_seconds",
        "speedup",
        "effect",
    )
    PART_PATTERNS = (
        rf"(rho|recall)_({'|'.join(EXTRA.values())})",
        rf"({'|'.join(EXTRA.values())})_seconds",
    )
    CURVES = CURVES
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
    # how the circuits were fitted: on the other half of the pairs, or why none were scored
    circuits_note: str = ""

    def cell(self, part: str) -> tuple[str, str] | None:
        """Each scoring method a row (exact patching's time too); rho, recall and seconds the columns."""
        for method in (*KEYS.values(), "exact"):
            for column in ("rho", "recall"):
                if part == f"{column}_{method}":
                    return (method, column)
            if part == f"{method}_seconds":
                return (method, "seconds")
        return None

    def rows(self) -> list[tuple[str, str]]:
        """The parts' rows, exhaustive patching's time and the speedup over it labelled as
        estimates where only a sample of the edges was patched (their time per edge times every
        edge), so an extrapolated figure never reads as a measured one."""
        sampled = self.recall_over != "every edge"
        edges = self.cost.get("exact", {}).get("edges")
        label = f" (estimated from {edges} of {self.n_edges} edges patched)" if sampled else ""
        return [
            (
                a + label
                if a.split(" ")[0] in (f"{self.name}.exhaustive_seconds", f"{self.name}.speedup")
                else a,
                b,
            )
            for a, b in super().rows()
        ]


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
    extra: Sequence[str] = (),
) -> EdgeCircuits:
    """Edge scores (EAP, EAP-IG, AtP*, and the `extra` methods of `EXTRA`) against exact patching,
    and circuits chosen by `method`'s scores on half the pairs, evaluated on the other half. `steps`
    0: chosen by `converged_steps`."""
    bad = [m for m in (*extra, method) if m not in KEYS]
    if bad:
        raise BadOption(f"unknown edge method {bad[0]!r}; choose from {', '.join(KEYS)}")
    methods = tuple(dict.fromkeys((*ATTRIBUTION_METHODS, *extra, method)))
    used, excluded = split_by_effect(trials, min_effect)
    rng = np.random.default_rng(seed)
    patchers = [edge_patcher(t.model, t.pair, metric=t.metric) for t in used]
    graph = patchers[0].graph if patchers else None
    convergence: list[dict] = []
    if patchers and steps == 0:
        steps, convergence = converged_steps(patchers[0])
    steps = steps or STEP_CHOICES[-1]
    parts: dict[str, list] = {k: [] for k in EdgeCircuits.PARTS if k not in ("effect",)}
    for m in methods[len(ATTRIBUTION_METHODS) :]:
        parts |= {f"rho_{KEYS[m]}": [], f"recall_{KEYS[m]}": [], f"{KEYS[m]}_seconds": []}
    patch_all = bool(graph is not None and len(graph) <= exhaustive)
    checked = _against_exact(
        patchers, used, methods, steps, exact if not patch_all else None, top, rng, parts
    )
    scores, exact_rows, cost = checked
    clusters = clusters_of(used)
    curves, note = _circuit_curves(patchers, used, scores[method], draws, rng, parts, seed=seed)
    est = {
        k: Estimate.of(v, seed=seed, clusters=clusters if len(v) == len(clusters) else None)
        for k, v in parts.items()
        if not k.endswith("_mib")
    }
    est.update({k: v or Estimate.of([]) for k, v in parts.items() if k.endswith("_mib")})
    est["effect"] = effect_estimate(used)
    x = [k / len(graph) for k in sizes_for(len(graph))] if graph is not None else []
    made = {n: Curve.of("fraction of edges", x, v, seed=seed, clusters=clusters) for n, v in curves.items()}
    if not made:
        made = {n: Curve.of("fraction of edges", [], []) for n in CURVES}
    table, graph_rows = _tables(graph, scores[method], exact_rows) if graph is not None else ([], [])
    return EdgeCircuits.of(
        name="edges",
        headline="faithfulness_auc",
        parts=est,
        curves=made,
        tables={
            "edges": table,
            "convergence": convergence,
            "graph": graph_rows,
            "nodes": _node_table(graph, scores[method], graph_rows) if graph is not None else [],
        },
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
        group_tokens=_group_tokens(patchers[0]) if patchers else {},
        circuits_note=note,
        description="edge-level circuits over the notebook: EAP, EAP-IG and AtP* against exact edge "
        "patching; cross-fitted circuits' faithfulness against matched random circuits",
    )


def _against_exact(patchers, used, methods, steps: int, exact: int | None, top: int, rng, parts: dict):
    """Each pair's edges scored by every method of `methods` (timed) and patched exactly (every edge,
    or with `exact` a random sample plus each method's top 2 `top`): rho, recall@top and the times
    into `parts`. Returns the scores per method, the exact rows (indices, effects) and the passes."""
    scores: dict[str, list[np.ndarray]] = {m: [] for m in methods}
    exact_rows: list[tuple[np.ndarray, np.ndarray]] = []
    cost: dict[str, dict] = {}
    for patcher in _progress(patchers, used, "edges"):
        made: dict[str, np.ndarray] = {}
        for m in methods:
            t0, f0, b0 = time.perf_counter(), patcher.forwards, patcher.backwards
            made[m] = method_scores(patcher, m, steps=steps, made=made)
            parts[f"{KEYS[m]}_seconds"].append(time.perf_counter() - t0)
            scores[m].append(made[m])
            cost[m] = {
                "forwards": patcher.forwards - f0,
                "backwards": patcher.backwards - b0,
                "steps": _steps(m, steps),
            }
        E = len(patcher.graph)
        if exact is None:
            idx = sample = np.arange(E)
        else:
            sample = rng.choice(E, size=min(exact, E), replace=False)
            tops = [np.argsort(-np.abs(scores[m][-1]))[: 2 * top] for m in methods]
            idx = np.unique(np.concatenate([sample, *tops]))
        f0, t0 = patcher.forwards, time.perf_counter()
        ex = patcher.exact(idx)
        t_exact = time.perf_counter() - t0
        cost["exact"] = {"forwards": patcher.forwards - f0, "edges": int(len(idx))}
        parts["exact_seconds"].append(t_exact)
        parts["exhaustive_seconds"].append(t_exact / len(idx) * E)
        parts["speedup"].append(parts["exhaustive_seconds"][-1] / parts["eap_ig_seconds"][-1])
        exact_rows.append((idx, ex))
        in_sample = np.isin(idx, sample)
        k = min(top, len(idx))
        best = set(idx[np.argsort(-np.abs(ex), kind="stable")[:k]])
        for m in methods:
            s = scores[m][-1]
            parts[f"rho_{KEYS[m]}"].append(spearman(s[idx[in_sample]].tolist(), ex[in_sample].tolist()))
            mine = set(np.argsort(-np.abs(s), kind="stable")[:k])
            parts[f"recall_{KEYS[m]}"].append(len(mine & best) / k)
    return scores, exact_rows, cost


def _steps(method: str, ig_steps: int) -> int:
    """A method's steps as its cost reports them: the integrated-gradient methods' points on each
    path, edge pruning's optimiser steps, 1 for the rest."""
    if method in ("eap-ig", "eap-ig-act"):
        return ig_steps
    return PRUNING.steps if method == "pruning" else 1


def _circuit_curves(patchers, used, chosen: list[np.ndarray], draws: int, rng, parts: dict, *, seed: int):
    """Cross-fitted faithfulness curves (top, greedy and matched random circuits at every size),
    each pair's CPR and CMD into `parts`, and the dataset-mean (MIB) figures beside them. Returns
    the curves (per curve, per size, a value per pair) and the note on how they were fitted."""
    folds = cross_fit(len(patchers))
    if not folds:
        n = len(patchers)
        return {}, (
            f"no circuits scored: {n} usable pair{'s' if n != 1 else ''}; out-of-sample circuits need "
            "at least 2 (one to choose on, one to score); raise --n or lower --min-effect"
        )
    graph = patchers[0].graph
    sizes = sizes_for(len(graph))
    scores = np.array(chosen)
    rec = {name: np.zeros((len(patchers), len(sizes))) for name in CURVES}
    for i, patcher in enumerate(_progress(patchers, used, "edge circuits")):
        rec_i, random_draws = _pair_curves(patcher, scores[folds[i]].mean(0), sizes, draws, rng)
        for name in CURVES:
            rec[name][i] = rec_i[name]
        for name, part in (("faithfulness", "faithfulness"), ("greedy", "greedy")):
            cpr, cmd = area(sizes, rec_i[name], len(graph))
            parts[f"{part}_auc"].append(cpr)
            if name == "faithfulness":
                parts["faithfulness_cmd"].append(cmd)
        each = [area(sizes, d, len(graph)) for d in random_draws]  # every draw's own curve
        parts["random_auc"].append(float(np.mean([a for a, _ in each])))
        parts["random_cmd"].append(float(np.mean([c for _, c in each])))
    effects = np.array([s.effect for s in patchers])
    for name in ("faithfulness", "random"):
        cpr, cmd = dataset_areas(sizes, rec[name], effects, len(graph), seed=seed)
        parts[f"{name}_auc_mib"], parts[f"{name}_cmd_mib"] = cpr, cmd
    curves = {name: [list(rec[name][:, j]) for j in range(len(sizes))] for name in CURVES}
    return curves, "each pair's circuits chosen on the other half of the pairs"


def _pair_curves(patcher, mean: np.ndarray, sizes: list[int], draws: int, rng):
    """One pair's recovery at every size for the top and greedy circuits of `mean` (scores chosen
    on other pairs) and the mean of `draws` matched random circuits, in one batch of patches; and
    each random draw's own curve [draws, sizes]."""
    graph = patcher.graph
    grown = greedy_order(graph, mean)
    rows, tags = [], []
    for j, k in enumerate(sizes):
        c = top_circuit(mean, k)
        rows += [c, greedy_circuit(graph, mean, k, grown)]
        tags += [("faithfulness", j, 0), ("greedy", j, 0)]
        for d in range(draws):
            rows.append(matched_random(graph, c, rng))
            tags.append(("random", j, d))
    got = patcher.patch(np.stack(rows))
    out = {name: np.zeros(len(sizes)) for name in CURVES}
    random_draws = np.zeros((draws, len(sizes)))
    for (name, j, d), r in zip(tags, got):
        if name == "random":
            random_draws[d, j] = r
        else:
            out[name][j] = r
    out["random"] = random_draws.mean(0)
    return out, random_draws


def _progress(patchers: list, trials: Sequence[Trial], desc: str):
    """`patchers` with a progress bar unless the trials were made quiet."""
    from tqdm.auto import tqdm

    return tqdm(patchers, desc=desc, unit="pair", disable=not (trials and trials[0].progress))


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


def _group_tokens(patcher: EdgePatcher) -> dict[str, list[str]]:
    """The new prompt's tokens in each position group of `patcher` (the first `GROUP_TOKENS`)."""
    strings = patcher.model.token_strings(patcher.ids_new)
    out: dict[str, list[str]] = {}
    for t, g in zip(strings, patcher.groups.tolist()):
        got = out.setdefault(GROUPS[g], [])
        if len(got) < GROUP_TOKENS:
            got.append(t)
    return out


@dataclass(frozen=True)
class EdgesConfig(PairOptions):
    ig_steps: int = option(
        0, "EAP-IG steps (0: the fewest of 2-32 whose scores doubling moves < 0.01)", least=0, arg="steps"
    )
    edge_method: str = option(
        "eap-ig", "the edge scores circuits are chosen by", choices=tuple(KEYS), arg="method"
    )
    methods: str = option(
        "",
        "more edge methods scored per pair beside EAP, EAP-IG and AtP* (comma-separated): eap-ig-act, "
        "acdc, pruning, ensemble (EAP-IG's and pruning's ranks), eap-ig+acdc",
    )
    exact_edges: int = option(
        512, "edges patched exactly per pair when the graph is too large for all", least=1, arg="exact"
    )
    exhaustive_edges: int = option(
        EXHAUSTIVE,
        "graphs with at most this many edges are patched edge by edge in full",
        least=0,
        arg="exhaustive",
    )
    recall_k: int = option(20, "k of recall@k against exact edge patching", least=1, arg="top")
    circuit_draws: int = option(4, "matched random circuits per circuit size", least=1, arg="draws")

    def __post_init__(self):
        super().__post_init__()
        if self.edge_method not in KEYS:
            raise BadOption(f"edge_method must be one of {', '.join(KEYS)}, got {self.edge_method!r}")
        bad = [m for m in self.extra if m not in EXTRA]
        if bad:
            raise BadOption(
                f"--methods names {bad[0]!r}; the methods beside EAP, EAP-IG and AtP* are "
                f"{', '.join(EXTRA)} (comma-separated)"
            )

    @property
    def extra(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in self.methods.split(",") if m.strip())


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
    edge_graph(ctx.model)  # a model the graph cannot describe is refused before the prefills
    trials = cfg.call(shared_trials, ctx)
    return cfg.call(analyse_edges, trials, seed=ctx.seed, min_effect=ctx.min_effect, extra=cfg.extra)
