"""What every benchmark shares: the growth exponent of a figure over prompt lengths, neutral filler
text, the answer tokens of a model and the models to run on both backends (a report's JSON and
header are the result protocol's, in `kvnotes.analysis.results`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvnotes.engine import Capability, has
from kvnotes.engine.nnsight.model import NNsightModel
from kvnotes.errors import BadArgument
from kvnotes.fixtures import FILLER
from kvnotes.models.model import KVModel


def both_backends(model: KVModel) -> tuple[KVModel, NNsightModel | None]:
    """(the TransformerLens-backend model, the nnsight-backend one or None) for a bench asked for on
    `model`'s backend: on the nnsight backend the same name is loaded on TransformerLens too, so
    the two engines run side by side in one process."""
    if not has(model, Capability.TRANSFORMER_LENS):
        from kvnotes.zoo import load_model

        if not isinstance(model, NNsightModel):  # pragma: no cover - two backends today
            raise BadArgument(
                f"the benches run on the TransformerLens or nnsight backend, not {model.name}'s"
            )
        return load_model(model.name), model
    return model, None


def growth_exponent(xs: Sequence[int | float], ys: Sequence[int | float | None]) -> float | None:
    """The slope of log y on log x (y ∝ x^e; 1: linear), or None with fewer than two distinct x or
    any y missing.

    >>> round(growth_exponent([1, 2, 4], [3, 12, 48]), 6)
    2.0
    """
    known = [float(y) for y in ys if y is not None]
    if len(set(xs)) < 2 or len(known) < len(ys):
        return None
    return float(np.polyfit(np.log(list(xs)), np.log(known), 1)[0])


def text_ids(model: KVModel, n: int, line: str = FILLER) -> list[int]:
    """`n` token ids of neutral text (no BOS): policy-like lines, or `line` repeated."""
    ids: list[int] = []
    i = 0
    while len(ids) < n:
        ids += model.encode("".join(line.format(i=j) for j in range(i, i + 50)), bos=False)
        i += 50
    return ids[:n]


def model_answer_ids(model: KVModel, answers: Sequence[str]) -> tuple[int, int]:
    """The first token of each of two answers under `model`'s tokenizer (a decision is read by
    token id); refuses two answers that start with the same token."""
    first, second = (model.encode(a, bos=False)[0] for a in answers)
    if first == second:
        raise BadArgument(
            f"answers {tuple(answers)} start with the same token under {model.name}'s tokenizer; "
            "pick two answers whose first tokens differ"
        )
    return first, second
