"""Memory placement: a user's memory early in the context (pre-digested by everything after it) or
late (precompiled alone, re-rotated and spliced each turn), against full recompute, and a fact of it
edited under each placement.

Each episode of the generated multi-session memory task (`kvnotes.tasks.memory`) gives a memory
of about `size` tokens, the current session's conversation, and one cloze question per fact. Three
notebooks answer every question:

- `early`: BOS, memory, conversation, prefilled in context (the conversation's tokens read the
  memory as they are computed: pre-digestion);
- `late`: the conversation prefilled, the memory precompiled alone (after its own BOS), re-rotated
  to follow it and spliced, its first `seam` tokens recomputed in context;
- `full`: the late layout prefilled whole (what the spliced notebook stands in for).

A question is answered right when its true value's token scores highest among the attribute's
values. The cost of forgoing pre-digestion is early minus late accuracy, per question; whether the
splice is as good as recomputing is a TOST of late minus full correctness per question at `margin`
(`kvnotes.analysis.equivalence`, with `bound` 1 for the case where no answer differs). The test
treats questions as independent; the CIs of the parts resample episodes, since the questions of
one memory are not.

Then one fact changes (the episode's edit: same token count) and each placement is fixed two ways:
`erratum` (a correction line appended before the question) and `refresh` (the value's slots
recomputed in place; every later slot stale). Recovery is (ld - ld_old) / (ld_full - ld_old), with ld
the new value's logit minus the old one's, ld_old the placement's notebook before the edit, and
ld_full its layout with the new memory prefilled whole; `edited` is whether the new value wins.

TTFT is the time from a question's arrival to its answer's logits, given what each placement keeps
between turns: `early` decides on its cached notebook; `late` splices the cached memory after the
cached conversation, then decides; `full` prefills everything. An edit's TTFT adds its erratum or
refresh. One time per episode (the first question's), on whatever machine runs it (named in the
result): the parts give their mean and CI, the JSON every value.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from tqdm.auto import tqdm

from kvnotes.analysis.bench_report import machine
from kvnotes.analysis.equivalence import Equivalence, tost
from kvnotes.analysis.registry import Context, Need, Options, Section, analysis, option, register_section
from kvnotes.analysis.results import TaskResult
from kvnotes.analysis.stats import Estimate
from kvnotes.errors import OutOfRange, TaskError
from kvnotes.metrics import recovery
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook
from kvnotes.ops import decide, precompile, prefill, recompute, splice
from kvnotes.tasks.memory import ATTRIBUTES, MemoryEpisode, Question, memory_episode, overhead

SIDES = ("early", "late", "full")
PLACEMENT_EDITS = ("erratum", "refresh")
SIZES = (1000, 2000, 4000, 8000)
QUICK_SIZES = (1000,)
MARGIN = 0.03  # the paper's LoCoMo margin: an accuracy difference of 3 points counts as none


@dataclass(frozen=True, kw_only=True)
class MemoryPlacement(TaskResult):
    """Per memory size S (tokens): `accuracy@S.{early,late,full}` (per question, clustered by
    episode; `updated@S.*` only the questions about the fact the user updated in a later session),
    `cost@S` (early minus late accuracy, per question), `late_minus_full@S`,
    `recovery@S.{early,late}.{erratum,refresh}` and `edited@S.{early,late}.{erratum,refresh,full}`
    (the edited fact), and `ttft@S.<side>` / `ttft@S.<placement>.<method>` (seconds per turn, one per
    episode). `tost[S]`: late against full at `margin`, over questions."""

    TASK_FREE: ClassVar[bool] = True  # its episodes are generated; it reads no pair task
    PART_PATTERNS = (
        r"(accuracy|updated)@\d+\.(early|late|full)",
        r"(cost|late_minus_full)@\d+",
        r"recovery@\d+\.(early|late)\.(erratum|refresh)",
        r"edited@\d+\.(early|late)\.(erratum|refresh|full)",
        r"ttft@\d+\.(early|late|full)",
        r"ttft@\d+\.(early|late)\.(erratum|refresh)",
    )
    sizes: tuple[int, ...]
    memory_tokens: dict[str, int] = field(default_factory=dict)  # per size: the mean memory length
    episodes: int = 0
    facts: int = len(ATTRIBUTES)
    seam: int = 0
    margin: float = MARGIN
    alpha: float = 0.05
    tost: dict[str, dict] = field(default_factory=dict)  # per size: `Equivalence.to_dict()`
    machine: str = ""
    skipped: tuple[str, ...] = ()  # preset sizes left out because they do not fit the context
    GRID_ROWS: ClassVar[str] = "placement (and edit)"

    def cell(self, part: str) -> tuple[str, str] | None:
        """Each placement (early, late, full; with an edit, placement.method) a row at each size;
        accuracy, updated, recovery, edited and ttft the columns. cost and late_minus_full rows."""
        figure, _, where = part.partition(".")
        if not where:
            return None
        name, _, size = figure.partition("@")
        return (f"{where} @{size}" if len(self.sizes) > 1 else where, name)

    def notes(self) -> list[tuple[str, str]]:
        """Each size's TOST verdict (late against full) and the sizes left out."""
        rows = [
            (f"tost@{size} late vs full", str(Equivalence(**{**t, "ci": tuple(t["ci"])})))
            for size, t in self.tost.items()
        ]
        return rows + [("left out", s) for s in self.skipped]


