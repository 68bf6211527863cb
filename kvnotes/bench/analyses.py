"""The analyses users run, the unshared way and the shared way side by side (`kvnotes bench analyses`).

The unshared way (`kvnotes.batches.sharing(False)`): every prompt prefilled from its first token,
sweeps in fixed batches of 16 patches from block 0, nothing memoised across a report's sections.
The shared way (the default): a prompt computes only what it does not share with one prefilled
before, sweeps planned by cost and started at their lowest patched layer, one memo
per task across sections. Both compute the same numbers; the bench checks it on every value
under the results' parts and reports the largest difference. Timed: the probe set
(`kvnotes probe all`), optionally the quick report's task sections, over a list of pair counts
and of preamble lengths (neutral lines every prompt starts with: the shared start grows), each
way's time the median of `repeats` runs alternating in one process, and the growth exponent of
each way's time in pairs and in prompt length.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from tqdm.auto import tqdm

from kvnotes.analysis.bench_report import BenchReport, header, machine
from kvnotes.analysis.registry import Context, Options, analysis, option
from kvnotes.batches import sharing
from kvnotes.bench.common import growth_exponent
from kvnotes.engine.profile import profile
from kvnotes.models.model import KVModel
from kvnotes.prompt import Template
from kvnotes.tasks import Task, load_gated_task
from kvnotes.tasks.sampler import fit_notes

WAYS = ("unshared", "shared")


@dataclass(frozen=True)
class AnalysesPoint:
    """One workload at one size: each way's median seconds, and how far their numbers differ."""

    work: str  # "probe all" or "quick report sections"
    n: int  # prompt pairs
    preamble: int  # neutral tokens added before every prompt
    prompt_tokens: int  # the longest prompt's tokens (with the preamble)
    unshared_s: float
    shared_s: float
    values: int  # numbers compared under the results' parts
    max_diff: float  # the largest |unshared - shared| among them
    repeats: int
    worst: str = ""  # where that largest difference is (a path in the results' JSON)
    # the same outside rank statistics (RANK_STATISTICS), whose values step under rounding
    max_diff_smooth: float | None = None
    worst_smooth: str = ""
    unshared_gflop: float | None = None  # each way's matmul work (the last repeat's), 1e9 flops
    shared_gflop: float | None = None

    @property
    def speedup(self) -> float:
        return self.unshared_s / self.shared_s

    @property
    def work_ratio(self) -> float | None:
        """The unshared way's matmul work over the shared way's: what sharing removed."""
        if not self.unshared_gflop or not self.shared_gflop:
            return None
        return self.unshared_gflop / self.shared_gflop

    @property
    def shared_rate(self) -> float | None:
        """GFLOP/s the shared way ran its matmul work at."""
        return self.shared_gflop / self.shared_s if self.shared_gflop else None


@dataclass(frozen=True)
class AnalysesReport(BenchReport):
    POINT: ClassVar[type] = AnalysesPoint
    model: str
    task: str
    machine: str
    results: list[AnalysesPoint]
    n_exponent: dict[str, float | None]  # per way: seconds ~ pairs^e (probe all, no preamble)
    length_exponent: dict[str, float | None]  # per way: seconds ~ prompt tokens^e (probe all, largest n)
    matmul_gflops: float | None = None  # the machine's matmul rate (`matmul_rate`), GFLOP/s

    def table(self) -> str:
        reps = self.results[0].repeats if self.results else 1
        lines = [
            header("analyses: unshared vs shared", self.model, self.task, self.machine, f"median of {reps}"),
            f"{'work':<22}{'n':>4}{'preamble':>10}{'tokens':>8}{'unshared s':>12}{'shared s':>10}"
            f"{'speedup':>9}{'values':>8}{'max diff':>10}{'work x':>8}{'GFLOP/s':>9}{'at peak s':>10}",
        ]
        for r in self.results:
            work = "—" if r.work_ratio is None else f"{r.work_ratio:.2f}x"
            rate = "—" if r.shared_rate is None else f"{r.shared_rate:.0f}"
            peak = (
                "—"
                if not (r.shared_gflop and self.matmul_gflops)
                else f"{r.shared_gflop / self.matmul_gflops:.3g}"
            )
            lines.append(
                f"{r.work:<22}{r.n:>4}{r.preamble:>10}{r.prompt_tokens:>8}{r.unshared_s:>12.2f}"
                f"{r.shared_s:>10.2f}{r.speedup:>8.2f}x{r.values:>8}{r.max_diff:>10.1e}"
                f"{work:>8}{rate:>9}{peak:>10}"
            )
        if self.matmul_gflops:
            lines.append(
                f"matmul rate of this machine: {self.matmul_gflops:.0f} GFLOP/s (work x: the unshared way's "
                "matmul work over the shared way's; at peak s: the shared way's work at that rate)"
            )

        def fmt(e: float | None) -> str:
            return "—" if e is None else f"{e:.2f}"

        lines.append(
            "growth exponent in pairs: "
            + ", ".join(f"{w} {fmt(self.n_exponent.get(w))}" for w in WAYS)
            + "; in prompt tokens: "
            + ", ".join(f"{w} {fmt(self.length_exponent.get(w))}" for w in WAYS)
        )
        worst = max(self.results, key=lambda r: r.max_diff, default=None)
        if worst is not None and worst.max_diff > 0:
            where = f"{worst.worst} ({worst.work}, n={worst.n})"
            lines.append(f"largest difference: {worst.max_diff:.1e} at {where}")
        smooth = [r for r in self.results if r.max_diff_smooth is not None]
        calm = max(smooth, key=lambda r: r.max_diff_smooth or 0.0, default=None)  # none None: `smooth`
        if calm is not None and calm.max_diff_smooth != worst.max_diff:
            where = f"{calm.worst_smooth} ({calm.work}, n={calm.n})"
            lines.append(f"largest outside rank statistics: {calm.max_diff_smooth:.1e} at {where}")
        return "\n".join(lines)


