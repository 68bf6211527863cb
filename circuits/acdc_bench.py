"""ACDC two ways side by side in one process (`kvnotes bench acdc`): through the notebook
(`circuits.edges.acdc` on `EdgePatcher`s) and the plain TransformerLens way (the same ACDC loop on
`circuits.acdc_peer.TLEdgePatch`: hooks, cached corrupt and clean runs, batched candidates started at
the first block a removed edge reaches). Both evaluate the same candidate rows, so the decisions
must agree edge for edge; the bench first patches a batch of random circuits both ways and reports
the largest difference of the decision (logits), then times each way's ACDC run (median of
`repeats`, the two ways alternating) and prints the ratio, the circuits each kept and how many
edges' decisions differ.

It is a bench of the circuits layer, so it lives here rather than in `kvnotes.bench`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import numpy as np
from tqdm.auto import tqdm

from circuits.acdc_peer import ROWS, TLEdgePatch
from circuits.edges import edge_patcher
from circuits.edges.acdc import acdc
from kvnotes.analysis.bench_report import BenchReport, header, machine
from kvnotes.analysis.registry import Context, Options, analysis, option
from kvnotes.analysis.trials import MIN_EFFECT
from kvnotes.errors import BadArgument
from kvnotes.models.model import KVModel

CHECK_ROWS = 16  # random circuits patched both ways before timing
T = TypeVar("T")


@dataclass(frozen=True)
class ACDCWayPoint:
    """ACDC at one threshold, both ways: seconds (median over repeats), forwards and what each kept."""

    tau: float
    notebook_s: float
    tl_s: float
    ratio: float  # the TransformerLens way's seconds over the notebook's
    forwards: int  # candidate batches, the same for both ways (the same rows)
    kept: int  # edges the notebook's ACDC kept
    tl_kept: int
    differ: int  # edges on which the two ways decided differently
    visited: int  # edges ACDC decided (all unless stopped at `limit` forwards)
    recovery: float  # of the kept circuit, averaged over the pairs
    tl_recovery: float


@dataclass(frozen=True)
class ACDCBenchReport(BenchReport):
    POINT: ClassVar[type] = ACDCWayPoint
    model: str
    task: str
    machine: str
    results: list[ACDCWayPoint]
    pairs: int
    n_edges: int
    prompt_tokens: int  # the longest prompt (the TransformerLens way runs all of it)
    computed_tokens: int  # the longest span from the field on (what the notebook runs)
    repeats: int
    rows: int  # the TransformerLens way's candidates a forward
    setup_s: float  # the notebook's: prefix prefilled, both runs captured (all pairs)
    tl_setup_s: float  # the TransformerLens way's: both runs cached
    max_diff: float  # logits: largest difference of the two ways' decision on random circuits

    def table(self) -> str:
        lines = [
            header(
                "ACDC: the notebook vs plain TransformerLens hooks",
                self.model,
                self.task,
                self.machine,
                f"median of {self.repeats}",
            ),
            f"{self.pairs} pairs, {self.n_edges:,} edges, prompts of up to {self.prompt_tokens} tokens "
            f"({self.computed_tokens} from the field on); TransformerLens {self.rows} candidates a forward",
            f"setup: notebook {self.setup_s:.2f} s, TransformerLens {self.tl_setup_s:.2f} s; the two ways' "
            f"decision on {CHECK_ROWS} random circuits a pair differs by at most {self.max_diff:.1e} logits",
            f"{'tau':>7}{'notebook s':>12}{'TL s':>10}{'TL/notebook':>13}{'forwards':>10}{'visited':>9}"
            f"{'kept':>7}{'TL kept':>9}{'differ':>8}{'recovery':>10}{'TL recovery':>13}",
        ]
        for r in self.results:
            lines.append(
                f"{r.tau:>7g}{r.notebook_s:>12.2f}{r.tl_s:>10.2f}{r.ratio:>12.2f}x{r.forwards:>10}{r.visited:>9}"
                f"{r.kept:>7}{r.tl_kept:>9}{r.differ:>8}{r.recovery:>10.4f}{r.tl_recovery:>13.4f}"
            )
        return "\n".join(lines)


def _pairs(model: KVModel, task: str, n: int, seed: int) -> tuple[str, list]:
    """`n` pairs: a compiled tracr program's own (task ""), else the task's or pair dataset's."""
    from kvnotes.tasks import load_task
    from kvnotes.tasks.sampler import sample
    from kvnotes.zoo import default_task
    from kvnotes.zoo.tracr import TracrModel, pairs

    if not task and isinstance(model, TracrModel):
        return f"{model.name} (compiled pairs)", pairs(model, n, seed=seed)
    task = task or default_task(model.name)
    return task, sample(load_task(task), model, n, seed=seed)


