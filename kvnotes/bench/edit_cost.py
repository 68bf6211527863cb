"""The cost of one edit as the changed field moves through the prompt: an erratum line, suffix
recompute and full prefill bring a stale notebook up to date side by side (`kvnotes bench edit-cost`),
each way's decision checked against full recompute's."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from tqdm.auto import tqdm

from kvnotes import ops
from kvnotes.analysis.bench_report import BenchReport, header, machine
from kvnotes.analysis.registry import Context, Options, analysis, option
from kvnotes.errors import OutOfRange
from kvnotes.fixtures import FILLER
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook

FRACTIONS = (0.1, 0.3, 0.5, 0.7, 0.9)  # where the field sits, as a share of the filler lines before it


@dataclass(frozen=True)
class EditCostPoint:
    field_position: int
    tokens: int
    erratum_s: float  # median of `repeats` timings
    suffix_s: float
    full_s: float
    suffix_tokens: int
    erratum_tokens: int
    # whether each method's decision (top-1 token) is full recompute's, in that run, and how far
    # it moved the logit difference from the stale notebook's toward full recompute's (1 = all
    # the way; None where full recompute's decision is the stale one's and nothing moved)
    erratum_agrees: bool | None = None
    suffix_agrees: bool | None = None
    erratum_recovery: float | None = None
    suffix_recovery: float | None = None
    repeats: int = 1


@dataclass(frozen=True)
class EditCostReport(BenchReport):
    POINT: ClassVar[type] = EditCostPoint
    model: str
    machine: str
    results: list[EditCostPoint]

    def table(self) -> str:
        def answer(agrees: bool | None, rec: float | None) -> str:
            mark = "?" if agrees is None else ("same" if agrees else "DIFF")
            return f"{mark} {'—' if rec is None else f'{rec:.2f}'}"

        reps = self.results[0].repeats if self.results else 1
        lines = [
            header("one changed field", self.model, self.machine, f"median of {reps}"),
            "answer = the decision against full recompute's (same/DIFF) and the recovery of its "
            "logit difference",
            f"{'field at':>9}{'tokens':>8}{'erratum s':>11}{'suffix s':>10}{'full s':>9}"
            f"{'full/erratum':>14}{'suffix tok':>12}{'erratum answer':>16}{'suffix answer':>15}",
        ]
        for r in self.results:
            lines.append(
                f"{r.field_position:>9}{r.tokens:>8}{r.erratum_s:>11.3f}{r.suffix_s:>10.3f}"
                f"{r.full_s:>9.3f}{r.full_s / r.erratum_s:>13.1f}x{r.suffix_tokens:>12}"
                f"{answer(r.erratum_agrees, r.erratum_recovery):>16}"
                f"{answer(r.suffix_agrees, r.suffix_recovery):>15}"
            )
        return "\n".join(lines)


def edit_cost(
    model: KVModel,
    n_tokens: int = 2048,
    fractions: tuple[float, ...] = FRACTIONS,
    *,
    repeats: int = 3,
    progress: bool = True,
) -> EditCostReport:
    """Erratum vs suffix recompute vs full prefill for one changed field at each position.

    The prompt is about `n_tokens` of policy-like lines with `order_status: pending` placed after
    the given fraction of them; the stale notebook is prefilled beforehand (not timed). Each way
    then brings it up to `shipped` and decides, timed side by side (median of `repeats`), and
    each way's decision is checked against full recompute's from the same run (`_answer`).
    """
    from kvnotes.prompt import Template

    n_lines = max(2, n_tokens // max(1, len(model.encode(FILLER.format(i=10), bos=False))))
    lines = [FILLER.format(i=i) for i in range(n_lines)]
    points = []
    ops.prefill(model, model.encode("".join(lines)))  # warm-up: first calls pay one-off costs
    for f in tqdm(fractions, desc="edit cost", disable=not progress, unit="position"):
        k = int(round(f * n_lines))
        tpl = Template(
            "".join(lines[:k])
            + "order_status: {order_status}\n"
            + "".join(lines[k:])
            + "[[decision:Q: Can the order be cancelled?\nA:]]"
        )
        old = tpl.render(model, order_status="pending")
        new = old.with_values(model, order_status="shipped")
        if len(new) > model.n_ctx:
            raise OutOfRange(f"{len(new)} tokens exceed {model.name}'s n_ctx={model.n_ctx}; lower n_tokens")
        stale = ops.prefill(model, old)
        line = model.encode(
            "[STATE UPDATE] order_status → shipped; overrides any earlier value.\n", bos=False
        )
        ways = _update_ways(model, stale, new, line)
        seconds: dict[str, list[float]] = {w: [] for w in ways}
        logits: dict[str, torch.Tensor] = {}
        for _ in range(max(1, repeats)):
            for w, go in ways.items():  # side by side, in turn, each repeat
                t0 = time.perf_counter()
                logits[w] = go()
                seconds[w].append(time.perf_counter() - t0)
        before = ops.decide(model, stale, old).last[0]
        (e_ok, e_rec), (s_ok, s_rec) = (
            _answer(logits[w], logits["full"], before) for w in ("erratum", "suffix")
        )
        start = new.span("order_status").start
        points.append(
            EditCostPoint(
                field_position=start,
                tokens=len(new),
                erratum_s=float(np.median(seconds["erratum"])),
                suffix_s=float(np.median(seconds["suffix"])),
                full_s=float(np.median(seconds["full"])),
                suffix_tokens=new.span("decision").start - start,
                erratum_tokens=len(line),
                erratum_agrees=e_ok,
                suffix_agrees=s_ok,
                erratum_recovery=e_rec,
                suffix_recovery=s_rec,
                repeats=max(1, repeats),
            )
        )
    return EditCostReport(model=model.name, machine=machine(), results=points)


def _update_ways(model: KVModel, stale: Notebook, new, line: list[int]) -> dict:
    """The three ways to bring `stale` up to `new` and decide: each returns the last logits."""
    return {
        "erratum": lambda: ops.decide(model, ops.append(model, stale, line), new).last[0],
        "suffix": lambda: ops.decide(
            model, ops.recompute_suffix(model, stale, new, "order_status"), new
        ).last[0],
        "full": lambda: ops.decide(model, ops.prefill(model, new), new).last[0],
    }


def _answer(mine: torch.Tensor, full: torch.Tensor, stale: torch.Tensor) -> tuple[bool, float | None]:
    """Whether `mine`'s top-1 token is full recompute's, and the recovery of the logit difference
    between full's answer and the stale notebook's (its runner-up where the two answers are the
    same): (ld_mine − ld_stale) / (ld_full − ld_stale), None when that denominator is 0.

    >>> full, stale = torch.tensor([0.0, 3.0, 1.0]), torch.tensor([2.0, 0.0, 1.0])
    >>> _answer(torch.tensor([1.0, 1.5, 0.0]), full, stale)  # exact: (1.5 - 1.0) / 1.0
    (True, 0.5)
    """
    a = int(full.argmax())
    b = int(stale.argmax())
    if b == a:
        b = int(full.topk(2).indices[1])

    def ld(x: torch.Tensor) -> float:
        return float(x[a].double() - x[b].double())

    moved = ld(full) - ld(stale)
    recovery = (ld(mine) - ld(stale)) / moved if moved != 0 else None
    return int(mine.argmax()) == a, recovery


@dataclass(frozen=True)
class EditCostConfig(Options):
    tokens: int = option(2048, "prompt length", least=0, tokens=True, skips=True)
    repeats: int = option(3, "side-by-side timings per position (the median is reported)", least=1)
    # where the field sits decides how much a suffix recompute redoes: early, middle and late
    fractions: tuple[float, ...] = option(
        FRACTIONS, "the changed field's places, as shares of the prompt before it", least=0.0, most=1.0
    )


@analysis(
    "edit_cost",
    "bench",
    EditCostConfig,
    EditCostReport,
    quick={"tokens": 1024, "repeats": 1},
    title="Cost of an edit",
    order=30,
)
def _run_edit_cost(ctx: Context, cfg: EditCostConfig) -> EditCostReport | None:
    """One changed field: erratum vs suffix recompute vs full prefill, with the field at several places."""
    tokens = min(cfg.tokens, ctx.model.n_ctx) if ctx.fit_context else cfg.tokens
    if not tokens:
        return None
    return cfg.call(edit_cost, ctx.model, tokens, progress=ctx.progress)
