"""A multi-turn edit+compose agent loop: does splicing plus errata drift as the turns pile up?

Per prompt: the policy chunk is precompiled once and spliced (seam repaired) after a host line
it never saw; the live
state is computed after it. Then for `turns` turns the gating field toggles, and each change is
appended as one erratum line — nothing is ever recomputed. Each turn the decision is read and
compared with recompute-every-turn: a fresh full prefill of exactly the same text.
"""

from __future__ import annotations

from dataclasses import dataclass

from tqdm.auto import tqdm

from kvnotes.analysis.registry import Context, Need, Options, analysis, option
from kvnotes.analysis.results import TaskResult
from kvnotes.analysis.stats import Estimate
from kvnotes.engine import run
from kvnotes.errors import OutOfRange
from kvnotes.hosts import HOST_LINE
from kvnotes.metrics import logit_cosine
from kvnotes.models.model import KVModel
from kvnotes.ops import append, decide, precompile, prefiller, splice
from kvnotes.tasks import Task, load_gated_task, sample
from probes.compose import chunk_end
from probes.edit import ERRATUM


@dataclass(frozen=True, kw_only=True)
class AgentLoop(TaskResult):
    """Per turn t: logit `cosine@t` and answer `agree@t` against recomputing every turn."""

    PARTS = ("cosine_last", "cosine_min", "follows")
    PART_PATTERNS = (r"(cosine|agree)@\d+",)
    turns: int
    seam: int
    erratum: str


def agent_loop(
    model: KVModel,
    task: Task | str,
    *,
    n: int = 2,
    turns: int = 28,
    seam: int = 4,
    erratum: str = ERRATUM,
    seed: int = 0,
    progress: bool = True,
) -> TaskResult:
    """Per turn: `cosine@t` (logit cosine to recompute-every-turn) and `agree@t` (same answer).

    Headline `cosine_last` (the last turn); `cosine_min` is the worst turn of each prompt;
    `follows` whether the decision follows the toggled value (against the task's expected answer).
    """
    task = load_gated_task(task, "the agent loop (it toggles the task's gate)")
    field = task.gate.field
    acc: dict[str, list[float]] = {}
    labels: dict[str, list[int]] = {}  # the template of the prompt behind each value in acc

    def add(name: str, value: float) -> None:
        acc.setdefault(name, []).append(value)
        labels.setdefault(name, []).append(pair.template)

    host = model.encode(HOST_LINE)  # the policy is composed into a context it was not compiled in
    pairs = sample(task, model, n, seed=seed)
    most = most_turns(model, task, pairs, erratum)
    if turns > most:
        raise OutOfRange(
            f"--turns {turns}: that many errata do not fit {model.name}'s context of {model.n_ctx} "
            f"positions after the host and the prompt; give --turns {most} or fewer"
        )
    pf = prefiller(model)  # the host (and a transcript's earlier turns) computed once
    for pair in tqdm(pairs, desc="agent loop", disable=not progress, unit="prompt"):
        p = pair.old
        ids = list(p.ids)
        c1, d0 = chunk_end(p, field), p.span("decision").start
        query = ids[d0:]
        chunk = precompile(model, ids[1:c1])
        nb = splice(model, pf(host), chunk, seam=seam)
        nb, _ = run(model, nb, ids[c1:d0], logits_at=())
        text_ids = host + ids[1:d0]
        values = [v for v in task.gate.values if task.outcome(v) != task.outcome(p.values[field])]
        current = p.values[field]
        worst = 1.0
        for turn in range(1, turns + 1):
            current = values[0] if task.outcome(current) == task.outcome(p.values[field]) else p.values[field]
            line = model.encode(erratum.format(field=field, value=current), bos=False)
            nb = append(model, nb, line)
            text_ids = text_ids + line
            out = decide(model, nb, query).last[0]
            ref = decide(model, pf(text_ids), query).last[0]
            cos = float(logit_cosine(out, ref))
            worst = min(worst, cos)
            a = list(pair.answers)
            add(f"cosine@{turn}", cos)
            add(f"agree@{turn}", float(out[a].argmax() == ref[a].argmax()))
            add("follows", float(int(out[a].argmax()) == task.outcome(current)))
        add("cosine_last", cos)
        add("cosine_min", worst)
    order = ["cosine_last", "cosine_min", "follows"] + [
        f"{k}@{t}" for k in ("cosine", "agree") for t in range(1, turns + 1)
    ]
    return AgentLoop.of(
        name="agent_loop",
        headline="cosine_last",
        parts={k: Estimate.of(acc[k], clusters=labels[k]) for k in order},
        turns=turns,
        seam=seam,
        erratum=erratum,
        description="spliced policy, one erratum per turn as the field toggles, vs recompute every turn",
    )


def most_turns(model: KVModel, task: Task, pairs, erratum: str = ERRATUM) -> int:
    """The most turns whose errata fit the model's context after the host and the longest prompt
    of `pairs` (tokenizer only: no forward)."""
    longest = max(
        len(model.encode(erratum.format(field=task.gate.field, value=v), bos=False)) for v in task.gate.values
    )
    fixed = len(model.encode(HOST_LINE)) + max(len(p.old) for p in pairs)
    return max(0, (model.n_ctx - fixed) // longest)


@dataclass(frozen=True)
class AgentConfig(Options):
    prompts: int = option(2, "agent-loop prompts", least=1, arg="n")
    turns: int = option(
        28,
        "turns of field toggles, each an erratum (0 to skip; default: 28, or as many as fit)",
        least=0,
        fitted=True,
    )
    seam: int = option(4, "chunk tokens recomputed at the seam", least=0)


@analysis(
    "agent_loop",
    "compose",
    AgentConfig,
    AgentLoop,
    quick={"turns": 6},
    order=3,
    requires=(Need.RULE, Need.MOVING_CHUNKS),
)
def _run_agent_loop(ctx: Context, cfg: AgentConfig) -> AgentLoop | None:
    """A spliced policy kept current by one erratum per turn, against recomputing every turn."""
    turns = cfg.turns
    if ctx.fit_context:  # left at its default: as many turns as fit the model (the notes organism's 512)
        task = load_gated_task(ctx.task, "the agent loop (it toggles the task's gate)")
        turns = min(turns, most_turns(ctx.model, task, sample(task, ctx.model, cfg.prompts, seed=ctx.seed)))
    if not turns:
        return None
    return cfg.call(agent_loop, ctx.model, ctx.task, turns=turns, **ctx.common)
