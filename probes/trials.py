"""A `Trial` is one prompt pair, prefilled once: the old and new notebooks and their decisions.

Every probe reads trials, so a run of several probes prefills each prompt once, and what one
probe learns about a pair (its note map) is reused by the next (knockout, injection).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from kvnotes.engine import Hook
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook
from kvnotes.ops import Patch, decide, decide_patched, prefill
from kvnotes.tasks import GATE, Pair, Task, load_task, sample
from kvnotes.types import Float, Tensor

MIN_EFFECT = 0.1  # logits: below this the two prompts barely differ, and recovery is noise


@dataclass(frozen=True, eq=False)
class Trial:
    """One pair prefilled: `old_nb`/`new_nb` and the answer logit difference of each.

    `ld` is logit[answers[0]] - logit[answers[1]] at the decision; recovery of a patched run is
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

    @property
    def effect(self) -> float:
        """How far the decision moves from old to new, signed so that + is toward the expected answer."""
        toward_first = self.pair.expected[1] == 0  # new answer is answers[0]: ld should rise
        d = self.ld_new - self.ld_old
        return d if toward_first else -d

    def usable(self, min_effect: float = MIN_EFFECT) -> bool:
        return abs(self.ld_new - self.ld_old) >= min_effect

    def ld(self, nb: Notebook, hooks: Sequence[Hook] = ()) -> Float[Tensor, " batch"]:
        """Decision logit difference for each batch element of `nb`."""
        out = decide(self.model, nb, self.pair.new, hooks=hooks, vocab=self.pair.answers).last
        return (out[:, 0] - out[:, 1]).double()

    def recovery(self, ld: Tensor | float) -> Tensor:
        ld = torch.as_tensor(ld, dtype=torch.float64)
        return (ld - self.ld_old) / (self.ld_new - self.ld_old)

    def sweep(
        self,
        specs: Sequence[Patch],
        *,
        src: Notebook | None = None,
        dst: Notebook | None = None,
        batch_size: int = 16,
    ) -> Float[Tensor, " n"]:
        """Recovery of each patch in `specs` (new → old by default), as batched forwards."""
        src = self.new_nb if src is None else src
        dst = self.old_nb if dst is None else dst
        out = decide_patched(
            self.model, dst, src, list(specs), self.pair.new, batch_size=batch_size, vocab=self.pair.answers
        )
        return self.recovery(out[:, 0].double() - out[:, 1].double())

    def token_strings(self, positions: Sequence[int]) -> list[str]:
        return self.model.token_strings([self.pair.new.ids[p] for p in positions])


def each(trials: Sequence[Trial], desc: str):
    """Iterate `trials` with a progress bar on a terminal (silent when output is not a TTY, or when
    the trials were made with `progress=False`)."""
    quiet = bool(trials) and not trials[0].progress
    return tqdm(trials, desc=desc, unit="pair", disable=True if quiet else None, leave=False)


def make_trials(
    model: KVModel,
    task: Task | str,
    n: int,
    *,
    seed: int = 0,
    kind: str = GATE,
    filler: str = "",
    progress: bool = True,
) -> list[Trial]:
    """Sample `n` aligned pairs of `task` and prefill both prompts of each.

    >>> from kvnotes import load_model
    >>> trials = make_trials(load_model("tiny-llama"), "order-cancel", 2, progress=False)
    >>> len(trials), trials[0].old_nb.n_slots == trials[0].pair.old.spans["decision"][0]
    (2, True)
    """
    task = load_task(task)
    if task.model and task.model != model.name:
        warnings.warn(
            f"task {task.name!r} was made for {task.model}, not {model.name}; its known "
            "answers (docs/organisms.md) hold only there",
            stacklevel=2,
        )
    pairs = sample(task, model, n, seed=seed, kind=kind, filler=filler)
    out = []
    for pair in tqdm(pairs, desc=f"prefill {task.name} ({kind})", disable=not progress, unit="pair"):
        old_nb, new_nb = prefill(model, pair.old), prefill(model, pair.new)
        lds = []
        for nb, prompt in ((old_nb, pair.old), (new_nb, pair.new)):
            o = decide(model, nb, prompt, vocab=pair.answers).last[0]
            lds.append(float(o[0] - o[1]))
        out.append(
            Trial(
                model=model,
                pair=pair,
                old_nb=old_nb,
                new_nb=new_nb,
                ld_old=lds[0],
                ld_new=lds[1],
                progress=progress,
            )
        )
    return out
