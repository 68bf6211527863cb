"""`kvnotes bench serve`: the erratum pattern against a real vLLM server, online.

Many sessions share one long policy, rendered from a task: its rule, few-shot examples, each
session's own state block (the gating field among it), neutral notes (`--tokens` in all), then the
question. Requests arrive as a Poisson process at each `--rates` value; each picks a session at
random and changes its gating field first. A `PromptManager` per session turns the change into the
prompt its strategy sends (`kvnotes.serving.manager`): `erratum` appends one line, `in_place` rewrites the
field, `hoist` keeps the field's line at the end. Per strategy and rate the bench reads:

- the prefix-cache hit rate, from vLLM's token counters (`vllm:prefix_cache_queries_total`,
  `vllm:prefix_cache_hits_total`) read from `/metrics` before and after the run;
- time to first token per request, from the streamed response, sent to first token (queueing
  included): p50, p90, p99; and throughput, requests finished per second of the run;
- the decision: the answer tokens' log-probs (`logprob_token_ids`) against those of the freshly
  rendered prompt (the template with the current value, no errata), read after the run.

Steady state: each session's first prompt is sent once before the clock starts, so the runs
measure changes to a session the server has seen, not cold starts. Each run salts the cache
(`cache_salt`) with its own id, so no run reuses another's blocks. Numeric gating fields (days
since purchase) take a fresh value each change, alternating sides of the rule, as a counter or a
balance would; a field with a few named values (order status) toggles between them, and then
`in_place` finds the earlier rendering cached, which the hit rate shows.

The agent loop (`--agent-turns`) is the 28-turn errata stress test on the server: one session per
prompt, the gating field toggling every turn, sent in turn by `erratum` (errata stacked, never
compacted), `in_place` and `recompute` (the fresh prompt with a new cache salt each turn: no reuse at
all), with decision agreement against `recompute` and cumulative TTFT per strategy.
"""

from __future__ import annotations

import asyncio
import math
import os
import platform
import random
import statistics
import sys
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from tqdm.auto import tqdm

from kvnotes.analysis.registry import Context, Options, analysis, option
from kvnotes.bench.sweep import BenchReport
from kvnotes.errors import BadOption, KVNotesError
from kvnotes.serving.manager import (
    DEFAULT_COMPACTION,
    NEVER,
    STRATEGIES,
    Compaction,
    PromptManager,
    escape,
    fill,
)
from kvnotes.serving.vllm import Completion, Server, complete, run_sync
from kvnotes.tasks import Task, load_task
from kvnotes.tasks.sampler import fit_notes, shots_text, values_for

DEFAULT_TASK = "refund-window"  # a numeric gating field: every change is a new value
AGENT_TASK = "order-cancel"  # the gating field toggles, as in the paper's stress test
AGENT_STRATEGIES = ("erratum", "in_place", "recompute")


# --- the workload --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Session:
    """One session's prompt: a manager template whose only field is the task's gating field."""

    template: str
    tail: str
    field: str
    initial: str


class Values:
    """A session's new values for the gating field, alternating between the two outcomes.

    Numeric fields whose outcomes sit on either side of a threshold draw fresh numbers from each
    side (the low side from 1 to its largest listed value, the high side from its smallest to five
    times its largest), never repeating within a session while a side has numbers left. Other
    fields toggle among the task's listed values."""

    def __init__(self, task: Task, rng: random.Random):
        self.task, self.rng = task, rng
        gate = task.gate
        sides = {o: [v for v, oo in zip(gate.values, gate.outcomes) if oo == o] for o in (0, 1)}
        self.ranges: dict[int, range] | None = None
        if all(v.isdigit() for v in gate.values) and all(sides.values()):
            lo, hi = sorted((0, 1), key=lambda o: max(int(v) for v in sides[o]))
            top_lo = max(int(v) for v in sides[lo])
            bottom_hi = min(int(v) for v in sides[hi])
            if top_lo < bottom_hi:
                self.ranges = {
                    lo: range(1, top_lo + 1),
                    hi: range(bottom_hi, 5 * max(int(v) for v in sides[hi]) + 1),
                }
                self.threshold, self.low = top_lo, lo
        self.sides = sides
        self.used: set[str] = set()

    def outcome(self, value: str) -> int:
        if self.ranges is not None:
            return self.low if int(value) <= self.threshold else 1 - self.low
        return self.task.outcome(value)

    def draw(self, side: int) -> str:
        if self.ranges is None:
            return self.rng.choice(self.sides[side])
        pool = [str(v) for v in self.ranges[side] if str(v) not in self.used] or [
            str(v) for v in self.ranges[side]
        ]
        v = self.rng.choice(pool)
        self.used.add(v)
        return v

    def first(self) -> str:
        return self.draw(self.rng.randrange(2))

    def next(self, current: str) -> str:
        return self.draw(1 - self.outcome(current))