def with_preamble(model: KVModel, task: Task, n_tokens: int) -> Task:
    """`task` with at least `n_tokens` of neutral store notes before every template's text (the
    start all its prompts share grows by that much); the task itself for 0."""
    if n_tokens <= 0:
        return task
    notes = fit_notes(lambda s: len(model.encode(s, bos=False)), n_tokens)

    def longer(t: Template) -> Template:
        return replace(t, text=notes + t.text)

    variants = tuple(replace(v, template=longer(v.template)) for v in task.variants)
    return replace(task, template=longer(task.template), variants=variants)


# what is measured in seconds, or as a ratio of seconds (attribution's speedup over exact patching)
TIMINGS = ("meta", "seconds", "speedup")


def part_values(d: Any, path: str = "") -> dict[str, float]:
    """Every number under a result's JSON (timings — the seconds of edit methods, attribution's
    speedup — and metadata aside), by path: what the unshared and shared ways must agree on."""
    out: dict[str, float] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            if k in TIMINGS or str(k).endswith("seconds"):  # edit methods' `x.seconds`, `activation_seconds`
                continue
            out.update(part_values(v, f"{path}/{k}"))
    elif isinstance(d, (list, tuple)):
        for i, v in enumerate(d):
            out.update(part_values(v, f"{path}[{i}]"))
    elif isinstance(d, (int, float)) and not isinstance(d, bool):
        out[path] = float(d)
    return out


# Rank correlations step when two near-equal values swap places (two slots whose recoveries are
# both ~1e-6 trade ranks under float rounding: Spearman's rho moves by 12/(n^3 - n) x their gap in
# rank, 0.02 for 21 slots), so they are compared, and their largest difference reported, apart.
RANK_STATISTICS = ("spearman",)


def compare(a: Any, b: Any, *, skip: Sequence[str] = ()) -> tuple[int, float, str]:
    """(numbers compared, largest |difference|, its path) between two results' JSON (NaN equals
    NaN; a number missing on one side, or NaN on one side only, is an infinite difference);
    numbers whose path contains one of `skip` are left out."""
    va, vb = part_values(a), part_values(b)
    worst, where = 0.0, ""
    keys = sorted(k for k in set(va) | set(vb) if not any(s in k for s in skip))
    for k in keys:
        x, y = va.get(k), vb.get(k)
        if x is None or y is None or math.isnan(x) != math.isnan(y):
            d = math.inf
        else:
            d = 0.0 if math.isnan(x) else abs(x - y)
        if d > worst:
            worst, where = d, k
    return sum(k in va for k in keys), worst, where


def time_ways(run: Callable[[], Any], repeats: int) -> tuple[dict[str, float], list[Any], dict[str, float]]:
    """Each way's median seconds over `repeats` runs (the ways alternating within a repeat), the
    last result of each way, and each way's matmul work in its last run (GFLOP)."""
    seconds: dict[str, list[float]] = {w: [] for w in WAYS}
    last: dict[str, Any] = {}
    work: dict[str, float] = {}
    for _ in range(repeats):
        for way in WAYS:
            with sharing(way == "shared"), profile() as p:
                start = time.perf_counter()
                last[way] = run()
                seconds[way].append(time.perf_counter() - start)
            work[way] = p.gflop
    return {w: statistics.median(s) for w, s in seconds.items()}, [last[w] for w in WAYS], work


