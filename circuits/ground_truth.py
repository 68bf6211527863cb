"""Circuit discovery scored against circuits no one here wrote: tracr's compiled programs
(`kvnotes bench ground-truth`).

A tracr model (`kvnotes.zoo.tracr`) computes each RASP step in its own component and writes it to
its own labelled residual directions, so for a pair of inputs the edges through which the changed
token can reach the decision are known exactly (`known_edges`): a step at a position is *touched*
when a direction it reads there differs between the prompts, or (a head) when a key it selects in
either prompt has a touched key or value; walking back from the logit over the touched steps
whose output someone downstream reads gives the known circuit in the notebook's edge graph
(`circuits.edges`): residual edges writer -> reader at each position group, and attention edges
from the KV slots a head's queries select. Node level: the heads and MLPs those edges touch.

Per program and method (`GROUND_TRUTH_METHODS`: EAP, EAP-IG on the inputs and on the activations, AtP*, exact
edge patching, ACDC's threshold sweep, edge pruning and the two rank-average ensembles; see
`circuits.edges.methods`), against the known circuit, as
InterpBench reports them: precision and recall of the top |known| by |score|, and AUROC of |score|,
at edge level and at node level (a node's score: its output edges' scores summed; exact: the patch
of all of them at once). Beside them, the faithfulness of the known circuit itself: the recovery of a
run in which only its edges carry the clean prompt's values.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, TypedDict, cast

import numpy as np
from scipy.stats import rankdata
from tqdm.auto import tqdm

from circuits.edges import GROUPS, RESIDUAL, EdgePatcher, edge_patcher
from circuits.edges.methods import ENSEMBLES, PRUNING, method_scores, rank_average
from kvnotes.analysis.bench_report import BenchReport, header, machine
from kvnotes.analysis.registry import MIN_EFFECT, Context, Options, analysis, option
from kvnotes.analysis.stats import Estimate
from kvnotes.errors import BadArgument, UnknownModelError

GROUND_TRUTH_METHODS = (
    "eap",
    "eap-ig",
    "eap-ig-act",
    "atp*",
    "exact",
    "acdc",
    "pruning",
    "ensemble",
    "eap-ig+acdc",
)


# --- the known circuit in the edge graph -----------------------------------------------------------
READS = ("scores", "selection")  # `known_edges`' rules: the right one, and the old one kept as a fault


def _inputs(model, ids) -> list:
    return [model.values[s] for s in model.token_strings(ids[1:])]


def _differs(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is None or b is None or abs(float(a) - float(b)) > 1e-9
    return a != b


class _Pair:
    """Both prompts' causal traces (values per label, selections per head step; input positions,
    BOS not counted), and what each step computes from any mix of the two prompts' inputs."""

    def __init__(self, model, clean: list, corrupt: list):
        self.circuit = model.circuit
        self.c, self.sel_c = model.circuit.trace(clean)
        self.o, self.sel_o = model.circuit.trace(corrupt)

    def differs(self, label: str, i: int) -> bool:
        return label in self.c and _differs(self.c[label][i], self.o[label][i])

    def pred(self, step):
        """The head step's score as a function of (key value, query value), with the labels it
        reads them from; None where the selector is not a plain Select (every change counts)."""
        sel = self.circuit.selectors.get(step.expr)
        if sel is None or not hasattr(sel, "predicate"):
            return None
        return sel.keys.label, sel.queries.label, sel.predicate

    def mlp_fn(self, step):
        """The MLP step's function of its argument labels, or None (every change counts)."""
        expr = self.circuit.exprs.get(step.expr)
        if step.op == "SelectorWidth":
            hidden = [x for x in step.reads["input"] if x in self.circuit.aliases]
            return (hidden, lambda w: w) if len(hidden) == 1 else None
        if step.op == "Map" and expr is not None:
            return [expr.inner.label], expr.f
        if step.op in ("SequenceMap", "LinearSequenceMap") and expr is not None:
            return [expr.fst.label, expr.snd.label], expr.f


