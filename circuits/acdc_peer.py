"""Edge patching the plain TransformerLens way, for ACDC side by side with the notebook's
(`kvnotes bench acdc`): the strongest way a skilled TransformerLens user would write it.

The same edge graph and the same patch as `EdgePatcher.patch` (`circuits.edges`), built from
TransformerLens hooks and nothing of kvnotes' engine:
- the corrupt (old) run is cached once (`run_with_cache`), and so is the clean (new) one;
- each candidate circuit is a row of a batched forward of the whole new prompt (the shared prefix
  included: TransformerLens has no notebook of it), started with `start_at_layer` at the lowest
  block that reads a removed edge, from the clean run's residual there, and stopped before the
  unembedding (`stop_at_layer`), whose two answer columns are read at the last position only;
- a reader's input (`hook_q_input`, `hook_k_input`, `hook_v_input` with split inputs; `hook_mlp_in`;
  the final residual for the logit) is its residual with each removed writer's output swapped for the
  old run's: a head's output from `hook_z` and W_O, an MLP's from `hook_mlp_out`, the embeddings'
  from the first residual. Under a norm after attention (Gemma) the layer's head outputs are mixed
  before that norm, one mix per reader;
- a removed attention edge (KV slot at a key group -> head at a query group) makes that head's
  queries at the query group score the old run's rotated keys at the key group
  (`hook_attn_scores`) and sum the old values there (`hook_z`).

So it computes what the notebook computes, at the cost TransformerLens has: the prefix recomputed
by every row, and the full residual stream carried through every hook.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from circuits.edges.graph import ATTENTION, GROUPS, RESIDUAL, EdgeGraph
from circuits.edges.patcher import EdgePatcher
from kvnotes.engine import hooked
from kvnotes.errors import BadArgument, UnsupportedArchitecture
from kvnotes.metrics import answer_columns

ROWS = 64  # candidates a forward: each carries the whole prompt's residual stream and its hooks' mixes


@contextmanager
def _split_inputs(tl):
    """TransformerLens fires the per-head input hooks and `hook_mlp_in` only when asked."""
    cfg = tl.cfg
    before = (cfg.use_split_qkv_input, cfg.use_hook_mlp_in, cfg.use_attn_result)
    cfg.use_split_qkv_input, cfg.use_hook_mlp_in, cfg.use_attn_result = True, True, False
    try:
        yield
    finally:
        cfg.use_split_qkv_input, cfg.use_hook_mlp_in, cfg.use_attn_result = before


@dataclass
class _Cached:
    """One run's writer outputs per layer, and what the attention edges read."""

    resid: list[Tensor]  # [P, d] the residual into each block
    heads: list[Tensor]  # [P, H, d] each head's output (z @ W_O)
    mlp: list[Tensor]  # [P, d]
    rot_k: list[Tensor]  # [P, H, d_head] the keys as scored (rotated, normed), one per query head
    v: list[Tensor]  # [P, H, d_head]
    final: Tensor  # [P, d] the residual after the last block


