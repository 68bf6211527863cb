"""Readouts: the decision metric (logit difference, answer log-probability), recovery, rank
correlation, logit cosine, decision agreement, KV deviation."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.nn.functional as F

from kvnotes.engine.guard import allow
from kvnotes.errors import MIN_EFFECT, BadArgument, SmallEffect
from kvnotes.notebook import Notebook
from kvnotes.types import Float, Tensor

Metric = Callable[[Tensor, tuple[int, int]], Tensor]
"""A decision metric: `(logits [..., d_vocab], answers) -> float64 [...]`, the decision read
from the logits of one token position for an answer pair (token ids, or columns of `logits`)."""


def logit_diff(
    logits: Float[Tensor, "*b d_vocab"], a: int | tuple[int, int], b: int | None = None
) -> Float[Tensor, "*b"]:
    """logit[a] - logit[b] in float64: the decision's margin between answer tokens a and b.

    The default `Metric`: `logit_diff(logits, (a, b))`; `logit_diff(logits, a, b)` is the same.
    Both logits are cast before subtracting, so the difference of float32 or bfloat16 logits is
    not rounded back to their precision (every figure reads the same, exact, margin). The cast
    stays on the logits' device, the one upcast `kvnotes.engine.guard` allows here.
    """
    if b is None:
        a, b = a
    with allow(torch.float64):
        return logits[..., a].double() - logits[..., b].double()


def answer_logprob(logits: Float[Tensor, "*b d_vocab"], answers: tuple[int, int]) -> Float[Tensor, "*b"]:
    """log p(answers[0]) over the whole vocabulary, in float64: a `Metric` that, unlike the logit
    difference, also moves when probability shifts to tokens outside the answer pair."""
    with allow(torch.float64):
        return torch.log_softmax(logits.double(), dim=-1)[..., answers[0]]


def answer_columns(metric: Metric, answers: Sequence[int]) -> tuple[tuple[int, int] | None, tuple[int, int]]:
    """What a decision must unembed for `metric`, and where the answers are in it:
    `(vocab, columns)` for `decide(..., vocab=vocab)` then `metric(logits, columns)`.

    The logit difference reads only the two answers' logits, so only those are computed
    (`vocab=answers`, read as columns (0, 1)); any other metric gets the whole vocabulary.
    """
    a, b = (int(x) for x in answers)
    if metric is logit_diff:
        return (a, b), (0, 1)
    return None, (a, b)


def recovery(
    patched: Tensor | float,
    old: Tensor | float,
    new: Tensor | float,
    *,
    undefined: Literal["raise", "nan"] = "raise",
    min_effect: float | int = MIN_EFFECT,
) -> Float[Tensor, "*b"]:
    """(patched - old) / (new - old) in float64: 0 = unchanged from old, 1 = fully the new decision.

    Where |new - old| < 1e-9 recovery is undefined: `undefined="raise"` raises ValueError,
    `undefined="nan"` gives NaN there (for callers that drop undefined values, not prompts).
    Where |new - old| is defined but under `min_effect` (logits; the analyses' MIN_EFFECT, 0.1) it
    warns SmallEffect, naming the effect: a ratio of two small differences is mostly noise, and the
    analyses leave such pairs out. `min_effect=0` takes every effect as it is (no warning).

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     r = recovery(0.0196, 0.0, 0.02)
    >>> round(float(r), 2), w[0].category.__name__
    (0.98, 'SmallEffect')
    """
    if undefined not in ("raise", "nan"):
        raise BadArgument(f"undefined must be 'raise' or 'nan', got {undefined!r}")
    device = next((x.device for x in (patched, old, new) if isinstance(x, Tensor)), None)
    with allow(torch.float64):  # on the metrics' device: numbers given as floats join them there
        patched, old, new = (
            torch.as_tensor(x, dtype=torch.float64, device=device) for x in (patched, old, new)
        )
        denom = new - old
        flat = denom.abs() < 1e-9
        if undefined == "raise" and flat.any():
            raise ValueError("recovery is undefined: the old and new metrics are equal for some prompt")
        small = ~flat & (denom.abs() < min_effect)
        if small.any():
            _warn_small(denom.abs()[small], int(denom.numel()), min_effect)
        out = (patched - old) / denom
        return torch.where(flat, math.nan, out) if undefined == "nan" else out


def _warn_small(effects: Tensor, total: int, min_effect: float) -> None:
    warnings.warn(
        f"recovery read on an effect of {float(effects.min()):.3g} logits"
        + (f" ({effects.numel()} of {total} prompts under the minimum)" if total > 1 else "")
        + f", under the minimum effect {min_effect:g} the analyses use: a ratio of two small differences "
        "is mostly noise. Use pairs whose decision moves more, or pass min_effect=0 to take it as it is.",
        SmallEffect,
        stacklevel=3,
    )


def undefined_recovery(n: int, device: torch.device | str | None = None) -> Float[Tensor, " n"]:
    """`n` recoveries that are undefined (NaN; `n` = 0: none), float64 on `device` as `recovery`'s
    are, for an analysis with nothing to measure.

    >>> undefined_recovery(2).tolist(), undefined_recovery(0).shape
    ([nan, nan], torch.Size([0]))
    """
    with allow(torch.float64):
        return torch.full((n,), math.nan, dtype=torch.float64, device=device)


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation of `a` and `b`; None when either is constant (rho is undefined)."""
    if len(set(a)) < 2 or len(set(b)) < 2:
        return None
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def logit_cosine(a: Float[Tensor, "*b d_vocab"], b: Float[Tensor, "*b d_vocab"]) -> Float[Tensor, "*b"]:
    """Cosine similarity of two logit vectors (over the vocabulary)."""
    with allow(torch.float64):
        return F.cosine_similarity(a.double(), b.double(), dim=-1)


def agreement(
    a: Float[Tensor, "*b d_vocab"], b: Float[Tensor, "*b d_vocab"], answers: tuple[int, ...] | None = None
) -> Tensor:
    """Whether two logit vectors pick the same token: among `answers`, or top-1 over the vocab."""
    if answers is not None:
        idx = torch.tensor(answers, device=a.device)
        a, b = a[..., idx], b[..., idx]
    return a.argmax(-1) == b.argmax(-1)


def kv_deviation(a: Notebook, b: Notebook) -> Float[Tensor, "batch layer slot"]:
    """Per slot and layer, the L2 norm of the difference in (K, V) over heads and d_head.

    Slots are matched by position; the result follows `a`'s slot order.
    """
    a.check_compatible(b)
    if not torch.equal(a.positions, b.positions):
        b = b.select(a.positions)
    rows = []
    for ka, va, kb, vb in zip(a.keys, a.values, b.keys, b.values):
        d = torch.cat([(ka - kb), (va - vb)], dim=-1)  # [batch, kv_head, slot, 2*d_head]
        rows.append(d.pow(2).sum(dim=(1, 3)).sqrt())
    return torch.stack(rows, dim=1)
