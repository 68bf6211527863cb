"""`run`: the one compute primitive every notebook operation is built from.

`run(model, notebook, tokens, positions)` computes `tokens` at `positions`; each attends causally
*by position* to the notebook's slots and to the other computed tokens (a slot whose position is
being recomputed is replaced, not attended). With `write=True` the computed tokens' fresh K/V
replace the slots at their positions or are appended. The model's own TransformerLens modules and
hook points do the work, so `blocks.{l}.attn.hook_pattern` & co. fire with their usual meaning.

In `hook_attn_scores` / `hook_pattern` the key axis is the notebook's slots in slot order, then
the `overlay`'s slots (if any), then the computed tokens in the order given.

Two attention paths compute the same numbers. The *reference* path forms every score over that
whole key axis and fires `hook_attn_scores` / `hook_pattern`. The *fast* path, taken in a layer
where nothing hooks those two points (and always unless `fast_attention(False)` or
`KVNOTES_FAST_ATTENTION=0` says otherwise): a sliding-window layer reads only the slots inside
its window (a view when the slots are in position order, as prefill writes them), and attention
is `scaled_dot_product_attention` (or, where a batch-1 notebook serves a batch, or with a score
softcap, the same matmuls without the full mask). A long append (`prefill`) with no hooks runs
in chunks of `PREFILL_CHUNK` tokens, so memory grows linearly with the context.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import einops
import torch
import torch.nn.functional as F
from transformer_lens.utilities.activation_functions import apply_softcap, softcap_enabled

from kvnotes import rope
from kvnotes.errors import BadArgument, DeviceMismatch, OutOfRange, ShapeMismatch
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook
from kvnotes.types import Float, Tensor

Hook = tuple[str | Callable[[str], bool], Callable]

PREFILL_CHUNK = 1024  # tokens per chunk of a long hook-free append: memory linear in the context
_SMALL = 64  # up to this many computed tokens, a batch-1 notebook under a batch is never expanded
_fast = os.environ.get("KVNOTES_FAST_ATTENTION", "1") != "0"


@contextmanager
def fast_attention(enabled: bool = True) -> Iterator[None]:
    """Turn the fast attention path on or off inside a `with` block (both give the same numbers;
    off, every layer forms the full score matrix as TransformerLens does)."""
    global _fast
    before, _fast = _fast, bool(enabled)
    try:
        yield
    finally:
        _fast = before


def fast_attention_enabled() -> bool:
    return _fast


@dataclass(frozen=True, eq=False)
class Readout:
    """What a run reads out: logits at `positions` (over the whole vocabulary, or the `vocab`
    ids asked for), and activations named in `capture`."""

    logits: Float[Tensor, "batch pos d_vocab"]
    positions: tuple[int, ...]
    activations: dict[str, Tensor] = field(default_factory=dict)

    @property
    def last(self) -> Float[Tensor, "batch d_vocab"]:
        """Logits at the last read-out position."""
        return self.logits[:, -1]


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
) -> tuple[Notebook, Readout]:
    """Compute `tokens` at `positions` against `notebook`; return the new notebook and a readout.

    tokens: `[pos]` or `[batch, pos]` ids; positions default to right after the notebook.
    logits_at: positions (among those computed) to unembed; default the last one; `()` for none.
    vocab: token ids whose logits to return (in that order); default the whole vocabulary.
    hooks: TransformerLens-style `(name_or_filter, fn)` pairs, active for this call only.
    overlay: slots read in place of `notebook`'s slots at the same positions (or beside them),
        with a batch of their own: what a batch of patches differs in, while the unpatched slots
        stay shared, never copied. Read-only: needs `write=False`.

    >>> from kvnotes import load_model, prefill
    >>> model = load_model("tiny-llama")
    >>> nb = prefill(model, "The order has shipped.")
    >>> nb2, out = run(model, nb, model.encode(" Deny.", bos=False))  # appended after the notebook
    >>> nb.n_slots, nb2.n_slots, tuple(out.logits.shape)  # [batch, read-out positions, d_vocab]
    (7, 11, (1, 1, 512))
    """
    notebook.check_model(model)
    tok, pos = tokens_and_positions(notebook, tokens, positions)
    n = tok.shape[1]
    _check_inputs(model, notebook, tok, pos)
    batch = max(notebook.batch, tok.shape[0])
    if overlay is not None:
        batch = _check_overlay(model, notebook, overlay, batch, write)
    if tok.shape[0] != batch:
        tok = tok.expand(batch, -1)
    read = (int(pos[-1]),) if logits_at is None and n else tuple(int(p) for p in logits_at or ())
    read_idx = _indices_of(pos, read)
    n_vocab = model.cfg.d_vocab_out
    cols = None if vocab is None else torch.as_tensor(list(vocab), dtype=torch.long)
    if cols is not None and cols.numel() and not 0 <= int(cols.min()) <= int(cols.max()) < n_vocab:
        raise OutOfRange(f"vocab ids must lie in 0..{n_vocab - 1}")
    width = n_vocab if cols is None else cols.numel()
    if n == 0:  # nothing to compute: the notebook as it is, an empty readout
        return notebook, Readout(logits=torch.zeros(notebook.batch, 0, width), positions=())
    if not hooks and not capture and overlay is None and _chunkable(model, notebook, pos):
        return _run_in_chunks(model, notebook, tok, pos, read, vocab, write)
    if model.tl is None:  # another backend computes the same thing its own way (kvnotes.nn_engine)
        from kvnotes.nn_engine import forward

        fresh_k, fresh_v, logits, captured = forward(
            model, notebook, overlay, tok, pos, read_idx, cols, hooks, capture
        )
        out = Readout(logits=logits, positions=read, activations=captured)
        return (_write(notebook, tok, pos, fresh_k, fresh_v) if write else notebook), out

    captured: dict[str, Tensor] = {}
    capture_hooks = [(name, _saver(captured)) for name in capture]
    with model.tl.hooks(fwd_hooks=list(hooks) + capture_hooks):
        fresh_k, fresh_v, resid = _forward(model, notebook, overlay, tok, pos)
        logits = final_logits(model, resid[:, read_idx], cols) if read else resid.new_zeros(batch, 0, width)
    out = Readout(logits=logits, positions=read, activations=captured)
    return (_write(notebook, tok, pos, fresh_k, fresh_v) if write else notebook), out


def tokens_and_positions(notebook: Notebook, tokens, positions) -> tuple[Tensor, Tensor]:
    """`[batch, pos]` token ids and their positions (default: right after the notebook's last)."""
    tok = torch.as_tensor(tokens, dtype=torch.long)
    tok = tok[None] if tok.ndim == 1 else tok
    n = tok.shape[1]
    pos = (
        torch.arange(notebook.next_position, notebook.next_position + n)
        if positions is None
        else torch.as_tensor(positions, dtype=torch.long).reshape(-1)
    )
    return tok, pos


def _check_overlay(model: KVModel, nb: Notebook, overlay: Notebook, batch: int, write: bool) -> int:
    overlay.check_model(model)
    if write:
        raise BadArgument(
            "an overlay is read-only: pass write=False, or patch the notebook first "
            "(kvnotes.ops.patch / patch_batch) to keep the patched slots"
        )
    if overlay.n_slots and overlay.keys[0].device != nb.keys[0].device:
        raise DeviceMismatch(
            f"the overlay is on {overlay.keys[0].device}, the notebook on {nb.keys[0].device}"
        )
    if overlay.batch not in (1, batch) and batch != 1:
        raise ShapeMismatch(
            f"overlay batch {overlay.batch} does not match batch {batch}; "
            f"give an overlay of batch 1 or {batch}"
        )
    return max(batch, overlay.batch)


def _observed(point) -> bool:
    """Whether anything (TransformerLens hooks or plain torch hooks) watches a hook point."""
    return bool(
        point.fwd_hooks
        or point.bwd_hooks
        or point._forward_hooks
        or point._forward_pre_hooks
        or point._backward_hooks
    )


def _chunkable(model: KVModel, nb: Notebook, pos: Tensor) -> bool:
    """A long pure append (positions increasing, after every slot) with no hook anywhere: its
    result does not depend on computing it in one piece."""
    if not _fast or pos.numel() <= PREFILL_CHUNK:
        return False
    if nb.n_slots and int(pos[0]) <= int(nb.positions.max()):
        return False
    if not bool((pos[1:] > pos[:-1]).all()):
        return False
    return model.tl is None or not any(_observed(p) for p in model.tl.hook_dict.values())


def _run_in_chunks(model, notebook, tok, pos, read, vocab, write) -> tuple[Notebook, Readout]:
    """`run` over `PREFILL_CHUNK` tokens at a time, each chunk written before the next reads it."""
    nb, pieces, order = notebook, [], []
    for a in range(0, pos.numel(), PREFILL_CHUNK):
        cpos = pos[a : a + PREFILL_CHUNK]
        lo, hi = int(cpos[0]), int(cpos[-1])
        here = tuple(p for p in read if lo <= p <= hi)
        nb, out = run(model, nb, tok[:, a : a + PREFILL_CHUNK], cpos, logits_at=here, vocab=vocab)
        pieces.append(out.logits)
        order += here
    logits = torch.cat(pieces, 1)[:, [order.index(p) for p in read]]
    return (nb if write else notebook), Readout(logits=logits, positions=read)


def _check_inputs(model: KVModel, nb: Notebook, tok: Tensor, pos: Tensor) -> None:
    device = model.device
    if nb.keys and nb.keys[0].device != device:
        raise DeviceMismatch(
            f"the notebook is on {nb.keys[0].device} but {model.name} is on {device}; "
            f"move it with notebook.to({str(device)!r})"
        )
    if tok.ndim != 2 or tok.shape[1] != pos.shape[0]:
        raise ShapeMismatch(
            f"{tok.shape[-1]} tokens but {pos.shape[0]} positions; give one position per token"
        )
    if tok.shape[0] not in (1, nb.batch) and nb.batch != 1:
        raise ShapeMismatch(
            f"token batch {tok.shape[0]} does not match notebook batch {nb.batch}; give "
            f"tokens of batch 1 or {nb.batch}, or run one notebook row at a time (nb[i])"
        )
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= model.n_ctx):
        raise OutOfRange(
            f"positions must lie in 0..{model.n_ctx - 1} for {model.name}; "
            f"got {int(pos.min())}..{int(pos.max())}"
        )
    if pos.unique().numel() != pos.numel():
        raise BadArgument("positions repeat; give each computed token its own position")
    vocab = model.cfg.d_vocab
    if tok.numel() and (int(tok.min()) < 0 or int(tok.max()) >= vocab):
        raise OutOfRange(f"token ids must lie in 0..{vocab - 1}; got {int(tok.min())}..{int(tok.max())}")


