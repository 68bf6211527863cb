"""One pair ready for edge patching and scoring (`edge_patcher`): the shared prefix as a notebook, both
runs captured (`kvnotes.capture.capture_pair`), and the forward whose hooks patch a batch of
circuits (`EdgePatcher.patch`) or leave zero leaves for the gradients the scores need
(`circuits.edges.scores`)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import cast

import numpy as np
import torch

from circuits.edges.graph import (
    ATTENTION,
    DECISION,
    FIELD,
    GROUPS,
    NOTES,
    OTHER,
    RESIDUAL,
    EdgeGraph,
    edge_graph,
)
from kvnotes.capture import CaptureRun, RunCapture, capture_pair
from kvnotes.engine import Capability, has, hooked, require, run
from kvnotes.engine.memory import FRACTION, budget, mib, row_bytes
from kvnotes.engine.plan import Resume, softcap
from kvnotes.engine.transformer_lens import kv_weights
from kvnotes.errors import BadArgument
from kvnotes.metrics import Metric, answer_columns, logit_diff
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook
from kvnotes.ops import prefill
from kvnotes.prompt import is_delimiter
from kvnotes.tasks.sampler import Pair
from kvnotes.types import Tensor


@dataclass
class _Run:
    """What one forward left behind, per layer (batch first; positions: the computed tokens)."""

    emb: Tensor | None = None
    x: dict = field(default_factory=dict)  # resid_pre [b, T, d]
    heads: dict = field(default_factory=dict)  # per-head outputs (no bias) [b, T, H, d_model]
    attn_sum: dict = field(default_factory=dict)  # sum of head outputs + b_O, before any post-norm
    mlp: dict = field(default_factory=dict)  # [b, T, d]
    mid: dict = field(default_factory=dict)  # resid_mid [b, T, d]
    q_raw: dict = field(default_factory=dict)  # the queries before any QK norm and rotation
    q_rot: dict = field(default_factory=dict)  # [b, T, H, d_head]
    k_rot: dict = field(default_factory=dict)  # [b, T, KVH, d_head]
    k_raw: dict = field(default_factory=dict)  # the keys before any QK norm and rotation
    v: dict = field(default_factory=dict)  # [b, T, KVH, d_head]
    scores: dict = field(default_factory=dict)  # [b, H, T, slots + T]
    pattern: dict = field(default_factory=dict)
    z: dict = field(default_factory=dict)  # [b, T, H, d_head]
    mid_live: dict = field(default_factory=dict)  # resid_mid kept in the graph (gradient runs)

    def below(self, layer: int, rows: int) -> _Run:
        """What the blocks below `layer` left behind, for `rows` rows (a one-row run's values
        repeated, as views; a forward that starts at `layer` fills the rest): the embeddings and
        each such block's values."""

        def wide(v: Tensor) -> Tensor:
            return v.expand(rows, *v.shape[1:])

        out = _Run(emb=None if self.emb is None else wide(self.emb))
        for f in _Run.__dataclass_fields__:
            if f != "emb":
                getattr(out, f).update({l: wide(v) for l, v in getattr(self, f).items() if l < layer})
        return out

    def row(self, m: int) -> _Run:
        """Row `m` of what a batched forward left behind."""

        def cut(d: dict) -> dict:
            return {k: v[m : m + 1] for k, v in d.items()}

        return _Run(
            emb=None if self.emb is None else self.emb[m : m + 1],
            **{f: cut(getattr(self, f)) for f in _Run.__dataclass_fields__ if f != "emb"},
        )