def _matters_mlp(t: _Pair, step, label: str, i: int) -> bool:
    """Whether `label`'s change at input position `i` changes the MLP step's output, whatever
    mix of the two prompts its other arguments come from."""
    if not t.differs(label, i):
        return False
    fn = t.mlp_fn(step)
    if fn is None or label not in fn[0]:
        return fn is None
    args, f = fn
    others = [a for a in args if a != label]
    for mix in range(2 ** len(others)):
        env = {a: (t.c if mix >> j & 1 else t.o)[a][i] for j, a in enumerate(others)}
        outs = []
        for side in (t.c, t.o):
            env[label] = side[label][i]
            vals = [env[a] for a in args]
            outs.append(None if any(v is None for v in vals) else _apply(f, vals))
        if _differs(*outs):
            return True
    return False


def _apply(f, vals):
    try:
        return f(*vals)
    except Exception:  # a value outside the function's domain: tracr's MLP has no row for it
        return None


def _query_matters(t: _Pair, step, q: int, reads: str) -> bool:
    """Whether the query's change at input position `q` changes any of the head's scores there,
    with each key from either prompt (`reads="selection"`: the old rule, the prompts' own
    selections only)."""
    if not any(t.differs(x, q) for x in step.reads["query"]):
        return False
    if reads == "selection":
        return bool((t.sel_c[step.expr][q] != t.sel_o[step.expr][q]).any())
    p = t.pred(step)
    if p is None:
        return True
    keys, queries, pred = p
    qc, qo = t.c[queries][q], t.o[queries][q]
    return any(
        _score(pred, side[keys][k], qc) != _score(pred, side[keys][k], qo)
        for k in range(q + 1)
        for side in (t.c, t.o)
    )


def _key_matters(t: _Pair, step, k: int, q: int, reads: str) -> bool:
    """Whether the key's change at `k` changes the score of query `q` for it, with the query
    from either prompt (`"selection"`: the old rule, only where the prompts' selections differ)."""
    if not any(t.differs(x, k) for x in step.reads["key"]):
        return False
    if reads == "selection":
        return bool(t.sel_c[step.expr][q, k] != t.sel_o[step.expr][q, k])
    p = t.pred(step)
    if p is None:
        return True
    keys, queries, pred = p
    kc, ko = t.c[keys][k], t.o[keys][k]
    return any(
        _score(pred, kc, side[queries][q]) != _score(pred, ko, side[queries][q]) for side in (t.c, t.o)
    )


def _score(pred, key, query):
    return None if key is None or query is None else bool(pred(key, query))


def known_edges(model, site: EdgePatcher, *, reads: str = "scores") -> np.ndarray:
    """The known circuit of `site`'s pair (a `TracrModel`'s): a boolean mask over `site.graph`,
    right by construction: only its edges carrying the clean prompt's values give the clean run's
    decision exactly, and only they carrying the corrupt one's the corrupt run's.

    Walking back from the logit over nodes (a component at a position group): a node in the
    circuit must compute its clean value at every position of its group (its output edges carry
    all of them), so it reads each input, at every position of its group, whose change changes
    what it computes there with the other inputs from either prompt: an MLP its arguments; a head
    its query wherever the query's change moves one of its scores against either prompt's keys,
    a KV slot's key wherever the key's change moves the score of a query of the group, and a
    value wherever a query of the group selects it in either prompt. `reads="selection"` is the
    old rule (a query or key read only where the prompts' own selections differ), kept as the
    planted fault the random programs catch (`circuits.random_programs`)."""
    if reads not in READS:
        raise BadArgument(f"reads must be one of {READS}, got {reads!r}")
    pair = site.pair
    t = _Pair(model, _inputs(model, pair.new.ids), _inputs(model, pair.old.ids))
    start = int(site.pos[0])
    at: dict[str, list[int]] = {}  # group -> input positions (prompt position - 1)
    for p, g in zip(site.pos, site.groups):
        at.setdefault(GROUPS[int(g)], []).append(int(p) - 1)
    last = len(pair.new.ids) - 2
    moved = [lab for lab in t.c for i in range(start - 1) if t.differs(lab, i)]
    if moved:
        raise AssertionError(f"{moved[0]} differs before the field at {start}: the trace is not causal")
    writer: dict[str, str] = {"tokens": "EMB"}
    for s in model.circuit.steps:
        for w in s.writes:
            writer.setdefault(w, f"L{s.layer}H{s.head}" if s.kind == "head" else f"MLP{s.layer}")
    edges: set[str] = set()
    todo: list[tuple[str, str]] = []
    done: set[tuple[str, str]] = set()

    def need(label: str, g: str, reader: str) -> None:
        w = writer.get(label)
        if w is None:  # indices and one never differ (checked in `differs`' callers)
            raise AssertionError(f"{label} differs but nothing in the graph writes it")
        edges.add(f"{w}@{g}->{reader}")
        if (w, g) not in done:
            done.add((w, g))
            todo.append((w, g))

    group_of_last = next(g for g, ps in at.items() if last in ps)
    if t.differs(model.circuit.output, last):
        need(model.circuit.output, group_of_last, "LOGIT")
    while todo:
        node, g = todo.pop()
        if node == "EMB":
            continue
        for s in model.circuit.steps:
            me = f"L{s.layer}H{s.head}" if s.kind == "head" else f"MLP{s.layer}"
            if me != node:
                continue
            if s.kind == "mlp":
                for x in s.reads["input"]:
                    if any(_matters_mlp(t, s, x, i) for i in at[g]):
                        need(x, g, f"{me}@{g}")
                continue
            if any(_query_matters(t, s, q, reads) for q in at[g]):
                for x in s.reads["query"]:
                    if any(t.differs(x, q) for q in at[g]):
                        need(x, g, f"{me}@{g}")
            for gk, ks in at.items():
                pairs_ = [(k, q) for k in ks for q in at[g] if k <= q]
                key = any(_key_matters(t, s, k, q, reads) for k, q in pairs_)
                value = any(
                    (t.sel_c[s.expr][q, k] or t.sel_o[s.expr][q, k])
                    and any(t.differs(x, k) for x in s.reads["value"])
                    for k, q in pairs_
                )
                if not (key or value):
                    continue
                kv = f"KV{s.layer}.{s.head}@{gk}"
                edges.add(f"{kv}->{me}@{g}")
                for x in set(s.reads["key"] if key else ()) | set(s.reads["value"] if value else ()):
                    if any(t.differs(x, k) for k in ks):
                        need(x, gk, kv)
    mask = np.zeros(len(site.graph), dtype=bool)
    mask[[site.graph.index_of(lab) for lab in edges]] = True
    return mask


