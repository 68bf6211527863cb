"""`run`: the one compute primitive every notebook operation is built from.

`run(model, notebook, tokens, positions)` computes `tokens` at `positions`; each attends causally
*by position* to the notebook's slots and to the other computed tokens (a slot whose position is
being recomputed is replaced, not attended). With `write=True` the computed tokens' fresh K/V
replace the slots at their positions or are appended.

`plan.py` checks the call and says which keys each layer reads; the model's backend (`backend.py`,
the protocol; `table.py`, which backend runs which model class: `transformer_lens/`, `nnsight/`)
computes it; `plan.write_back` stores the result. A long append (`prefill`) with no hooks runs in
chunks of `PREFILL_CHUNK` tokens, so memory grows linearly with the context.

Beside `run`, the engine answers what a model's backend offers (`has`, `require`, by `Capability`;
`hooked`, the TransformerLens module behind a model that has one, the only way past the seam)
and gives the operations every backend implements: `move_keys` (post-RoPE keys to new positions),
`full_logits` (one plain forward) and `in_float64` (the model computing in float64, `verify`'s truth).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvnotes.engine import profile
from kvnotes.engine.backend import Backend, Capability
from kvnotes.engine.phases import phase
from kvnotes.engine.plan import (
    PREFILL_CHUNK,
    Hook,
    Readout,
    Resume,
    check_stop_hooks,
    fast_attention,
    fast_attention_enabled,
    make_plan,
    tokens_and_positions,
    write_back,
)
from kvnotes.engine.table import (
    BACKENDS,
    backend_of,
    full_logits,
    has,
    hooked,
    in_float64,
    lens_model,
    move_keys,
    require,
)
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook
from kvnotes.types import Int, Tensor


def run(
    model: KVModel,
    notebook: Notebook,
    tokens: Sequence[int] | Tensor,
    positions: Sequence[int] | Tensor | None = None,
    *,
    write: bool = True,
    hooks: Sequence[Hook] = (),
    capture: Sequence[str] = (),
    logits_at: Sequence[int] | None = None,
    vocab: Sequence[int] | None = None,
    overlay: Notebook | None = None,
    resume: Resume | None = None,
    stop: int | None = None,
) -> tuple[Notebook, Readout]:
    """Compute `tokens` at `positions` against `notebook`; return the new notebook and a readout.

    tokens: `[pos]` or `[batch, pos]` ids; positions default to right after the notebook.
    logits_at: positions (among those computed) to unembed; default the last one; `()` for none.
    vocab: token ids whose logits to return (in that order); default the whole vocabulary.
    hooks: TransformerLens-style `(name_or_filter, fn)` pairs, active for this call only.
    overlay: slots read in place of `notebook`'s slots at the same positions (or beside them),
        with a batch of their own: what a batch of patches differs in, while the unpatched slots
        stay shared, never copied. Read-only: needs `write=False`.
    resume: start at a later block with the residual given (`plan.Resume`; backends with the
        "resume" capability). Read-only; hooks on the skipped blocks do not fire.
    stop: run the blocks below `stop` only (backends with the "stop" capability): no logits, hooks
        and captures up to block `stop - 1`; the notebook written holds those blocks' K/V, and
        serves later runs that stop there or earlier. What reading one residual costs:
        `stop_for(model, [name])` is the least stop that still reaches it.

    Inside `kvnotes.engine.profile.profile()` each call is timed and recorded.

    >>> from kvnotes import load_model, prefill
    >>> model = load_model("tiny-llama")
    >>> nb = prefill(model, "The order has shipped.")
    >>> nb2, out = run(model, nb, model.encode(" Deny.", bos=False))  # appended after the notebook
    >>> nb.n_slots, nb2.n_slots, tuple(out.logits.shape)  # [batch, read-out positions, d_vocab]
    (7, 11, (1, 1, 512))
    """
    kw: dict[str, Any] = dict(
        write=write,
        hooks=hooks,
        capture=capture,
        logits_at=logits_at,
        vocab=vocab,
        overlay=overlay,
        resume=resume,
        stop=stop,
    )
    if not profile.active():
        return _compute(model, notebook, tokens, positions, **kw)
    tok = tokens if isinstance(tokens, Tensor) else torch.as_tensor(tokens)
    rows = max(notebook.batch, 1 if tok.ndim == 1 else tok.shape[0], overlay.batch if overlay else 1)
    slots = notebook.n_slots + (overlay.n_slots if overlay is not None else 0)
    f = model.facts
    blocks = (f.n_layers if stop is None else stop) - (resume.layer if resume is not None else 0)
    reads = 1 if logits_at is None else len(logits_at)
    cols = f.d_vocab_out if vocab is None else len(vocab)
    work = profile.matmul_flops(f, rows, tok.shape[-1], slots, blocks, reads, cols) / 1e9
    with profile.record(rows, tok.shape[-1], slots, work):
        return _compute(model, notebook, tokens, positions, **kw)


def _compute(
    model: KVModel,
    notebook: Notebook,
    tokens: Sequence[int] | Tensor,
    positions: Sequence[int] | Tensor | None,
    *,
    write: bool,
    hooks: Sequence[Hook],
    capture: Sequence[str],
    logits_at: Sequence[int] | None,
    vocab: Sequence[int] | None,
    overlay: Notebook | None,
    resume: Resume | None,
    stop: int | None,
) -> tuple[Notebook, Readout]:
    """`run`'s three steps: plan, the backend's forward, write back."""
    if resume is not None:
        require(model, Capability.RESUME, "a run that starts at a later block (`resume`)")
    if stop is not None:
        require(model, Capability.STOP, "a run that stops before the last block (`stop`)")
        check_stop_hooks(model, stop, [*capture, *(t for t, _ in hooks if isinstance(t, str))])
    # 1) plan: checked tokens [batch, pos] at positions [pos], the read-out positions and columns
    with phase("plan"):
        plan = make_plan(
            model,
            notebook,
            tokens,
            positions,
            write=write,
            logits_at=logits_at,
            vocab=vocab,
            overlay=overlay,
            resume=resume,
            stop=stop,
        )
    if plan.tok.shape[1] == 0:  # nothing to compute: the notebook as it is, an empty readout
        empty = torch.zeros(notebook.batch, 0, plan.width, dtype=model.dtype, device=model.device)
        return notebook, Readout(logits=empty, positions=())
    plain = not hooks and not capture and overlay is None and resume is None and stop is None
    if plain and _chunkable(model, notebook, plan.pos):
        return _run_in_chunks(model, notebook, plan.tok, plan.pos, plan.read, vocab, write)
    # 2) the backend: per layer fresh K/V [batch, n_kv_heads, pos, d_head], logits [batch, read, width]
    fresh = backend_of(model).forward(model, plan, hooks, capture)
    out = Readout(logits=fresh.logits, positions=plan.read, activations=fresh.activations)
    # 3) write back: the fresh K/V replace the slots at their positions or are appended
    if not write:
        return notebook, out
    with phase("write_back"):
        return write_back(notebook, plan.tok, plan.pos, *fresh.every_layer()), out


def stop_for(model: KVModel, names: Sequence[str]) -> int | None:
    """The least `stop` a run can take and still reach every hook point in `names` (one more than
    the last block they name), where the model's backend can stop early and that saves a block;
    else None (run every block).

    >>> from kvnotes import load_model
    >>> model = load_model("tiny-llama")
    >>> stop_for(model, ["blocks.0.hook_resid_post"]), stop_for(model, ["ln_final.hook_normalized"])
    (1, None)
    """
    blocks = [n.split(".")[1] for n in names if n.startswith("blocks.")]
    if (
        not has(model, Capability.STOP)
        or not blocks
        or len(blocks) < len(names)
        or not all(b.isdigit() for b in blocks)
    ):
        return None
    stop = max(int(b) for b in blocks) + 1
    return stop if stop < model.n_layers else None


def _chunkable(model: KVModel, nb: Notebook, pos: Int[Tensor, " pos"]) -> bool:
    """A long pure append (positions increasing, after every slot) with no hook anywhere: its
    result does not depend on computing it in one piece."""
    if not fast_attention_enabled() or pos.numel() <= PREFILL_CHUNK:
        return False
    if nb.n_slots and int(pos[0]) <= int(nb.positions.max()):
        return False
    if not bool((pos[1:] > pos[:-1]).all()):
        return False
    return not backend_of(model).watched(model)


def _run_in_chunks(model, notebook, tok, pos, read, vocab, write) -> tuple[Notebook, Readout]:
    """`run` over `PREFILL_CHUNK` tokens at a time, each chunk written before the next reads it."""
    nb, pieces, order = notebook, list[Tensor](), list[int]()
    for a in range(0, pos.numel(), PREFILL_CHUNK):
        cpos = pos[a : a + PREFILL_CHUNK]
        lo, hi = int(cpos[0]), int(cpos[-1])
        here = tuple(p for p in read if lo <= p <= hi)
        nb, out = run(model, nb, tok[:, a : a + PREFILL_CHUNK], cpos, logits_at=here, vocab=vocab)
        pieces.append(out.logits)
        order += here
    logits = torch.cat(pieces, 1)[:, [order.index(p) for p in read]]
    return (nb if write else notebook), Readout(logits=logits, positions=read)


__all__ = [
    "BACKENDS",
    "PREFILL_CHUNK",
    "Backend",
    "Capability",
    "Hook",
    "Readout",
    "Resume",
    "backend_of",
    "fast_attention",
    "fast_attention_enabled",
    "full_logits",
    "has",
    "hooked",
    "in_float64",
    "lens_model",
    "move_keys",
    "require",
    "run",
    "stop_for",
    "tokens_and_positions",
]
