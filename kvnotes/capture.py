"""Runs captured at the same hook points: the one way heads, features and edges read both runs.

A patching analysis first reads what it patches from: each run (the old and the new notebook, or
any two prompt sets) computes its tokens once, read-only, with the same hook points captured. A
`CaptureRun` says what one run computes; `capture_runs` runs each once (one batched forward each)
and returns a `RunCapture` per run; `capture_pair` is the two-run case (`PairCapture`, old then new),
which `circuits.heads`, `circuits.feature_sites` and `circuits.edges.patcher` specialise.

Captured tensors are detached copies in the engine's own layout (`[batch, pos, ...]`, attention
patterns and scores `[batch, head, query, key]`), in the model's dtype and device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvnotes.engine import run
from kvnotes.engine.plan import Readout
from kvnotes.errors import BadArgument
from kvnotes.notebook import Notebook
from kvnotes.types import Tensor

if TYPE_CHECKING:
    from kvnotes.models.model import KVModel


@dataclass(frozen=True, eq=False)
class CaptureRun:
    """One run to capture: `tokens` (`[pos]`, or `[batch, pos]` rows) at `positions` against
    `notebook`. The first `written` tokens are computed and written into the notebook first,
    uncaptured (a query's tokens before the one read); the rest run once, read-only, captured."""

    notebook: Notebook
    tokens: Sequence[int] | Tensor
    positions: Sequence[int] | Tensor
    written: int = 0


@dataclass(frozen=True, eq=False)
class RunCapture:
    """What one run left: `activations` per hook name (detached copies, the engine's layout),
    the notebook the captured tokens ran against (after any written tokens), and the readout
    (logits at `logits_at`)."""

    notebook: Notebook
    activations: dict[str, Tensor]
    readout: Readout

    def __getitem__(self, hook: str) -> Tensor:
        return self.activations[hook]

    def stacked(self, hooks: Sequence[str], row: int = 0, pos: int = -1) -> Tensor:
        """`hooks`' activations at batch `row` and computed token `pos`, stacked (one per hook:
        per-layer hook names give `[layer, ...]`)."""
        return torch.stack([self.activations[h][row, pos] for h in hooks])


@dataclass(frozen=True, eq=False)
class PairCapture:
    """Both runs captured at the same hook points: `old` (the run patched into) and `new` (the
    run patched from)."""

    old: RunCapture
    new: RunCapture


@torch.no_grad()
def capture_runs(
    model: KVModel,
    runs: Sequence[CaptureRun],
    hooks: Sequence[str],
    *,
    logits_at: Sequence[int] | None = (),
    vocab: Sequence[int] | None = None,
) -> tuple[RunCapture, ...]:
    """Each run of `runs` computed once with `hooks` captured (read-only: no notebook changes
    but each run's own `written` tokens, which go into a new notebook). `logits_at` and `vocab`
    as `kvnotes.engine.run` takes them (default: no logits).

    >>> from kvnotes import load_model, prefill
    >>> model = load_model("tiny-llama")
    >>> nb = prefill(model, "The order has shipped.")
    >>> ids = model.encode(" Deny.", bos=False)
    >>> (cap,) = capture_runs(model, [CaptureRun(nb, ids, range(7, 7 + len(ids)))], ["blocks.0.attn.hook_z"])
    >>> tuple(cap["blocks.0.attn.hook_z"].shape)  # [batch, pos, n_heads, d_head]
    (1, 4, 4, 16)
    """
    if not hooks:
        raise BadArgument("capture_runs needs at least one hook name to capture (e.g. blocks.0.attn.hook_z)")
    out = []
    for r in runs:
        nb, tokens, positions, w = r.notebook, r.tokens, r.positions, r.written
        if w:
            nb, _ = run(
                model,
                nb,
                tokens[..., :w] if isinstance(tokens, Tensor) else tokens[:w],
                positions[:w],
                logits_at=(),
            )
        _, readout = run(
            model,
            nb,
            tokens[..., w:] if isinstance(tokens, Tensor) else tokens[w:],
            positions[w:],
            write=False,
            capture=list(hooks),
            logits_at=logits_at,
            vocab=vocab,
        )
        out.append(RunCapture(notebook=nb, activations=readout.activations, readout=readout))
    return tuple(out)


def capture_pair(
    model: KVModel,
    old: CaptureRun,
    new: CaptureRun,
    hooks: Sequence[str],
    *,
    logits_at: Sequence[int] | None = (),
    vocab: Sequence[int] | None = None,
) -> PairCapture:
    """Both runs captured at `hooks` (`capture_runs` of the two): what every patching analysis
    reads before it patches."""
    a, b = capture_runs(model, [old, new], hooks, logits_at=logits_at, vocab=vocab)
    return PairCapture(old=a, new=b)
