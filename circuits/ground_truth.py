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

Per program and method (EAP, EAP-IG, AtP*, exact edge patching), against the known circuit, as
InterpBench reports them: precision and recall of the top |known| by |score|, and AUROC of |score|,
at edge level and at node level (a node's score: its output edges' scores summed; exact: the patch
of all of them at once). Beside them, the faithfulness of the known circuit itself: the recovery
of a run in which only its edges carry the clean prompt's values.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
from scipy.stats import rankdata
from tqdm.auto import tqdm

from circuits.edges import GROUPS, RESIDUAL, EdgePatcher, edge_patcher, score_edges
from kvnotes.analysis.registry import Context, Options, analysis, option
from kvnotes.analysis.results import BenchReport, Estimate, header, machine
from kvnotes.errors import BadArgument

METHODS = ("eap", "eap-ig", "atp*", "exact")


# --- the known circuit in the edge graph -----------------------------------------------------------
def _inputs(model, ids) -> list:
    return [model.values[s] for s in model.token_strings(ids[1:])]


def _differs(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is None or b is None or abs(float(a) - float(b)) > 1e-9
    return a != b


def _touched(model, clean: list, corrupt: list):
    """Where each expression's value differs between the prompts (prompt positions: BOS is 0),
    and per head step both prompts' selections."""
    v_new, s_new = model.circuit.trace(clean)
    v_old, s_old = model.circuit.trace(corrupt)
    touched = {
        label: {i + 1 for i, (a, b) in enumerate(zip(v_new[label], v_old[label])) if _differs(a, b)}
        for label in v_new
    }
    return touched, s_new, s_old


def known_edges(model, site: EdgePatcher) -> np.ndarray:
    """The known circuit of `site`'s pair (a `TracrModel`'s): a boolean mask over `site.graph`.

    Walking back from the logit: a step is in the circuit at a position where its output differs
    between the prompts and a reader in the circuit reads it there. An MLP then reads the inputs
    that differ there; a head its query where the query differs and the selection with it, the
    keys whose selection differs where the key differs, and the values that differ at the keys
    it selects in either prompt."""
    pair = site.pair
    clean, corrupt = _inputs(model, pair.new.ids), _inputs(model, pair.old.ids)
    touched, s_new, s_old = _touched(model, clean, corrupt)
    start = int(site.pos[0])
    group = {int(p): GROUPS[int(g)] for p, g in zip(site.pos, site.groups)}
    last = len(pair.new.ids) - 1
    demand: dict[tuple[str, int], set[str]] = {(model.circuit.output, last): {"LOGIT"}}
    labels: set[str] = set()

    def need(x: str, p: int, reader: str) -> bool:
        if p in touched.get(x, ()):
            demand.setdefault((x, p), set()).add(reader)
            return True
        return False

    for s in reversed(model.circuit.steps):
        for p in sorted(set().union(*(touched.get(w, set()) for w in s.writes)), reverse=True):
            readers = set().union(*(demand.get((w, p), set()) for w in s.writes))
            if not readers:
                continue
            if p < start:
                raise AssertionError(f"position {p} differs but lies before the field at {start}")
            me = f"L{s.layer}H{s.head}@{group[p]}" if s.kind == "head" else f"MLP{s.layer}@{group[p]}"
            labels |= {f"{me}->{r}" for r in readers}
            if s.kind == "mlp":
                for x in s.reads["input"]:
                    need(x, p, me)
                continue
            q = p - 1
            new, old = s_new[s.expr][q], s_old[s.expr][q]
            if (new != old).any():
                for x in s.reads["query"]:
                    need(x, p, me)
            for k in np.flatnonzero(new | old):
                kv = f"KV{s.layer}.{s.head}@{group.get(int(k) + 1, 'prefix')}"
                reads = list(s.reads["value"]) + (list(s.reads["key"]) if new[k] != old[k] else [])
                if any([need(x, int(k) + 1, kv) for x in reads]):
                    labels.add(f"{kv}->{me}")
    for p in touched["tokens"]:
        labels |= {f"EMB@{group[p]}->{r}" for r in demand.get(("tokens", p), set())}
    mask = np.zeros(len(site.graph), dtype=bool)
    mask[[site.graph.index_of(lab) for lab in labels]] = True
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
        if n.kind in ("head", "mlp"):
            by.setdefault(_component(n.label), []).append(int(e))
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

    def table(self) -> str:
        lines = [
            header("circuit discovery vs tracr's compiled circuits", "tracr library", self.machine),
            f"{self.pairs} pairs a program; EAP-IG {self.steps} steps; precision = recall at k = |known|",
            f"{'program':<10}{'method':<8}{'level':<6}{'precision':>10}{'AUROC':>8}{'AUROC 95% CI':>16}",
        ]
        for r in self.results:
            ci = f"[{r.auroc_ci[0]:.2f}, {r.auroc_ci[1]:.2f}]" if r.auroc_ci else "-"
            au = f"{r.auroc:.3f}" if r.auroc is not None else "-"
            lines.append(f"{r.program:<10}{r.method:<8}{r.level:<6}{r.precision:>10.3f}{au:>8}{ci:>16}")
        lines.append("known circuit's own faithfulness (recovery when only its edges carry the clean run):")
        for name, p in self.programs.items():
            ci = p["faithfulness_ci"]
            lines.append(
                f"  {name:<10} {p['faithfulness']:.4f}"
                + (f" [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "")
                + f"; {p['known_edges']:.1f} of {p['edges']} edges, "
                f"{p['known_nodes']:.1f} of {p['components']} components"
            )
        return "\n".join(lines)


def score_program(model, pairs, *, steps: int = 8, progress: bool = True):
    """Per method and level, each pair's (precision, recall, AUROC); and the known circuits' sizes
    and faithfulness, for one compiled program's `pairs`."""
    names = components(model)
    got: dict[tuple[str, str], list[tuple]] = {(m, lv): [] for m in METHODS for lv in ("edge", "node")}
    sizes = {"edges": 0, "known_edges": [], "known_nodes": [], "faithfulness": []}
    for pair in tqdm(pairs, desc=model.name, unit="pair", disable=not progress or None, leave=False):
        patcher = edge_patcher(model, pair)
        if abs(patcher.effect) < 1e-6:
            raise BadArgument(f"{model.name}: a pair whose answers do not move ({pair.new.text!r})")
        truth = known_edges(model, patcher)
        nodes = known_nodes(patcher, truth)
        node_truth = np.array([c in nodes for c in names])
        sizes["edges"] = len(patcher.graph)
        sizes["known_edges"].append(int(truth.sum()))
        sizes["known_nodes"].append(len(nodes))
        sizes["faithfulness"].append(float(patcher.patch(truth[None])[0]))
        for m in METHODS:
            s = patcher.exact() if m == "exact" else score_edges(patcher, m, steps=steps).scores
            s = np.nan_to_num(np.asarray(s, dtype=np.float64))
            ns = node_scores(patcher, None if m == "exact" else s, names)
            for lv, sc, tr in (("edge", np.abs(s), truth), ("node", ns, node_truth)):
                p, r = precision_recall(sc, tr)
                got[(m, lv)].append((p, r, auroc(sc, tr)))
    return got, sizes


def ground_truth_bench(
    programs: list[str] | None = None, *, n: int = 8, steps: int = 8, seed: int = 0, progress: bool = True
) -> GroundTruthReport:
    """Every shipped tracr program (or `programs`): `n` pairs each, scored by every method."""
    from kvnotes.zoo.tracr import TRACR_PROGRAMS, load_tracr, pairs

    results, about = [], {}
    for short in programs or TRACR_PROGRAMS:
        model = load_tracr(short if short.startswith("tracr-") else f"tracr-{short}")
        got, sizes = score_program(model, pairs(model, n, seed=seed), steps=steps, progress=progress)
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
        }
    return GroundTruthReport(machine=machine(), results=results, pairs=n, steps=steps, programs=about)


@dataclass(frozen=True)
class GroundTruthConfig(Options):
    programs: str = option("", "comma-separated tracr programs (default: every shipped one)")
    n: int = option(8, "pairs a program (0: skip the bench)", least=0)
    ig_steps: int = option(8, "EAP-IG steps", least=1)


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
    return ground_truth_bench(names, n=cfg.n, steps=cfg.ig_steps, seed=ctx.seed, progress=ctx.progress)


__all__ = [
    "METHODS",
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