def sessions(
    task: Task, count_tokens: Callable[[str], int], tokens: int, n: int, *, seed: int = 0
) -> list[Session]:
    """`n` sessions of about `tokens` tokens each: shared rule, examples and notes, each with its
    own state block (names, ids, the gating field's first value)."""
    if not task.has_filler:
        raise KVNotesError(
            f"task {task.name!r} has no {{filler}} field to hold the long policy; add one after the "
            "gating field"
        )
    t = task.with_template(0)
    field_name = t.gate.field
    shared = random.Random(f"serve/{t.name}/{seed}")
    shots = shots_text(t, shared)
    written = {t.rule.field: t.rule.values[0]} if t.rule else {}
    out, states = [], set()
    for s in range(n):
        rng = random.Random(f"serve/{t.name}/{seed}/session/{s}")
        first = Values(t, rng).first()
        for _ in range(1000):  # each session is its own customer: redraw a state another one has
            vals = {**values_for(t, rng), **written, "shots": shots, field_name: first}
            if tuple(vals[k] for k in t.vary) not in states:
                break
        states.add(tuple(vals[k] for k in t.vary))

        def layout(filler: str, vals=vals):
            return t.template.layout(**{**vals, "filler": filler})

        text, spans = layout(fit_notes(lambda f: count_tokens(layout(f)[0]), tokens))
        fs, fe = spans[field_name]
        d0 = spans["decision"][0] if "decision" in spans else len(text)
        template = escape(text[:fs]) + "{" + field_name + "}" + escape(text[fe:d0])
        out.append(Session(template=template, tail=text[d0:], field=field_name, initial=first))
    return out


@dataclass(frozen=True)
class Planned:
    """One request of a run: when it arrives, whose it is, what it sends, what it should match."""

    at: float
    session: int
    prompt: str
    fresh: str
    value: str
    expected: int
    action: str


def plan(
    task: Task,
    the_sessions: Sequence[Session],
    strategy: str,
    rate: float,
    requests: int,
    *,
    seed: int = 0,
    compaction: Compaction = DEFAULT_COMPACTION,
    count_tokens: Callable[[str], int] | None = None,
) -> tuple[list[str], list[Planned]]:
    """(each session's first prompt, the run's requests). Arrival times, sessions and values depend
    only on `seed` and `rate`, so every strategy answers the same stream of changes."""
    rng = random.Random(f"serve/plan/{seed}/{rate}")
    streams = [
        Values(task.with_template(0), random.Random(f"serve/values/{seed}/{s}"))
        for s in range(len(the_sessions))
    ]
    kw = {"count_tokens": count_tokens} if count_tokens else {}
    managers = [
        PromptManager(
            s.template, {s.field: s.initial}, tail=s.tail, strategy=strategy, compaction=compaction, **kw
        )
        for s in the_sessions
    ]
    firsts = [m.render() for m in managers]
    out, t = [], 0.0
    for _ in range(requests):
        t += rng.expovariate(rate)
        s = rng.randrange(len(managers))
        m, sess = managers[s], the_sessions[s]
        value = streams[s].next(m.values[sess.field])
        action = m.update(sess.field, value)
        out.append(Planned(t, s, m.render(), m.fresh(), value, streams[s].outcome(value), action))
    return firsts, out


