"""The regime sweep: does a model read the field directly, or notes, as the field moves away?

Neutral filler text is put into the task's `{filler}` field (between the gating field and the
query) so the distance from the field to the decision grows; at each distance field-only refresh
and the notes transplant are measured on the same pairs. Near-verbatim lookup shows as refresh ≈ 1
and transplant ≈ 0; the notes regime as the reverse.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from kvnotes.analysis.registry import Context, Need, analysis, option
from kvnotes.analysis.results import TaskResult
from kvnotes.analysis.stats import Estimate
from kvnotes.analysis.trials import MIN_EFFECT, PairOptions, clusters_of, make_trials
from kvnotes.errors import OutOfRange
from kvnotes.models.model import KVModel
from kvnotes.ops import Prefixes
from kvnotes.tasks import Task, TaskError, load_task
from kvnotes.tasks.sampler import fit_notes
from probes.causal import field_refresh, notes_transplant

DISTANCES = (0, 16, 32, 64, 128, 256, 512, 768)


def filler_text(model: KVModel, n_tokens: int) -> str:
    """Neutral notes ("Note 1: ...\\n") adding about `n_tokens` tokens (at least that many), or ""."""
    return fit_notes(lambda text: len(model.encode(text, bos=False)), n_tokens)


@dataclass(frozen=True, kw_only=True)
class Regime(TaskResult):
    """Per filler length d: `field_refresh@d`, `notes_transplant@d` and the field's `effect@d`."""

    PART_PATTERNS = (r"(field_refresh|notes_transplant|effect)@\d+",)
    filler_tokens: tuple[int, ...]  # filler lengths measured
    distance: tuple[int, ...]  # tokens from the field to the decision at each
    skipped: tuple[dict, ...]  # lengths beyond the model's context, with the reason
    window: int | None  # the model's sliding window (None: global attention only)
    n_layers: int


def _no_filler(task) -> str:
    """Why the regime sweep cannot run on `task`, and what can: a built-in task cannot be edited, so
    name the built-in tasks that have a filler; a user's task can take one."""
    from kvnotes.tasks.task import builtin_tasks

    why = f"task {task.name!r} has no {{filler}} field, so the field cannot be moved away from the decision"
    if task.name not in builtin_tasks():
        return why + "; add {filler} to its template after the gating field"
    ok = [n for n in builtin_tasks() if load_task(n).has_filler]
    return why + f" (its prompts are fixed); the regime sweep runs on {', '.join(ok)} (--task {ok[0]})"


def regime(
    model: KVModel,
    task: Task | str,
    *,
    n: int = 4,
    distances: Sequence[int] = DISTANCES,
    seed: int = 0,
    min_effect: float = MIN_EFFECT,
    template: int | None = None,
    progress: bool = True,
) -> TaskResult:
    """Field-only refresh vs notes transplant recovery at each filler length in `distances`, on
    pairs drawn across the task's templates (or from `template` alone).

    Parts `field_refresh@{d}` and `notes_transplant@{d}` per filler length d (tokens); the
    headline is the notes transplant at the longest distance. `details["distance"]` holds the
    measured token distance from the field to the decision at each d (in the first pair; other
    templates differ by a few tokens); a d whose prompt exceeds the model's context is listed
    under `details["skipped"]`, not measured.
    """
    task = load_task(task)
    if not task.has_filler:
        raise TaskError(_no_filler(task))
    parts, distance, measured, skipped = {}, [], [], []
    shared = Prefixes(model)  # the same pairs at every distance: their start before the filler, once
    for d in tqdm(list(distances), desc="regime", disable=not progress, unit="distance"):
        filler = filler_text(model, d)
        try:
            trials = make_trials(
                model, task, n, seed=seed, filler=filler, template=template, progress=False, prefixes=shared
            )
        except OutOfRange as e:  # the prompt outgrows the model's context: record it, measure the rest
            skipped.append({"filler_tokens": d, "reason": str(e)})
            continue
        measured.append(d)
        span = trials[0].pair
        distance.append(span.new.span("decision").start - span.field_span.stop)
        parts[f"field_refresh@{d}"] = field_refresh(trials, min_effect=min_effect).estimate
        parts[f"notes_transplant@{d}"] = notes_transplant(trials, min_effect=min_effect).estimate
        parts[f"effect@{d}"] = Estimate.of([t.effect for t in trials], clusters=clusters_of(trials))
    if not measured:
        raise OutOfRange(
            f"no filler length in {list(distances)} fits {model.name}'s context of "
            f"{model.n_ctx} tokens; pass shorter distances"
        )
    last = measured[-1]
    return Regime.of(
        name="regime",
        headline=f"notes_transplant@{last}",
        parts=parts,
        filler_tokens=measured,
        distance=distance,
        skipped=skipped,
        window=model.max_window,
        n_layers=model.n_layers,
        description="field-only refresh vs notes transplant as filler separates the field from the decision",
    )


@dataclass(frozen=True)
class RegimeConfig(PairOptions):
    n: int = option(4, "prompt pairs at each distance", least=1)
    distances: tuple[int, ...] = option(
        DISTANCES, "filler lengths in tokens between the field and the query", least=0, tokens=True
    )


@analysis(
    "regime",
    "regime",
    RegimeConfig,
    Regime,
    quick={"n": 3, "distances": (0, 64, 256)},
    default=False,
    requires=(Need.TEMPLATE,),
)
def _run_regime(ctx: Context, cfg: RegimeConfig) -> Regime:
    """Field-only refresh vs notes transplant as filler moves the field away from the decision."""
    return cfg.call(regime, ctx.model, ctx.task, min_effect=ctx.min_effect, **ctx.common)