def _component(label: str) -> str | None:
    """The head or MLP a node label belongs to (`KV1.0@x` is head 0 of layer 1's KV input)."""
    name = label.split("@")[0]
    if name.startswith("KV"):
        layer, head = name[2:].split(".")
        return f"L{layer}H{head}"
    return name if re.fullmatch(r"L\d+H\d+|MLP\d+", name) else None


def components(model) -> list[str]:
    """Every head and MLP of `model`, as node-level circuits name them."""
    return [f"L{l}H{h}" for l in range(model.n_layers) for h in range(model.n_heads)] + [
        f"MLP{l}" for l in range(model.n_layers)
    ]


def known_nodes(site: EdgePatcher, mask: np.ndarray) -> set[str]:
    """The components the known edges touch (embeddings and the logit are no component)."""
    gr = site.graph
    out = set()
    for e in np.flatnonzero(mask):
        for n in (gr.nodes[gr.src[e]], gr.nodes[gr.dst[e]]):
            c = _component(n.label)
            if c is not None:
                out.add(c)
    return out


def _output_edges(site: EdgePatcher) -> dict[str, np.ndarray]:
    """Per component, the residual edges that carry its output."""
    gr = site.graph
    by: dict[str, list[int]] = {}
    for e in np.flatnonzero(gr.kind == RESIDUAL):
        n = gr.nodes[gr.src[e]]
        if n.kind in ("head", "mlp"):  # a head's label is `L{l}H{h}@..`, an MLP's `MLP{l}@..`: a component
            by.setdefault(cast(str, _component(n.label)), []).append(int(e))
    return {c: np.array(v, dtype=np.int64) for c, v in by.items()}


# --- scoring --------------------------------------------------------------------------------------
def auroc(scores: np.ndarray, truth: np.ndarray) -> float | None:
    """The probability that a random true item outscores a random false one (ties count half);
    None where either class is empty."""
    truth = np.asarray(truth, dtype=bool)
    pos, neg = int(truth.sum()), int((~truth).sum())
    if not pos or not neg:
        return None
    ranks = rankdata(scores)
    return float((ranks[truth].sum() - pos * (pos + 1) / 2) / (pos * neg))


