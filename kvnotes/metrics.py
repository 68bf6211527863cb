"""Readouts: logit difference, recovery, logit cosine, decision agreement, KV deviation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvnotes.notebook import Notebook
from kvnotes.types import Float, Tensor


def logit_diff(logits: Float[Tensor, "*b d_vocab"], a: int, b: int) -> Float[Tensor, "*b"]:
    """logit[a] - logit[b]: the decision's margin between answer tokens a and b."""
    return logits[..., a] - logits[..., b]


def recovery(patched: Tensor, old: Tensor, new: Tensor) -> Tensor:
    """(patched - old) / (new - old): 0 = unchanged from old, 1 = fully the new decision."""
    patched, old, new = (torch.as_tensor(x, dtype=torch.float64) for x in (patched, old, new))
    denom = new - old
    if (denom.abs() < 1e-9).any():
        raise ValueError("recovery is undefined: the old and new metrics are equal for some prompt")
    return (patched - old) / denom


def logit_cosine(a: Float[Tensor, "*b d_vocab"], b: Float[Tensor, "*b d_vocab"]) -> Float[Tensor, "*b"]:
    """Cosine similarity of two logit vectors (over the vocabulary)."""
    return F.cosine_similarity(a.double(), b.double(), dim=-1)


def agreement(
    a: Float[Tensor, "*b d_vocab"], b: Float[Tensor, "*b d_vocab"], answers: tuple[int, ...] | None = None
) -> Tensor:
    """Whether two logit vectors pick the same token: among `answers`, or top-1 over the vocab."""
    if answers is not None:
        idx = torch.tensor(answers)
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
