"""The multi-host case of the time to first token bench: one precompiled chunk spliced after several
different host lines, the ways to answer a request on it (composed, full prefill, prefix-cached)
and how far the spliced chunk's decision agrees with full recompute's (`seam_agreement`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from kvnotes import ops
from kvnotes.bench.common import model_answer_ids, text_ids
from kvnotes.engine import run
from kvnotes.errors import BadArgument, OutOfRange
from kvnotes.hosts import HOSTS
from kvnotes.metrics import logit_cosine
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook
from kvnotes.prompt import Prompt
from kvnotes.tasks import Task, load_task, sample

DEFAULT_SEAM = 8  # chunk tokens recomputed in context after a splice

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


def chunk_ids(model: KVModel, n: int) -> list[int]:
    """The bench's chunk: `n` token ids of the policy line, then policy-like notes (no BOS)."""
    return (model.encode(POLICY, bos=False) + text_ids(model, n))[:n]


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
            answers=model_answer_ids(model, ANSWERS),
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
            answers=(model.answer_token(task.answers[0]), model.answer_token(task.answers[1])),
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


def host_pair(
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
        host_pair(model, case, i, chunk_nb, seam)
        for i in tqdm(range(len(case.hosts)), desc=f"seam {seam}", disable=not progress, unit="host")
    ]
    return SeamAgreement.of([c for c, _ in pairs], [f for _, f in pairs], case.answers, seam=seam)
