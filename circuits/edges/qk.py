"""AtP*'s QK fix (Kramár et al. 2024): an edge that reaches attention through a key or a query has
the softmax it changes recomputed exactly, and only the head outputs' change onward is linearised
(`gz . (z' - z)`, gz the gradient at the head's output).

- keys: an attention edge (the old keys and values at the key group's positions), and a residual
  edge into a KV slot (the writer's change pushed through the layer's input norm, W_K and W_V, the
  QK norm and RoPE): every query that reads those keys gets its softmax recomputed;
- queries: a residual edge into a head's query input at a group (the same path through W_Q): the
  queries at that group's positions are recomputed and their softmax over every key with them.
  A query's row of the softmax depends on that query alone, so one recomputation over every
  position serves each group's edge.
"""

from __future__ import annotations

import torch

from circuits.edges.graph import GROUPS
from kvnotes.engine import hooked
from kvnotes.engine.plan import softcap
from kvnotes.engine.transformer_lens import kv_weights, qk_normed, rotated
from kvnotes.types import Tensor

EXACT_KEYS = ("changed", "whole")  # the exact-key step: the changed keys swapped in, or every key again


def qk_fix(acc, grads: dict) -> None:
    """Add AtP*'s exact-softmax changes to the accumulator `acc` (`scores._Accumulator`) for one
    run at the new prompt: attention edges, and the residual edges into KV slots and queries."""
    patcher, gr = acc.patcher, acc.patcher.graph
    for l in range(gr.n_layers):
        layer = _Layer(patcher, l, grads)
        for gk in range(len(GROUPS)):  # attention edges: the old keys and values at gk's positions
            at = patcher.groups == gk
            if bool(at.any()):
                d = layer.key_change(acc.keys, layer.s_old[None], layer.v_old[None], at)[0]  # [H, query]
                acc.att[l, :, gk] += torch.einsum("hq,qg->hg", d, acc.onehot)
        writers = [w for w in range(gr.n_writers) if gr.writer_layer(w) < l]
        n_in = layer.normed_change(acc.deltas[writers])  # [n, T, d]
        _kv_edges(acc, layer, writers, n_in)
        _query_edges(acc, layer, writers, n_in)


class _Layer:
    """Layer l of the new run in float64: its scores, values, head outputs and their gradient."""

    def __init__(self, patcher, l: int, grads: dict):
        model = patcher.model
        self.patcher, self.l, self.model = patcher, l, model
        self.attn = hooked(model).blocks[l].attn
        self.g = gr_g = model.n_heads // model.n_kv_heads
        self.ns = patcher.prefix.n_slots
        self.cap = model.facts.attn_scores_soft_cap
        self.W_K, self.W_V, _, _ = kv_weights(self.attn, hooked(model).cfg)
        self.s_all = patcher.new.scores[l][0].double()  # [H, T, K]
        keys = torch.cat([patcher.prefix.keys[l][0].transpose(0, 1), patcher.new.k_rot[l][0]], dim=0)
        self.k_all = keys.double().repeat_interleave(gr_g, 1)  # [K, H, d]
        self.v_all = torch.cat(
            [patcher.prefix.values[l][0].transpose(0, 1), patcher.new.v[l][0]], dim=0
        ).double()
        self.gz = grads[("z", l)][0].double()  # [T, H, d]
        self.z = patcher.new.z[l][0].double()  # [T, H, d]
        self.q = patcher.new.q_rot[l][0].double()  # [T, H, d]
        k_old = patcher.old.k_rot[l][0].double().repeat_interleave(gr_g, 1)
        self.s_old = self.scores(torch.einsum("qhe,phe->hqp", self.q, k_old))
        self.v_old = patcher.old.v[l][0].double()

    def scores(self, dots: Tensor) -> Tensor:
        return softcap(dots / float(self.attn.attn_scale), self.cap)

    def normed_change(self, D: Tensor) -> Tensor:
        """Each writer's change `D` [n, T, d] as the layer's readers see it, after the input norm."""
        x = self.patcher.new.x[self.l][0]  # [T, d]
        ln1 = hooked(self.model).blocks[self.l].ln1
        return ln1(x[None] + D) - ln1(x[None].expand_as(D))

    def key_change(self, keys: str, s_new: Tensor, v_new: Tensor, at: Tensor) -> Tensor:
        """`changed_keys` (or `whole_softmax`) on this layer: [n, H, query]."""
        way = changed_keys if keys == "changed" else whole_softmax
        return way(self.s_all, self.v_all, self.z, self.gz, s_new, v_new, at, self.ns, self.g)


def _kv_edges(acc, layer: _Layer, writers: list[int], n_in: Tensor) -> None:
    """Residual edges into KV slots: each writer's change at the slot's input, exactly."""
    patcher, gr, l = acc.patcher, acc.patcher.graph, layer.l
    H, g, B = gr.n_heads, layer.g, gr.block
    dk = torch.einsum("ntd,jde->ntje", n_in, layer.W_K)
    dv = torch.einsum("ntd,jde->ntje", n_in, layer.W_V)
    k2 = qk_normed(layer.attn, hooked(layer.model).cfg, patcher.new.k_raw[l][0][None] + dk, "k")
    k2 = rotated(layer.attn, k2, patcher.pos).double().repeat_interleave(g, 2)  # [n, T, H, d]
    s2 = layer.scores(torch.einsum("qhe,nphe->nhqp", layer.q, k2))
    v2 = patcher.new.v[l][0].double()[None] + dv.double()
    for gk in range(len(GROUPS)):
        at = patcher.groups == gk
        if not bool(at.any()):
            continue
        d = layer.key_change(acc.keys, s2, v2, at)  # [n, H, query]
        for j in range(gr.n_kv_heads):
            acc.res[l * B + H + j, writers, gk] = d[:, j * g : (j + 1) * g].sum((1, 2))


