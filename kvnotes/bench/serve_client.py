"""The serve bench's side of the wire: a run's requests sent to the vLLM server (on schedule, or one
at a time), the fresh prompts' reference completions, and what is read from the replies."""

from __future__ import annotations

import asyncio
import statistics
import uuid
from collections.abc import Sequence

from tqdm.auto import tqdm

from kvnotes.bench.serve_workload import Planned
from kvnotes.errors import KVNotesError
from kvnotes.serving.vllm import Completion, Server, complete, run_sync


def quantile(xs: Sequence[float], q: float) -> float:
    """The q-quantile of `xs` (linear between order statistics, as numpy's default)."""
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1] if len(xs) > 1 else xs[0]


def server_answer_ids(server: Server, answers: Sequence[str]) -> tuple[int, ...]:
    """The token id of each answer under the server's tokenizer; each must be one token."""
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


async def drive(server: Server, planned: Sequence[Planned], answers, salt: str, desc: str, progress: bool):
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


async def sequential(
    server: Server, prompts: Sequence[str], answers, salt: str | Sequence[str] | None
) -> list[Completion]:
    """`prompts` one at a time, under `salt` (one for all, or one per prompt)."""
    import httpx

    salts = [salt] * len(prompts) if salt is None or isinstance(salt, str) else list(salt)
    async with httpx.AsyncClient(timeout=None) as client:
        return [await complete(client, server, p, answers=answers, salt=s) for p, s in zip(prompts, salts)]


def references(server: Server, prompts: Sequence[str], answers, memo: dict) -> list[Completion]:
    """The completion of each fresh prompt sent as a new request that no cached block can serve:
    each under a cache salt of its own, so the server computes it from scratch (what no strategy
    reuses, the reference every strategy's decision is read against, in-place's included, whose
    prompt is the same text but whose blocks come from the session's earlier requests). From `memo`
    where one was already sent (another strategy's run), else sent now, one at a time."""
    todo = [p for p in dict.fromkeys(prompts) if p not in memo]
    salts = [f"kvnotes-reference-{uuid.uuid4().hex}" for _ in todo]
    memo.update(zip(todo, run_sync(sequential(server, todo, answers, salts))))
    return [memo[p] for p in prompts]


def answer_ld(c: Completion) -> float | None:
    """The log-prob difference of the two answers, or None where either is missing."""
    a, b = c.answer_logprobs[:2]
    return None if a is None or b is None else a - b


def share(flags: Sequence[bool | None]) -> float | None:
    """The share of true flags among those known (None where none is)."""
    known = [f for f in flags if f is not None]
    return sum(known) / len(known) if known else None