class TLEdgePatch:
    """One pair (an `EdgePatcher`'s) patched through TransformerLens hooks; `patch` and `graph` as
    `EdgePatcher`'s, so `circuits.edges.acdc.acdc` runs on it unchanged."""

    def __init__(self, patcher: EdgePatcher, *, rows: int = ROWS):
        tl = hooked(patcher.model)
        cfg = tl.cfg
        if cfg.parallel_attn_mlp:
            raise UnsupportedArchitecture("the TransformerLens way handles sequential blocks only")
        if cfg.positional_embedding_type not in ("rotary", "standard"):
            raise UnsupportedArchitecture(
                f"the TransformerLens way: no {cfg.positional_embedding_type} positions"
            )
        self.patcher, self.net, self.graph = patcher, tl, patcher.graph
        self.rows = rows
        self.forwards = 0
        g: EdgeGraph = patcher.graph
        self.H, self.KVH, self.L = g.n_heads, g.n_kv_heads, g.n_layers
        n = len(patcher.pair.new.ids)
        group = torch.full((n,), -1, dtype=torch.long)  # -1: the shared prefix, no node
        group[patcher.pos] = patcher.groups.to(torch.long)
        self.group = group
        self.onehot = torch.stack([group == k for k in range(len(GROUPS))], 1).to(cfg.dtype)  # [P, G]
        vocab, cols = answer_columns(patcher.metric, patcher.pair.answers)
        self.answers = list(vocab) if vocab is not None else None
        self.cols = cols
        with torch.no_grad(), _split_inputs(tl):
            self.old = self._cache(list(patcher.pair.old.ids))
            self.new = self._cache(list(patcher.pair.new.ids))
        self.ld_old, self.ld_new = (float(self._metric(c.final[None])[0]) for c in (self.old, self.new))

    # -- the two cached runs -------------------------------------------------------------------
    def _cache(self, ids: list[int]) -> _Cached:
        names = lambda n: (  # noqa: E731
            n.endswith(("hook_resid_pre", "hook_z", "hook_mlp_out", "hook_rot_k", "hook_k", "attn.hook_v"))
            or n == f"blocks.{self.L - 1}.hook_resid_post"
        )
        _, cache = self.net.run_with_cache(torch.tensor(ids)[None], names_filter=names, stop_at_layer=self.L)
        self.forwards += 1
        rot = "hook_rot_k" if self.net.cfg.positional_embedding_type == "rotary" else "hook_k"
        out = _Cached([], [], [], [], [], cache[f"blocks.{self.L - 1}.hook_resid_post"][0])
        for l in range(self.L):
            attn = self.net.blocks[l].attn
            out.resid.append(cache[f"blocks.{l}.hook_resid_pre"][0])
            out.heads.append(torch.einsum("phe,hed->phd", cache[f"blocks.{l}.attn.hook_z"][0], attn.W_O))
            out.mlp.append(cache[f"blocks.{l}.hook_mlp_out"][0])
            out.rot_k.append(self._per_head(cache[f"blocks.{l}.attn.{rot}"][0]))
            out.v.append(self._per_head(cache[f"blocks.{l}.attn.hook_v"][0]))
        return out

    def _per_head(self, t: Tensor) -> Tensor:
        """Keys or values [..., KVH, d_head] read by each query head: [..., H, d_head]."""
        return t if t.shape[-2] == self.H else t.repeat_interleave(self.H // t.shape[-2], dim=-2)

    def _metric(self, final: Tensor) -> Tensor:
        """The decision's metric from the residual after the last block [b, P, d]: float64 [b]."""
        tl = self.net
        x = final[:, -1]
        if tl.cfg.normalization_type is not None:
            x = tl.ln_final(x)
        W, b = tl.unembed.W_U, tl.unembed.b_U
        if self.answers is not None:
            W, b = W[:, self.answers], b[self.answers]
        logits = x @ W + b
        cap = tl.cfg.output_logits_soft_cap
        if cap and cap > 0:
            logits = cap * torch.tanh(logits / cap)
        return self.patcher.metric(logits, self.cols)

    # -- patching ------------------------------------------------------------------------------
    def patch(self, circuits: np.ndarray, *, batch: int = ROWS) -> np.ndarray:
        """Each row's recovery toward the new run: True edges carry the new run's value, the others
        the old run's (booleans only: ACDC's patch)."""
        keep = np.asarray(circuits)
        if keep.ndim != 2 or keep.shape[1] != len(self.graph) or keep.dtype != bool:
            raise BadArgument(
                f"circuits must be [rows, {len(self.graph)}] booleans, got {keep.dtype} {keep.shape}"
            )
        out = []
        with torch.no_grad(), _split_inputs(self.net):
            for a in range(0, len(keep), min(batch, self.rows)):
                out.append(self._forward(keep[a : a + min(batch, self.rows)]))
        lds = torch.cat(out).numpy() if out else np.zeros(0)
        return (lds - self.ld_old) / (self.ld_new - self.ld_old)

    def _masks(self, keep: np.ndarray) -> tuple[Tensor, Tensor]:
        """Which edges are removed: residual [b, readers, writers, G], attention [b, L, H, Gk, Gq]."""
        g, b = self.graph, len(keep)
        off = torch.as_tensor(~keep, dtype=self.net.cfg.dtype)
        res = torch.zeros(b, g.n_readers, g.n_writers, len(GROUPS), dtype=off.dtype)
        att = torch.zeros(b, self.L, self.H, len(GROUPS), len(GROUPS), dtype=off.dtype)
        r, t = np.flatnonzero(g.kind == RESIDUAL), np.flatnonzero(g.kind == ATTENTION)
        res[:, g.b[r], g.a[r], g.c[r]] = off[:, r]
        att[:, g.a[t], g.b[t], g.c[t], g.d[t]] = off[:, t]
        return res, att

    def _start(self, res: Tensor, att: Tensor) -> int:
        """The lowest block that reads a removed edge (n_layers: only the logit's)."""
        g = self.graph
        readers = torch.nonzero(res.abs().sum((0, 2, 3)))[:, 0].tolist()
        layers = [r // g.block for r in readers]
        layers += torch.nonzero(att.abs().sum((0, 2, 3, 4)))[:, 0].tolist()
        return min(layers, default=self.L)

    def _forward(self, keep: np.ndarray) -> Tensor:
        res, att = self._masks(keep)
        b = len(keep)
        start = min(self._start(res, att), self.L - 1)
        live = _Live(self, res, att, b, start)
        x = self.new.resid[start][None].expand(b, -1, -1).clone()
        final = self.net.run_with_hooks(x, start_at_layer=start, stop_at_layer=self.L, fwd_hooks=live.hooks())
        self.forwards += 1
        final = final + live.delta(self.L * self.graph.block, self.L, final)[:, 0]
        return self._metric(final)


class _Live:
    """The hooks of one batched patching forward, and the live writer outputs they collect."""

    def __init__(self, way: TLEdgePatch, res: Tensor, att: Tensor, b: int, start: int):
        self.w, self.res, self.att, self.b = way, res, att, b
        # the blocks below `start` are the new run's
        self.heads = {l: way.new.heads[l][None].expand(b, -1, -1, -1) for l in range(start)}
        self.mlp = {l: way.new.mlp[l][None].expand(b, -1, -1) for l in range(start)}
        self.q: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}
        self.pattern: dict[int, Tensor] = {}
        self.made: dict[tuple[int, int], Tensor] = {}  # (reader, upto): its input change
        self.start = start

    def hooks(self) -> list:
        out = []
        for l in range(self.start, self.w.L):
            p = f"blocks.{l}."
            out += [
                (p + "hook_q_input", lambda x, hook, l=l: x + self._heads_in(l, 0, self.w.H, x)),
                (p + "hook_k_input", lambda x, hook, l=l: x + self._heads_in(l, self.w.H, self.w.KVH, x)),
                (p + "hook_v_input", lambda x, hook, l=l: x + self._heads_in(l, self.w.H, self.w.KVH, x)),
                (
                    p + "hook_mlp_in",
                    lambda x, hook, l=l: x + self.delta(self._reader(l, "mlp"), l + 1, x)[:, 0],
                ),
                (p + "hook_mlp_out", lambda x, hook, l=l: self._keep(self.mlp, l, x)),
                (p + "attn.hook_z", lambda z, hook, l=l: self._z(l, z)),
            ]
            if self.att[:, l].any():
                rot = (
                    "attn.hook_rot_q"
                    if self.w.net.cfg.positional_embedding_type == "rotary"
                    else "attn.hook_q"
                )
                out += [
                    (p + rot, lambda q, hook, l=l: self._keep(self.q, l, q)),
                    (p + "attn.hook_v", lambda v, hook, l=l: self._keep(self.v, l, v)),
                    (p + "attn.hook_attn_scores", lambda s, hook, l=l: self._scores(l, s)),
                    (p + "attn.hook_pattern", lambda a, hook, l=l: self._keep(self.pattern, l, a)),
                ]
        return out

    def _keep(self, store: dict, l: int, x: Tensor) -> Tensor:
        store[l] = x
        return x

    def _reader(self, l: int, kind: str, i: int = 0) -> int:
        g = self.w.graph
        return l * g.block + {"q": 0, "kv": self.w.H, "mlp": self.w.H + self.w.KVH}[kind] + i

    def _heads_in(self, l: int, first: int, n: int, x: Tensor) -> Tensor:
        """The input change of layer l's readers first .. first + n (query heads or KV heads)."""
        if x.shape[2] != n:
            raise UnsupportedArchitecture(f"split inputs of {x.shape[2]} heads where the graph has {n}")
        r = l * self.w.graph.block + first
        return torch.stack([self.delta(r + i, l, x)[:, 0] for i in range(n)], 2)

    def delta(self, reader: int, upto: int, x: Tensor) -> Tensor:
        """Reader `reader`'s input change [b, 1, P, d]: its removed writers (embeddings, the heads and
        MLPs of layers below `upto`) swapped for the old run's outputs at its groups' positions."""
        if (reader, upto) in self.made:  # a KV head's keys and values read one input
            return self.made[reader, upto]
        self.made[reader, upto] = out = self._delta(reader, upto, x)
        return out

    def _delta(self, reader: int, upto: int, x: Tensor) -> Tensor:
        w, g = self.w, self.w.graph
        m = torch.einsum("bwk,pk->bwp", self.res[:, reader], w.onehot)  # [b, writers, P]
        out = torch.zeros(self.b, 1, *w.new.resid[0].shape, dtype=x.dtype)
        if not m.any():
            return out
        out = out + (m[:, 0, :, None] * (w.old.resid[0] - w.new.resid[0]))[:, None]
        for l in range(upto):
            base = 1 + l * (g.n_heads + 1)
            mh, mm = m[:, base : base + g.n_heads], m[:, base + g.n_heads]
            if mh.any():
                out = out + self._heads_change(l, mh)[:, None]
            if mm.any():
                out = out + (mm[..., None] * (w.old.mlp[l] - self.mlp[l]))[:, None]
        return out

    def _heads_change(self, l: int, mh: Tensor) -> Tensor:
        """Layer l's attention output change [b, P, d] when its heads swap in the old outputs where
        `mh` [b, H, P] says; mixed before the norm after attention, where the model has one."""
        blk, live = self.w.net.blocks[l], self.heads[l]
        mix = live + mh.transpose(1, 2)[..., None] * (self.w.old.heads[l] - live)  # [b, P, H, d]
        if not self.w.net.cfg.use_normalization_before_and_after:
            return (mix - live).sum(2)
        bo = blk.attn.b_O
        return blk.ln1_post(mix.sum(2) + bo) - blk.ln1_post(live.sum(2) + bo)

    def _scores(self, l: int, s: Tensor) -> Tensor:
        """Scores with the removed attention edges' keys the old run's: [b, H, q, k]."""
        w = self.w
        M = self._attention_mask(l)
        attn = w.net.blocks[l].attn
        q = self.q[l]
        old = torch.einsum("bqhe,khe->bhqk", q, w.old.rot_k[l]) / attn.attn_scale
        cap = w.net.cfg.attn_scores_soft_cap
        if cap and cap > 0:
            old = cap * torch.tanh(old / cap)
        masked = torch.isneginf(s) | (s <= torch.finfo(s.dtype).min / 2)
        return torch.where(M & ~masked, old, s)

    def _attention_mask(self, l: int) -> Tensor:
        """Which (head, query, key) read the old run: [b, H, q, k] bool."""
        oh = self.w.onehot
        return torch.einsum("bhkq,pq,sk->bhps", self.att[:, l], oh, oh) > 0.5

    def _z(self, l: int, z: Tensor) -> Tensor:
        w = self.w
        if self.att[:, l].any():
            M = self._attention_mask(l).to(z.dtype)
            v_live = w._per_head(self.v[l])
            z = z + torch.einsum("bhqk,bkhe->bqhe", self.pattern[l] * M, w.old.v[l][None] - v_live)
        self.heads[l] = torch.einsum("bphe,hed->bphd", z, w.net.blocks[l].attn.W_O)
        return z