def _query_edges(acc, layer: _Layer, writers: list[int], n_in: Tensor) -> None:
    """Residual edges into query heads: each writer's change at the head's query input, every
    query's softmax recomputed over every key (the new run's), summed over each group's queries."""
    patcher, l = acc.patcher, layer.l
    B, H = patcher.graph.block, patcher.graph.n_heads
    dq = torch.einsum("ntd,hde->nthe", n_in, layer.attn.W_Q)
    q_raw = patcher.new.q_raw[l][0]  # [T, H, d] before the QK norm and rotation
    q2 = torch.cat([q_raw[None], q_raw[None] + dq])  # row 0: no change, the baseline
    q2 = rotated(layer.attn, qk_normed(layer.attn, hooked(layer.model).cfg, q2, "q"), patcher.pos).double()
    s2 = layer.scores(torch.einsum("nqhe,khe->nhqk", q2, layer.k_all))
    p2 = torch.softmax(torch.where(torch.isfinite(layer.s_all)[None], s2, -torch.inf), dim=-1)
    z2 = torch.einsum(
        "nhqk,khe->nqhe", torch.nan_to_num(p2, nan=0.0), layer.v_all.repeat_interleave(layer.g, 1)
    )
    d = torch.einsum("nqhe,qhe->nhq", z2[1:] - z2[:1], layer.gz)  # against the same float64 path
    acc.res[l * B : l * B + H, writers] = torch.einsum("nhq,qg->hng", d, acc.onehot)


def changed_keys(s_all, v_all, z, gz, s_new, v_new, at, ns: int, g: int) -> Tensor:
    """The linearised change of the metric, `gz . (z' - z)` per patch, head and query [n, H, T], when
    the computed keys at positions `at` ([T] bool) take scores `s_new` [n, H, T(query), T(key)] and
    values `v_new` [n, T, KVH, d]: the softmax recomputed over every key (the notebook's first), as
    attention computes it. `s_all` [H, T, K] and `v_all` [K, KVH, d] are the new run's.

    Only the keys at `at` change, so each patch's softmax is the new run's (recomputed once, in
    float64) with those keys' terms swapped: `z' = (Z z + sum_at (e' v' - e v)) / Z'`, with `e` the
    exponentiated scores and `Z` their sum. A patch costs its changed keys, not every key."""
    n, H, T = s_new.shape[0], s_all.shape[0], s_all.shape[1]
    kvh, d = v_all.shape[1], v_all.shape[2]
    cols = ns + torch.nonzero(at).flatten()  # the changed keys' columns in s_all
    m = s_all.amax(-1, keepdim=True)  # [H, T, 1]
    e = torch.exp(s_all - m)  # [H, T, K]; masked keys (-inf) give 0
    Z = e.sum(-1)  # [H, T]
    e_g = e.reshape(kvh, g, T, -1)  # head h = kv head * g + j
    num = torch.einsum("jgqk,kje->qjge", e_g, v_all)  # [T, KVH, g, d]
    e_old = e[..., cols]  # [H, T, A]
    s_at = s_new[..., at]  # [n, H, T, A]
    live = torch.isfinite(s_all[..., cols])[None]
    m2 = torch.maximum(m[None], torch.where(live, s_at, -torch.inf).amax(-1, keepdim=True))  # [n, H, T, 1]
    scale = torch.exp(m[None] - m2)  # rescale the new run's sums to the patch's maximum
    e_new = torch.where(live, torch.exp(s_at - m2), 0.0)  # [n, H, T, A]
    Z2 = (Z[None] - e_old.sum(-1)[None]) * scale[..., 0] + e_new.sum(-1)  # [n, H, T]
    v_old_at, v_new_at = v_all[cols], v_new[:, at]  # [A, KVH, d], [n, A, KVH, d]
    scale_q = scale.reshape(n, kvh, g, T, 1).permute(0, 3, 1, 2, 4)  # [n, T, KVH, g, 1]
    swap = torch.einsum("njgqa,najd->nqjgd", e_new.reshape(n, kvh, g, T, -1), v_new_at)
    swap = swap - torch.einsum("jgqa,ajd->qjgd", e_old.reshape(kvh, g, T, -1), v_old_at)[None] * scale_q
    num2 = num[None] * scale_q + swap  # [n, T, KVH, g, d]
    z2 = num2 / Z2.reshape(n, kvh, g, T).permute(0, 3, 1, 2)[..., None]
    z2 = torch.where(torch.isnan(z2), torch.zeros_like(z2), z2).reshape(n, T, H, d)
    return torch.einsum("nqhe,qhe->nhq", z2 - z[None], gz)


def whole_softmax(s_all, v_all, z, gz, s_new, v_new, at, ns: int, g: int) -> Tensor:
    """`changed_keys` the reference way: each patch's softmax recomputed over every key."""
    s = s_all[None].expand(s_new.shape[0], -1, -1, -1).clone()
    sel = at[None, None, None, :] & torch.isfinite(s_all)[None, ..., ns:]
    s[..., ns:] = torch.where(sel, s_new, s[..., ns:])
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    vv = v_all[None].expand(s.shape[0], -1, -1, -1).clone()
    vv[:, ns:][:, at] = v_new[:, at]
    z2 = torch.einsum("nhqk,nkhe->nqhe", p, vv.repeat_interleave(g, dim=2))
    return torch.einsum("nqhe,qhe->nhq", z2 - z[None], gz)