def _bos(model: KVModel) -> list[int]:
    bos = model.tokenizer.bos_token_id
    return [] if bos is None else [bos]


def _read(model: KVModel, nb: Notebook, q: Question, before: Sequence[int] = ()) -> list[float]:
    """The question's candidate logits after `before` (an erratum) and the question, on `nb`."""
    out = decide(model, nb, [*before, *q.ids], vocab=list(q.candidates)).last[0]
    return [float(v) for v in out]


def _timed(fn: Callable):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def _answers(model: KVModel, ep: MemoryEpisode, seam: int) -> tuple[dict, dict, dict]:
    """Each side's notebook of the old memory, its accuracy per question, and its turn's TTFT."""
    bos, mem, conv = _bos(model), list(ep.memory_old), list(ep.conversation)
    host = prefill(model, bos + conv)
    chunk = precompile(model, mem)
    early = prefill(model, bos + mem + conv)
    late, t_splice = _timed(lambda: splice(model, host, chunk, seam=min(seam, len(mem))))
    full, t_prefill = _timed(lambda: prefill(model, bos + conv + mem))
    books = {"early": early, "late": late, "full": full}
    correct: dict[str, list[float]] = {s: [] for s in SIDES}
    ttft: dict[str, float] = {}
    for i, q in enumerate(ep.questions):
        for side, nb in books.items():
            logits, t = _timed(lambda nb=nb, q=q: _read(model, nb, q))
            correct[side].append(float(max(range(len(logits)), key=logits.__getitem__) == q.truth))
            if i == 0:
                ttft[side] = t + {"early": 0.0, "late": t_splice, "full": t_prefill}[side]
    return books, correct, {"splice": t_splice, **ttft}