# --- results -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServePoint:
    """One strategy at one arrival rate."""

    strategy: str
    rate: float  # requests per second offered
    requests: int
    hit_rate: float | None  # prefix-cache hits / queries, in tokens, over the run
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    throughput: float  # requests finished per second, first send to last finish
    decision_agreement: float | None  # same likelier answer as the fresh prompt
    follows: float | None = None  # likelier answer is the one the rule gives for the current value
    fresh_follows: float | None = None  # the same for the fresh prompts
    ld_gap: float | None = None  # mean |(lp answer 0 - lp answer 1) - the fresh prompt's|, in nats
    prompt_tokens: float | None = None  # mean prompt length the server reported
    queried_tokens: float = 0.0
    hit_tokens: float = 0.0
    seconds: float = 0.0  # the run's wall time
    compactions: int = 0
    arrival_rate: float | None = None  # requests / time of the last arrival: the Poisson draw's own rate
    saturated: bool = False  # finished fewer than 90% of the requests per second that arrived


@dataclass(frozen=True)
class AgentTurns:
    """The agent loop on the server: per strategy, decisions against `recompute` and TTFT."""

    strategy: str
    turns: int
    prompts: int
    agreement: float | None  # share of turns whose likelier answer matches recompute's (None for recompute)
    follows: float | None  # share of turns whose likelier answer follows the toggled value
    cumulative_ttft: float  # seconds summed over all turns of all prompts
    hit_rate: float | None
    per_turn_agreement: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class ServeReport(BenchReport):
    POINT: ClassVar[type] = ServePoint
    model: str
    server: dict
    machine: str
    task: str
    tokens: int
    sessions: int
    results: list[ServePoint]
    agent: list[AgentTurns] = field(default_factory=list)
    agent_task: str = AGENT_TASK
    notes: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict) -> ServeReport:
        return cls(
            **{
                **d,
                "results": [ServePoint(**r) for r in d["results"]],
                "agent": [AgentTurns(**a) for a in d.get("agent", [])],
            }
        )

    def point(self, strategy: str, rate: float) -> ServePoint | None:
        return next((p for p in self.results if p.strategy == strategy and p.rate == rate), None)

    def table(self) -> str:
        def pct(x):
            return "—" if x is None else f"{100 * x:.1f}%"

        def num(x, spec=".3f"):
            return "—" if x is None else format(x, spec)

        s = self.server
        lines = [
            f"serve — {self.model} on {s.get('vllm', 'vLLM')} (block {s.get('block_size')}) — {self.machine}",
            f"task {self.task}, {self.sessions} sessions, prompts of ~{self.tokens} tokens; TTFT in seconds",
            f"{'rate':>6}{'drawn':>7}  {'strategy':<9}{'hit rate':>9}{'p50':>9}{'p90':>9}{'p99':>9}"
            f"{'req/s':>8}"
            f"{'agree':>7}{'|Δld|':>7}{'follows':>8}{'fresh':>7}",
        ]
        for p in self.results:
            lines.append(
                f"{p.rate:>6.2f}{num(p.arrival_rate, '.2f'):>7}  {p.strategy:<9}{pct(p.hit_rate):>9}"
                f"{num(p.ttft_p50):>9}{num(p.ttft_p90):>9}"
                f"{num(p.ttft_p99):>9}{p.throughput:>8.2f}{num(p.decision_agreement, '.2f'):>7}"
                f"{num(p.ld_gap, '.2f'):>7}{num(p.follows, '.2f'):>8}{num(p.fresh_follows, '.2f'):>7}"
                + ("  saturated" if p.saturated else "")
            )
        for rate in sorted({p.rate for p in self.results}):
            e, i = self.point("erratum", rate), self.point("in_place", rate)
            if e and i and e.ttft_p90 > 0:
                lines.append(
                    f"  at {rate:.2f} req/s: in_place p90 / erratum p90 = {i.ttft_p90 / e.ttft_p90:.1f}×"
                )
        if self.agent:
            lines.append(f"agent loop ({self.agent_task}): decisions against recompute-every-turn")
            lines.append(
                f"  {'strategy':<10}{'turns':>6}{'agree':>7}{'follows':>8}{'Σ TTFT s':>10}{'hit rate':>9}"
            )
            for a in self.agent:
                lines.append(
                    f"  {a.strategy:<10}{a.turns:>6}{num(a.agreement, '.2f'):>7}{num(a.follows, '.2f'):>8}"
                    f"{a.cumulative_ttft:>10.2f}{pct(a.hit_rate):>9}"
                )
        lines.append(
            "agree: same likelier answer as the fresh prompt sent as a new request under a cache salt of "
            "its own (computed from scratch; in the agent loop recompute is that reference, so its agree "
            "is —); |Δld|: mean gap to its log-prob difference; "
            "follows / fresh: the likelier answer is the rule's for the current value (0.5 with one "
            "constant answer)"
        )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def machine() -> str:
    return f"{platform.machine()} {os.cpu_count()} CPU cores, {platform.system()}"


