"""The trial layer every analysis stands on: a `Trial` is one prompt pair, prefilled once (the old
and new notebooks and their decisions); `make_trials` and `shared_trials` make them, `PairOptions`
are the options of an analysis that takes only its pairs, and `split_by_effect` / `effect_estimate`
are the effect statistics every analysis reports over them.

Every analysis reads trials, so a run of several prefills each prompt once, and what one learns
about a pair (a probe's note map) is reused by the next (knockout, injection, scrubbing).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from kvnotes.analysis.registry import MIN_EFFECT, Context, Options, option
from kvnotes.analysis.stats import Estimate
from kvnotes.batches import sharing_enabled
from kvnotes.engine import Hook
from kvnotes.errors import BadOption
from kvnotes.metrics import Metric, answer_columns, logit_diff, recovery
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook
from kvnotes.ops import Patch, Prefixes, PromptLike, decide, decide_patched, prefill
from kvnotes.tasks import GATE, Pair, TaskSource, load_task, sample
from kvnotes.types import Float, Tensor
from kvnotes.zoo import default_task


@dataclass(frozen=True)
class PairOptions(Options):
    """The options of an analysis that takes only its prompt pairs: how many, and from which of
    the task's templates."""

    n: int = option(8, "prompt pairs", least=1)
    template: int | None = option(
        None,
        "use only template N of the task (default: pairs drawn across all of them)",
        metavar="N",
        least=0,
    )

    def __post_init__(self):
        super().__post_init__()
        t = self.template
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 0):
            raise BadOption(
                f"template (the task template pairs are drawn from) must be a template number "
                f"0, 1, ... or None for all of them, got {t!r}"
            )


def shared_trials(ctx: Context, n: int, *, kind: str = GATE, template: int | None = None) -> list[Trial]:
    """`n` prefilled pairs of the context's task (drawn across its templates, or from `template`
    alone), made once per run and shared by its analyses."""
    fingerprint = getattr(ctx.model, "fingerprint", None)  # one memo may serve several runs
    key = ("trials", ctx.model.name, fingerprint, ctx.task.name, ctx.seed, n, kind, template)
    return ctx.shared(
        key,
        lambda: make_trials(
            ctx.model, ctx.task, n, seed=ctx.seed, kind=kind, template=template, progress=ctx.progress
        ),
    )


def clusters_of(trials: Sequence[Trial]) -> list[int]:
    """The template of each trial's pair, in order: the `clusters=` of an `Estimate` over them."""
    return [t.pair.template for t in trials]


@dataclass(frozen=True, eq=False)
class Trial:
    """One pair prefilled: `old_nb`/`new_nb` and the decision metric of each.

    `ld` is `metric` at the decision, by default the logit difference
    logit[answers[0]] - logit[answers[1]]; recovery of a patched run is
    (ld - ld_old) / (ld_new - ld_old).
    """

    model: KVModel
    pair: Pair
    old_nb: Notebook
    new_nb: Notebook
    ld_old: float
    ld_new: float
    cache: dict = field(default_factory=dict, repr=False)  # per-pair results shared across probes
    progress: bool = field(default=True, repr=False)  # made with progress=False: probes iterate quietly
    metric: Metric = field(default=logit_diff, repr=False)  # what `ld`, `ld_old` and `ld_new` read

    @property
    def vocab(self) -> tuple[int, int] | None:
        """The token ids a decision must unembed for `metric` (`decide(..., vocab=t.vocab)`)."""
        return answer_columns(self.metric, self.pair.answers)[0]

    def score(self, logits: Float[Tensor, "*b vocab"]) -> Float[Tensor, "*b"]:
        """`metric` of decision logits computed with `vocab=self.vocab`, in float64."""
        return self.metric(logits, answer_columns(self.metric, self.pair.answers)[1])

    @property
    def effect(self) -> float:
        """How far the decision moves from old to new, signed so that + is toward the expected answer."""
        toward_first = self.pair.expected[1] == 0  # new answer is answers[0]: ld should rise
        d = self.ld_new - self.ld_old
        return d if toward_first else -d

    def usable(self, min_effect: float = MIN_EFFECT) -> bool:
        return abs(self.ld_new - self.ld_old) >= min_effect

    def ld(self, nb: Notebook, hooks: Sequence[Hook] = ()) -> Float[Tensor, " batch"]:
        """The decision metric (logit difference by default) for each batch element of `nb`."""
        return read_decision(
            self.model, nb, self.pair.new, self.pair.answers, metric=self.metric, hooks=hooks
        )

    def recovery(self, ld: Tensor | float) -> Tensor:
        """`recovery` of `ld` between this pair's old and new decisions (NaN where they are equal).
        No SmallEffect warning: the analyses weigh each pair's effect themselves (min_effect)."""
        return recovery(ld, self.ld_old, self.ld_new, undefined="nan", min_effect=0)

    def sweep(
        self,
        specs: Sequence[Patch],
        *,
        src: Notebook | None = None,
        dst: Notebook | None = None,
        batch_size: int | None = None,
    ) -> Float[Tensor, " n"]:
        """Recovery of each patch in `specs` (new → old by default), as batched forwards
        (`batch_size` patches each; default sized by `kvnotes.ops.patch_batches`)."""
        src = self.new_nb if src is None else src
        dst = self.old_nb if dst is None else dst
        out = decide_patched(
            self.model, dst, src, list(specs), self.pair.new, batch_size=batch_size, vocab=self.vocab
        ).last
        return self.recovery(self.score(out))

    def token_strings(self, positions: Sequence[int]) -> list[str]:
        return self.model.token_strings([self.pair.new.ids[p] for p in positions])