def _edits(
    model: KVModel, ep: MemoryEpisode, books: dict, t_splice: float, size: int, min_effect: float
) -> dict:
    """The edited fact under each placement: recovery and whether the new value wins, per method
    (parts named for `size`), and each method's TTFT."""
    bos, conv, e = _bos(model), list(ep.conversation), ep.edit
    q, (a, b) = e.question, e.span
    layouts = {
        "early": (bos + list(ep.memory_new) + conv, len(bos)),
        "late": (bos + conv + list(ep.memory_new), len(bos) + len(conv)),
    }
    out: dict[str, float | None] = {}
    for place, (new_ids, at) in layouts.items():
        nb = books[place]
        ld = lambda logits: logits[e.new] - logits[e.old]  # noqa: E731
        wins = lambda logits: float(max(range(len(logits)), key=logits.__getitem__) == e.new)  # noqa: E731
        target = _read(model, prefill(model, new_ids), q)
        old = _read(model, nb, q)
        extra = t_splice if place == "late" else 0.0
        in_place = range(at + a, at + b)
        fixed = {
            "erratum": _timed(lambda nb=nb: _read(model, nb, q, e.erratum)),
            "refresh": _timed(
                lambda nb=nb, ids=new_ids, pos=in_place: _read(model, recompute(model, nb, ids, pos), q)
            ),
        }
        usable = abs(ld(target) - ld(old)) >= min_effect  # else recovery is noise (or 0 / 0)
        for m, (logits, t) in fixed.items():
            rec = float(recovery(ld(logits), ld(old), ld(target), undefined="nan", min_effect=0))
            out[f"recovery@{size}.{place}.{m}"] = rec if usable else None
            out[f"edited@{size}.{place}.{m}"] = wins(logits)
            out[f"ttft@{size}.{place}.{m}"] = t + extra
        out[f"edited@{size}.{place}.full"] = wins(target)
    return out


def _room(model: KVModel) -> int:
    """The most memory tokens an episode can have in the model's context."""
    return model.n_ctx - overhead(lambda s: model.encode(s, bos=False))


def check_context(model: KVModel, sizes: Sequence[int]) -> None:
    """Refuse a memory size whose episode (BOS, memory, conversation, erratum, question) would not
    fit the model's context, naming the largest that does; before any forward."""
    room = _room(model)
    over = [s for s in sizes if s > room]
    if over:
        raise OutOfRange(
            f"memory sizes {over} do not fit {model.name}'s context of {model.n_ctx} tokens beside the "
            f"conversation, erratum and question; give --memory-sizes of at most {room}"
        )


def fit_preset(
    model: KVModel, sizes: Sequence[int], facts: int
) -> tuple[tuple[int, ...], int, tuple[str, ...]]:
    """A preset's sizes cut to those that fit the model, or the largest that fits where none does,
    with as many of the `facts` as that room holds; and a note per size left out."""
    room = _room(model)
    keep = tuple(s for s in sizes if s <= room) or (room,)
    encode = lambda s: model.encode(s, bos=False)  # noqa: E731
    while facts > 2:
        try:
            memory_episode(encode, size=min(keep), seed=0, index=0, facts=facts)
            break
        except TaskError:
            facts -= 1
    left = tuple(
        f"{s} tokens: over the context of {model.n_ctx} with the episode's other tokens"
        for s in sizes
        if s > room
    )
    return keep, facts, left


