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
from kvnotes.analysis.registry import Context, Options, analysis, option
from kvnotes.bench.sweep import BenchReport, machine
from kvnotes.conformance import FILLER
from kvnotes.engine import run
from kvnotes.errors import BadArgument, OutOfRange
from kvnotes.metrics import logit_cosine
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook
from kvnotes.prompt import Prompt
from kvnotes.tasks import Task, load_task, sample

DEFAULT_SEAM = 8  # chunk tokens recomputed in context after a splice
# Host lines of similar length, each with its own first letter, so that they differ from the
# first token after BOS even under a byte-level tokenizer and a prefix cache shares nothing with
# them but BOS. The first is the one host of paths 1-3.
HOSTS = (
    "You are the store's order assistant. Follow the policy below.\n",
    "Support desk, order team. Read the policy below before you answer.\n",
    "Acting as the shop's customer-service agent, apply this policy.\n",
    "Order help bot for an online store: use the policy that follows.\n",
    "Customer care assistant. The store policy is given below.\n",
    "Hello! I handle orders for the shop; its policy comes next.\n",
    "Mode: order management helper. The policy text follows.\n",
    "Retail assistant instructions: obey the policy below.\n",
    "Welcome to the order desk. Our cancellation policy is below.\n",
    "This assistant answers order questions using the policy below.\n",
    "Internal tool for order cancellations. Apply the following policy.\n",
    "Please act as the merchant's support agent and follow this policy.\n",
    "Bot for the shop's orders: read the policy, then answer the customer.\n",
    "Note to the agent: requests are decided by the policy below.\n",
    "Good morning, team. Today's order policy is below.\n",
    "Every reply must follow the store policy written below.\n",
)
HOST = HOSTS[0]
POLICY = (
    "Policy: an order may be cancelled while its status is pending. Once an order has shipped, "
    "deny the cancellation and offer a return instead.\n"
)
QUERY = "\nQ: Can the order be cancelled? Answer cancel or deny.\nA:"
ANSWERS = (" cancel", " deny")  # the decision: the sign of the first token's logit minus the second's
LIVE = "Customer: Alice. Order id: 1234.\norder_status: {status}.\n"
STATUSES = ("pending", "shipped")  # host i's live suffix has STATUSES[i % 2]: the answer should alternate
SUFFIX = LIVE.format(status="shipped")  # the live suffix of paths 1-3
UNRELATED = "Shelf {i} in aisle {i} of the warehouse holds spare parts for the delivery vans.\n"


def _text_ids(model: KVModel, n: int, line: str = FILLER) -> list[int]:
    """`n` token ids of neutral text (no BOS): policy-like lines, or `line` repeated."""
    ids: list[int] = []
    i = 0
    while len(ids) < n:
        ids += model.encode("".join(line.format(i=j) for j in range(i, i + 50)), bos=False)
        i += 50
    return ids[:n]


def chunk_ids(model: KVModel, n: int) -> list[int]:
    """The bench's chunk: `n` token ids of the policy line, then policy-like notes (no BOS)."""
    return (model.encode(POLICY, bos=False) + _text_ids(model, n))[:n]


def answer_ids(model: KVModel, answers: Sequence[str] = ANSWERS) -> tuple[int, int]:
    """The first token of each of the two answers (as `_answer` reads a decision, by token id)."""
    first, second = (model.encode(a, bos=False)[0] for a in answers)
    if first == second:
        raise BadArgument(
            f"answers {tuple(answers)} start with the same token under {model.name}'s tokenizer; "
            "pick two answers whose first tokens differ"
        )
    return first, second