def with_progress(trials: Sequence[Trial], desc: str):
    """Iterate `trials` with a progress bar on a terminal (silent when output is not a TTY, or when
    the trials were made with `progress=False`)."""
    quiet = bool(trials) and not trials[0].progress
    return tqdm(trials, desc=desc, unit="pair", disable=True if quiet else None, leave=False)


def read_decision(
    model: KVModel,
    nb: Notebook,
    prompt: PromptLike,
    answers: Sequence[int],
    *,
    metric: Metric = logit_diff,
    hooks: Sequence[Hook] = (),
) -> Float[Tensor, " batch"]:
    """`metric` of the decision `prompt` reads after `nb` between `answers`, per batch element."""
    vocab, columns = answer_columns(metric, answers)
    return metric(decide(model, nb, prompt, hooks=hooks, vocab=vocab).last, columns)


def make_trials(
    model: KVModel,
    task: TaskSource | str,
    n: int,
    *,
    seed: int = 0,
    kind: str = GATE,
    filler: str = "",
    template: int | None = None,
    progress: bool = True,
    metric: Metric = logit_diff,
    share: bool | None = None,
    prefixes: Prefixes | None = None,
) -> list[Trial]:
    """Sample `n` aligned pairs of `task` (across its templates, or from `template` alone; see
    `kvnotes.tasks.sample`) and prefill both prompts of each; `metric` is the decision readout
    every probe reads from the trials (default: the logit difference).

    `share`: each prompt computes only what it does not share with an earlier one (the start a
    template's prompts share, a pair's start before its changed field: `kvnotes.ops.Prefixes`,
    or `prefixes`, kept across calls) and reads its decision in the same forward
    (`Prefixes.prefill_and_decide`); the slots and decisions equal separate prefills and decides
    up to float rounding (invariants 1 and 2). `share=False` prefills every prompt from its first
    token and decides it apart; None follows
    `kvnotes.batches.sharing`.

    >>> from kvnotes import load_model
    >>> trials = make_trials(load_model("tiny-llama"), "order-cancel", 2, progress=False)
    >>> len(trials), trials[0].old_nb.n_slots == trials[0].pair.old.spans["decision"][0]
    (2, True)
    """
    task = load_task(task)
    if task.model and task.model != model.name and default_task(model.name) != task.name:
        warnings.warn(
            f"task {task.name!r} was made for {task.model}, not {model.name}; its known "
            "answers (docs/organisms.md) hold only there",
            stacklevel=2,
        )
    pairs = sample(task, model, n, seed=seed, kind=kind, filler=filler, template=template)
    share = sharing_enabled() if share is None else share
    shared = (prefixes or Prefixes(model)) if share else None
    out = []
    for pair in tqdm(pairs, desc=f"prefill {task.name} ({kind})", disable=not progress, unit="pair"):
        if shared is not None:  # each prompt's decision read in the forward that prefills it
            vocab, columns = answer_columns(metric, pair.answers)
            (old_nb, old_logits), (new_nb, new_logits) = (
                shared.prefill_and_decide(p, vocab=vocab) for p in (pair.old, pair.new)
            )
            lds = [float(metric(x, columns)[0]) for x in (old_logits, new_logits)]
        else:
            old_nb, new_nb = prefill(model, pair.old), prefill(model, pair.new)
            lds = [
                float(read_decision(model, nb, prompt, pair.answers, metric=metric)[0])
                for nb, prompt in ((old_nb, pair.old), (new_nb, pair.new))
            ]
        out.append(
            Trial(
                model=model,
                pair=pair,
                old_nb=old_nb,
                new_nb=new_nb,
                ld_old=lds[0],
                ld_new=lds[1],
                progress=progress,
                metric=metric,
            )
        )
    return out


def split_by_effect(trials: Sequence[Trial], min_effect: float) -> tuple[list[Trial], list[dict]]:
    """The trials usable for recovery, and a record of the excluded ones."""
    used = [t for t in trials if t.usable(min_effect)]
    excluded = [
        {"index": i, "effect": t.effect, "reason": f"|ld_new - ld_old| < {min_effect}"}
        for i, t in enumerate(trials)
        if not t.usable(min_effect)
    ]
    return used, excluded


def effect_estimate(trials: Sequence[Trial]) -> Estimate:
    """Signed effect of the change on the decision (logits; + is toward the expected answer)."""
    return Estimate.of([t.effect for t in trials], clusters=clusters_of(trials))
