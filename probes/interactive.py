"""A patching session for interactive use: two aligned prompts prefilled once, and any selection
of slots × layers (K and/or V) transplanted from the new run into the old and re-decided.

This is the computing half of the notebook's patching view (`dashboards.widget.PatchingView`,
which only draws it); it is as useful from a script:

    >>> from kvnotes import load_model
    >>> s = PatchSession.from_task(load_model("tiny-llama"), "order-cancel")
    >>> abs(s.patch(s.positions).ld_patched - s.ld_new) < 1e-5  # every slot and layer: the new decision
    True
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from kvnotes.errors import BadArgument, OutOfRange
from kvnotes.metrics import logit_diff, recovery
from kvnotes.models.model import KVModel
from kvnotes.ops import Patch, decide, decide_patched, prefill
from kvnotes.prompt import Prompt
from kvnotes.tasks import load_task, sample


@dataclass(frozen=True, kw_only=True)
class PatchState:
    """What is patched (slots by position, layers, K and/or V) and the decision it gives.

    `ld_*` are logit[answers[0]] - logit[answers[1]] at the decision; `recovery` is
    (ld_patched - ld_old) / (ld_new - ld_old), NaN when old and new decide alike.
    """

    positions: tuple[int, ...]
    layers: tuple[int, ...]
    keys: bool
    values: bool
    ld_old: float
    ld_new: float
    ld_patched: float
    recovery: float

    @property
    def empty(self) -> bool:
        """True when nothing is transplanted (no slot, or neither K nor V)."""
        return not self.positions or not (self.keys or self.values)

    def to_dict(self) -> dict:
        """JSON-safe: lists of ints, floats, and None for an undefined recovery."""
        d = asdict(self)
        d["positions"], d["layers"] = list(self.positions), list(self.layers)
        if math.isnan(self.recovery):
            d["recovery"] = None
        return d


def _answer_id(model: KVModel, answer: str | int) -> int:
    return answer if isinstance(answer, int) else model.answer_token(answer)


class PatchSession:
    """Transplant chosen slots × layers (K and/or V) from `new`'s notebook into `old`'s and re-decide.

    `old` and `new` are aligned prompts (same token count, e.g. `Prompt.with_values`). Both are
    prefilled once; each `patch` is one decision forward on a patched copy (nothing mutates).
    `changed` are the slots whose token differs (the field), `downstream` every slot after the
    last of them (where its notes are written).
    """

    def __init__(
        self,
        model: KVModel,
        old: Prompt,
        new: Prompt,
        answers: tuple[str | int, str | int] = (" cancel", " deny"),
    ):
        old.check_aligned(new)
        self.model, self.old, self.new = model, old, new
        self.answers = (_answer_id(model, answers[0]), _answer_id(model, answers[1]))
        self.nb_old, self.nb_new = prefill(model, old), prefill(model, new)
        self.ld_old = self._ld(decide(model, self.nb_old, old, vocab=self.answers).last[0])
        self.ld_new = self._ld(decide(model, self.nb_new, new, vocab=self.answers).last[0])
        self.positions: tuple[int, ...] = tuple(int(p) for p in self.nb_old.positions.tolist())
        old_ids = self.nb_old.tokens[0].tolist()
        new_ids = self.nb_new.select(self.positions).tokens[0].tolist()
        self.old_tokens = model.token_strings(old_ids)
        self.new_tokens = model.token_strings(new_ids)
        self.changed = tuple(p for p, a, b in zip(self.positions, old_ids, new_ids) if a != b)
        after = max(self.changed) + 1 if self.changed else min(self.positions, default=0)
        self.downstream = tuple(p for p in self.positions if p >= after)

    @classmethod
    def from_task(cls, model: KVModel, task: str = "order-cancel", seed: int = 0) -> PatchSession:
        """A session on one sampled pair of a task (its gating field changed; answers from the task)."""
        pair = sample(load_task(task), model, 1, seed=seed)[0]
        return cls(model, pair.old, pair.new, answers=pair.answers)

    def layer_range(self, layers: Iterable[int] | None) -> tuple[int, ...]:
        """`layers` checked against the model (None: all of them)."""
        n = self.model.n_layers
        if layers is None:
            return tuple(range(n))
        ls = tuple(sorted({int(l) for l in layers}))
        if not ls:
            raise BadArgument("layers is empty; pass None for all layers or a range such as range(0, 4)")
        if ls[0] < 0 or ls[-1] >= n:
            raise OutOfRange(f"layers {ls[0]}..{ls[-1]} out of range: the model has {n} layers (0..{n - 1})")
        return ls

    def check_positions(self, positions: Iterable[int]) -> tuple[int, ...]:
        """`positions` sorted and checked against the old notebook's slots."""
        pos = tuple(sorted({int(p) for p in positions}))
        bad = [p for p in pos if p not in set(self.positions)]
        if bad:
            raise OutOfRange(
                f"position(s) {bad} are not slots of the old notebook "
                f"({self.positions[0]}..{self.positions[-1]})"
            )
        return pos

    def patch(
        self,
        positions: Iterable[int] = (),
        layers: Iterable[int] | None = None,
        *,
        keys: bool = True,
        values: bool = True,
    ) -> PatchState:
        """Transplant `positions` × `layers` (None: all) from the new run, K and/or V, and re-decide."""
        pos = self.check_positions(positions)
        layers = self.layer_range(layers)
        if not pos or not (keys or values):
            ld_patched = self.ld_old  # nothing transplanted: the old notebook as it is
        else:
            spec = Patch(positions=pos, layers=layers, keys=keys, values=values)
            ld_patched = self._ld(
                decide_patched(
                    self.model, self.nb_old, self.nb_new, [spec], self.new, vocab=self.answers
                ).last[0]
            )
        rec = float(recovery(ld_patched, self.ld_old, self.ld_new, undefined="nan"))
        return PatchState(
            positions=pos,
            layers=layers,
            keys=bool(keys),
            values=bool(values),
            ld_old=self.ld_old,
            ld_new=self.ld_new,
            ld_patched=ld_patched,
            recovery=rec,
        )

    @staticmethod
    def _ld(logits) -> float:
        return float(logit_diff(logits, (0, 1)))

    def __repr__(self) -> str:
        return (
            f"PatchSession({self.model.name!r}, {len(self.positions)} slots, "
            f"{len(self.changed)} changed, ld old {self.ld_old:+.3f} → new {self.ld_new:+.3f})"
        )