def quantile(xs: Sequence[float], q: float) -> float:
    """The q-quantile of `xs` (linear between order statistics, as numpy's default)."""
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1] if len(xs) > 1 else xs[0]


# --- running -------------------------------------------------------------------------------------
def answer_ids(server: Server, answers: Sequence[str]) -> tuple[int, ...]:
    out = []
    for a in answers:
        ids = server.tokenize(a)
        if len(ids) != 1:
            raise KVNotesError(
                f"answer {a!r} is {len(ids)} tokens for {server.model}'s tokenizer; the decision is read "
                "from one token's log-prob, so pick answers that are one token each"
            )
        out.append(ids[0])
    return tuple(out)


async def _drive(server: Server, planned: Sequence[Planned], answers, salt: str, desc: str, progress: bool):
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=None) as client:
        bar = tqdm(total=len(planned), desc=desc, unit="req", disable=not progress, leave=False)
        start = asyncio.get_running_loop().time()

        async def one(p: Planned) -> Completion:
            await asyncio.sleep(max(0.0, start + p.at - asyncio.get_running_loop().time()))
            c = await complete(client, server, p.prompt, answers=answers, salt=salt)
            bar.update()
            return c

        try:
            return await asyncio.gather(*(one(p) for p in planned))
        finally:
            bar.close()


async def _sequential(
    server: Server, prompts: Sequence[str], answers, salt: str | Sequence[str] | None
) -> list[Completion]:
    """`prompts` one at a time, under `salt` (one for all, or one per prompt)."""
    import httpx

    salts = [salt] * len(prompts) if salt is None or isinstance(salt, str) else list(salt)
    async with httpx.AsyncClient(timeout=None) as client:
        return [await complete(client, server, p, answers=answers, salt=s) for p, s in zip(prompts, salts)]


def _references(server: Server, prompts: Sequence[str], answers, memo: dict) -> list[Completion]:
    """The completion of each fresh prompt sent as a new request that no cached block can serve:
    each under a cache salt of its own, so the server computes it from scratch (what no strategy
    reuses, the reference every strategy's decision is read against, in-place's included, whose
    prompt is the same text but whose blocks come from the session's earlier requests). From `memo`
    where one was already sent (another strategy's run), else sent now, one at a time."""
    todo = [p for p in dict.fromkeys(prompts) if p not in memo]
    salts = [f"kvnotes-reference-{uuid.uuid4().hex}" for _ in todo]
    memo.update(zip(todo, run_sync(_sequential(server, todo, answers, salts))))
    return [memo[p] for p in prompts]


def _ld(c: Completion) -> float | None:
    a, b = c.answer_logprobs[:2]
    return None if a is None or b is None else a - b


def _share(flags: Sequence[bool | None]) -> float | None:
    known = [f for f in flags if f is not None]
    return sum(known) / len(known) if known else None


