"""The TransformerLens backend: `run()` on the model's own TransformerLens modules and hook points.

`blocks.{l}.attn.hook_pattern` & co. fire with their usual meaning; in `hook_attn_scores` /
`hook_pattern` the key axis is the notebook's slots in slot order, then the overlay's slots (if
any), then the computed tokens in the order given.

Two attention paths compute the same numbers. The *reference* path forms every score over that
whole key axis and fires `hook_attn_scores` / `hook_pattern`. The *fast* path, taken in a layer
where nothing hooks those two points (and always unless `fast_attention(False)` or
`KVNOTES_FAST_ATTENTION=0` says otherwise): a sliding-window layer reads only the slots inside
its window (a view when the slots are in position order, as prefill writes them), and attention
is `scaled_dot_product_attention` (or, where a batch-1 notebook serves a batch, or with a score
softcap, the same matmuls without the full mask).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import einops
import torch
import torch.nn.functional as F

from kvnotes import rope
from kvnotes.engine import plan as planning
from kvnotes.engine.backend import Capability
from kvnotes.engine.float64 import float64_everywhere
from kvnotes.engine.guard import allow
from kvnotes.engine.phases import phase
from kvnotes.engine.plan import Fresh, Hook, Plan, Resume, SlotKeys, saver, softcap, take_slots
from kvnotes.engine.transformer_lens.model import TransformerLensModel, cast_hooked
from kvnotes.errors import BadArgument, OutOfRange
from kvnotes.models.backends import BackendName
from kvnotes.notebook import Notebook
from kvnotes.types import Float, Int, Tensor

_SMALL = 64  # up to this many computed tokens, a batch-1 notebook under a batch is never expanded


class TransformerLensBackend:
    """`run()` on a TransformerLens `HookedTransformer` (`model.tl`): a `Backend[TransformerLensModel]`."""

    name = BackendName.TRANSFORMER_LENS
    capabilities = frozenset(
        {
            Capability.WEIGHTS,
            Capability.TRANSFORMER_LENS,
            Capability.HOOK_ATTN_SCORES,
            Capability.HOOK_PATTERN,
            Capability.HOOK_ROT_Q,
            Capability.HOOK_ROT_K,
            Capability.RESUME,
            Capability.STOP,
        }
    )

    def forward(
        self, model: TransformerLensModel, plan: Plan, hooks: Sequence[Hook], capture: Sequence[str]
    ) -> Fresh:
        """Fresh K/V and logits at the read positions, with `hooks` and the capture savers on."""
        _check_hook_names(model, [*capture, *(t for t, _ in hooks if isinstance(t, str))])
        captured: dict[str, Tensor] = {}
        capture_hooks = [(name, saver(captured)) for name in capture]
        with model.tl.hooks(fwd_hooks=list(hooks) + capture_hooks):
            # 1) every layer over the notebook's keys: fresh K/V per layer, resid [batch, pos, d_model]
            fresh_k, fresh_v, resid = _forward(
                model, plan.notebook, plan.overlay, plan.tok, plan.pos, plan.resume, plan.stop
            )
            # 2) unembed the read positions only: [batch, read, width]
            if plan.read:
                with phase("readout"):
                    logits = final_logits(model, resid[:, plan.read_idx], plan.cols)
            else:
                logits = resid.new_zeros(plan.batch, 0, plan.width)
        return Fresh(keys=fresh_k, values=fresh_v, logits=logits, activations=captured)

    def move_keys(
        self, model: TransformerLensModel, layer: int, keys: Tensor, old: Tensor, new: Tensor
    ) -> Tensor:
        """Undo the rotation at `old`, apply the one at `new`, from the layer's own RoPE tables, in
        float32 and rounded once (a bfloat16 key turned twice in bfloat16 would round three times).
        Tables stored in 16 bits (a bfloat16 model's) turn by cos² + sin² = 1 + up to 2⁻⁸, so the
        turn back divides that out: the moved key is then the key a prefill at `new` writes, but
        for the stored key's own rounding."""
        attn = model.tl.blocks[layer].attn
        with allow(torch.float32):  # the turn in float32 is this method's point (the engine guard)
            bare = unrotate_at(attn, keys.float(), old)
            cos, sin = rope_tables(attn, old)
            if torch.finfo(cos.dtype).bits == 16:
                rd = cos.shape[-1]
                norm = cos.to(bare.dtype) ** 2 + sin.to(bare.dtype) ** 2
                bare = torch.cat([bare[..., :rd] / norm, bare[..., rd:]], dim=-1)
            return rotate_at(attn, bare, new).to(keys.dtype)

    def full_logits(self, model: TransformerLensModel, ids: Sequence[int]) -> Tensor:
        with torch.no_grad():
            return model.tl(torch.tensor([list(ids)], device=model.device))[0]

    def hook_names(self, model: TransformerLensModel) -> list[str]:
        return list(model.tl.hook_dict)

    def watched(self, model: TransformerLensModel) -> bool:
        return any(_observed(p) for p in model.tl.hook_dict.values())

    @contextmanager
    def in_float64(self, model: TransformerLensModel) -> Iterator[TransformerLensModel]:
        """Weights and RoPE tables cast to float64 (the tables recomputed in float64, as
        TransformerLens computes them for a float64 model), every norm and softmax in float64; the
        float32 tables are put back afterwards, so the model returns bit for bit."""
        tl, dtype = model.tl, model.tl.cfg.dtype
        attns = [b.attn for b in tl.blocks if hasattr(b.attn, "rotary_cos")]
        tables = [(a.rotary_sin, a.rotary_cos) for a in attns]
        cast_hooked(tl, torch.float64)
        try:
            for a in attns:
                a._extend_rotary_embeddings(a.rotary_cos.shape[0])
            with float64_everywhere():
                yield model
        finally:
            cast_hooked(tl, dtype)
            for a, (sin, cos) in zip(attns, tables):
                a.rotary_sin, a.rotary_cos = sin, cos


TRANSFORMER_LENS = TransformerLensBackend()


def _check_hook_names(model: TransformerLensModel, names: Sequence[str]) -> None:
    """Refuse a hook name the model has no point for, or one its forward never reaches (an
    attention-only block's MLP points, which TransformerLens creates but never fires)."""
    cfg = model.cfg
    for name in names:
        mlp = cfg.attn_only and any(s in name for s in (".mlp.", "hook_mlp_", "hook_resid_mid", ".ln2."))
        if mlp:
            raise BadArgument(
                f"{model.name} has no hook point {name!r} that fires (it is attention-only: its "
                "blocks have no MLP); hook hook_attn_out or hook_resid_post instead"
            )
        if name not in model.tl.hook_dict:
            raise BadArgument(
                f"{model.name} has no hook point {name!r}; "
                "kvnotes.engine.backend_of(model).hook_names(model) lists its points"
            )


def _observed(point) -> bool:
    """Whether anything (TransformerLens hooks or plain torch hooks) watches a hook point."""
    return bool(
        point.fwd_hooks
        or point.bwd_hooks
        or point._forward_hooks
        or point._forward_pre_hooks
        or point._backward_hooks
    )


def _forward(
    model: TransformerLensModel,
    nb: Notebook,
    overlay: Notebook | None,
    tok: Int[Tensor, "batch pos"],
    pos: Int[Tensor, " pos"],
    resume: Resume | None = None,
    stop: int | None = None,
) -> tuple[list[Tensor | None], list[Tensor | None], Float[Tensor, "batch pos d_model"]]:
    """Run the computed tokens through every block against the notebook's slots (then the
    overlay's): per layer their fresh K/V `[batch, n_kv_heads, pos, d_head]`, and the last residual.
    With `resume`, the blocks before its layer are skipped (their K/V are None); with `stop`, the
    blocks from `stop` on are not run (no K/V for them: the residual is block `stop - 1`'s)."""
    tl, cfg = model.tl, model.cfg
    device = nb.keys[0].device
    keys_for = planning.key_planner(nb, overlay, pos, device, nb.keys[0].dtype)
    start = 0 if resume is None else resume.layer
    fresh_k: list[Tensor | None] = [None] * start
    fresh_v: list[Tensor | None] = [None] * start
    if resume is None:
        with phase("embed"):
            resid = tl.hook_embed(tl.embed(tok.to(device)))  # [batch, pos, d_model]
            if cfg.positional_embedding_type == "standard":  # learned positions, added at the input
                resid = resid + tl.hook_pos_embed(position_embedding(tl, pos.to(device)))
    else:
        resid = resume.resid.to(device).expand(tok.shape[0], -1, -1)
    for l in range(start, len(tl.blocks) if stop is None else stop):
        block = tl.blocks[l]
        # 1) the keys this layer reads: the fast path trims a sliding window's slots
        attn = block.attn
        fast = planning.fast_attention_enabled() and not (
            _observed(attn.hook_attn_scores) or _observed(attn.hook_pattern)
        )
        with phase("keys"):
            keys = keys_for(model.window(l), fast)
        with phase("slots"):
            segments = [take_slots(nb.keys[l], nb.values[l], keys.take)]
        if overlay is not None:
            segments.append((overlay.keys[l], overlay.values[l]))
        # 2) attention over [slots, overlay, computed]; k, v: [batch, n_kv_heads, pos, d_head]
        with phase("attention"):
            resid = block.hook_resid_pre(resid)
            attn_out, k, v = _attention(model, l, block.ln1(resid), segments, pos, keys, fast)
            if cfg.use_normalization_before_and_after:
                attn_out = block.ln1_post(attn_out)
            attn_out = block.hook_attn_out(attn_out)
        # 3) the MLP, as TransformerLens's block runs it (none in an attention-only model)
        with phase("mlp"):
            if cfg.attn_only:
                resid = block.hook_resid_post(resid + attn_out)
            else:
                resid_mid = block.hook_resid_mid(resid + attn_out)
                mlp_in = block.hook_mlp_in(resid_mid.clone()) if cfg.use_hook_mlp_in else resid_mid
                resid = block.hook_resid_post(resid_mid + block.apply_mlp(block.ln2(mlp_in)))
        fresh_k.append(k)
        fresh_v.append(v)
    return fresh_k, fresh_v, resid


def _attention(
    model: TransformerLensModel,
    layer: int,
    x: Tensor,
    segments: list[tuple[Tensor, Tensor]],
    pos: Tensor,
    keys: SlotKeys,
    fast: bool,
):
    """One attention layer over [each (keys, values) segment, fresh tokens]; returns
    (out, fresh_k, fresh_v). Segments are `[1 or batch, kv_head, slot, d_head]`.

    Grouped-query heads are handled by grouping queries per KV head, so notebook keys are never
    copied per query head (nor, on the reference path or for a short query, per batch element
    when a batch-1 notebook serves a batch).
    """
    attn, cfg = model.tl.blocks[layer].attn, model.cfg
    q, k, v = _qkv(attn, cfg, x)  # hook_q/k/v fire: [batch, pos, head, d_head]
    # rotation is the identity for learned positions; hook_rot_q/k fire there too (`from_hooked`
    # gives those models the points), with q and k as they are (TransformerLens's own forward
    # leaves them silent), so rotation hooks need no branch
    q = attn.hook_rot_q(rotated(attn, q, pos))
    k = attn.hook_rot_k(rotated(attn, k, pos))
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
        scores = softcap(scores / attn.attn_scale, cfg.attn_scores_soft_cap)
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
        w = _packed(attn, "o", (attn.W_O,), _output_layout)
        out = F.linear(z.reshape(b, n, h * d), w, attn.b_O)
    return out, k, v


def position_embedding(tl, pos: Int[Tensor, " pos"]) -> Float[Tensor, "1 pos d_model"]:
    """The learned absolute position embedding of each computed token (GPT-2, tracr): `W_pos`'s
    rows at the tokens' own positions, added to the residual stream at the input."""
    return tl.pos_embed.W_pos[pos][None]


def _output_layout(w: Tensor) -> Tensor:
    return einops.rearrange(w, "head d_head d_model -> d_model (head d_head)")


def _qkv(attn, cfg, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Q, K, V `[batch, pos, head, d_head]` as TransformerLens's `calculate_qkv_matrices` gives
    them (hook_q/k/v fire, then the QK norm), from one matmul against the three weights packed
    once into TransformerLens's `(head d_head) d_model` layout (TransformerLens re-lays each weight
    out on every call: a copy of the layer's attention weights per forward, a tenth of a small
    decision's time). Configurations that project otherwise take TransformerLens's own path."""
    if cfg.use_split_qkv_input or cfg.use_attn_in or getattr(cfg, "load_in_4bit", False):
        return attn.calculate_qkv_matrices(x, x, x)
    wk, wv, bk, bv = kv_weights(attn, cfg)
    sources = (attn.W_Q, wk, wv, attn.b_Q, bk, bv)
    if any(t.requires_grad for t in sources):  # a weight being trained: TransformerLens's path
        return attn.calculate_qkv_matrices(x, x, x)
    w, bias = _packed(attn, "qkv", sources, _qkv_layout)
    heads = (attn.W_Q.shape[0], wk.shape[0], wv.shape[0])
    d, b, n = attn.W_Q.shape[-1], x.shape[0], x.shape[1]
    parts = F.linear(x, w, bias).split([h * d for h in heads], -1)
    q, k, v = (t.reshape(b, n, hd, d) for t, hd in zip(parts, heads))
    q, k, v = attn.hook_q(q), attn.hook_k(k), attn.hook_v(v)
    return qk_normed(attn, cfg, q, "q"), qk_normed(attn, cfg, k, "k"), v


def kv_weights(attn, cfg) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """W_K, W_V `[n_kv_heads, d_model, d_head]` and their biases as the forward reads them: one per
    KV head under grouped-query attention (not TransformerLens's per-query-head expansion)."""
    grouped = hasattr(attn, "_W_K") and not getattr(cfg, "ungroup_grouped_query_attention", False)
    if grouped:
        return attn._W_K, attn._W_V, attn._b_K, attn._b_V
    return attn.W_K, attn.W_V, attn.b_K, attn.b_V


def qk_normed(attn, cfg, t: Float[Tensor, "*b pos heads d_head"], which: str) -> Tensor:
    """Queries (`which` "q") or keys ("k") after the QK norm, where the model has one."""
    if not cfg.use_qk_norm:
        return t
    return attn._apply_qk_norm(t, attn.q_norm if which == "q" else attn.k_norm)


def rotated(attn, t: Float[Tensor, "*b pos heads d_head"], pos: Int[Tensor, " pos"]) -> Tensor:
    """Queries or keys (positions second to last but one) rotated by this layer's RoPE."""
    return rotate_at(attn, t.transpose(-3, -2), pos).transpose(-3, -2)


def rotate_at(attn, x: Float[Tensor, "*b n d_head"], positions: Int[Tensor, " n"]) -> Tensor:
    """`x` (positions along the second-to-last axis) rotated by this layer's RoPE at `positions`."""
    return rope.rotate(x, *rope_tables(attn, positions), attn.rotate_every_two)


def unrotate_at(attn, x: Float[Tensor, "*b n d_head"], positions: Int[Tensor, " n"]) -> Tensor:
    """Undo `rotate_at`: post-RoPE `x` turned back from `positions`."""
    return rope.unrotate(x, *rope_tables(attn, positions), attn.rotate_every_two)


# --- the layer's RoPE tables ---------------------------------------------------------------------
# The tables are the attention module's own (`rotary_cos`/`rotary_sin`), so every per-layer detail
# (base, partial rotary dims, NeoX or GPT-J pairing, Llama-3 / YaRN scaling) is exactly what the
# model's full forward uses; `kvnotes.rope` applies them.
def rotary_dim(attn) -> int:
    """How many of a head's dimensions this layer rotates: 0 where positions are learned and
    added at the input (GPT-2, tracr), so that rotation is the identity there."""
    return (attn.cfg.rotary_dim or 0) if attn.cfg.positional_embedding_type == "rotary" else 0


def rope_tables(attn, positions: Int[Tensor, " n"]) -> tuple[Tensor, Tensor]:
    """cos and sin rows `[n, rotary_dim]` for `positions` from `attn`'s own RoPE tables (`[n, 0]`
    where the layer rotates nothing)."""
    rd = rotary_dim(attn)
    _check_range(attn, positions)
    if positions.numel() == 0 or rd == 0:
        empty = attn.W_Q.new_zeros(positions.numel(), 0)
        return (attn.rotary_cos[:0, :rd], attn.rotary_sin[:0, :rd]) if rd else (empty, empty)
    need = int(positions.max()) + 1
    if need > attn.rotary_cos.shape[0]:  # grow the table the way the model's own forward does
        attn._extend_rotary_embeddings(min(attn.cfg.n_ctx, max(need, 2 * attn.rotary_cos.shape[0])))
    positions = positions.to(attn.rotary_cos.device)
    return attn.rotary_cos[positions], attn.rotary_sin[positions]


def _check_range(attn, positions: Tensor) -> None:
    if positions.numel() == 0:
        return
    need = int(positions.max()) + 1
    if int(positions.min()) < 0 or need > attn.cfg.n_ctx:
        raise OutOfRange(
            f"position {int(positions.min()) if int(positions.min()) < 0 else need - 1} is out of "
            f"range: this model's context is 0..{attn.cfg.n_ctx - 1} (n_ctx={attn.cfg.n_ctx})"
        )


def _qkv_layout(wq, wk, wv, bq, bk, bv) -> tuple[Tensor, Tensor]:
    """The Q, K and V weights as one `[(heads d_head), d_model]` matrix, and their biases."""
    flat = [einops.rearrange(w, "head d_model d_head -> (head d_head) d_model") for w in (wq, wk, wv)]
    return torch.cat(flat), torch.cat([bq.reshape(-1), bk.reshape(-1), bv.reshape(-1)])


def _packed(module, name: str, sources: tuple[Tensor, ...], make: Callable):
    """`make(*sources)`, kept on `module` until a source tensor is replaced or edited in place
    (its storage or version counter changes: a weight edit re-packs on the next forward). The
    entry holds views of the storages it was made from, so no new weight can take their address
    while it is kept."""
    key = tuple((t.data_ptr(), t._version, tuple(t.shape)) for t in sources)
    kept = module.__dict__.setdefault("_kvnotes_packed", {})
    if name not in kept or kept[name][0] != key:
        with torch.no_grad():
            kept[name] = (key, make(*sources), tuple(t.detach() for t in sources))
    return kept[name][1]


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
    assert z is not None, "no segment to attend to"  # the computed tokens are always one
    return z


def _fast_z(
    attn, cfg, q: Tensor, qg: Tensor, segments: list[tuple[Tensor, Tensor]], keys: SlotKeys
) -> Tensor:
    """The fast path's attention output, grouped as `qg` is: `[batch, kv_head, group * query, d_head]`.

    Scaled dot-product attention with grouped KV heads and an additive mask of one row per query
    (memory: the mask, `query x keys`; no score matrix). A short query against a batch-1 notebook
    serving a batch, or a score softcap, takes the explicit matmuls over the same keys instead.
    """
    b, n, h, d = q.shape
    kvh, rows = qg.shape[1], qg.shape[2]
    segments = [(sk, sv) for sk, sv in segments if sk.shape[2]]
    capped = (cfg.attn_scores_soft_cap or 0) > 0
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
    scores = softcap(scores / attn.attn_scale, cfg.attn_scores_soft_cap)
    pattern = F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return _mix(pattern, segments)


def final_logits(model: TransformerLensModel, resid: Tensor, vocab: Tensor | None = None) -> Tensor:
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
    return softcap(u.hook_out(logits), model.cfg.output_logits_soft_cap)