def _indices_of(pos: Tensor, wanted: tuple[int, ...]) -> Tensor:
    where = {int(p): i for i, p in enumerate(pos.tolist())}
    missing = [p for p in wanted if p not in where]
    if missing:
        raise OutOfRange(f"logits_at position(s) {missing} are not among the computed positions")
    return torch.tensor([where[p] for p in wanted], dtype=torch.long)


def _saver(store: dict[str, Tensor]):
    def save(act, hook):
        store[hook.name] = act.detach()

    return save


@dataclass(frozen=True, eq=False)
class _Keys:
    """Which notebook slots a layer reads (`take`: all when None) and its boolean
    `[computed, read slots + overlay slots + computed]` mask."""

    take: slice | Tensor | None
    mask: Tensor
    bias: Tensor | None = None  # the fast path's additive form of `mask` (0 or -inf)


def _key_plans(model: KVModel, nb: Notebook, overlay: Notebook | None, pos: Tensor, device, dtype):
    """`plan(window, fast)`: the keys a layer with that sliding window reads. The reference path
    reads every slot (its hooks' key axis); the fast path only those inside the window."""
    nb_pos = nb.positions
    ov_pos = overlay.positions if overlay is not None else nb_pos[:0]
    live_nb = ~torch.isin(nb_pos, torch.cat([pos, ov_pos]))
    live_ov = ~torch.isin(ov_pos, pos)
    in_order = nb.n_slots < 2 or bool((nb_pos[1:] > nb_pos[:-1]).all())
    plans: dict[tuple[int | None, bool], _Keys] = {}

    def plan(window: int | None, fast: bool) -> _Keys:
        if (window, fast) in plans:
            return plans[window, fast]
        take: slice | Tensor | None = None
        if fast and window is not None and nb.n_slots:
            lo = int(pos.min()) - window + 1  # no query reads a slot before this position
            if in_order:
                first = int(torch.searchsorted(nb_pos, lo))
                take = slice(first, None) if first else None
            elif bool((nb_pos < lo).any()):
                take = (nb_pos >= lo).nonzero().flatten()
        kept_pos = nb_pos if take is None else nb_pos[take]
        kept_live = live_nb if take is None else live_nb[take]
        key_pos = torch.cat([kept_pos, ov_pos, pos])
        live = torch.cat([kept_live, live_ov, torch.ones_like(pos, dtype=torch.bool)])
        mask = _mask(key_pos, live, pos, window)
        if isinstance(take, Tensor):
            take = take.to(device)
        mask = mask.to(device)
        bias = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf"))
        plans[window, fast] = _Keys(take=take, mask=mask, bias=bias if fast else None)
        return plans[window, fast]

    return plan