@dataclass(eq=False)
class EdgePatcher:
    """A pair prepared for edge patching: the shared prefix as a notebook, the computed tokens of
    both prompts from the field on, each position's group, and both runs' activations."""

    model: KVModel
    pair: Pair
    graph: EdgeGraph
    prefix: Notebook
    ids_old: list[int]
    ids_new: list[int]
    pos: Tensor
    groups: Tensor  # [T] group of each computed position
    metric: Metric
    old: _Run
    new: _Run
    ld_old: float
    ld_new: float
    forwards: int = 0
    backwards: int = 0

    @property
    def effect(self) -> float:
        return self.ld_new - self.ld_old

    @property
    def n_tokens(self) -> int:
        return len(self.ids_new)

    def group_positions(self, g: int) -> list[int]:
        """The prompt positions in group `g`."""
        return [int(p) for p, q in zip(self.pos, self.groups) if int(q) == g]

    # -- patching --------------------------------------------------------------------------------
    def patch(self, circuits: np.ndarray | Tensor, *, batch: int = 16) -> np.ndarray:
        """The decision (recovery toward the new run) of each row's circuit: True edges carry the
        new run's value, the others the old run's. Rows may be fractions: an edge kept at `a`
        carries old + a (new - old) (its keys interpolated before the softmax), the finite
        differences the gradient scores are checked against; 1 and 0 are the boolean patch exactly."""
        keep = torch.as_tensor(np.asarray(circuits))
        if keep.ndim != 2 or keep.shape[1] != len(self.graph):
            raise BadArgument(f"circuits must be [rows, {len(self.graph)}] booleans, got {tuple(keep.shape)}")
        out = []
        for a in range(0, keep.shape[0], batch):
            rows = keep[a : a + batch]
            out.append(self._forward(_Patch(*self._masks(rows)), start=self.first_layer(rows))[0])
        lds = torch.cat(out).numpy() if out else np.zeros(0)
        return (lds - self.ld_old) / self.effect

    def soft(self, keep: Tensor) -> Tensor:
        """`patch` for one batch of rows, differentiable in the shares `keep` [rows, edges] (edge
        pruning's masks): each edge carries old + keep (new - old), the forward keeps its graph."""
        if keep.ndim != 2 or keep.shape[1] != len(self.graph):
            raise BadArgument(f"keep must be [rows, {len(self.graph)}] shares, got {tuple(keep.shape)}")
        start = self.first_layer(keep.detach().cpu().numpy())
        with torch.enable_grad():
            ld, _ = self._forward(_PatchGrad(*self._masks(keep), leaves=False), start=start)
        return (ld - self.ld_old) / self.effect

    def first_layer(self, keep: Tensor | np.ndarray) -> int:
        """The lowest layer whose blocks read a corrupted edge (kept at any share but 1) of any row of
        `keep` (n_layers: only the logit's, or none): every block below computes the new run's
        values, so a forward may start there from the new run's residual (`_forward(start=)`), on a
        backend that can resume (0 on one that cannot)."""
        if not has(self.model, Capability.RESUME):
            return 0
        gr = self.graph
        cut = (np.asarray(keep) != 1).any(0)  # an edge kept at any share but 1 (0, or a fraction)
        if not cut.any():
            return gr.n_layers
        return int(self._edge_layer[cut].min())

    @cached_property
    def _edge_layer(self) -> np.ndarray:
        """The block each edge's reader sits in (the logit: n_layers)."""
        gr = self.graph
        return np.where(gr.kind == RESIDUAL, gr.b // gr.block, gr.a)

    def exact(self, edges: Sequence[int] | np.ndarray | None = None, *, batch: int = 16) -> np.ndarray:
        """Exact scores: the recovery lost by corrupting each edge alone (default every edge)."""
        idx = np.arange(len(self.graph)) if edges is None else np.asarray(edges, dtype=np.int64)
        keep = np.ones((len(idx), len(self.graph)), dtype=bool)
        keep[np.arange(len(idx)), idx] = False
        return 1.0 - self.patch(keep, batch=batch)

    def _masks(self, keep: Tensor) -> tuple[Tensor, Tensor]:
        """Dense masks of a batch of circuits, as the share of the old run's value each edge carries
        (1 - keep): residual [b, readers, writers, groups] and attention [b, layer, head, key group,
        query group]."""
        gr = self.graph
        b = keep.shape[0]
        here = dict(dtype=self.new.x[0].dtype, device=self.new.x[0].device)
        res = torch.zeros(b, gr.n_readers, gr.n_writers, len(GROUPS), **here)
        att = torch.zeros(b, gr.n_layers, gr.n_heads, len(GROUPS), len(GROUPS), **here)
        off = 1 - keep.to(**here)
        r = np.flatnonzero(gr.kind == RESIDUAL)
        t = np.flatnonzero(gr.kind == ATTENTION)
        res[:, gr.b[r], gr.a[r], gr.c[r]] = off[:, r]
        att[:, gr.a[t], gr.b[t], gr.c[t], gr.d[t]] = off[:, t]
        # a writer no edge names (the embeddings outside the field) is the same in both runs
        return res, att

    # -- the forward ------------------------------------------------------------------------------
    def _forward(self, mode: _Mode, ids: Sequence[int] | None = None, start: int = 0) -> tuple[Tensor, _Run]:
        """One forward of the computed tokens (the new prompt's unless `ids`) under `mode`'s hooks:
        the decision's metric per row (float64; kept in the autograd graph under `_Grad`), and what
        the forward left behind. `start` > 0 (a patch whose corrupted edges all sit in blocks from
        `start` on, `first_layer`): the blocks below are not run, their values are the new run's."""
        model = self.model
        ids = self.ids_new if ids is None else ids
        tok = torch.as_tensor(list(ids))[None].expand(mode.rows, -1)
        vocab, columns = answer_columns(self.metric, self.pair.answers)
        st, resume = _Run(), None
        start = min(start, self.graph.n_layers - 1)  # the logit's edges alone: the last block runs
        if start > 0:
            st = self.new.below(start, mode.rows)
            resume = Resume(start, self.new.x[start])
        with _mlp_in_hook(model):
            _, out = run(
                model,
                self.prefix,
                tok,
                self.pos,
                write=False,
                hooks=_Hooks(self, mode, st).hooks(),
                logits_at=(int(self.pos[-1]),),
                vocab=vocab,
                resume=resume,
            )
        self.forwards += 1
        score = self.metric(out.last, columns)
        return (score if mode.live else score.detach()), st


@contextlib.contextmanager
def _mlp_in_hook(model: KVModel):
    """TransformerLens fires `hook_mlp_in` only when asked; the MLP reader needs it."""
    cfg = hooked(model).cfg
    before = cfg.use_hook_mlp_in
    cfg.use_hook_mlp_in = True
    try:
        yield
    finally:
        cfg.use_hook_mlp_in = before


class _Mode:
    """How a patching forward's hooks act (the base: no patch, no leaves; the two runs are captured
    by `kvnotes.capture` instead). `live`: the forward keeps its autograd graph (its values are not
    detached); `leaves`: zero leaves at every reader's input, the scores and the head outputs."""

    rows = 1
    live = False
    leaves: dict | None = None
    interpolate: Tensor | None = None  # [rows] alphas of the field's embeddings
    old_emb: Tensor | None = None
    drop: Tensor | None = None  # [rows] the layer whose outputs pass no gradient (GradDrop), or -1

    def corrections(self, patcher, st, l: int, readers: slice, include_layer: bool) -> Tensor | None:
        return None


class _Patch(_Mode):
    """Each row a circuit: each edge carries its share `off` of the old run's value."""

    def __init__(self, res: Tensor, att: Tensor):
        self.res, self.att = res, att
        self.rows = res.shape[0]

    def corrections(self, patcher, st, l, readers, include_layer):
        """The change of each reader's input [b, readers, T, d] that its corrupted edges make."""
        gr, old = patcher.graph, patcher.old
        off = self.res[:, readers][..., patcher.groups]  # [b, R, W, T]
        live = (off != 0).any(-1).any(1).any(0).tolist()  # [W]: writers with a corrupted edge here
        if not any(live):
            return None  # nothing corrupted: the change is zero, and adding zero changes no bit
        H = gr.n_heads
        # a writer none of whose edges into these readers is corrupted adds exactly zero: skipped
        corr = off[:, :, 0, :, None] * (old.emb - st.emb)[:, None]
        last = l if include_layer and l < gr.n_layers else l - 1
        for lp in range(last + 1):
            w0 = 1 + lp * (H + 1)
            if any(live[w0 : w0 + H]):
                corr = corr + _head_changes(
                    patcher.model, lp, st.attn_sum[lp], off[:, :, w0 : w0 + H], old.heads[lp] - st.heads[lp]
                )
            if lp < l and live[w0 + H]:
                corr = corr + off[:, :, w0 + H, :, None] * (old.mlp[lp] - st.mlp[lp])[:, None]
        return corr

    def attention(self, patcher, l: int) -> Tensor:
        """Layer l's attention edges' shares of the old run, per position: [b, H, query, key]."""
        return self.att[:, l][:, :, patcher.groups][..., patcher.groups].transpose(-1, -2)


def _leaf(mode: _Mode, name, like: Tensor) -> Tensor:
    """A zero leaf the shape of `like`, kept in `mode.leaves[name]` for its gradient."""
    t = torch.zeros_like(like).requires_grad_(True)
    assert mode.leaves is not None
    mode.leaves[name] = t
    return t


class _Grad(_Mode):
    """Rows: runs whose field embeddings are interpolated (alpha per row); zero leaves at every
    reader's input, the scores and the head outputs, for their gradients."""

    live = True

    def __init__(self, alphas: Tensor, old_emb: Tensor, drop: Tensor | None = None):
        self.interpolate = alphas
        self.old_emb = old_emb
        self.rows = len(alphas)
        self.drop = drop
        self.leaves = {}


class _PatchGrad(_Patch):
    """A patch (each edge carrying its share of the old run's value; shares may be fractions) whose
    forward keeps its autograd graph: with `leaves`, zero leaves as under `_Grad` (EAP-IG on the
    activations: one writer's edges interpolated, the gradient at every reader); without, the
    metric differentiable in the shares themselves (edge pruning's masks)."""

    live = True

    def __init__(self, res: Tensor, att: Tensor, *, leaves: bool = True):
        super().__init__(res, att)
        self.leaves = {} if leaves else None


def _head_changes(model: KVModel, l: int, s: Tensor, off: Tensor, dh: Tensor) -> Tensor:
    """The change of each reader's input [b, R, T, d] from layer l's heads, each carrying its share
    `off` [b, R, H, T] of its change `dh` [b, T, H, d]. Whole shares (1) act jointly, as the layer
    mixes its heads before any post-attention norm: post(s + sum dh) - post(s). A fractional share
    scales that head's own change of the normed output, so the reader's input moves linearly in it
    (the finite differences that check EAP's input change x gradient)."""
    whole = (off == 1).to(dh.dtype)
    out = _post_delta(model, l, s, torch.einsum("brht,bthd->brtd", whole, dh))
    part = torch.where(off == 1, 0.0, off)
    if bool((part != 0).any()):
        each = _post_delta(model, l, s, dh.permute(0, 2, 1, 3))  # [b, H, T, d]: one head at a time
        out = out + torch.einsum("brht,bhtd->brtd", part, each)
    return out


def _post_delta(model: KVModel, l: int, s: Tensor, D: Tensor) -> Tensor:
    """post(s + D) - post(s), with post the attention output's norm where the model has one (else D):
    zero where D is zero. `s` [b, T, d], `D` [b, R, T, d]."""
    if not model.facts.norm_after_sublayers:
        return D
    post = hooked(model).blocks[l].ln1_post
    return post(s[:, None] + D) - post(s)[:, None]


class _Hooks:
    """The hooks of one forward: capture what the scores need; under `_Patch` swap corrupted edges'
    values in; under `_Grad` add zero leaves (and interpolate the field's embeddings). Each reader
    of a layer's attention reads its own copy of the normalised input: the residual plus the
    changes its corrupted edges make (`_Patch.corrections`), or plus its own leaf (`_Grad`)."""

    def __init__(self, patcher: EdgePatcher, mode: _Mode, st: _Run):
        self.patcher, self.mode, self.st = patcher, mode, st
        self.model, gr = patcher.model, patcher.graph
        self.L, self.H, self.KVH = gr.n_layers, gr.n_heads, gr.n_kv_heads
        self.B, self.g = gr.block, self.H // self.KVH
        self.grad = mode.leaves is not None  # zero leaves for the gradients
        self.live = mode.live  # the autograd graph kept: values stored undetached
        self.patching = isinstance(mode, _Patch)
        self.pend: dict = {}

    def hooks(self) -> list:
        out = [("hook_embed", self.embed)]
        for l in range(self.L):
            p = f"blocks.{l}"
            attn = hooked(self.model).blocks[l].attn
            W_K, W_V, _, _ = kv_weights(attn, hooked(self.model).cfg)
            out += [
                (f"{p}.hook_resid_pre", partial(self.resid_pre, l=l)),
                (f"{p}.attn.hook_q", partial(self.q, l=l)),
                (f"{p}.attn.hook_k", partial(self.kv, l=l, store=self.st.k_raw, W=W_K)),
                (f"{p}.attn.hook_v", partial(self.kv, l=l, store=self.st.v, W=W_V)),
                (f"{p}.attn.hook_rot_q", partial(self.keep_in, store=self.st.q_rot, l=l)),
                (f"{p}.attn.hook_rot_k", partial(self.keep_in, store=self.st.k_rot, l=l)),
                (f"{p}.attn.hook_attn_scores", partial(self.scores, l=l)),
                (f"{p}.attn.hook_pattern", partial(self.keep_in, store=self.st.pattern, l=l)),
                (f"{p}.attn.hook_z", partial(self.z, l=l)),
                (f"{p}.hook_resid_mid", partial(self.mid, l=l)),
                (f"{p}.hook_mlp_in", partial(self.mlp_in, l=l)),
                (f"{p}.hook_resid_post", partial(self.resid_post, l=l)),
            ]
        out.append((f"blocks.{self.L - 1}.hook_resid_post", self.final))
        return out

    def kept(self, x: Tensor) -> Tensor:
        """`x` as stored: detached unless the forward keeps its autograd graph."""
        return x if self.live else x.detach()

    def leaf(self, name, like: Tensor) -> Tensor | None:
        """A zero leaf for `name`'s gradient, where the mode wants leaves."""
        return _leaf(self.mode, name, like) if self.grad else None

    def changed(self, corr: Tensor | None, name, like: Tensor) -> Tensor | None:
        """A reader's input change: its corrupted edges' (`corr`, under a patch), plus its leaf."""
        leaf = self.leaf(name, like)
        if leaf is None:
            return corr
        return leaf if corr is None else corr + leaf

    def keep_in(self, x, hook, store: dict, l: int):
        store[l] = self.kept(x)
        return x

    def embed(self, x, hook):
        mode = self.mode
        if mode.interpolate is not None:
            a = mode.interpolate.to(x.dtype)[:, None, None]
            x = mode.old_emb + a * (x - mode.old_emb)
        self.st.emb = self.kept(x)
        return x

    def resid_pre(self, x, hook, l: int):
        self.st.x[l] = x
        return x

    def readers(self, l: int) -> Tensor | None:
        """The normalised-input changes of layer l's query and KV readers: [b, H + KVH, T, d]."""
        if l in self.pend:
            return self.pend[l]
        x, H, KVH = self.st.x[l], self.H, self.KVH
        corr = self.mode.corrections(self.patcher, self.st, l, slice(l * self.B, l * self.B + H + KVH), False)
        corr = self.changed(corr, ("attn", l), x[:, None].expand(-1, H + KVH, -1, -1))
        if corr is None:
            self.pend[l] = None
        else:
            ln1, xin = hooked(self.model).blocks[l].ln1, x[:, None]
            self.pend[l] = ln1(xin + corr) - ln1(xin.expand_as(corr))
        return self.pend[l]

    def q(self, q, hook, l: int):
        self.st.q_raw[l] = q.detach()
        n = self.readers(l)
        if n is None:
            return q
        return q + torch.einsum("bhtd,hde->bthe", n[:, : self.H], hooked(self.model).blocks[l].attn.W_Q)

    def kv(self, x, hook, l: int, store: dict, W: Tensor):
        """Keys or values with the KV readers' input changes added, kept in `store[l]`."""
        n = self.readers(l)
        if n is not None:
            x = x + torch.einsum("bjtd,jde->btje", n[:, self.H :], W)
        store[l] = self.kept(x)
        return x

    def scores(self, s, hook, l: int):
        if self.patching:
            s = self._old_keys(s, l)
        if self.grad:
            s = s + _leaf(self.mode, ("scores", l), s)
        self.st.scores[l] = self.kept(s)
        return s

    def _old_keys(self, s: Tensor, l: int) -> Tensor:
        """Scores with each corrupted attention edge's keys taken (a share `off` of the way) from
        the old run: softcap(lerp(q.k, q.k_old, off)), exactly the old keys' scores at off = 1."""
        mode = cast(_Patch, self.mode)  # called only where self.patching: the mode is a _Patch
        off = mode.attention(self.patcher, l)  # [b, H, query, key]
        if not bool((off != 0).any()):
            return s
        attn, cap = hooked(self.model).blocks[l].attn, self.model.facts.attn_scores_soft_cap
        q = self.st.q_rot[l]
        k_old = self.patcher.old.k_rot[l][0].repeat_interleave(self.g, dim=1)  # [T, H, d]
        raw = torch.einsum("bqhe,phe->bhqp", q, k_old) / attn.attn_scale
        if bool(((off != 0) & (off != 1)).any()):  # a fraction: between this run's keys and the old
            k = self.st.k_rot[l].repeat_interleave(self.g, dim=2)  # [b, T, H, d]
            here = torch.einsum("bqhe,bphe->bhqp", q, k) / attn.attn_scale
            raw = torch.lerp(here, raw, off)
        ns = self.patcher.prefix.n_slots
        tail = s[..., ns:]
        tail = torch.where((off != 0) & torch.isfinite(tail), softcap(raw, cap), tail)
        return torch.cat([s[..., :ns], tail], dim=-1)

    def z(self, z, hook, l: int):
        if self.patching:
            z = _old_values(self.patcher, cast(_Patch, self.mode), self.st, l, z)  # self.patching: a _Patch
        if self.grad:
            z = z + _leaf(self.mode, ("z", l), z)
        attn = hooked(self.model).blocks[l].attn
        self.st.z[l] = self.kept(z)
        heads = torch.einsum("bthe,hed->bthd", z, attn.W_O)
        self.st.heads[l] = self.kept(heads)
        self.st.attn_sum[l] = (heads.sum(2) + attn.b_O).detach()
        return z

    def dropped(self, base: Tensor, x: Tensor, l: int) -> Tensor:
        """`x` with its change from `base` passing no gradient in the rows that drop layer l."""
        if self.mode.drop is None:
            return x
        cut = (self.mode.drop == l)[:, None, None]
        d = x - base
        return base + torch.where(cut, d.detach(), d)

    def mid(self, x, hook, l: int):
        self.st.mid[l] = x.detach()
        if self.live:
            x = self.dropped(self.st.x[l], x, l)  # the attention's output
            self.st.mid_live[l] = x
        return x

    def mlp_in(self, x, hook, l: int):
        at = l * self.B + self.H + self.KVH
        corr = self.mode.corrections(self.patcher, self.st, l, slice(at, at + 1), True)
        corr = self.changed(None if corr is None else corr[:, 0], ("mlp", l), x)
        return x if corr is None else x + corr

    def resid_post(self, x, hook, l: int):
        # the MLP's output: TransformerLens fires hook_mlp_out inside some MLPs and not others
        st = self.st
        out = x - st.mid_live[l] if self.live else x - st.mid[l]
        st.mlp[l] = self.kept(out)
        return self.dropped(st.mid_live[l], x, l) if self.live else x

    def final(self, x, hook):
        L, B = self.L, self.B
        corr = self.mode.corrections(self.patcher, self.st, L, slice(L * B, L * B + 1), True)
        corr = None if corr is None else corr[:, 0, -1:]
        corr = self.changed(corr, ("logit",), x[:, -1:])
        if corr is not None:
            x = torch.cat([x[:, :-1], x[:, -1:] + corr], dim=1)
        return x


def _old_values(patcher: EdgePatcher, mode: _Patch, st: _Run, l: int, z: Tensor) -> Tensor:
    """Head outputs `z` [b, T, H, d] with each corrupted attention edge's values taken (a share
    `off` of the way) from the old run: z + sum over its keys of pattern x off x (v_old - v)
    (the pattern already reads the old keys)."""
    off = mode.attention(patcher, l)  # [b, H, query, key]
    if not bool((off != 0).any()):
        return z
    g = patcher.model.n_heads // patcher.model.n_kv_heads
    ns = patcher.prefix.n_slots
    dv = (patcher.old.v[l] - st.v[l]).repeat_interleave(g, dim=2)  # [b, T, H, d]: head h reads KV head h // g
    w = st.pattern[l][..., ns:] * off.to(z.dtype)  # [b, H, q, p]
    return z + torch.einsum("bhqp,bphe->bqhe", w, dv)


def groups_of(model: KVModel, pair: Pair) -> tuple[int, list[int]]:
    """Where the edge graph starts (the field's first position) and the group of each position
    from there to the prompt's end."""
    ids = list(pair.new.ids)
    start = pair.field_span.start
    dec = pair.new.span("decision")
    field_pos = set(pair.field_span)
    notes = set(p for p in pair.downstream() if is_delimiter(model.token_strings([ids[p]])[0]))
    out = []
    for p in range(start, len(ids)):
        if p in field_pos:
            out.append(FIELD)
        elif p in dec:
            out.append(DECISION)
        elif p in notes:
            out.append(NOTES)
        else:
            out.append(OTHER)
    return start, out


def edge_patcher(model: KVModel, pair: Pair, *, metric: Metric = logit_diff) -> EdgePatcher:
    """`pair` prepared for edge patching and scoring: the prefix prefilled once, both runs captured."""
    require(model, Capability.HOOK_ATTN_SCORES, "edge-level circuits")
    require(model, Capability.WEIGHTS, "edge-level circuits")
    if len(pair.old.ids) != len(pair.new.ids):
        raise BadArgument("the pair's prompts differ in length; edge patching needs aligned prompts")
    start, grp = groups_of(model, pair)
    differ = [p for p, (a, b) in enumerate(zip(pair.old.ids, pair.new.ids)) if a != b]
    if differ and differ[0] < start:
        raise BadArgument(f"the prompts differ at position {differ[0]}, before the changed field at {start}")
    check_patch_memory(model, start, len(pair.new.ids) - start)
    with torch.no_grad():
        prefix = prefill(model, list(pair.new.ids), upto=start) if start > 0 else Notebook.empty(model)
    patcher = EdgePatcher(
        model=model,
        pair=pair,
        graph=edge_graph(model),
        prefix=prefix,
        ids_old=list(pair.old.ids[start:]),
        ids_new=list(pair.new.ids[start:]),
        pos=torch.arange(start, len(pair.new.ids)),
        groups=torch.tensor(grp),
        metric=metric,
        old=_Run(),
        new=_Run(),
        ld_old=0.0,
        ld_new=0.0,
    )
    both = capture_pair(
        model,
        CaptureRun(prefix, patcher.ids_old, patcher.pos),
        CaptureRun(prefix, patcher.ids_new, patcher.pos),
        _captured_hooks(model.n_layers),
        logits_at=(int(patcher.pos[-1]),),
        vocab=answer_columns(metric, pair.answers)[0],
    )
    columns = answer_columns(metric, pair.answers)[1]
    for name, cap in (("old", both.old), ("new", both.new)):
        setattr(patcher, name, _run_of(model, cap))
        setattr(patcher, f"ld_{name}", float(metric(cap.readout.last, columns)[0]))
    return patcher


PATCH_ROWS = 16  # circuits per forward (`EdgePatcher.patch`'s batch)


def check_patch_memory(model: KVModel, n_prefix: int, n_tokens: int) -> None:
    """Refuse, before any forward, a pair the device cannot patch: both runs captured at every
    layer and a forward of `PATCH_ROWS` circuits whose every layer autograd keeps (EAP-IG), each
    a layer's `kvnotes.engine.memory.row_bytes` over the `n_tokens` from the field on and the
    `n_prefix` slots before it, must fit `FRACTION` of the free memory."""
    room = budget(model.device)
    per_layer = row_bytes(model.facts, model.dtype.itemsize, n_tokens, n_prefix)
    need = (2 + PATCH_ROWS) * model.n_layers * per_layer
    if room is not None and need > room:
        raise BadArgument(
            f"edge patching {n_tokens} tokens from the changed field on needs ~{mib(need)}, more than "
            f"{FRACTION:.0%} of the free memory on {model.device} ({mib(room)}); use a task whose field "
            "sits nearer the decision (a shorter prompt after it), or leave edges out (report --skip edges)"
        )


# what the patches read of each run, per layer: `_Run` field -> hook point (`_run_of` adds the rest)
_CAPTURED = {
    "x": "hook_resid_pre",
    "q_raw": "attn.hook_q",
    "k_raw": "attn.hook_k",
    "v": "attn.hook_v",
    "q_rot": "attn.hook_rot_q",
    "k_rot": "attn.hook_rot_k",
    "scores": "attn.hook_attn_scores",
    "pattern": "attn.hook_pattern",
    "z": "attn.hook_z",
    "mid": "hook_resid_mid",
}


def _captured_hooks(n_layers: int) -> list[str]:
    """The hook points `_run_of` reads: the embeddings, and per layer `_CAPTURED` and resid_post."""
    per_layer = [*_CAPTURED.values(), "hook_resid_post"]
    return ["hook_embed", *(f"blocks.{l}.{h}" for l in range(n_layers) for h in per_layer)]


@torch.no_grad()
def _run_of(model: KVModel, cap: RunCapture) -> _Run:
    """One run's `_Run` from its capture (`kvnotes.capture`): the hook points as captured, and what
    the patching forward derives from them, as it derives it (head outputs through W_O, their sum
    with b_O, and the MLP's output as resid_post - resid_mid)."""
    st = _Run(emb=cap["hook_embed"])
    for l in range(model.n_layers):
        for f, h in _CAPTURED.items():
            getattr(st, f)[l] = cap[f"blocks.{l}.{h}"]
        attn = hooked(model).blocks[l].attn
        heads = torch.einsum("bthe,hed->bthd", st.z[l], attn.W_O)
        st.heads[l] = heads
        st.attn_sum[l] = heads.sum(2) + attn.b_O
        st.mlp[l] = cap[f"blocks.{l}.hook_resid_post"] - st.mid[l]
    return st