def precision_recall(scores: np.ndarray, truth: np.ndarray) -> tuple[float, float]:
    """Precision and recall of the top |truth| items by score (ties broken by index)."""
    k = int(np.asarray(truth).sum())
    top = np.argsort(-scores, kind="stable")[:k]
    hit = int(np.asarray(truth)[top].sum())
    return (hit / k if k else 0.0), (hit / k if k else 0.0)


def node_scores(site: EdgePatcher, edge_scores: np.ndarray | None, names: list[str]) -> np.ndarray:
    """|a component's score|: its output edges' scores summed, or (`edge_scores` None) the exact
    recovery lost when all of them carry the corrupt prompt's values at once."""
    outs = _output_edges(site)
    if edge_scores is not None:
        return np.array([abs(float(edge_scores[outs[c]].sum())) if c in outs else 0.0 for c in names])
    keep = np.ones((len(names), len(site.graph)), dtype=bool)
    for i, c in enumerate(names):
        keep[i, outs.get(c, [])] = False
    return np.abs(1.0 - site.patch(keep))


@dataclass(frozen=True)
class GroundTruthPoint:
    """One program and method at one level: precision, recall and AUROC against the known
    circuit, means over the pairs with their 95% CIs."""

    program: str
    method: str
    level: str  # "edge" or "node"
    precision: float
    recall: float
    auroc: float | None
    auroc_ci: tuple[float, float] | None
    pairs: int