def _mask(key_pos: Tensor, live: Tensor, pos: Tensor, window: int | None) -> Tensor:
    """Boolean `[query, key]`: causal by position, live keys only, inside the sliding window."""
    mask = (key_pos[None, :] <= pos[:, None]) & live[None, :]
    if window is not None:
        mask &= key_pos[None, :] > pos[:, None] - window
    return mask


def _forward(model: KVModel, nb: Notebook, overlay: Notebook | None, tok: Tensor, pos: Tensor):
    tl, cfg = model.tl, model.cfg
    device = nb.keys[0].device
    plan = _key_plans(model, nb, overlay, pos, device, nb.keys[0].dtype)
    resid = tl.hook_embed(tl.embed(tok.to(device)))
    fresh_k, fresh_v = [], []
    for l, block in enumerate(tl.blocks):
        attn = block.attn
        fast = _fast and not (_observed(attn.hook_attn_scores) or _observed(attn.hook_pattern))
        keys = plan(model.window(l), fast)
        segments = [_take(nb.keys[l], nb.values[l], keys.take)]
        if overlay is not None:
            segments.append((overlay.keys[l], overlay.values[l]))
        resid = block.hook_resid_pre(resid)
        attn_out, k, v = _attention(model, l, block.ln1(resid), segments, pos, keys, fast)
        if cfg.use_normalization_before_and_after:
            attn_out = block.ln1_post(attn_out)
        attn_out = block.hook_attn_out(attn_out)
        resid_mid = block.hook_resid_mid(resid + attn_out)
        mlp_in = block.hook_mlp_in(resid_mid.clone()) if cfg.use_hook_mlp_in else resid_mid
        resid = block.hook_resid_post(resid_mid + block.apply_mlp(block.ln2(mlp_in)))
        fresh_k.append(k)
        fresh_v.append(v)
    return fresh_k, fresh_v, resid