@dataclass(frozen=True)
class MultiHost:
    """One chunk after several hosts, as token ids: each host (BOS first), the chunk, each host's
    live suffix, the query, and the two answer tokens whose logit difference is the decision.

    >>> from kvnotes import load_model
    >>> model = load_model("tiny-llama")
    >>> case = MultiHost.bench(model, chunk_ids(model, 40), 4)
    >>> len(case.hosts), len(case.chunk), len({h[1] for h in case.hosts})
    (4, 40, 4)
    """

    hosts: tuple[tuple[int, ...], ...]
    chunk: tuple[int, ...]
    lives: tuple[tuple[int, ...], ...]
    query: tuple[int, ...]
    answers: tuple[int, int]

    def __post_init__(self):
        if len(self.hosts) < 2 or len(self.lives) != len(self.hosts):
            raise BadArgument(
                f"{len(self.hosts)} hosts and {len(self.lives)} live suffixes: give at least 2 hosts "
                "and one live suffix per host"
            )
        if len(set(self.hosts)) != len(self.hosts):
            raise BadArgument("two hosts are the same token ids; every host must differ")

    def context(self, i: int) -> list[int]:
        """Host `i`'s whole context before the query: host, chunk, live suffix."""
        return [*self.hosts[i], *self.chunk, *self.lives[i]]

    @classmethod
    def bench(cls, model: KVModel, chunk: Sequence[int], n_hosts: int) -> MultiHost:
        """The bench's case: the first `n_hosts` of `HOSTS`, each with the `LIVE` suffix, its
        status alternating, so a model that reads the policy changes its answer from host to host."""
        if not 2 <= n_hosts <= len(HOSTS):
            raise OutOfRange(f"hosts={n_hosts}: the bench has 2 to {len(HOSTS)} host lines")
        hosts = tuple(tuple(model.encode(h)) for h in HOSTS[:n_hosts])
        same = sorted({h[1] for h in hosts if sum(g[1] == h[1] for g in hosts) > 1})
        if same:
            raise BadArgument(
                f"host lines share their first token {same} under {model.name}'s tokenizer; a "
                "prefix cache would reuse more than BOS; give each host its own first letter"
            )
        lives = tuple(
            tuple(model.encode(LIVE.format(status=STATUSES[i % 2]), bos=False)) for i in range(n_hosts)
        )
        return cls(
            hosts=hosts,
            chunk=tuple(chunk),
            lives=lives,
            query=tuple(model.encode(QUERY, bos=False)),
            answers=answer_ids(model),
        )

    @classmethod
    def from_task(cls, model: KVModel, task: Task | str, n_hosts: int, *, seed: int = 0) -> MultiHost:
        """A task's own decision after `n_hosts` of `HOSTS`: the chunk is one sampled prompt's text
        between BOS and the gating field's line (policy, few-shot block), host i's live suffix is
        the i-th sampled prompt's from that line to the decision, whose gating value alternates,
        and the query is the decision span (template 0, so every prompt's query is the same)."""
        task = load_task(task)
        if not 2 <= n_hosts <= len(HOSTS):
            raise OutOfRange(f"n_hosts={n_hosts}: there are 2 to {len(HOSTS)} host lines")
        prompts = [p.old for p in sample(task, model, n_hosts, seed=seed, template=0)]
        first = prompts[0]
        end = _line_start(first, task.gate.field)
        return cls(
            hosts=tuple(tuple(model.encode(h)) for h in HOSTS[:n_hosts]),
            chunk=tuple(first.ids[1:end]),
            lives=tuple(
                tuple(p.ids[_line_start(p, task.gate.field) : p.span("decision").start]) for p in prompts
            ),
            query=tuple(first.ids[first.span("decision").start :]),
            answers=tuple(model.answer_token(a) for a in task.answers),
        )


def _line_start(p: Prompt, field: str) -> int:
    """Token index where the line holding `field` starts (everything before it is the chunk)."""
    line = p.text.rfind("\n", 0, p.char_spans[field][0]) + 1
    start = next(i for i, (a, b) in enumerate(p.offsets) if b > a and a >= line)
    if start <= 1:
        raise BadArgument(f"the prompt has nothing before the {field!r} line to precompile as a chunk")
    return start


