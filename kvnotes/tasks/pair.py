"""A prompt pair: two prompts that line up token for token and differ where the answer turns.

Sampled from a task (`kvnotes.tasks.sampler.sample`) or read from a pair dataset
(`kvnotes.tasks.pairs`); every probe's trial holds one.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvnotes.prompt import Prompt


@dataclass(frozen=True)
class Pair:
    """Two prompts that differ only in `changed` (the gating field, or the rule for `kind="rule"`).

    `answers` are the two answer token ids; `expected` the answer index each prompt should get;
    `template` which of the task's templates both prompts were rendered from (`Task.with_template`).
    """

    task: str
    kind: str
    changed: str
    old: Prompt
    new: Prompt
    answers: tuple[int, int]
    expected: tuple[int, int]
    seed: int

    inputs: tuple[str, ...] = ()  # every field the conclusion depends on (changed one first)
    template: int = 0  # the task template both prompts were rendered from

    @property
    def field_span(self) -> range:
        """Token range of the changed field (the same in both prompts)."""
        return self.old.span(self.changed)

    def downstream(self) -> list[int]:
        """Positions after the changed field and before the decision: where notes can be written.

        For a rule pair the notes must follow both the rule and the gating field, so they start
        after whichever of the two comes later.
        """
        end = max(self.old.span(f).stop for f in (self.inputs or (self.changed,)))
        return list(range(end, self.old.span("decision").start))
