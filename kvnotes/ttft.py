"""Time to first token: a composed context against full prefill of the same context, side by side.

The context is `BOS + host line + chunk + suffix`, then a query whose last token gives the first
answer token. *Composed*: the chunk was precompiled in isolation once (not timed, as a cached
skill or policy would be); per request it is spliced after the host line with re-rotation, its
first `seam` tokens are recomputed in context (it was computed without the host line), the live
`suffix` is computed, and the query is decided. *Full*: the whole context is prefilled and the
query decided. Both readouts are compared (logit cosine, top-1), so the speed is never bought
with a different answer unnoticed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from tqdm.auto import tqdm

from kvnotes import ops
from kvnotes.analysis import Context, analysis, option
from kvnotes.bench import BenchReport, machine
from kvnotes.conformance import FILLER
from kvnotes.engine import run
from kvnotes.errors import OutOfRange
from kvnotes.metrics import logit_cosine
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook

HOST = "You are the store's order assistant. Follow the policy below.\n"
QUERY = "\nQ: Can the order be cancelled? Answer cancel or deny.\nA:"
SUFFIX = "Customer: Alice. Order id: 1234.\norder_status: shipped.\n"


@dataclass(frozen=True)
class TTFTPoint:
    tokens: int  # context + query
    chunk_tokens: int
    composed_s: float  # median of `repeats`
    full_s: float
    ratio: float  # full / composed (medians)
    logit_cosine: float
    top1_agree: bool
    composed_min_s: float | None = None
    composed_max_s: float | None = None
    full_min_s: float | None = None
    full_max_s: float | None = None
    repeats: int = 1
    # the cosine between the full-recompute logits of this context and of an unrelated context of
    # the same length: how close two logit vectors are anyway, the floor `logit_cosine` is read against
    null_cosine: float | None = None


@dataclass(frozen=True)
class TTFTReport(BenchReport):
    POINT: ClassVar[type] = TTFTPoint
    model: str
    machine: str
    seam: int
    suffix_tokens: int
    results: list[TTFTPoint]
    exponent_composed: float | None
    exponent_full: float | None

    def table(self) -> str:
        lines = [
            f"time to first token — {self.model} — {self.machine}",
            f"composed = precompiled chunk spliced (seam {self.seam}) "
            f"+ {self.suffix_tokens}-token live suffix",
            f"median of {self.results[0].repeats if self.results else 1} side-by-side repeats "
            "[min, max]; null cosine: full logits of an unrelated context of the same length",
            f"{'tokens':>7}{'chunk':>7}{'composed s':>26}{'full s':>28}{'ratio':>9}"
            f"{'cosine':>10}{'null cos':>10}{'top-1':>7}",
        ]

        def spread(med: float, lo: float | None, hi: float | None) -> str:
            return f"{med:.3f}" + (f" [{lo:.3f}, {hi:.3f}]" if lo is not None else "")

        for r in self.results:
            null = "—" if r.null_cosine is None else f"{r.null_cosine:.5f}"
            lines.append(
                f"{r.tokens:>7}{r.chunk_tokens:>7}"
                f"{spread(r.composed_s, r.composed_min_s, r.composed_max_s):>26}"
                f"{spread(r.full_s, r.full_min_s, r.full_max_s):>28}"
                f"{r.ratio:>8.1f}x{r.logit_cosine:>10.5f}{null:>10}{'same' if r.top1_agree else 'DIFF':>7}"
            )
        if self.exponent_full is not None:
            lines.append(
                f"growth exponent (time ∝ tokens^e): composed {self.exponent_composed:.2f}, "
                f"full {self.exponent_full:.2f}"
            )
        return "\n".join(lines)


UNRELATED = "Shelf {i} in aisle {i} of the warehouse holds spare parts for the delivery vans.\n"


def _text_ids(model: KVModel, n: int, line: str = FILLER) -> list[int]:
    """`n` token ids of neutral text (no BOS): policy-like lines, or `line` repeated."""
    ids: list[int] = []
    i = 0
    while len(ids) < n:
        ids += model.encode("".join(line.format(i=j) for j in range(i, i + 50)), bos=False)
        i += 50
    return ids[:n]


def compose_and_decide(
    model: KVModel, host: list[int], chunk_nb: Notebook, suffix: list[int], query: list[int], *, seam: int
) -> torch.Tensor:
    """The host tokens, the spliced chunk (seam repaired), the live suffix; the query's last logits."""
    host = ops.prefill(model, host)
    nb = ops.splice(model, host, chunk_nb, seam=seam)
    nb, _ = run(model, nb, suffix, logits_at=())
    return ops.decide(model, nb, query).last[0]


