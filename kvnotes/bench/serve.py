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

import math
import os
import platform
import statistics
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from tqdm.auto import tqdm

from kvnotes.analysis.bench_report import BenchReport
from kvnotes.analysis.registry import Context, Options, analysis, option
from kvnotes.bench.serve_client import (
    answer_ld,
    drive,
    quantile,
    references,
    sequential,
    server_answer_ids,
    share,
)
from kvnotes.bench.serve_workload import Session, schedule, sessions
from kvnotes.bench.served_agent import AGENT_TASK, AgentTurns, served_agent_loop
from kvnotes.errors import BadOption
from kvnotes.serving.manager import DEFAULT_COMPACTION, STRATEGIES, Compaction, fill
from kvnotes.serving.vllm import Server, run_sync
from kvnotes.tasks import Task, load_gated_task

DEFAULT_TASK = "refund-window"  # a numeric gating field: every change is a new value
RATE_FACTORS = (0.5, 1.0, 2.0, 4.0)  # the default rates, as multiples of the rate one cold request can serve


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


def client_machine() -> str:
    """The machine the bench's client ran on (the server's is in the report's `server`)."""
    return f"{platform.machine()} {os.cpu_count()} CPU cores, {platform.system()}"


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
    firsts, planned = schedule(
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
    run_sync(sequential(server, firsts, answers, salt))  # steady state: the server has seen each session
    before = server.counters()
    done = run_sync(drive(server, planned, answers, salt, f"{strategy} @ {rate:g} req/s", progress))
    delta = server.counters() - before
    sent0 = min(c.sent for c in done)
    wall = max(c.sent + c.latency for c in done) - sent0
    ttfts = [c.ttft for c in done]
    memo = reference if reference is not None else {}
    refs = references(server, [p.fresh for p in planned], answers, memo)
    fresh = [c.decision for c in refs]
    gaps = [
        abs(answer_ld(a) - answer_ld(b))
        for a, b in zip(done, refs)
        if answer_ld(a) is not None and answer_ld(b) is not None
    ]
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
        decision_agreement=share([None if a is None or b is None else a == b for a, b in zip(mine, fresh)]),
        ld_gap=statistics.mean(gaps) if gaps else None,
        follows=share([None if a is None else a == p.expected for a, p in zip(mine, planned)]),
        fresh_follows=share([None if b is None else b == p.expected for b, p in zip(fresh, planned)]),
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


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def service_time(server: Server, the_sessions: Sequence[Session], answers, repeats: int = 2) -> float:
    """Median seconds of a cold request (a new salt each): what an in-place rewrite costs."""
    prompts = [
        fill(s.template, {s.field: s.initial}) + s.tail
        for s in (the_sessions[i % len(the_sessions)] for i in range(repeats))
    ]
    times = []
    for p in prompts:
        (c,) = run_sync(sequential(server, [p], answers, f"kvnotes-probe-{uuid.uuid4().hex}"))
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
    rate_factors: Sequence[float] = RATE_FACTORS,
    strategies: Sequence[str] = STRATEGIES,
    agent_turns: int = 0,
    agent_prompts: int = 2,
    agent_task: Task | str = AGENT_TASK,
    agent_tokens: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> ServeReport:
    """Every strategy at every rate (default: `rate_factors` times the rate one in-place rewrite at
    a time can serve, measured first), then the agent loop when `agent_turns` > 0."""
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad:
        raise BadOption(f"unknown strategies {bad}; choose from {', '.join(STRATEGIES)}")
    task = load_gated_task(task, "the serving bench")
    agent_task = load_gated_task(agent_task, "the serving bench's agent loop")
    answers = server_answer_ids(server, task.answers)
    say = (lambda s: tqdm.write(s, file=sys.stderr)) if progress else (lambda s: None)
    the_sessions = sessions(task, server.count_tokens, tokens, sessions_n, seed=seed)
    notes = []
    if not rates:
        cold = service_time(server, the_sessions, answers)
        base = 1.0 / cold
        rates = tuple(round(base * f, 3) for f in rate_factors)
        span = f"{min(rate_factors):g}-{max(rate_factors):g}x"
        notes.append(f"one cold {tokens}-token request took {cold:.2f} s; rates are {span} its inverse")
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
        agent = served_agent_loop(
            server,
            agent_task,
            server_answer_ids(server, agent_task.answers),
            prompts=agent_prompts,
            turns=agent_turns,
            tokens=agent_tokens or tokens,
            seed=seed,
            progress=progress,
        )
    return ServeReport(
        model=server.model,
        server={k: v for k, v in server.info.items() if k != "command"} | {"url": server.url},
        machine=client_machine(),
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
    vllm_python: str = option(
        "", "a Python that has vLLM (`kvnotes vllm-env DIR`): launch a server from it", arg="python"
    )
    server: str = option("", "or the URL of a running vLLM server with prefix caching on")
    port: int = option(0, "port for the launched server (0: a free one)", least=0, most=65535)
    task: str = option(DEFAULT_TASK, "the task whose prompt the sessions share")
    tokens: int = option(2048, "prompt length in tokens (the paper's policy was ~8192)", least=64)
    sessions: int = option(4, "sessions sharing the policy", least=1, arg="sessions_n")
    requests: int = option(24, "requests per strategy and rate", least=2)
    rates: tuple[float, ...] = option(
        (), "arrival rates in requests/s (default: 0.5-4x the cold rate)", least=0.001
    )
    # around the cold rate: below it the queue stays short, above it in-place saturates first
    rate_factors: tuple[float, ...] = option(
        RATE_FACTORS, "without --rates: the rates as multiples of the cold rate", least=0.001
    )
    strategies: tuple[str, ...] = option(STRATEGIES, "prompt strategies to run")
    agent_turns: int = option(28, "agent-loop turns, the gating field toggling each (0 to skip)", least=0)
    agent_prompts: int = option(2, "agent-loop prompts", least=1)
    agent_tokens: int = option(512, "agent-loop prompt length in tokens", least=64)
    # a gating field with two named values toggles every turn, as in the paper's stress test
    agent_task: str = option(AGENT_TASK, "the task of the agent loop")
    ready_timeout: float = option(900.0, "seconds to wait for a launched server to answer", least=1.0)
    dtype: str = option("auto", "the launched server's dtype (auto: vLLM's choice, bfloat16 on a CPU)")
    vllm_args: str = option("", "more arguments for the launched vLLM server, as one string")
    seed: int = option(0, "seed of the sessions, arrivals and values", least=0)


def _serve_model_dir(name: str | None, progress: bool):
    """What to hand vLLM for `--model`: a checkpoint directory as is; a kvnotes model exported once."""
    from pathlib import Path

    from kvnotes.zoo import load_model
    from kvnotes.zoo.export import cached

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
    order=50,
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

    def bench(server):
        return cfg.call(serve_bench, server, progress=ctx.progress)

    if cfg.server:
        return bench(connect(cfg.server))
    model_dir, name = _serve_model_dir(ctx.model_name, ctx.progress)
    longest = max(cfg.tokens, cfg.agent_tokens + 40 * cfg.agent_turns) + 512
    with cfg.call(
        launch,
        model_dir,
        port=cfg.port or None,
        name=name,
        max_model_len=max(4096, 1 << math.ceil(math.log2(longest))),
        extra=["--dtype", cfg.dtype, *shlex.split(cfg.vllm_args)]
        if cfg.dtype != "auto"
        else shlex.split(cfg.vllm_args),
        progress=ctx.progress,
    ) as server:
        return bench(server)
