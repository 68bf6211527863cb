"""Edge scores against exhaustive edge patching, side by side in one process (`kvnotes bench edges`).

Per pair of the task: each method (EAP, EAP-IG, AtP*, AtP* with GradDrop) scores every edge of the
notebook graph (`circuits.edges`), timed `repeats` times in turn (the median kept); then the exact
way patches edges one by one (each a row of a batched forward): every edge where the graph has at
most `exhaustive`, else a random `exact` of them plus each method's top 2k, and the exhaustive
sweep's time is that sweep's time per edge times the graph's edges (said in the report: projected).
Against it: each method's Spearman ρ on the random sample (GradDrop's unsigned scores against
|exact|), recall@k (the exact top k among the edges patched) and the exhaustive sweep's time over
the method's.

AtP*'s false-negative diagnostic (`circuits.edges.faithfulness.block_bound`), measured: AtP*'s top 2k are
verified one by one, the rest bounded by the joint effects of random blocks, and the bound is set
against the exact effects of the sampled unverified edges: how many of them reach the threshold θ
(the k-th largest exact effect verified: what it takes to be in the circuit), how many the bound
failed to cover (no-cancellation broken), and what share of all unverified edges it rules out of θ.

It is a bench of the circuits layer, so it lives here rather than in `kvnotes.bench` (the engine's
benches, which import nothing above kvnotes/); it shares their report base and machine line, both in
`kvnotes.analysis.results`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
from tqdm.auto import tqdm

from circuits.auto_circuit_peer import check_peer, compare
from circuits.edges import edge_graph, edge_patcher, score_edges
from circuits.edges.faithfulness import block_bound
from kvnotes.analysis.bench_report import BenchReport, header, machine
from kvnotes.analysis.registry import Context, Options, analysis, option
from kvnotes.analysis.stats import Estimate
from kvnotes.analysis.trials import MIN_EFFECT, make_trials, split_by_effect
from kvnotes.metrics import spearman
from kvnotes.models.model import KVModel

BENCH_METHODS = ("eap", "eap-ig", "atp*", "atp*-gd")
WHOLE = "atp* (every key)"  # AtP* with its exact-key step the reference way, timed beside it
BOUND_TOL = 1e-4  # recovery units: float32 patches of one edge and of a block round apart by ~1e-6


@dataclass(frozen=True)
class EdgeMethodPoint:
    """One method over the pairs: median seconds a pair, passes, and agreement with exact patching."""

    method: str
    seconds: float  # median over pairs of each pair's median over repeats
    forwards: int  # a pair's
    backwards: int
    rho: float | None  # mean over pairs (GradDrop: against |exact|)
    rho_ci: tuple[float, float] | None
    recall: float | None  # recall@k, mean over pairs
    recall_ci: tuple[float, float] | None
    speedup: float  # the exhaustive sweep's seconds over this method's


@dataclass(frozen=True)
class EdgeBenchReport(BenchReport):
    POINT: ClassVar[type] = EdgeMethodPoint
    model: str
    task: str
    machine: str
    results: list[EdgeMethodPoint]
    pairs: int
    n_edges: int
    prompt_tokens: int  # the longest computed span (from the field on) of the pairs
    repeats: int
    top: int
    exact_edges: int  # patched one by one per pair
    exhaustive_s: float  # median over pairs of the exhaustive sweep's seconds
    projected: bool  # True: from the sample's seconds an edge; False: every edge patched
    steps: int  # EAP-IG's
    bound: dict  # AtP*'s false-negative diagnostic, measured (see the module docstring)
    peer: dict = field(default_factory=dict)  # auto-circuit on the same pairs (`circuits.auto_circuit_peer`)
    # AtP*'s exact-key step the whole-softmax way beside the changed-keys way (`score_edges(keys=)`)
    exact_keys: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict):
        pts = [EdgeMethodPoint(**{**r, **_tuples(r)}) for r in d["results"]]
        return cls(**{**d, "results": pts})

    def table(self) -> str:
        way = "projected from the exact sample" if self.projected else "every edge patched"
        lines = [
            header(
                "edge scores vs exhaustive edge patching",
                self.model,
                self.task,
                self.machine,
                f"median of {self.repeats}",
            ),
            f"{self.pairs} pairs, {self.n_edges:,} edges, up to {self.prompt_tokens} tokens from the "
            f"field on; exact: {self.exact_edges} edges a pair; exhaustive sweep "
            f"{self.exhaustive_s:.1f} s a pair ({way})",
            f"{'method':<10}{'s/pair':>9}{'fwd':>5}{'bwd':>5}{'rho':>7}{'rho 95% CI':>16}"
            f"{f'recall@{self.top}':>11}{'recall 95% CI':>16}{'exhaustive/method':>19}",
        ]
        for r in self.results:
            lines.append(
                f"{r.method:<10}{r.seconds:>9.3f}{r.forwards:>5}{r.backwards:>5}{_f(r.rho):>7}"
                f"{_ci(r.rho_ci):>16}{_f(r.recall):>11}{_ci(r.recall_ci):>16}{r.speedup:>18.0f}x"
            )
        b = self.bound
        if b:
            lines.append(
                f"AtP* false-negative bound ({b['verified']} verified a pair, {b['rows']} block patches): "
                f"theta {b['theta']:.3f}; rules out {b['ruled_out']:.1%} of the unverified edges; of "
                f"{b['sampled']} sampled unverified, {b['missed']} reach theta "
                f"(rate {b['missed_rate']:.4f}, 95% upper {b['missed_upper']:.4f}), "
                f"{b['violations']} exceed their bound; largest missed |effect| {b['largest_missed']:.3f}"
            )
        k = self.exact_keys
        if k:
            lines.append(
                f"AtP*'s exact-key step: every key recomputed {k['whole_s']:.3f} s/pair, the changed keys "
                f"swapped in {k['changed_s']:.3f} s/pair ({k['whole_s'] / k['changed_s']:.2f}x); largest "
                f"score difference {k['max_diff']:.1e} of a largest |score| {k['max_score']:.2f}"
            )
        if self.peer:
            lines += _peer_lines(self.peer)
        return "\n".join(lines)


def _peer_lines(p: dict) -> list[str]:
    s = p["seconds"]
    out = [
        f"auto-circuit 1.0.1 (TransformerLens {p['transformer_lens']}; logits within {p['parity']:.1e} of "
        f"kvnotes') on the same {p['pairs']} pairs, {p['edges']} edges of its graph (kvnotes' residual "
        "edges summed over positions, K+V joined):",
        f"  EAP: rho {p['eap_rho']:.4f}, largest difference {p['eap_max_rel_diff']:.1e} of the largest "
        f"score; IG (theirs over edge masks, ours over the input): rho {p['ig_rho']:.3f}",
    ]
    if pos := p.get("positions"):  # reports from before the per-position comparison lack it
        out.append(
            f"  EAP per token position ({max(pos['edges'])} of our residual edges a pair, each at its "
            f"position; its graph with positions has {max(pos['auto_circuit_edges'])}): rho "
            f"{pos['eap_rho']:.4f}, largest difference {pos['eap_max_rel_diff']:.1e}; its edges before "
            f"the field (we have none: the prompts are the same there) at most {pos['prefix_max']:.1e}"
        )
    out.append("  not comparable: attention edges (its graph does not split a head's keys by position)")
    ways = [(f"{m} {way}", f"{m}-{way}", m) for m in ("eap", "ig") for way in ("plain", "cached")]
    ways.append(("eap positions", "eap-positions", "eap-positions"))
    for label, theirs_way, ours_way in ways:
        ours, theirs = s.get(f"ours-{ours_way}"), s.get(f"theirs-{theirs_way}")
        if ours and theirs:
            out.append(
                f"  {label:<14}kvnotes {ours:.3f} s/pair, auto-circuit {theirs:.3f} s/pair: "
                f"{theirs / ours:.2f}x"
            )
    return out


def _tuples(r: dict) -> dict:
    return {k: tuple(r[k]) if r.get(k) is not None else None for k in ("rho_ci", "recall_ci")}


def _f(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def _ci(c: tuple[float, float] | None) -> str:
    return "—" if c is None else f"[{c[0]:.3f}, {c[1]:.3f}]"


def _upper(k: int, n: int, level: float = 0.95) -> float:
    """The one-sided upper bound of a rate seen k times in n (Clopper-Pearson)."""
    from scipy.stats import beta

    return 1.0 if n == 0 else (1.0 if k == n else float(beta.ppf(level, k + 1, n - k)))


def edge_bench(
    model: KVModel,
    task: str = "order-cancel",
    n: int = 4,
    *,
    steps: int = 8,
    exact: int = 256,
    exhaustive: int = 4096,
    top: int = 20,
    repeats: int = 3,
    levels: int = 5,
    peer_python: str | None = None,
    seed: int = 0,
    progress: bool = True,
) -> EdgeBenchReport:
    """Time and check every method against exact edge patching on `n` pairs of `task`; with
    `peer_python`, auto-circuit's EAP and IG on the same pairs too (run first: its checks fail fast)."""
    edge_graph(model)  # a model the graph cannot describe is refused before the prefills
    if peer_python:
        check_peer(model, peer_python)
    used, _ = split_by_effect(make_trials(model, task, n, seed=seed, progress=False), MIN_EFFECT)
    peer = (
        compare(model, [t.pair for t in used], peer_python, steps=steps, repeats=repeats)
        if peer_python
        else {}
    )
    rng = np.random.default_rng(seed)
    tally = _Tally(top)
    for t in tqdm(used, desc="edge bench", unit="pair", disable=not progress):
        site = edge_patcher(t.model, t.pair, metric=t.metric)
        tally.n_edges, tally.tokens = len(site.graph), max(tally.tokens, site.n_tokens)
        got = tally.time_methods(site, steps, repeats)
        tally.projected = len(site.graph) > exhaustive
        idx, sample, ex = tally.against_exact(site, got, exact if tally.projected else None, rng)
        tally.bound_check(site, got["atp*"].scores, idx, sample, ex, levels, rng)
    return tally.report(model, task, used, repeats=repeats, steps=steps, peer=peer, seed=seed)