def ttft(
    model: KVModel, lengths: list[int], *, seam: int = 8, repeats: int = 3, progress: bool = True
) -> TTFTReport:
    """Composed vs full time to first token at each total length in `lengths` (tokens): the two
    timed side by side, in turn, `repeats` times (medians, with min and max); the exponents are
    fitted on the medians. Quality: the logit cosine and top-1 agreement of the composed answer
    with the full one, beside the cosine of the full logits with those of an unrelated context
    of the same length (`null_cosine`), below which "close" means nothing."""
    suffix = model.encode(SUFFIX, bos=False)
    query = model.encode(QUERY, bos=False)
    host = model.encode(HOST)
    fixed = len(host) + len(suffix) + len(query)
    bad = [n for n in lengths if n - fixed <= seam or n > model.n_ctx]
    if bad:
        raise OutOfRange(
            f"lengths {bad} do not fit: each must exceed {fixed + seam} tokens (host, suffix, "
            f"query and seam) and stay within {model.name}'s n_ctx={model.n_ctx}"
        )
    points = []
    reps = max(1, repeats)
    for n in tqdm(lengths, desc="ttft", disable=not progress, unit="length"):
        chunk = _text_ids(model, n - fixed)
        chunk_nb = ops.precompile(model, chunk)  # offline: not part of time to first token
        t_comp, t_full = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            composed = compose_and_decide(model, host, chunk_nb, suffix, query, seam=seam)
            t1 = time.perf_counter()
            full = ops.decide(model, ops.prefill(model, [*host, *chunk, *suffix]), query).last[0]
            t2 = time.perf_counter()
            t_comp.append(t1 - t0)
            t_full.append(t2 - t1)
        other = [*host, *_text_ids(model, n - fixed, UNRELATED), *suffix]  # not timed
        unrelated = ops.decide(model, ops.prefill(model, other), query).last[0]
        c, f = float(np.median(t_comp)), float(np.median(t_full))
        points.append(
            TTFTPoint(
                tokens=n,
                chunk_tokens=len(chunk),
                composed_s=c,
                full_s=f,
                ratio=f / c,
                logit_cosine=float(logit_cosine(composed, full)),
                top1_agree=bool(composed.argmax() == full.argmax()),
                composed_min_s=min(t_comp),
                composed_max_s=max(t_comp),
                full_min_s=min(t_full),
                full_max_s=max(t_full),
                repeats=reps,
                null_cosine=float(logit_cosine(unrelated, full)),
            )
        )
    exp_c = exp_f = None
    if len(points) >= 2:
        x = np.log([p.tokens for p in points])
        exp_c = float(np.polyfit(x, np.log([p.composed_s for p in points]), 1)[0])
        exp_f = float(np.polyfit(x, np.log([p.full_s for p in points]), 1)[0])
    return TTFTReport(
        model=model.name,
        machine=machine(),
        seam=seam,
        suffix_tokens=len(suffix),
        results=points,
        exponent_composed=exp_c,
        exponent_full=exp_f,
    )


# --- the cost of one edit as the changed field moves through the prompt --------------------------
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
            f"one changed field — {self.model} — {self.machine} — median of {reps}",
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
    fractions: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9),
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
    >>> _answer(torch.tensor([1.0, 1.5, 0.0]), full, stale)
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


QUICK_LENGTHS = (256, 512, 1024, 2048)  # the quick report's lengths


@dataclass(frozen=True)
class TTFTConfig:
    lengths: tuple[int, ...] = option((512, 1024, 2048, 4096, 8192), "total lengths (tokens)")
    seam: int = option(8, "chunk tokens recomputed in context at the seam")
    repeats: int = option(3, "side-by-side timings per length (the median is reported)", least=1)


@dataclass(frozen=True)
class EditCostConfig:
    tokens: int = option(2048, "prompt length")
    repeats: int = option(3, "side-by-side timings per position (the median is reported)", least=1)


@analysis(
    "ttft",
    "bench",
    TTFTConfig,
    TTFTReport,
    quick={"lengths": QUICK_LENGTHS, "repeats": 1},
    title="Time to first token",
)
def _ttft(ctx: Context, cfg: TTFTConfig) -> TTFTReport | None:
    """Time to first token: spliced precompiled chunk vs full prefill."""
    lengths = [n for n in cfg.lengths if n <= ctx.model.n_ctx] if ctx.fit_context else list(cfg.lengths)
    if not lengths:
        return None
    return ttft(ctx.model, lengths, seam=cfg.seam, repeats=cfg.repeats, progress=ctx.progress)


@analysis(
    "edit_cost",
    "bench",
    EditCostConfig,
    EditCostReport,
    quick={"tokens": 1024, "repeats": 1},
    title="Cost of an edit",
)
def _edit_cost(ctx: Context, cfg: EditCostConfig) -> EditCostReport | None:
    """One changed field: erratum vs suffix recompute vs full prefill, with the field at several places."""
    tokens = min(cfg.tokens, ctx.model.n_ctx) if ctx.fit_context else cfg.tokens
    return edit_cost(ctx.model, tokens, repeats=cfg.repeats, progress=ctx.progress) if tokens else None