@dataclass(frozen=True)
class SeamAgreement:
    """A precompiled chunk spliced after each host (first `seam` tokens recomputed) against full
    recompute of the same context, per host. The decision is the sign of the logit difference
    `answers[0] − answers[1]` (`full_ld`, `composed_ld`)."""

    seam: int
    cosine: tuple[float, ...]  # logit cosine of the composed readout with full recompute's
    top1: tuple[bool, ...]  # the same top-1 token over the whole vocabulary
    composed_ld: tuple[float, ...]
    full_ld: tuple[float, ...]

    @classmethod
    def of(
        cls,
        composed: Sequence[torch.Tensor],
        full: Sequence[torch.Tensor],
        answers: tuple[int, int],
        *,
        seam: int,
    ) -> SeamAgreement:
        """From each host's composed and full last-token logits."""
        a, b = answers

        def ld(x: torch.Tensor) -> float:
            return float(x[a].double() - x[b].double())

        return cls(
            seam=seam,
            cosine=tuple(float(logit_cosine(c, f)) for c, f in zip(composed, full)),
            top1=tuple(bool(c.argmax() == f.argmax()) for c, f in zip(composed, full)),
            composed_ld=tuple(ld(c) for c in composed),
            full_ld=tuple(ld(f) for f in full),
        )

    @property
    def hosts(self) -> int:
        return len(self.full_ld)

    @property
    def agreement(self) -> float:
        """Share of hosts whose composed decision is full recompute's."""
        return float(np.mean([(c > 0) == (f > 0) for c, f in zip(self.composed_ld, self.full_ld)]))

    @property
    def mean_cosine(self) -> float:
        return float(np.mean(self.cosine))

    @property
    def top1_rate(self) -> float:
        return float(np.mean(self.top1))

    @property
    def balance(self) -> float:
        """Share of hosts whose full decision is the first answer: at 0 or 1 every host decides
        alike, and agreement says less than it seems."""
        return float(np.mean([f > 0 for f in self.full_ld]))

    @property
    def min_margin(self) -> float:
        """The smallest |full logit difference| over hosts: how near a decision came to flipping."""
        return float(min(abs(f) for f in self.full_ld))


def compose_and_decide(
    model: KVModel, host: list[int], chunk_nb: Notebook, suffix: list[int], query: list[int], *, seam: int
) -> torch.Tensor:
    """The host tokens, the spliced chunk (seam repaired), the live suffix; the query's last logits."""
    host = ops.prefill(model, host)
    nb = ops.splice(model, host, chunk_nb, seam=seam)
    nb, _ = run(model, nb, suffix, logits_at=())
    return ops.decide(model, nb, query).last[0]


def full_decide(model: KVModel, context: Sequence[int], query: Sequence[int]) -> torch.Tensor:
    """Full prefill of `context`, then the query's last logits."""
    return ops.decide(model, ops.prefill(model, context), query).last[0]


def reuse_prefix(model: KVModel, cached: Notebook, context: Sequence[int]) -> Notebook:
    """Prefix caching: keep the slots of `cached` (a prefilled context) up to the longest token
    prefix it shares with `context`, and prefill the rest of `context` after them."""
    old = cached.tokens[0, torch.argsort(cached.positions)].tolist()
    same = 0
    for x, y in zip(old, context):
        if x != y:
            break
        same += 1
    nb = cached.truncate(same)
    if same < len(context):
        nb, _ = run(model, nb, list(context[same:]), logits_at=())
    return nb