@dataclass(frozen=True)
class GroundTruthReport(BenchReport):
    POINT: ClassVar[type] = GroundTruthPoint
    machine: str
    results: list[GroundTruthPoint]
    pairs: int  # per program
    steps: int  # EAP-IG's
    # per program: layers, heads, edges of the graph, known edges and nodes (means), and the known
    # circuit's own faithfulness (recovery, mean and CI) and how many pairs it covers
    programs: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict):
        pts = [
            GroundTruthPoint(**{**r, "auroc_ci": tuple(r["auroc_ci"]) if r["auroc_ci"] else None})
            for r in d["results"]
        ]
        return cls(**{**d, "results": pts})

    @property
    def sources(self) -> str:
        """Where the programs come from, each source once with its programs: "reverse, hist (tracr
        library); count-first (kvnotes); same_ends (same.py:same_ends)"."""
        by: dict[str, list[str]] = {}
        for name, p in self.programs.items():
            by.setdefault(p.get("source", "tracr library"), []).append(name)
        return "; ".join(f"{', '.join(names)} ({src})" for src, names in by.items())

    def table(self) -> str:
        w = max([10, *(len(r.program) + 2 for r in self.results)])  # the program column's width
        lines = [
            header("circuit discovery vs tracr's compiled circuits", self.sources, self.machine),
            f"{self.pairs} pairs a program, each checked on the compiled model; EAP-IG (on the inputs "
            f"and on the activations) {self.steps} steps; edge pruning {PRUNING.steps} steps; "
            "precision = recall at k = |known|",
            f"{'program':<{w}}{'method':<12}{'level':<6}{'precision':>10}{'AUROC':>8}{'AUROC 95% CI':>16}",
        ]
        for r in self.results:
            ci = f"[{r.auroc_ci[0]:.2f}, {r.auroc_ci[1]:.2f}]" if r.auroc_ci else "-"
            au = f"{r.auroc:.3f}" if r.auroc is not None else "-"
            lines.append(f"{r.program:<{w}}{r.method:<12}{r.level:<6}{r.precision:>10.3f}{au:>8}{ci:>16}")
        lines.append("known circuit's own faithfulness (recovery when only its edges carry the clean run):")
        for name, p in self.programs.items():
            ci = p["faithfulness_ci"]
            lines.append(
                f"  {name:<{w}} {p['faithfulness']:.4f}"
                + (f" [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "")
                + f"; {p['known_edges']:.1f} of {p['edges']} edges, "
                f"{p['known_nodes']:.1f} of {p['components']} components" + _dropped(p)
            )
        return "\n".join(lines)


def _dropped(p: dict) -> str:
    """`; 2 of 10 candidate pairs dropped (1 answered wrongly, 1 moved < 0.1)`, or nothing."""
    wrong, small = p.get("dropped_wrong", 0), p.get("dropped_small", 0)
    if not wrong + small:
        return ""
    return (
        f"; {wrong + small} of {p['checked']} candidate pairs dropped ({wrong} answered wrongly "
        f"by the compiled model, {small} moved < {MIN_EFFECT} logits)"
    )


class ProgramSizes(TypedDict):
    """`score_program`'s sizes of one program: its edges, and per pair the known circuit's edges, nodes
    and faithfulness."""

    edges: int
    known_edges: list[int]
    known_nodes: list[int]
    faithfulness: list[float]


def score_program(
    model, pairs, *, steps: int = 8, methods: Sequence[str] = GROUND_TRUTH_METHODS, progress: bool = True
):
    """Per method (of `methods`) and level, each pair's (precision, recall, AUROC); and the known
    circuits' sizes and faithfulness, for one compiled program's `pairs`."""
    names = components(model)
    got: dict[tuple[str, str], list[tuple]] = {(m, lv): [] for m in methods for lv in ("edge", "node")}
    sizes: ProgramSizes = {"edges": 0, "known_edges": [], "known_nodes": [], "faithfulness": []}
    for pair in tqdm(pairs, desc=model.name, unit="pair", disable=not progress or None, leave=False):
        patcher = edge_patcher(model, pair)
        if patcher.effect < MIN_EFFECT:  # pairs() checks each on the model; a hand-made list may not
            raise BadArgument(
                f"{model.name}: the pair {pair.new.text!r} / {pair.old.text!r} moves the decision "
                f"{patcher.effect:+.3f} logits (under {MIN_EFFECT}, or the wrong way), so no recovery "
                "can be read from it; draw pairs with kvnotes.zoo.tracr.pairs, which checks each"
            )
        truth = known_edges(model, patcher)
        nodes = known_nodes(patcher, truth)
        node_truth = np.array([c in nodes for c in names])
        sizes["edges"] = len(patcher.graph)
        sizes["known_edges"].append(int(truth.sum()))
        sizes["known_nodes"].append(len(nodes))
        sizes["faithfulness"].append(float(patcher.patch(truth[None])[0]))
        made: dict[str, np.ndarray] = {}
        at_nodes: dict[str, np.ndarray] = {}
        for m in methods:
            s = method_scores(patcher, m, steps=steps, made=made)
            made[m] = s = np.nan_to_num(np.asarray(s, dtype=np.float64))
            if m in ENSEMBLES:  # the members' node scores' ranks averaged, as at edge level
                ns = rank_average([_node_scores(patcher, e, made, names, at_nodes) for e in ENSEMBLES[m]])
            else:
                ns = node_scores(patcher, None if m == "exact" else s, names)
            at_nodes[m] = ns
            for lv, sc, tr in (("edge", np.abs(s), truth), ("node", ns, node_truth)):
                p, r = precision_recall(sc, tr)
                got[(m, lv)].append((p, r, auroc(sc, tr)))
    return got, sizes


def _node_scores(patcher, method: str, made: dict, names: list[str], at_nodes: dict) -> np.ndarray:
    """`method`'s node scores for this pair (kept in `at_nodes`): an ensemble's member that was not
    itself asked for is scored from its edges as every method is."""
    if method not in at_nodes:
        at_nodes[method] = node_scores(patcher, None if method == "exact" else made[method], names)
    return at_nodes[method]


def _load(name: str):
    from kvnotes.zoo.names import is_program_spec
    from kvnotes.zoo.tracr import load_program, load_tracr

    if is_program_spec(name):
        return load_program(name)
    return load_tracr(name if name.startswith("tracr-") else f"tracr-{name}")


def check_methods(methods: Sequence[str]) -> None:
    """Refuse an empty list or a method the bench does not know, before anything compiles."""
    bad = [m for m in methods if m not in GROUND_TRUTH_METHODS]
    if bad or not methods:
        raise BadArgument(
            f"the bench's methods are {', '.join(GROUND_TRUTH_METHODS)} (comma-separated); got "
            + (f"{bad[0]!r}" if bad else "none")
        )


def check_programs(names: Sequence[str]) -> None:
    """Refuse a name that is neither a shipped program (`reverse`, `tracr-reverse`) nor a user's
    `FILE.py:NAME` that defines a RASP program and what tracr needs beside it, before anything
    compiles or is scored (a wrong last name costs no scoring of the first ones)."""
    from kvnotes.zoo.names import is_program_spec
    from kvnotes.zoo.tracr import TRACR_PROGRAMS, read_program

    for name in names:
        if is_program_spec(name):
            read_program(name)
        elif name.removeprefix("tracr-") not in TRACR_PROGRAMS:
            raise UnknownModelError(
                f"no tracr program {name!r}; shipped: {', '.join(TRACR_PROGRAMS)}, or your own "
                "as FILE.py:NAME (NAME a RASP program in FILE.py, beside VOCAB and MAX_SEQ_LEN)"
            )


def ground_truth_bench(
    programs: list[str] | None = None,
    *,
    n: int = 8,
    steps: int = 8,
    seed: int = 0,
    methods: Sequence[str] = GROUND_TRUTH_METHODS,
    progress: bool = True,
) -> GroundTruthReport:
    """Every shipped tracr program (or `programs`): `n` pairs each, scored by every method (or
    those of `methods`)."""
    from kvnotes.zoo.tracr import TRACR_PROGRAMS, draw_pairs, to_pair

    names = programs or TRACR_PROGRAMS
    check_methods(methods)
    check_programs(names)  # every name, before the first compiles
    results, about = [], {}
    for short in names:
        model = _load(short)
        draw = draw_pairs(model, n, seed=seed)
        chosen = [to_pair(model, p, seed=seed) for p in draw.pairs]
        got, sizes = score_program(model, chosen, steps=steps, methods=methods, progress=progress)
        for (m, lv), rows in got.items():
            aur = [a for _, _, a in rows if a is not None]
            est = Estimate.of(aur, seed=seed)
            results.append(
                GroundTruthPoint(
                    program=model.name.removeprefix("tracr-"),
                    method=m,
                    level=lv,
                    precision=float(np.mean([p for p, _, _ in rows])),
                    recall=float(np.mean([r for _, r, _ in rows])),
                    auroc=est.mean if aur else None,
                    auroc_ci=est.ci if aur else None,
                    pairs=len(rows),
                )
            )
        faith = Estimate.of(sizes["faithfulness"], seed=seed)
        about[model.name.removeprefix("tracr-")] = {
            "layers": model.n_layers,
            "heads": model.n_heads,
            "components": len(components(model)),
            "edges": sizes["edges"],
            "known_edges": statistics.mean(sizes["known_edges"]),
            "known_nodes": statistics.mean(sizes["known_nodes"]),
            "faithfulness": faith.mean,
            "faithfulness_ci": list(faith.ci) if faith.ci else None,
            "known": model.circuit.to_dict(),
            "source": model.source,
            # candidate pairs the compiled model was checked on, and those dropped (wrong answer,
            # or a decision that moves less than MIN_EFFECT logits)
            "checked": draw.checked,
            "dropped_wrong": draw.wrong,
            "dropped_small": draw.small,
        }
    return GroundTruthReport(machine=machine(), results=results, pairs=n, steps=steps, programs=about)


@dataclass(frozen=True)
class GroundTruthConfig(Options):
    programs: str = option(
        "",
        "comma-separated tracr programs, shipped (reverse) or your own (FILE.py:NAME); "
        "default: every shipped one",
    )
    n: int = option(8, "pairs a program", least=0, skips=True)
    ig_steps: int = option(8, "EAP-IG steps", least=1, arg="steps")
    methods: str = option(
        "", f"comma-separated methods, of {', '.join(GROUND_TRUTH_METHODS)}; default: every one"
    )

    @property
    def method_list(self) -> tuple[str, ...]:
        return tuple(m.strip() for m in self.methods.split(",") if m.strip()) or GROUND_TRUTH_METHODS


@analysis(
    "ground_truth",
    "bench",
    GroundTruthConfig,
    GroundTruthReport,
    in_report=False,
    order=41,
    command="ground-truth",
    title="Circuit discovery vs tracr's known circuits",
    needs_model=False,
)
def _run_ground_truth(ctx: Context, cfg: GroundTruthConfig) -> GroundTruthReport | None:
    """EAP, EAP-IG, AtP* and exact patching against tracr's compiled circuits: precision, recall, AUROC."""
    if not cfg.n:
        return None
    names = [p.strip() for p in cfg.programs.split(",") if p.strip()] or None
    return cfg.call(ground_truth_bench, names, methods=cfg.method_list, **ctx.common)


__all__ = [
    "GROUND_TRUTH_METHODS",
    "GroundTruthPoint",
    "GroundTruthReport",
    "auroc",
    "components",
    "ground_truth_bench",
    "known_edges",
    "known_nodes",
    "node_scores",
    "precision_recall",
    "score_program",
]