def _take(k: Tensor, v: Tensor, take: slice | Tensor | None) -> tuple[Tensor, Tensor]:
    if take is None:
        return k, v
    if isinstance(take, slice):  # a view: nothing is copied
        return k[:, :, take], v[:, :, take]
    return k.index_select(2, take), v.index_select(2, take)


def _attention(
    model: KVModel,
    layer: int,
    x: Tensor,
    segments: list[tuple[Tensor, Tensor]],
    pos: Tensor,
    keys: _Keys,
    fast: bool,
):
    """One attention layer over [each (keys, values) segment, fresh tokens]; returns
    (out, fresh_k, fresh_v). Segments are `[1 or batch, kv_head, slot, d_head]`.

    Grouped-query heads are handled by grouping queries per KV head, so notebook keys are never
    copied per query head (nor, on the reference path or for a short query, per batch element
    when a batch-1 notebook serves a batch).
    """
    attn, cfg = model.tl.blocks[layer].attn, model.cfg
    q, k, v = attn.calculate_qkv_matrices(x, x, x)  # hook_q/k/v fire: [batch, pos, head, d_head]
    q = attn.hook_rot_q(rope.rotate(attn, q.transpose(1, 2), pos).transpose(1, 2))
    k = attn.hook_rot_k(rope.rotate(attn, k.transpose(1, 2), pos).transpose(1, 2))
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # -> [batch, kv_head, pos, d_head] (notebook layout)
    b, n, h, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    qg = q.permute(0, 2, 1, 3).reshape(b, kvh, g * n, d)  # head h = kv_head * g + j, row j * n + i
    segments = [*segments, (k, v)]
    mask = keys.mask
    if fast:
        zg = _fast_z(attn, cfg, q, qg, segments, keys)
    else:
        scores = torch.cat([_scores(qg, sk) for sk, _ in segments], dim=-1)
        scores = apply_softcap(scores / attn.attn_scale, cfg.attn_scores_soft_cap)
        scores = scores.reshape(b, h, n, -1)
        scores = torch.where(mask, scores, attn.IGNORE)
        scores = attn.hook_attn_scores(scores)
        pattern = F.softmax(scores, dim=-1)
        pattern = attn.hook_pattern(torch.where(torch.isnan(pattern), torch.zeros_like(pattern), pattern))
        zg = _mix(pattern.reshape(b, kvh, g * n, -1), segments)
    z = attn.hook_z(zg.reshape(b, h, n, d).transpose(1, 2))  # [batch, pos, head, d_head]
    if cfg.use_attn_result:
        w = einops.rearrange(attn.W_O, "head d_head d_model -> 1 1 head d_head d_model")
        result = attn.hook_result((z[..., None] * w).sum(-2))
        out = result.sum(-2) + attn.b_O
    else:
        w = einops.rearrange(attn.W_O, "head d_head d_model -> d_model (head d_head)")
        out = F.linear(z.reshape(b, n, h * d), w, attn.b_O)
    return out, k, v