def _host_pair(
    model: KVModel, case: MultiHost, i: int, chunk_nb: Notebook, seam: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host `i`'s composed and full-recompute last logits."""
    q = list(case.query)
    composed = compose_and_decide(model, list(case.hosts[i]), chunk_nb, list(case.lives[i]), q, seam=seam)
    return composed, full_decide(model, case.context(i), q)


def seam_agreement(
    model: KVModel,
    case: MultiHost,
    *,
    seam: int = DEFAULT_SEAM,
    chunk: Notebook | None = None,
    progress: bool = False,
) -> SeamAgreement:
    """`case`'s chunk, precompiled once (or given as `chunk`), spliced after every host with its
    first `seam` tokens recomputed, against full recompute of each host's context: the decision,
    logit cosine and top-1 per host.

    >>> from kvnotes import load_model
    >>> model = load_model("tiny-llama")
    >>> case = MultiHost.bench(model, chunk_ids(model, 24), 4)
    >>> seam_agreement(model, case, seam=24).agreement  # exact: a fraction; the whole chunk recomputed
    1.0
    """
    chunk_nb = ops.precompile(model, case.chunk) if chunk is None else chunk
    pairs = [
        _host_pair(model, case, i, chunk_nb, seam)
        for i in tqdm(range(len(case.hosts)), desc=f"seam {seam}", disable=not progress, unit="host")
    ]
    return SeamAgreement.of([c for c, _ in pairs], [f for _, f in pairs], case.answers, seam=seam)


# --- the report --------------------------------------------------------------------------------
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
            f"time to first token — {self.model} — {self.machine}",
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
    host, suffix, query = model.encode(HOST), model.encode(SUFFIX, bos=False), model.encode(QUERY, bos=False)
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
    rest = [_host_pair(model, case, i, chunk_nb, seam) for i in range(timed_hosts, hosts)]
    agree = SeamAgreement.of(
        m_comp + [c for c, _ in rest], m_full + [f for _, f in rest], case.answers, seam=seam
    )
    unrelated = full_decide(model, [*host, *_text_ids(model, chunk_tokens, UNRELATED), *suffix], query)
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
    fixed = len(model.encode(HOST)) + len(model.encode(SUFFIX, bos=False)) + query
    widest = max(len(h) + len(l) for h, l in zip(probe.hosts, probe.lives)) + query
    return fixed, max(0, widest - fixed)


def _timed(into: list[float], go: Callable, *args, **kwargs):
    """`go(*args, **kwargs)`, its wall time appended to `into`."""
    t0 = time.perf_counter()
    out = go(*args, **kwargs)
    into.append(time.perf_counter() - t0)
    return out


def _stats(ts: list[float]) -> tuple[float, float, float]:
    return float(np.median(ts)), min(ts), max(ts)


def _exponent(points: list[TTFTPoint], attr: str) -> float | None:
    ys = [getattr(p, attr) for p in points]
    if len(points) < 2 or any(y is None for y in ys):
        return None
    return float(np.polyfit(np.log([p.tokens for p in points]), np.log(ys), 1)[0])


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
    host = model.encode(HOST)
    fixed, widest = _layout(model, hosts)
    bad = [n for n in lengths if n - fixed <= seam or n + widest > model.n_ctx]
    if bad:
        raise OutOfRange(
            f"lengths {bad} do not fit: each must exceed {fixed + seam} tokens (host, suffix, "
            f"query and seam) and, with the longest host, stay within {model.name}'s n_ctx={model.n_ctx}"
        )
    reps = max(1, repeats)
    ops.prefill(model, host)  # warm-up: first calls pay one-off costs
    points = [
        _point(model, n, n - fixed, seam=seam, repeats=reps, hosts=hosts, timed_hosts=timed_hosts)
        for n in tqdm(lengths, desc="ttft", disable=not progress, unit="length")
    ]
    return TTFTReport(
        model=model.name,
        machine=machine(),
        seam=seam,
        suffix_tokens=len(model.encode(SUFFIX, bos=False)),
        results=points,
        exponent_composed=_exponent(points, "composed_s"),
        exponent_full=_exponent(points, "full_s"),
        exponent_multi_host_composed=_exponent(points, "multi_host_composed_s"),
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


QUICK_LENGTHS = (256, 512, 1024, 2048)  # the quick report's lengths


@dataclass(frozen=True)
class TTFTConfig(Options):
    lengths: tuple[int, ...] = option((512, 1024, 2048, 4096, 8192), "total lengths (tokens)", least=1)
    seam: int = option(DEFAULT_SEAM, "chunk tokens recomputed in context at the seam", least=0)
    repeats: int = option(3, "side-by-side timings per length (the median is reported)", least=1)
    hosts: int = option(8, "different host lines the spliced chunk's decision is checked after", least=2)
    timed_hosts: int = option(4, "of those hosts, how many are timed one request each", least=2)


@dataclass(frozen=True)
class EditCostConfig(Options):
    tokens: int = option(2048, "prompt length (0: skip the bench)", least=0)
    repeats: int = option(3, "side-by-side timings per position (the median is reported)", least=1)


@analysis(
    "ttft",
    "bench",
    TTFTConfig,
    TTFTReport,
    quick={"lengths": QUICK_LENGTHS, "repeats": 1},
    title="Time to first token",
)
def _run_ttft(ctx: Context, cfg: TTFTConfig) -> TTFTReport | None:
    """Time to first token: full prefill, prefix caching and a spliced precompiled chunk, after one
    host and after several."""
    room = ctx.model.n_ctx - _layout(ctx.model, cfg.hosts)[1]
    lengths = [n for n in cfg.lengths if n <= room] if ctx.fit_context else list(cfg.lengths)
    if not lengths:
        return None
    return ttft(
        ctx.model,
        lengths,
        seam=cfg.seam,
        repeats=cfg.repeats,
        hosts=cfg.hosts,
        timed_hosts=cfg.timed_hosts,
        progress=ctx.progress,
    )


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
