"""Time to first token: four ways to answer the same request, timed side by side.

The context is `BOS + host line + chunk + live suffix`, then a query whose last token gives the
first answer token. The chunk (a policy line, then policy-like notes) is the long, reusable part;
the live suffix is the request's own state. Per length, four paths:

1. *full prefill*: the whole context is prefilled and the query decided.
2. *prefix-cached*: host + chunk were prefilled once (not timed); per request only the live suffix
   is computed and the query decided. Exact: the same logits as full prefill, up to float rounding.
3. *composed*, same host: the chunk was precompiled once in isolation (not timed, as a cached skill
   or policy would be); per request the host line is prefilled, the chunk spliced after it with
   re-rotation, its first `seam` tokens recomputed in context, the live suffix computed and the
   query decided. With one constant host this never beats path 2: it is there for reference.
4. *multi-host*, the case splicing exists for: the same precompiled chunk follows K different
   host lines (they differ from the first token after BOS), one request per host, against (a)
   full prefill of each context and (b) prefix caching, which can reuse only the longest token
   prefix each context shares with the previous request's (here BOS), so it prefills the chunk
   again for every new host.

Quality is checked beside the speed, so it is never bought with a different answer unnoticed:
the logit cosine and top-1 of the composed readout against full prefill (beside a null cosine
between two unrelated contexts), and over several hosts the decision — the sign of the logit
difference between the query's two answers, " cancel" and " deny" — against full recompute's
(`seam_agreement`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from tqdm.auto import tqdm

from kvnotes import ops
from kvnotes.analysis.bench_report import BenchReport, header, machine
from kvnotes.analysis.registry import Context, Need, Options, analysis, option
from kvnotes.bench.common import growth_exponent, text_ids
from kvnotes.bench.edit_cost import EditCostReport, edit_cost  # noqa: F401 - their old address
from kvnotes.bench.multihost import (
    DEFAULT_SEAM,
    QUERY,
    SUFFIX,
    UNRELATED,
    MultiHost,
    SeamAgreement,
    chunk_ids,
    compose_and_decide,
    full_decide,
    host_pair,
    reuse_prefix,
)
from kvnotes.errors import BadArgument, OutOfRange
from kvnotes.hosts import HOST_LINE
from kvnotes.metrics import logit_cosine
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook

QUICK_LENGTHS = (256, 512, 1024, 2048)  # the quick report's lengths


@dataclass(frozen=True)
class TTFTPoint:
    tokens: int  # context + query (multi-host contexts differ from it by their host's length)
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
    # path 2, prefix-cached (host + chunk cached): median [min, max] per request; the largest
    # |logit| difference of any prefix-cached readout (same host or multi-host) from full prefill's
    prefix_cached_s: float | None = None
    prefix_cached_min_s: float | None = None
    prefix_cached_max_s: float | None = None
    prefix_cached_max_err: float | None = None
    # path 4, multi-host: median [min, max] per request over `timed_hosts` hosts x `repeats`
    multi_host_composed_s: float | None = None
    multi_host_composed_min_s: float | None = None
    multi_host_composed_max_s: float | None = None
    multi_host_full_s: float | None = None
    multi_host_full_min_s: float | None = None
    multi_host_full_max_s: float | None = None
    multi_host_prefix_cached_s: float | None = None
    multi_host_prefix_cached_min_s: float | None = None
    multi_host_prefix_cached_max_s: float | None = None
    multi_host_ratio: float | None = None  # prefix-cached / composed (medians): the real competitor
    multi_host_full_ratio: float | None = None  # full / composed (medians)
    timed_hosts: int | None = None
    # multi-host quality over `hosts` hosts at the report's seam (SeamAgreement)
    hosts: int | None = None
    multi_host_cosine: float | None = None  # mean over hosts
    multi_host_top1_rate: float | None = None
    decision_agreement: float | None = None
    decision_balance: float | None = None  # share of full decisions that are the first answer
    decision_min_margin: float | None = None  # smallest |full logit difference|


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def _spread(med: float | None, lo: float | None, hi: float | None) -> str:
    if med is None:
        return "—"
    return f"{med:.3f}" + (f" [{lo:.3f}, {hi:.3f}]" if lo is not None else "")


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
    exponent_multi_host_composed: float | None = None

    def table(self) -> str:
        r0 = self.results[0] if self.results else None
        k, n = (r0.timed_hosts, r0.hosts) if r0 else (None, None)
        lines = [
            header("time to first token", self.model, self.machine),
            f"per request, median of {r0.repeats if r0 else 1} side-by-side repeats [min, max]; "
            f"composed = precompiled chunk spliced (seam {self.seam}) + {self.suffix_tokens}-token "
            "live suffix",
            "one host: full prefill; prefix-cached (host + chunk cached, exact); composed",
            f"{'tokens':>7}{'chunk':>7}{'full s':>26}{'prefix-cached s':>26}{'composed s':>26}"
            f"{'full/comp':>10}{'cached err':>12}",
        ]
        for r in self.results:
            lines.append(
                f"{r.tokens:>7}{r.chunk_tokens:>7}"
                f"{_spread(r.full_s, r.full_min_s, r.full_max_s):>26}"
                f"{_spread(r.prefix_cached_s, r.prefix_cached_min_s, r.prefix_cached_max_s):>26}"
                f"{_spread(r.composed_s, r.composed_min_s, r.composed_max_s):>26}"
                f"{r.ratio:>9.1f}x{_fmt(r.prefix_cached_max_err, '.1e'):>12}"
            )
        if any(r.multi_host_composed_s is not None for r in self.results):
            lines += [
                f"{k} different hosts, one request each: composed; full prefill; prefix caching "
                "(reuses only the prefix shared with the previous request)",
                f"{'tokens':>7}{'composed s':>26}{'full s':>26}{'prefix-cached s':>26}"
                f"{'cached/comp':>12}{'full/comp':>10}",
            ]
            for r in self.results:
                mc, mf, mp = (
                    _spread(*(getattr(r, f"multi_host_{w}{x}") for x in ("_s", "_min_s", "_max_s")))
                    for w in ("composed", "full", "prefix_cached")
                )
                lines.append(
                    f"{r.tokens:>7}{mc:>26}{mf:>26}{mp:>26}"
                    f"{_fmt(r.multi_host_ratio, '.1f'):>11}x{_fmt(r.multi_host_full_ratio, '.1f'):>9}x"
                )
        lines += [
            "quality against full prefill: one host (cosine, null cosine = an unrelated context of the "
            f"same length, top-1); over {n if n else '—'} hosts (mean cosine, top-1 rate, decision "
            "agreement, share of full decisions that are the first answer, smallest |full logit diff|)",
            f"{'tokens':>7}{'cosine':>10}{'null cos':>10}{'top-1':>7}{'hosts cos':>11}{'top-1':>7}"
            f"{'decision':>10}{'balance':>9}{'margin':>8}",
        ]
        for r in self.results:
            lines.append(
                f"{r.tokens:>7}{r.logit_cosine:>10.5f}{_fmt(r.null_cosine, '.5f'):>10}"
                f"{'same' if r.top1_agree else 'DIFF':>7}{_fmt(r.multi_host_cosine, '.5f'):>11}"
                f"{_fmt(r.multi_host_top1_rate, '.2f'):>7}{_fmt(r.decision_agreement, '.2f'):>10}"
                f"{_fmt(r.decision_balance, '.2f'):>9}{_fmt(r.decision_min_margin, '.2f'):>8}"
            )
        if self.exponent_full is not None:
            multi = self.exponent_multi_host_composed
            lines.append(
                f"growth exponent (time ∝ tokens^e, on medians): composed {self.exponent_composed:.2f}, "
                f"full {self.exponent_full:.2f}"
                + ("" if multi is None else f", multi-host composed {multi:.2f}")
            )
        return "\n".join(lines)


def _cached_decide(
    model: KVModel, cached: Notebook, context: Sequence[int], query: Sequence[int]
) -> tuple[Notebook, torch.Tensor]:
    """One prefix-cached request: `context` from `cached` (`reuse_prefix`), then the query's last
    logits; the new notebook is the cache the next request finds."""
    nb = reuse_prefix(model, cached, context)
    return nb, ops.decide(model, nb, query).last[0]


def _point(
    model: KVModel, n: int, chunk_tokens: int, *, seam: int, repeats: int, hosts: int, timed_hosts: int
) -> TTFTPoint:
    """One length: the four paths timed side by side, in turn, `repeats` times, then the quality."""
    host, suffix, query = (
        model.encode(HOST_LINE),
        model.encode(SUFFIX, bos=False),
        model.encode(QUERY, bos=False),
    )
    chunk = chunk_ids(model, chunk_tokens)
    case = MultiHost.bench(model, chunk, hosts)
    q = list(case.query)
    # offline, not part of time to first token: the precompiled chunk, the prefix cache of
    # host + chunk, and the cache the first multi-host request finds (the last timed host's context)
    chunk_nb = ops.precompile(model, chunk)
    cached = ops.prefill(model, [*host, *chunk])
    last = ops.prefill(model, case.context(timed_hosts - 1))
    t: dict[str, list[float]] = {w: [] for w in ("comp", "full", "cached", "m_comp", "m_full", "m_cached")}
    for _ in range(repeats):
        composed = _timed(t["comp"], compose_and_decide, model, host, chunk_nb, suffix, query, seam=seam)
        full = _timed(t["full"], full_decide, model, [*host, *chunk, *suffix], query)
        _, by_cache = _timed(t["cached"], _cached_decide, model, cached, [*host, *chunk, *suffix], query)
        m_comp, m_full, m_err = [], [], []
        for i in range(timed_hosts):
            host_i, live_i = list(case.hosts[i]), list(case.lives[i])
            m_comp.append(
                _timed(t["m_comp"], compose_and_decide, model, host_i, chunk_nb, live_i, q, seam=seam)
            )
            m_full.append(_timed(t["m_full"], full_decide, model, case.context(i), q))
            last, out = _timed(t["m_cached"], _cached_decide, model, last, case.context(i), q)
            m_err.append(float((out - m_full[-1]).abs().max()))
    # quality, not timed: the timed hosts' logits are the last repeat's, the other hosts' computed here
    rest = [host_pair(model, case, i, chunk_nb, seam) for i in range(timed_hosts, hosts)]
    agree = SeamAgreement.of(
        m_comp + [c for c, _ in rest], m_full + [f for _, f in rest], case.answers, seam=seam
    )
    unrelated = full_decide(model, [*host, *text_ids(model, chunk_tokens, UNRELATED), *suffix], query)
    (c, c_lo, c_hi), (f, f_lo, f_hi), (p, p_lo, p_hi) = (_stats(t[w]) for w in ("comp", "full", "cached"))
    (mc, mc_lo, mc_hi), (mf, mf_lo, mf_hi), (mp, mp_lo, mp_hi) = (
        _stats(t[w]) for w in ("m_comp", "m_full", "m_cached")
    )
    return TTFTPoint(
        tokens=n,
        chunk_tokens=len(chunk),
        composed_s=c,
        full_s=f,
        ratio=f / c,
        logit_cosine=float(logit_cosine(composed, full)),
        top1_agree=bool(composed.argmax() == full.argmax()),
        composed_min_s=c_lo,
        composed_max_s=c_hi,
        full_min_s=f_lo,
        full_max_s=f_hi,
        repeats=repeats,
        null_cosine=float(logit_cosine(unrelated, full)),
        prefix_cached_s=p,
        prefix_cached_min_s=p_lo,
        prefix_cached_max_s=p_hi,
        prefix_cached_max_err=max([float((by_cache - full).abs().max()), *m_err]),
        multi_host_composed_s=mc,
        multi_host_composed_min_s=mc_lo,
        multi_host_composed_max_s=mc_hi,
        multi_host_full_s=mf,
        multi_host_full_min_s=mf_lo,
        multi_host_full_max_s=mf_hi,
        multi_host_prefix_cached_s=mp,
        multi_host_prefix_cached_min_s=mp_lo,
        multi_host_prefix_cached_max_s=mp_hi,
        multi_host_ratio=mp / mc,
        multi_host_full_ratio=mf / mc,
        timed_hosts=timed_hosts,
        hosts=hosts,
        multi_host_cosine=agree.mean_cosine,
        multi_host_top1_rate=agree.top1_rate,
        decision_agreement=agree.agreement,
        decision_balance=agree.balance,
        decision_min_margin=agree.min_margin,
    )


def _layout(model: KVModel, hosts: int) -> tuple[int, int]:
    """Tokens of a context besides its chunk: the one-host path's (host, suffix, query), and how
    many more the longest of the first `hosts` multi-host contexts has (at least 0)."""
    probe = MultiHost.bench(model, [], hosts)
    query = len(probe.query)
    fixed = len(model.encode(HOST_LINE)) + len(model.encode(SUFFIX, bos=False)) + query
    widest = max(len(h) + len(l) for h, l in zip(probe.hosts, probe.lives)) + query
    return fixed, max(0, widest - fixed)


def check_lengths(model: KVModel, lengths: list[int], *, seam: int, hosts: int) -> int:
    """Refuse total lengths that leave no chunk past the seam, or that overrun the model's context with
    the longest host; the tokens of a context besides its chunk (host, suffix and query)."""
    fixed, widest = _layout(model, hosts)
    bad = [n for n in lengths if n - fixed <= seam or n + widest > model.n_ctx]
    if bad:
        raise OutOfRange(
            f"lengths {bad} do not fit: each must exceed {fixed + seam} tokens (host, suffix, "
            f"query and seam) and, with the longest host, stay within {model.name}'s n_ctx={model.n_ctx}"
        )
    return fixed


def fitting_lengths(model: KVModel, cfg: TTFTConfig, fit: bool) -> list[int]:
    """`cfg.lengths`, less those the longest host would push past the model's context where `fit`
    (lengths left at their defaults: a command run with them fits the model it runs on)."""
    room = model.n_ctx - _layout(model, cfg.hosts)[1]
    return [n for n in cfg.lengths if n <= room] if fit else list(cfg.lengths)


def _timed(into: list[float], go: Callable, *args, **kwargs):
    """`go(*args, **kwargs)`, its wall time appended to `into`."""
    t0 = time.perf_counter()
    out = go(*args, **kwargs)
    into.append(time.perf_counter() - t0)
    return out


def _stats(ts: list[float]) -> tuple[float, float, float]:
    return float(np.median(ts)), min(ts), max(ts)


def ttft(
    model: KVModel,
    lengths: list[int],
    *,
    seam: int = DEFAULT_SEAM,
    repeats: int = 3,
    hosts: int = 8,
    timed_hosts: int = 4,
    progress: bool = True,
) -> TTFTReport:
    """The four paths' time to first token at each total length in `lengths` (tokens), timed side
    by side, in turn, `repeats` times (medians, with min and max; exponents fitted on the medians).
    Multi-host times are per request over the first `timed_hosts` hosts; its quality
    (`seam_agreement`) is over `hosts` hosts, beside the one-host logit cosine and top-1 and the
    null cosine of an unrelated context of the same length, below which "close" means nothing."""
    if not 2 <= timed_hosts <= hosts:
        raise BadArgument(f"timed_hosts={timed_hosts} must lie in 2..hosts ({hosts}); time fewer hosts")
    host = model.encode(HOST_LINE)
    fixed = check_lengths(model, lengths, seam=seam, hosts=hosts)
    reps = max(1, repeats)
    ops.prefill(model, host)  # warm-up: first calls pay one-off costs
    points = [
        _point(model, n, n - fixed, seam=seam, repeats=reps, hosts=hosts, timed_hosts=timed_hosts)
        for n in tqdm(lengths, desc="ttft", disable=not progress, unit="length")
    ]
    tokens = [p.tokens for p in points]
    return TTFTReport(
        model=model.name,
        machine=machine(),
        seam=seam,
        suffix_tokens=len(model.encode(SUFFIX, bos=False)),
        results=points,
        exponent_composed=growth_exponent(tokens, [p.composed_s for p in points]),
        exponent_full=growth_exponent(tokens, [p.full_s for p in points]),
        exponent_multi_host_composed=growth_exponent(tokens, [p.multi_host_composed_s for p in points]),
    )


@dataclass(frozen=True)
class TTFTConfig(Options):
    lengths: tuple[int, ...] = option(
        (512, 1024, 2048, 4096, 8192), "total lengths (tokens)", least=1, tokens=True
    )
    seam: int = option(DEFAULT_SEAM, "chunk tokens recomputed in context at the seam", least=0)
    repeats: int = option(3, "side-by-side timings per length (the median is reported)", least=1)
    hosts: int = option(8, "different host lines the spliced chunk's decision is checked after", least=2)
    timed_hosts: int = option(4, "of those hosts, how many are timed one request each", least=2)


@analysis(
    "ttft",
    "bench",
    TTFTConfig,
    TTFTReport,
    quick={"lengths": QUICK_LENGTHS, "repeats": 1},
    title="Time to first token",
    order=20,
    requires=(Need.MOVING_CHUNKS,),
)
def _run_ttft(ctx: Context, cfg: TTFTConfig) -> TTFTReport | None:
    """Time to first token: full prefill, prefix caching and a spliced precompiled chunk, after one
    host and after several."""
    lengths = fitting_lengths(ctx.model, cfg, ctx.fit_context)
    if not lengths:
        return None
    return cfg.call(ttft, ctx.model, lengths, progress=ctx.progress)