def _scores(qg: Tensor, keys: Tensor) -> Tensor:
    """`qg @ keys^T` for grouped queries `[batch, kv_head, rows, d_head]`; a batch-1 `keys` serving
    a batch is read once, the batch folded into the rows (a broadcast matmul would copy it)."""
    b, kvh, r, _ = qg.shape
    if keys.shape[0] == b:
        return qg @ keys.transpose(-1, -2)
    flat = qg.transpose(0, 1).reshape(1, kvh, b * r, -1) @ keys.transpose(-1, -2)
    return flat.reshape(kvh, b, r, -1).transpose(0, 1)


def _mix(pattern: Tensor, segments: list[tuple[Tensor, Tensor]]) -> Tensor:
    """pattern `[batch, kv_head, rows, keys]` times the values of the segments laid end to end
    along `keys` (a batch-1 segment read once, as in `_scores`)."""
    b, kvh, r, _ = pattern.shape
    z, start = None, 0
    for _, sv in segments:
        p = pattern[..., start : start + sv.shape[2]]
        if sv.shape[0] == b:
            part = p @ sv
        else:
            part = (p.transpose(0, 1).reshape(1, kvh, b * r, -1) @ sv).reshape(kvh, b, r, -1).transpose(0, 1)
        z = part if z is None else z + part
        start += sv.shape[2]
    return z