@dataclass
class _Tally:
    """What the bench gathers pair by pair (each step a method), and the report it makes of it."""

    top: int
    secs: dict = field(default_factory=lambda: {m: [] for m in BENCH_METHODS})
    passes: dict = field(default_factory=dict)
    rho: dict = field(default_factory=lambda: {m: [] for m in BENCH_METHODS})
    recall: dict = field(default_factory=lambda: {m: [] for m in BENCH_METHODS})
    full_s: list = field(default_factory=list)
    whole_s: list = field(default_factory=list)  # AtP* with every key recomputed, beside atp*
    keys_diff: float = 0.0
    keys_scale: float = 0.0
    fn: dict = field(default_factory=dict)
    ruled: list = field(default_factory=list)
    theta: list = field(default_factory=list)
    largest: float = 0.0
    n_edges: int = 0
    tokens: int = 0
    exact_n: int = 0
    projected: bool = False

    def __post_init__(self):
        self.fn = {"verified": 2 * self.top, "rows": 0, "sampled": 0, "missed": 0, "violations": 0}

    def time_methods(self, site, steps: int, repeats: int) -> dict:
        """Every method (and AtP* the whole-softmax way) timed in turn, each repeat; the scores."""
        score_edges(site, "eap")  # warm-up: the first gradient run pays one-off costs
        times: dict[str, list[float]] = {m: [] for m in (*BENCH_METHODS, WHOLE)}
        got = {}
        for _ in range(repeats):
            for m in (*BENCH_METHODS, WHOLE):  # side by side, in turn, each repeat
                t0 = time.perf_counter()
                whole = m == WHOLE
                got[m] = (
                    score_edges(site, "atp*", keys="whole") if whole else score_edges(site, m, steps=steps)
                )
                times[m].append(time.perf_counter() - t0)
        self.whole_s.append(statistics.median(times[WHOLE]))
        self.keys_diff = max(self.keys_diff, float(np.abs(got[WHOLE].scores - got["atp*"].scores).max()))
        self.keys_scale = max(self.keys_scale, float(np.abs(got["atp*"].scores).max()))
        for m in BENCH_METHODS:
            self.secs[m].append(statistics.median(times[m]))
            self.passes[m] = (got[m].forwards, got[m].backwards)
        return got

    def against_exact(self, site, got: dict, exact: int | None, rng):
        """Exact patching of every edge (`exact` None) or of a random `exact` plus each method's
        top 2k; each method's rho on the random sample and recall@k. Returns the edges patched, the
        sample, and their exact effects."""
        E = len(site.graph)
        if exact is None:
            idx = sample = np.arange(E)
        else:
            sample = rng.choice(E, size=min(exact, E), replace=False)
            tops = [np.argsort(-np.abs(got[m].scores), kind="stable")[: 2 * self.top] for m in BENCH_METHODS]
            idx = np.unique(np.concatenate([sample, *tops]))
        t0 = time.perf_counter()
        ex = site.exact(idx)
        self.full_s.append((time.perf_counter() - t0) / len(idx) * E)
        self.exact_n = len(idx)
        in_sample = np.isin(idx, sample)
        k = min(self.top, len(idx))
        best = set(idx[np.argsort(-np.abs(ex), kind="stable")[:k]].tolist())
        for m in BENCH_METHODS:
            s = got[m].scores
            target = np.abs(ex) if m == "atp*-gd" else ex
            self.rho[m].append(spearman(s[idx[in_sample]].tolist(), target[in_sample].tolist()))
            self.recall[m].append(len(set(np.argsort(-np.abs(s), kind="stable")[:k].tolist()) & best) / k)
        return idx, sample, ex

    def bound_check(self, site, atp: np.ndarray, idx, sample, ex, levels: int, rng) -> None:
        """AtP*'s false-negative diagnostic, against the exact effects of the sampled unverified edges."""
        k = min(self.top, len(idx))
        bb = block_bound(site, atp, 2 * self.top, rng, levels=levels)
        exact_of = dict(zip(idx.tolist(), np.abs(ex).tolist()))
        verified = [exact_of[e] for e in bb.verified.tolist() if e in exact_of]
        theta = sorted(verified, reverse=True)[min(k, len(verified)) - 1] if verified else float("inf")
        self.theta.append(theta)
        self.ruled.append(bb.ruled_out(theta))
        where = {e: i for i, e in enumerate(bb.unverified.tolist())}
        for e in sample.tolist():
            if e in where:
                self.fn["sampled"] += 1
                x = exact_of[e]
                self.fn["missed"] += int(x >= theta)
                self.fn["violations"] += int(x > bb.bound[where[e]] + BOUND_TOL)
                self.largest = max(self.largest, x)
        self.fn["rows"] = bb.rows

    def points(self, seed: int) -> list[EdgeMethodPoint]:
        ex_med = statistics.median(self.full_s) if self.full_s else 0.0
        out = []
        for m in BENCH_METHODS:
            r, c = Estimate.of(self.rho[m], seed=seed), Estimate.of(self.recall[m], seed=seed)
            sec = statistics.median(self.secs[m]) if self.secs[m] else 0.0
            fwd, bwd = self.passes.get(m, (0, 0))
            out.append(
                EdgeMethodPoint(
                    method=m,
                    seconds=sec,
                    forwards=fwd,
                    backwards=bwd,
                    rho=r.mean,
                    rho_ci=r.ci,
                    recall=c.mean,
                    recall_ci=c.ci,
                    speedup=ex_med / sec if sec else 0.0,
                )
            )
        return out

    def report(
        self, model, task, used, *, repeats: int, steps: int, peer: dict, seed: int
    ) -> EdgeBenchReport:
        fn = self.fn
        bound = (
            {
                **fn,
                "theta": float(statistics.median(self.theta)),
                "ruled_out": float(np.mean(self.ruled)),
                "missed_rate": fn["missed"] / fn["sampled"] if fn["sampled"] else 0.0,
                "missed_upper": _upper(fn["missed"], fn["sampled"]),
                "largest_missed": self.largest,
            }
            if used
            else {}
        )
        keys = {
            "whole_s": statistics.median(self.whole_s) if self.whole_s else 0.0,
            "changed_s": statistics.median(self.secs["atp*"]) if self.whole_s else 0.0,
            "max_diff": self.keys_diff,
            "max_score": self.keys_scale,
        }
        return EdgeBenchReport(
            model=model.name,
            task=str(task),
            machine=machine(),
            results=self.points(seed),
            pairs=len(used),
            n_edges=self.n_edges,
            prompt_tokens=self.tokens,
            repeats=repeats,
            top=self.top,
            exact_edges=self.exact_n,
            exhaustive_s=statistics.median(self.full_s) if self.full_s else 0.0,
            projected=self.projected,
            steps=steps,
            bound=bound,
            peer=peer,
            exact_keys=keys if self.whole_s else {},
        )