def _timed(run: Callable[[], T]) -> tuple[float, T]:
    t = time.perf_counter()
    out = run()
    return time.perf_counter() - t, out


def acdc_bench(
    model: KVModel,
    task: str = "",
    n: int = 2,
    *,
    taus: tuple[float, ...] = (0.03,),
    repeats: int = 3,
    rows: int = ROWS,
    limit: int = 0,
    seed: int = 0,
    progress: bool = True,
) -> ACDCBenchReport:
    """ACDC through the notebook and the plain TransformerLens way on `n` pairs of `task`; `limit` > 0:
    each run stops after that many forwards (the same candidates both ways: a sample of a run too
    long to time whole, such as Gemma's 19,638 edges on 2 cores)."""
    if not taus or min(taus) <= 0:
        raise BadArgument(f"tau must be positive thresholds, got {taus}")
    name, drawn = _pairs(model, task, n, seed)
    setup, notebooks = _timed(lambda: [edge_patcher(model, p) for p in drawn])
    notebooks = [p for p in notebooks if abs(p.effect) >= MIN_EFFECT]
    if not notebooks:
        raise BadArgument(f"no pair of {name} moves the decision by {MIN_EFFECT} logits; nothing to prune")
    tl_setup, ways = _timed(lambda: [TLEdgePatch(p, rows=rows) for p in notebooks])
    rng = np.random.default_rng(seed)
    n_edges = len(notebooks[0].graph)
    max_diff = 0.0
    for nb, tl in zip(notebooks, ways):  # the same patch both ways before any timing
        check = rng.random((CHECK_ROWS, n_edges)) < rng.uniform(0.5, 1.0, (CHECK_ROWS, 1))
        diff = np.abs(nb.patch(check, batch=CHECK_ROWS) - tl.patch(check)) * abs(nb.effect)
        max_diff = max(max_diff, float(diff.max()))
    results = []
    bar = tqdm(
        total=len(taus) * repeats * 2, desc="acdc both ways", disable=not progress or None, leave=False
    )
    for tau in taus:
        secs: dict[str, list[float]] = {"nb": [], "tl": []}
        runs = {}
        for r in range(repeats):
            for way, patchers in (("nb", notebooks), ("tl", ways))[:: 1 if r % 2 == 0 else -1]:
                s, runs[way] = _timed(
                    lambda p=patchers, t=tau: acdc(p, t, limit=limit or None, progress=progress)
                )
                secs[way].append(s)
                bar.update()
        nb, tl = runs["nb"], runs["tl"]
        a, b = statistics.median(secs["nb"]), statistics.median(secs["tl"])
        results.append(
            ACDCWayPoint(
                tau=float(tau),
                notebook_s=a,
                tl_s=b,
                ratio=b / a,
                forwards=nb.forwards,
                kept=nb.size,
                tl_kept=tl.size,
                differ=int((nb.kept != tl.kept).sum()),
                visited=nb.visited,
                recovery=nb.recovery,
                tl_recovery=tl.recovery,
            )
        )
    bar.close()
    return ACDCBenchReport(
        model=model.name,
        task=name,
        machine=machine(),
        results=results,
        pairs=len(notebooks),
        n_edges=n_edges,
        prompt_tokens=max(len(p.pair.new.ids) for p in notebooks),
        computed_tokens=max(p.n_tokens for p in notebooks),
        repeats=repeats,
        rows=rows,
        setup_s=setup,
        tl_setup_s=tl_setup,
        max_diff=max_diff,
    )


@dataclass(frozen=True)
class ACDCBenchConfig(Options):
    task: str = option(
        "",
        "the pairs: a task name, task file or pair dataset (default: a tracr program's "
        "compiled pairs, else the model's own task)",
    )
    n: int = option(2, "prompt pairs (ACDC averages the recovery over them)", least=1)
    taus: tuple[float, ...] = option(
        (0.03,), "ACDC's thresholds, in units of the pair's effect (one timed run each)", least=1e-6
    )
    repeats: int = option(3, "timed ACDC runs of each way (the median is kept)", least=1)
    tl_rows: int = option(ROWS, "the TransformerLens way's candidates a forward", least=1, arg="rows")
    limit: int = option(
        0, "stop each ACDC run after this many forwards, both ways (0: run it whole)", least=0
    )


@analysis(
    "acdc_bench",
    "bench",
    ACDCBenchConfig,
    ACDCBenchReport,
    in_report=False,
    order=41,
    command="acdc",
    title="ACDC: the notebook vs TransformerLens",
)
def _run_acdc_bench(ctx: Context, cfg: ACDCBenchConfig) -> ACDCBenchReport:
    """ACDC through the notebook and through plain TransformerLens hooks: time, ratio, same decisions."""
    return cfg.call(acdc_bench, ctx.model, **ctx.common)


__all__ = ["ACDCBenchReport", "ACDCWayPoint", "acdc_bench"]
