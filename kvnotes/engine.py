"""`run`: the one compute primitive every notebook operation is built from.

`run(model, notebook, tokens, positions)` computes `tokens` at `positions`; each attends causally
*by position* to the notebook's slots and to the other computed tokens (a slot whose position is
being recomputed is replaced, not attended). With `write=True` the computed tokens' fresh K/V
replace the slots at their positions or are appended. The model's own TransformerLens modules and
hook points do the work, so `blocks.{l}.attn.hook_pattern` & co. fire with their usual meaning.

In `hook_attn_scores` / `hook_pattern` the key axis is the notebook's slots in slot order, then
the computed tokens in the order given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import einops
import torch
import torch.nn.functional as F
from transformer_lens.utilities.activation_functions import apply_softcap

from kvnotes import rope
from kvnotes.errors import BadArgument, DeviceMismatch, OutOfRange, ShapeMismatch
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook
from kvnotes.types import Float, Tensor

Hook = tuple[str | Callable[[str], bool], Callable]


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
) -> tuple[Notebook, Readout]:
    """Compute `tokens` at `positions` against `notebook`; return the new notebook and a readout.

    tokens: `[pos]` or `[batch, pos]` ids; positions default to right after the notebook.
    logits_at: positions (among those computed) to unembed; default the last one; `()` for none.
    vocab: token ids whose logits to return (in that order); default the whole vocabulary.
    hooks: TransformerLens-style `(name_or_filter, fn)` pairs, active for this call only.

    >>> from kvnotes import load_model, prefill
    >>> model = load_model("tiny-llama")
    >>> nb = prefill(model, "The order has shipped.")
    >>> nb2, out = run(model, nb, model.encode(" Deny.", bos=False))  # appended after the notebook
    >>> nb.n_slots, nb2.n_slots, tuple(out.logits.shape)  # [batch, read-out positions, d_vocab]
    (7, 11, (1, 1, 512))
    """
    notebook.check_model(model)
    tok = torch.as_tensor(tokens, dtype=torch.long)
    tok = tok[None] if tok.ndim == 1 else tok
    n = tok.shape[1]
    pos = (
        torch.arange(notebook.next_position, notebook.next_position + n)
        if positions is None
        else torch.as_tensor(positions, dtype=torch.long).reshape(-1)
    )
    _check_inputs(model, notebook, tok, pos)
    batch = max(notebook.batch, tok.shape[0])
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

    captured: dict[str, Tensor] = {}
    capture_hooks = [(name, _saver(captured)) for name in capture]
    with model.tl.hooks(fwd_hooks=list(hooks) + capture_hooks):
        fresh_k, fresh_v, resid = _forward(model, notebook, tok, pos)
        logits = final_logits(model, resid[:, read_idx], cols) if read else resid.new_zeros(batch, 0, width)
    out = Readout(logits=logits, positions=read, activations=captured)
    return (_write(notebook, tok, pos, fresh_k, fresh_v) if write else notebook), out


def _check_inputs(model: KVModel, nb: Notebook, tok: Tensor, pos: Tensor) -> None:
    device = model.tl.embed.W_E.device
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


def _masks(model: KVModel, nb: Notebook, pos: Tensor) -> dict[int | None, Tensor]:
    """Boolean `[pos, slot + pos]` attention masks, one per distinct sliding window."""
    key_pos = torch.cat([nb.positions, pos])
    live = torch.cat([~torch.isin(nb.positions, pos), torch.ones_like(pos, dtype=torch.bool)])
    causal = (key_pos[None, :] <= pos[:, None]) & live[None, :]
    masks: dict[int | None, Tensor] = {None: causal}
    for l in range(model.n_layers):
        w = model.window(l)
        if w is not None and w not in masks:
            masks[w] = causal & (key_pos[None, :] > pos[:, None] - w)
    return masks


def _forward(model: KVModel, nb: Notebook, tok: Tensor, pos: Tensor):
    tl, cfg = model.tl, model.cfg
    device = nb.keys[0].device
    masks = {w: m.to(device) for w, m in _masks(model, nb, pos).items()}
    resid = tl.hook_embed(tl.embed(tok.to(device)))
    fresh_k, fresh_v = [], []
    for l, block in enumerate(tl.blocks):
        resid = block.hook_resid_pre(resid)
        attn_out, k, v = _attention(
            model, l, block.ln1(resid), nb.keys[l], nb.values[l], pos, masks[model.window(l)]
        )
        if cfg.use_normalization_before_and_after:
            attn_out = block.ln1_post(attn_out)
        attn_out = block.hook_attn_out(attn_out)
        resid_mid = block.hook_resid_mid(resid + attn_out)
        mlp_in = block.hook_mlp_in(resid_mid.clone()) if cfg.use_hook_mlp_in else resid_mid
        resid = block.hook_resid_post(resid_mid + block.apply_mlp(block.ln2(mlp_in)))
        fresh_k.append(k)
        fresh_v.append(v)
    return fresh_k, fresh_v, resid


def _attention(
    model: KVModel, layer: int, x: Tensor, old_k: Tensor, old_v: Tensor, pos: Tensor, mask: Tensor
):
    """One attention layer over [notebook slots, fresh tokens]; returns (out, fresh_k, fresh_v).

    Grouped-query heads are handled by grouping queries per KV head, so notebook keys are never
    copied per query head (or per batch element when a batch-1 notebook serves a batch).
    """
    attn, cfg = model.tl.blocks[layer].attn, model.cfg
    q, k, v = attn.calculate_qkv_matrices(x, x, x)  # hook_q/k/v fire: [batch, pos, head, d_head]
    q = attn.hook_rot_q(rope.rotate(attn, q.transpose(1, 2), pos).transpose(1, 2))
    k = attn.hook_rot_k(rope.rotate(attn, k.transpose(1, 2), pos).transpose(1, 2))
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # -> [batch, kv_head, pos, d_head] (notebook layout)
    b, n, h, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    qg = q.permute(0, 2, 1, 3).reshape(b, kvh, g * n, d)  # head h = kv_head * g + j
    scores = torch.cat([qg @ old_k.transpose(-1, -2), qg @ k.transpose(-1, -2)], dim=-1)
    scores = apply_softcap(scores / attn.attn_scale, cfg.attn_scores_soft_cap)
    scores = scores.reshape(b, h, n, -1)
    scores = torch.where(mask, scores, attn.IGNORE)
    scores = attn.hook_attn_scores(scores)
    pattern = F.softmax(scores, dim=-1)
    pattern = attn.hook_pattern(torch.where(torch.isnan(pattern), torch.zeros_like(pattern), pattern))
    pg = pattern.reshape(b, kvh, g * n, -1)
    s = old_k.shape[2]
    z = pg[..., :s] @ old_v + pg[..., s:] @ v
    z = attn.hook_z(z.reshape(b, h, n, d).transpose(1, 2))  # [batch, pos, head, d_head]
    if cfg.use_attn_result:
        w = einops.rearrange(attn.W_O, "head d_head d_model -> 1 1 head d_head d_model")
        result = attn.hook_result((z[..., None] * w).sum(-2))
        out = result.sum(-2) + attn.b_O
    else:
        w = einops.rearrange(attn.W_O, "head d_head d_model -> d_model (head d_head)")
        out = F.linear(z.reshape(b, n, h * d), w, attn.b_O)
    return out, k, v


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