@dataclass(frozen=True)
class EdgeBenchConfig(Options):
    task: str = option("order-cancel", "the task whose pairs are scored (a name or task file)")
    n: int = option(4, "prompt pairs", least=0, skips=True)
    ig_steps: int = option(8, "EAP-IG steps", least=1, arg="steps")
    exact_edges: int = option(
        256, "edges patched exactly per pair when the graph is too large for all", least=1, arg="exact"
    )
    exhaustive_edges: int = option(
        4096, "graphs with at most this many edges are patched in full", least=0, arg="exhaustive"
    )
    recall_k: int = option(20, "k of recall@k; AtP* verifies its top 2k", least=1, arg="top")
    repeats: int = option(3, "timings of each method per pair (the median is kept)", least=1)
    bound_levels: int = option(
        5, "the false-negative bound's partitions: 2, 4, ... 2**levels blocks", least=1, arg="levels"
    )
    auto_circuit_python: str = option(
        "", "a Python with auto-circuit (`kvnotes auto-circuit-env DIR`): its EAP and IG beside ours"
    )


@analysis(
    "edge_bench",
    "bench",
    EdgeBenchConfig,
    EdgeBenchReport,
    in_report=False,
    order=40,
    command="edges",
    title="Edge scores vs exhaustive patching",
)
def _run_edge_bench(ctx: Context, cfg: EdgeBenchConfig) -> EdgeBenchReport | None:
    """EAP, EAP-IG, AtP* and AtP*+GradDrop against exhaustive edge patching: time, rho, recall, bound."""
    if not cfg.n:
        return None
    return cfg.call(edge_bench, ctx.model, peer_python=cfg.auto_circuit_python or None, **ctx.common)


__all__ = ["BENCH_METHODS", "EdgeBenchReport", "EdgeMethodPoint", "edge_bench"]