def run_point(
    server: Server,
    task: Task,
    the_sessions: Sequence[Session],
    strategy: str,
    rate: float,
    requests: int,
    answers: tuple[int, ...],
    *,
    seed: int = 0,
    compaction: Compaction = DEFAULT_COMPACTION,
    reference: dict | None = None,
    progress: bool = True,
) -> ServePoint:
    """One strategy at one rate: prime the sessions, run the arrivals, read counters and decisions."""
    firsts, planned = plan(
        task,
        the_sessions,
        strategy,
        rate,
        requests,
        seed=seed,
        compaction=compaction,
        count_tokens=server.count_tokens,
    )
    salt = f"kvnotes-{strategy}-{rate}-{uuid.uuid4().hex}"
    run_sync(_sequential(server, firsts, answers, salt))  # steady state: the server has seen each session
    before = server.counters()
    done = run_sync(_drive(server, planned, answers, salt, f"{strategy} @ {rate:g} req/s", progress))
    delta = server.counters() - before
    sent0 = min(c.sent for c in done)
    wall = max(c.sent + c.latency for c in done) - sent0
    ttfts = [c.ttft for c in done]
    memo = reference if reference is not None else {}
    refs = _references(server, [p.fresh for p in planned], answers, memo)
    fresh = [c.decision for c in refs]
    gaps = [abs(_ld(a) - _ld(b)) for a, b in zip(done, refs) if _ld(a) is not None and _ld(b) is not None]
    mine = [c.decision for c in done]
    arrived = len(planned) / planned[-1].at
    throughput = len(done) / wall if wall > 0 else math.inf
    return ServePoint(
        strategy=strategy,
        rate=rate,
        requests=len(done),
        hit_rate=delta.hit_rate,
        ttft_p50=quantile(ttfts, 0.5),
        ttft_p90=quantile(ttfts, 0.9),
        ttft_p99=quantile(ttfts, 0.99),
        throughput=throughput,
        decision_agreement=_share([None if a is None or b is None else a == b for a, b in zip(mine, fresh)]),
        ld_gap=statistics.mean(gaps) if gaps else None,
        follows=_share([None if a is None else a == p.expected for a, p in zip(mine, planned)]),
        fresh_follows=_share([None if b is None else b == p.expected for b, p in zip(fresh, planned)]),
        # float: the mean of equal token counts is an int
        prompt_tokens=float(statistics.mean([c.prompt_tokens for c in done if c.prompt_tokens] or [0]))
        or None,
        queried_tokens=delta.queries,
        hit_tokens=delta.hits,
        seconds=wall,
        compactions=sum(p.action == "compacted" for p in planned),
        arrival_rate=arrived,
        saturated=throughput < 0.9 * arrived,
    )


def agent_loop(
    server: Server,
    task: Task,
    answers: tuple[int, ...],
    *,
    prompts: int = 2,
    turns: int = 28,
    tokens: int = 512,
    seed: int = 0,
    progress: bool = True,
) -> list[AgentTurns]:
    """The gating field toggles every turn; each strategy sends its prompt per turn, one at a time."""
    the_sessions = sessions(task, server.count_tokens, tokens, prompts, seed=seed + 1)
    t = task.with_template(0)
    rows: dict[str, dict] = {
        s: {"ttft": 0.0, "agree": [], "follows": [], "q": 0.0, "h": 0.0} for s in AGENT_STRATEGIES
    }
    per_turn: dict[str, list[list[bool]]] = {s: [[] for _ in range(turns)] for s in AGENT_STRATEGIES}
    bar = tqdm(
        total=prompts * turns * len(AGENT_STRATEGIES), desc="agent loop", unit="req", disable=not progress
    )
    for k, sess in enumerate(the_sessions):
        values = Values(t, random.Random(f"serve/agent/{seed}/{k}"))
        decided: dict[str, list[int | None]] = {}
        for strategy in AGENT_STRATEGIES:
            m = PromptManager(
                sess.template,
                {sess.field: sess.initial},
                tail=sess.tail,
                strategy="in_place" if strategy == "recompute" else strategy,
                compaction=NEVER,
            )
            salt = f"kvnotes-agent-{strategy}-{uuid.uuid4().hex}"
            run_sync(_sequential(server, [m.render()], answers, salt))
            before = server.counters()
            current, got = sess.initial, []
            for _turn in range(turns):
                current = values.draw(1 - values.outcome(current)) if values.ranges else _toggle(t, current)
                m.update(sess.field, current)
                s = f"kvnotes-agent-recompute-{uuid.uuid4().hex}" if strategy == "recompute" else salt
                (c,) = run_sync(_sequential(server, [m.render()], answers, s))
                rows[strategy]["ttft"] += c.ttft
                got.append((c.decision, values.outcome(current)))
                bar.update()
            delta = server.counters() - before
            rows[strategy]["q"] += delta.queries
            rows[strategy]["h"] += delta.hits
            decided[strategy] = got
            values = Values(t, random.Random(f"serve/agent/{seed}/{k}"))  # the same toggles for each
        for strategy in AGENT_STRATEGIES:
            for turn, ((d, expected), (ref, _)) in enumerate(zip(decided[strategy], decided["recompute"])):
                # recompute is the reference: its agreement with itself could not fail (not applicable)
                ok = None if d is None or ref is None or strategy == "recompute" else d == ref
                rows[strategy]["agree"].append(ok)
                rows[strategy]["follows"].append(None if d is None else d == expected)
                if ok is not None:
                    per_turn[strategy][turn].append(ok)
    bar.close()
    return [
        AgentTurns(
            strategy=s,
            turns=turns,
            prompts=prompts,
            agreement=_share(rows[s]["agree"]),
            follows=_share(rows[s]["follows"]),
            cumulative_ttft=rows[s]["ttft"],
            hit_rate=rows[s]["h"] / rows[s]["q"] if rows[s]["q"] else None,
            per_turn_agreement=[sum(x) / len(x) if x else math.nan for x in per_turn[s]],
        )
        for s in AGENT_STRATEGIES
    ]


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _toggle(task: Task, current: str) -> str:
    other = [v for v in task.gate.values if task.outcome(v) != task.outcome(current)]
    return other[0]