def memory_placement(
    model: KVModel,
    *,
    sizes: Sequence[int] = SIZES,
    n: int = 8,
    facts: int = len(ATTRIBUTES),
    seam: int = 8,
    margin: float = MARGIN,
    alpha: float = 0.05,
    min_effect: float = 0.1,
    seed: int = 0,
    progress: bool = True,
    skipped: Sequence[str] = (),
) -> MemoryPlacement:
    """Early, late and fully recomputed memory at each size over `n` episodes, and one fact edited
    under each placement (module docstring). Every size is checked against the context first."""
    check_context(model, sizes)
    encode = lambda s: model.encode(s, bos=False)  # noqa: E731
    episodes = {
        s: [memory_episode(encode, size=s, seed=seed, index=i, facts=facts) for i in range(n)] for s in sizes
    }
    acc: dict[str, list] = {}
    labels: dict[str, list[int]] = {}
    tests, lengths = {}, {}
    bar = tqdm(total=n * len(sizes), desc="memory placement", unit="episode", disable=not progress)
    for size, eps in episodes.items():
        lengths[str(size)] = round(statistics.mean(len(ep.memory_old) for ep in eps))
        per_question = []
        for k, ep in enumerate(eps):
            books, correct, ttft = _answers(model, ep, seam)
            got: dict[str, list] = {f"accuracy@{size}.{s}": correct[s] for s in SIDES}
            got |= {
                f"updated@{size}.{s}": [c for c, q in zip(correct[s], ep.questions) if q.updated]
                for s in SIDES
            }
            got[f"cost@{size}"] = [x - y for x, y in zip(correct["early"], correct["late"])]
            got[f"late_minus_full@{size}"] = [x - y for x, y in zip(correct["late"], correct["full"])]
            got |= {f"ttft@{size}.{s}": [ttft[s]] for s in SIDES}
            got |= {k_: [v] for k_, v in _edits(model, ep, books, ttft["splice"], size, min_effect).items()}
            per_question += got[f"late_minus_full@{size}"]
            for name, vals in got.items():
                acc.setdefault(name, []).extend(vals)
                labels.setdefault(name, []).extend([k] * len(vals))
            bar.update()
        tests[str(size)] = tost(per_question, margin=margin, alpha=alpha, bound=1.0).to_dict()
    bar.close()
    parts = {name: Estimate.of(v, seed=seed, clusters=labels[name]) for name, v in acc.items()}
    return MemoryPlacement.of(
        name="memory_placement",
        headline=f"cost@{max(sizes)}",
        parts=parts,
        sizes=tuple(sizes),
        memory_tokens=lengths,
        episodes=n,
        facts=facts,
        seam=seam,
        margin=margin,
        alpha=alpha,
        tost=tests,
        machine=machine(),
        skipped=tuple(skipped),
        description="memory placed early, late (spliced) and recomputed: accuracy, edits and TTFT",
    )


register_section(
    Section(
        "memory",
        "Memory placement",
        order=60,
        command="probe",
        intro="A user's memory early in the context or late (precompiled and spliced), against full "
        "recompute, with one fact edited under each placement.",
    )
)


@dataclass(frozen=True)
class PlacementConfig(Options):
    memory_sizes: tuple[int, ...] = option(
        SIZES,
        "memory-placement: memory sizes in tokens (default: those of 1000-8000 that fit beside the "
        "conversation, fewer facts where none does)",
        least=1,
        tokens=True,
        fitted=True,  # left at a preset, fitted by `fit_preset` to the room the conversation leaves
    )
    episodes: int = option(8, "memory-placement: episodes (memories) per size", least=2, arg="n")
    facts: int = option(len(ATTRIBUTES), "memory-placement: facts per memory", least=2, most=len(ATTRIBUTES))
    placement_seam: int = option(
        8, "memory-placement: memory tokens recomputed in context at the seam", least=0, arg="seam"
    )
    margin: float = option(
        MARGIN, "memory-placement: TOST equivalence margin (accuracy)", least=1e-6, most=1.0
    )


@analysis(
    "memory_placement",
    "memory",
    PlacementConfig,
    MemoryPlacement,
    quick={"memory_sizes": QUICK_SIZES, "episodes": 2},
    default=False,  # `kvnotes probe memory_placement`; reports run it,
    requires=(Need.MOVING_CHUNKS,),
)
def _run_memory_placement(ctx: Context, cfg: PlacementConfig) -> MemoryPlacement:
    """Memory placed early or late (spliced) against full recompute, and a fact edited under each."""
    sizes, facts, skipped = tuple(cfg.memory_sizes), cfg.facts, ()
    if sizes in (SIZES, QUICK_SIZES):  # a preset's sizes are fitted to the model; sizes given are checked
        sizes, facts, skipped = fit_preset(ctx.model, sizes, facts)
    return cfg.call(
        memory_placement,
        ctx.model,
        sizes=sizes,
        facts=facts,
        min_effect=ctx.min_effect,
        skipped=skipped,
        **ctx.common,
    )