def matmul_rate(model: KVModel, repeats: int = 7) -> float:
    """This machine's float32 matmul rate, GFLOP/s: the median over `repeats` of a 1024-token MLP
    input projection of `model`'s widths (the largest matmul a forward of a few hundred tokens runs,
    at a size where the rate has levelled off)."""
    f = model.facts
    a = torch.randn(1024, f.d_model, dtype=torch.float32)
    b = torch.randn(f.d_model, f.d_mlp or 4 * f.d_model, dtype=torch.float32)
    a @ b  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] / statistics.median(times) / 1e9


def analyses_bench(
    model: KVModel,
    task: Task | str = "order-cancel",
    ns: Sequence[int] = (8,),
    preambles: Sequence[int] = (0,),
    *,
    report: bool = False,
    repeats: int = 3,
    seed: int = 0,
    progress: bool = True,
) -> AnalysesReport:
    """Time `kvnotes probe all` the unshared and the shared way at each pair count in `ns` (no
    preamble) and each preamble in `preambles` (at the largest n); with `report`, the quick
    report's task sections too (`ReportConfig.quick()`, its own sizes), once."""
    from kvnotes.analysis.report import ReportConfig, plan_parts
    from kvnotes.analysis.runner import run_section

    task = load_gated_task(task, "the analyses bench")
    n_max = max(ns)
    sizes = [(n, 0) for n in ns] + [(n_max, p) for p in preambles if p > 0]
    results: list[AnalysesPoint] = []
    for n, pre in tqdm(sizes, desc="analyses bench", disable=not progress, unit="size"):
        t = with_preamble(model, task, pre)

        def probes(t=t, n=n):
            return run_section("probe", model, t, ["all"], n=n, seed=seed, progress=False).to_dict()

        works: list[tuple[str, int, Callable[[], Any]]] = [("probe all", n, probes)]
        if report and n == n_max and pre == 0:  # the quick report's sections once, at its own sizes
            quick = ReportConfig.quick(seed=seed)

            def sections(t=t, quick=quick):
                parts = plan_parts(model, [t], quick, progress=False)
                return {k: f().to_dict() for k, f in parts if not k.startswith("model/")}

            works.append(("quick report sections", quick.n, sections))
        tokens = _longest_prompt(model, t, n, seed)
        for work, size, run in works:
            med, (a, b), gflop = time_ways(run, repeats)
            count, worst, where = compare(a, b)
            _, smooth, smooth_where = compare(a, b, skip=RANK_STATISTICS)
            results.append(
                AnalysesPoint(
                    work,
                    size,
                    pre,
                    tokens,
                    med["unshared"],
                    med["shared"],
                    count,
                    worst,
                    repeats,
                    where,
                    max_diff_smooth=smooth,
                    worst_smooth=smooth_where,
                    unshared_gflop=gflop["unshared"],
                    shared_gflop=gflop["shared"],
                )
            )
    probe = [r for r in results if r.work == "probe all"]
    by_n = [r for r in probe if r.preamble == 0]
    by_len = [r for r in probe if r.n == n_max]
    return AnalysesReport(
        model=model.name,
        task=task.name,
        machine=machine(),
        results=results,
        n_exponent={
            w: growth_exponent([r.n for r in by_n], [getattr(r, f"{w}_s") for r in by_n]) for w in WAYS
        },
        length_exponent={
            w: growth_exponent([r.prompt_tokens for r in by_len], [getattr(r, f"{w}_s") for r in by_len])
            for w in WAYS
        },
        matmul_gflops=matmul_rate(model),
    )


def _longest_prompt(model: KVModel, task: Task, n: int, seed: int) -> int:
    from kvnotes.tasks import sample

    return max(len(q) for p in sample(task, model, n, seed=seed) for q in (p.old, p.new))


@dataclass(frozen=True)
class AnalysesConfig(Options):
    task: str = option("order-cancel", "the task whose pairs the analyses run on (a name or task file)")
    ns: tuple[int, ...] = option(
        (8,), "prompt pair counts to time at (the growth exponent in pairs)", least=2
    )
    preambles: tuple[int, ...] = option(
        (0,),
        "neutral tokens put before every prompt, at the largest n (the exponent in length)",
        least=0,
        tokens=True,
    )
    report: bool = option(False, "also time the quick report's task sections (at their own sizes)")
    repeats: int = option(3, "runs of each way per size (the median is reported)", least=1)


@analysis("analyses", "bench", AnalysesConfig, AnalysesReport, in_report=False, order=35)
def _run_analyses(ctx: Context, cfg: AnalysesConfig) -> AnalysesReport:
    """The probe set (and the report's task sections) unshared vs shared, same numbers, the ratio."""
    return cfg.call(analyses_bench, ctx.model, **ctx.common)


__all__ = ["AnalysesPoint", "AnalysesReport", "analyses_bench", "compare", "matmul_rate", "with_preamble"]