def service_time(server: Server, the_sessions: Sequence[Session], answers, repeats: int = 2) -> float:
    """Median seconds of a cold request (a new salt each): what an in-place rewrite costs."""
    prompts = [
        fill(s.template, {s.field: s.initial}) + s.tail
        for s in (the_sessions[i % len(the_sessions)] for i in range(repeats))
    ]
    times = []
    for p in prompts:
        (c,) = run_sync(_sequential(server, [p], answers, f"kvnotes-probe-{uuid.uuid4().hex}"))
        times.append(c.ttft)
    return statistics.median(times)


def serve_bench(
    server: Server,
    *,
    task: Task | str = DEFAULT_TASK,
    tokens: int = 2048,
    sessions_n: int = 4,
    requests: int = 24,
    rates: Sequence[float] = (),
    strategies: Sequence[str] = STRATEGIES,
    agent_turns: int = 0,
    agent_prompts: int = 2,
    agent_task: Task | str = AGENT_TASK,
    agent_tokens: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> ServeReport:
    """Every strategy at every rate (default: 0.5, 1, 2 and 4 times the rate one in-place rewrite
    a time can serve, measured first), then the agent loop when `agent_turns` > 0."""
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad:
        raise BadOption(f"unknown strategies {bad}; choose from {', '.join(STRATEGIES)}")
    task, agent_task = load_task(task), load_task(agent_task)
    answers = answer_ids(server, task.answers)
    say = (lambda s: tqdm.write(s, file=sys.stderr)) if progress else (lambda s: None)
    the_sessions = sessions(task, server.count_tokens, tokens, sessions_n, seed=seed)
    notes = []
    if not rates:
        cold = service_time(server, the_sessions, answers)
        base = 1.0 / cold
        rates = tuple(round(base * f, 3) for f in (0.5, 1, 2, 4))
        notes.append(f"one cold {tokens}-token request took {cold:.2f} s; rates are 0.5-4x its inverse")
        say(notes[-1])
    reference: dict = {}
    points = []
    for rate in rates:
        for strategy in strategies:
            p = run_point(
                server,
                task,
                the_sessions,
                strategy,
                rate,
                requests,
                answers,
                seed=seed,
                reference=reference,
                progress=progress,
            )
            say(
                f"{strategy:>9} @ {rate:g} req/s: hit rate {_pct(p.hit_rate)}, "
                f"p90 TTFT {p.ttft_p90:.3f} s, {p.throughput:.2f} req/s"
            )
            points.append(p)
    agent = []
    if agent_turns > 0:
        agent = agent_loop(
            server,
            agent_task,
            answer_ids(server, agent_task.answers),
            prompts=agent_prompts,
            turns=agent_turns,
            tokens=agent_tokens or tokens,
            seed=seed,
            progress=progress,
        )
    return ServeReport(
        model=server.model,
        server={k: v for k, v in server.info.items() if k != "command"} | {"url": server.url},
        machine=machine(),
        task=task.name,
        tokens=tokens,
        sessions=sessions_n,
        results=points,
        agent=agent,
        agent_task=agent_task.name,
        notes=notes,
    )


# --- the command ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServeConfig(Options):
    vllm_python: str = option("", "a Python that has vLLM (`kvnotes vllm-env DIR`): launch a server from it")
    server: str = option("", "or the URL of a running vLLM server with prefix caching on")
    port: int = option(0, "port for the launched server (0: a free one)", least=0, most=65535)
    task: str = option(DEFAULT_TASK, "the task whose prompt the sessions share")
    tokens: int = option(2048, "prompt length in tokens (the paper's policy was ~8192)", least=64)
    sessions: int = option(4, "sessions sharing the policy", least=1)
    requests: int = option(24, "requests per strategy and rate", least=2)
    rates: tuple[float, ...] = option(
        (), "arrival rates in requests/s (default: 0.5-4x the cold rate)", least=0.001
    )
    strategies: tuple[str, ...] = option(STRATEGIES, "prompt strategies to run")
    agent_turns: int = option(28, "agent-loop turns, the gating field toggling each (0 to skip)", least=0)
    agent_prompts: int = option(2, "agent-loop prompts", least=1)
    agent_tokens: int = option(512, "agent-loop prompt length in tokens", least=64)
    ready_timeout: float = option(900.0, "seconds to wait for a launched server to answer", least=1.0)
    dtype: str = option("auto", "the launched server's dtype (auto: vLLM's choice, bfloat16 on a CPU)")
    vllm_args: str = option("", "more arguments for the launched vLLM server, as one string")
    seed: int = option(0, "seed of the sessions, arrivals and values", least=0)


def _serve_model_dir(name: str | None, progress: bool):
    """What to hand vLLM for `--model`: a checkpoint directory as is; a kvnotes model exported once."""
    from pathlib import Path

    from kvnotes.models import load_model
    from kvnotes.models.export import cached

    if name and (Path(name).expanduser() / "config.json").is_file():
        return Path(name).expanduser(), Path(name).name
    model = load_model(name or "gemma-3-270m")
    return cached(model, progress=progress), model.name


@analysis(
    "serve",
    "bench",
    ServeConfig,
    ServeReport,
    quick={"tokens": 512, "requests": 12, "sessions": 2, "agent_turns": 6},
    in_report=False,
    needs_model=False,
    title="Serving: erratum, in-place and hoist against vLLM",
)
def _run_serve(ctx: Context, cfg: ServeConfig) -> ServeReport:
    """Erratum vs in-place vs hoist prompts against a real vLLM server: hit rate, TTFT, decisions."""
    import shlex

    from kvnotes.serving.vllm import connect, launch

    if bool(cfg.vllm_python) == bool(cfg.server):
        raise BadOption(
            "give exactly one of --vllm-python PATH (launch vLLM from that Python; `kvnotes vllm-env DIR` "
            "makes one) and --server URL (a running vLLM server)"
        )
    kw = dict(
        task=cfg.task,
        tokens=cfg.tokens,
        sessions_n=cfg.sessions,
        requests=cfg.requests,
        rates=cfg.rates,
        strategies=cfg.strategies,
        agent_turns=cfg.agent_turns,
        agent_prompts=cfg.agent_prompts,
        agent_tokens=cfg.agent_tokens,
        seed=cfg.seed,
        progress=ctx.progress,
    )
    if cfg.server:
        return serve_bench(connect(cfg.server), **kw)
    model_dir, name = _serve_model_dir(ctx.model_name, ctx.progress)
    longest = max(cfg.tokens, cfg.agent_tokens + 40 * cfg.agent_turns) + 512
    with launch(
        model_dir,
        python=cfg.vllm_python,
        port=cfg.port or None,
        name=name,
        max_model_len=max(4096, 1 << math.ceil(math.log2(longest))),
        extra=["--dtype", cfg.dtype, *shlex.split(cfg.vllm_args)]
        if cfg.dtype != "auto"
        else shlex.split(cfg.vllm_args),
        ready_timeout=cfg.ready_timeout,
        progress=ctx.progress,
    ) as server:
        return serve_bench(server, **kw)
