"""The agent loop on a vLLM server (`kvnotes bench serve --agent-turns`): the 28-turn errata
stress test, one session per prompt, the gating field toggling every turn, sent in turn by
`erratum` (errata stacked, never compacted), `in_place` and `recompute` (the fresh prompt under a
new cache salt each turn), with decision agreement against `recompute` and cumulative TTFT."""

from __future__ import annotations

import math
import random
import uuid
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from kvnotes.bench.serve_client import sequential, share
from kvnotes.bench.serve_workload import Values, sessions
from kvnotes.serving.manager import NEVER, PromptManager
from kvnotes.serving.vllm import Server, run_sync
from kvnotes.tasks import Task

AGENT_TASK = "order-cancel"  # the gating field toggles, as in the paper's stress test
AGENT_STRATEGIES = ("erratum", "in_place", "recompute")  # recompute is the reference


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


def served_agent_loop(
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
            run_sync(sequential(server, [m.render()], answers, salt))
            before = server.counters()
            current, got = sess.initial, []
            for _turn in range(turns):
                current = values.draw(1 - values.outcome(current)) if values.ranges else _toggle(t, current)
                m.update(sess.field, current)
                s = f"kvnotes-agent-recompute-{uuid.uuid4().hex}" if strategy == "recompute" else salt
                (c,) = run_sync(sequential(server, [m.render()], answers, s))
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
            agreement=share(rows[s]["agree"]),
            follows=share(rows[s]["follows"]),
            cumulative_ttft=rows[s]["ttft"],
            hit_rate=rows[s]["h"] / rows[s]["q"] if rows[s]["q"] else None,
            per_turn_agreement=[sum(x) / len(x) if x else math.nan for x in per_turn[s]],
        )
        for s in AGENT_STRATEGIES
    ]


def _toggle(task: Task, current: str) -> str:
    other = [v for v in task.gate.values if task.outcome(v) != task.outcome(current)]
    return other[0]