def _fast_z(attn, cfg, q: Tensor, qg: Tensor, segments: list[tuple[Tensor, Tensor]], keys: _Keys) -> Tensor:
    """The fast path's attention output, grouped as `qg` is: `[batch, kv_head, group * query, d_head]`.

    Scaled dot-product attention with grouped KV heads and an additive mask of one row per query
    (memory: the mask, `query x keys`; no score matrix). A short query against a batch-1 notebook
    serving a batch, or a score softcap, takes the explicit matmuls over the same keys instead.
    """
    b, n, h, d = q.shape
    kvh, rows = qg.shape[1], qg.shape[2]
    segments = [(sk, sv) for sk, sv in segments if sk.shape[2]]
    capped = softcap_enabled(cfg.attn_scores_soft_cap)
    shared = any(sk.shape[0] != b for sk, _ in segments)
    if not capped and not (shared and n <= _SMALL):
        if len(segments) == 1:
            k, v = segments[0]
        else:  # a long query: laying the keys end to end costs less than its scores
            k = torch.cat([sk.expand(b, -1, -1, -1) for sk, _ in segments], dim=2)
            v = torch.cat([sv.expand(b, -1, -1, -1) for _, sv in segments], dim=2)
        z = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=keys.bias, scale=1 / attn.attn_scale, enable_gqa=h != kvh
        )  # [batch, head, query, d_head]
        return z.reshape(b, kvh, rows, d)
    mask = keys.mask.repeat(h // kvh, 1)  # row j * n + i is query i
    scores = torch.cat([_scores(qg, sk) for sk, _ in segments], dim=-1)
    scores = apply_softcap(scores / attn.attn_scale, cfg.attn_scores_soft_cap)
    pattern = F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return _mix(pattern, segments)


def final_logits(model: KVModel, resid: Tensor, vocab: Tensor | None = None) -> Tensor:
    """Logits from the last block's residual stream: final norm, then unembed (`vocab`: those ids).

    Same numbers as TL's `Unembed`, without its per-call contiguous copy of the transposed `W_U`
    (671 MB for Gemma's 262k vocabulary, the largest cost of a small batched decision), and
    with `vocab` only those columns are computed.
    """
    tl, u = model.tl, model.tl.unembed
    if model.cfg.normalization_type is not None:
        resid = tl.ln_final(resid)
    x = u.hook_in(resid)
    logits = x @ u.W_U + u.b_U if vocab is None else x @ u.W_U[:, vocab] + u.b_U[vocab]
    return apply_softcap(u.hook_out(logits), model.cfg.output_logits_soft_cap)


def _write(nb: Notebook, tok: Tensor, pos: Tensor, fresh_k: list[Tensor], fresh_v: list[Tensor]) -> Notebook:
    """Put fresh K/V into the slots at `pos` (replacing) or after the last slot (appending)."""
    batch = tok.shape[0]
    base = nb.expand(batch) if nb.batch != batch else nb
    is_old = torch.isin(pos, nb.positions)
    new_idx = (~is_old).nonzero().flatten()
    old_idx = is_old.nonzero().flatten()
    target = nb.slot_index(pos[old_idx]) if old_idx.numel() else old_idx

    def merge(old: Tensor, fresh: Tensor) -> Tensor:
        out = torch.cat([old, fresh[:, :, new_idx]], dim=2)
        if old_idx.numel():
            out[:, :, target] = fresh[:, :, old_idx]
        return out

    tokens = torch.cat([base.tokens, tok[:, new_idx]], 1)
    if old_idx.numel():
        tokens[:, target] = tok[:, old_idx]
    return replace(
        base,
        keys=tuple(merge(o, f) for o, f in zip(base.keys, fresh_k)),
        values=tuple(merge(o, f) for o, f in zip(base.values, fresh_v)),
        positions=torch.cat([nb.positions, pos[new_idx]]),
        tokens=tokens,
    )
