"""Edge-level circuits over the notebook: a graph whose nodes are heads, MLPs and KV slots at
position groups, scored edge by edge (EAP-IG, AtP* with the QK fix) and patched edge by edge exactly.

The graph of one pair (old and new prompt, the same tokens but the changed field). Positions before
the field are the same in both runs, so they are a shared notebook (`prefix`) and no node; from the
field on, each position is in one group of `GROUPS`: the field's tokens, the notes (delimiters
between the field and the decision), the decision span, and every other position (`other`).

Nodes, per group g: `EMB@g` (the token embeddings; only the field's differ between the runs, so only
`EMB@field` has edges), `L{l}H{h}@g` (query head h of layer l: its query input and its output),
`KV{l}.{j}@g` (layer l's KV head j at those positions: the keys and values that heads read),
`MLP{l}@g`, and `LOGIT` (the decision's answer logit difference, read at the last position).

Edges:
- residual: a writer (`EMB`, a head's output, an MLP) at g feeds every later reader at g: a head's
  query input, a KV slot's input, an MLP's input (a layer's MLP also reads its own layer's heads),
  and `LOGIT` (writers at the decision only);
- attention: `KV{l}.{j}@gk` feeds each head h of that KV group at `L{l}H{h}@gq` (the keys and values at
  gk's positions as read by h's queries at gq's positions).

Patching (`EdgeSite.patch`): a circuit is a set of edges; in the patched run (on the new prompt)
every edge outside it carries the old run's value: a reader's input is the residual with each
corrupted writer's output swapped for the old one (under a post-attention norm, as Gemma has, the
layer's head outputs are mixed before the norm), and a corrupted attention edge makes that head read
the old keys and values at those positions. Every edge in: the new run exactly; none: the old run
(tested against independent runs). It runs through `kvnotes.engine.run` with hooks, many circuits as
rows of one batch.

Scores, in recovery units (the share of ld_new - ld_old that corrupting the edge alone removes):
- `exact`: that patch, one row per edge (`EdgeSite.exact`);
- `eap` / `eap-ig`: (input change) · (gradient at the reader's input), the gradient at the new run
  (EAP) or averaged over `steps` runs whose field embeddings lie on the straight path from old to new
  (integrated gradients, midpoint rule: Hanna et al. 2024); attention edges through the scores'
  and values' gradients;
- `atp*`: attribution patching with the QK fix (Kramár et al. 2024) for every edge that reaches the
  model through a key: an attention edge, or a residual edge into a KV slot, has its patched keys and
  values recomputed exactly and the softmax of every query that reads them recomputed, and only the
  head outputs' change is linearised; other edges as EAP at the new run;
- `atp*-gd`: AtP* with GradDrop (Kramár et al. 2024), against cancellation between an edge's direct
  and indirect paths: layer m's attention and MLP outputs let no gradient through (their values
  unchanged), one row per m of one batched forward, and an edge's score is the mean over m of
  |AtP*_m| (m other than the reader's own layer, where the drop cuts the reader off: L - 1 terms;
  the logit's edges, which no layer's drop reaches, L). Unsigned: a magnitude for ranking.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvnotes import rope
from kvnotes.engine import require, run
from kvnotes.errors import BadArgument
from kvnotes.metrics import Metric, answer_columns, logit_diff
from kvnotes.models.model import KVModel
from kvnotes.notebook import Notebook
from kvnotes.ops import prefill
from kvnotes.prompt import is_delimiter
from kvnotes.tasks.sampler import Pair
from kvnotes.types import Tensor

GROUPS = ("field", "notes", "decision", "other")
FIELD, NOTES, DECISION, OTHER = range(4)
RESIDUAL, ATTENTION = 0, 1
METHODS = ("eap", "eap-ig", "atp*")  # what the `edges` analysis runs on every pair
GRADDROP = "atp*-gd"  # AtP* with GradDrop: one backward per layer, so asked for by name (the bench)
EXACT_KEYS = ("changed", "whole")  # AtP*'s exact-key step: the changed keys swapped in, or every key again

# attention edges run from a key group to a query group that can follow it
_READS = {
    FIELD: (FIELD, NOTES, DECISION, OTHER),
    NOTES: (NOTES, DECISION, OTHER),
    DECISION: (DECISION,),
    OTHER: (NOTES, DECISION, OTHER),
}


@dataclass(frozen=True)
class Node:
    """A node of the edge graph: `kind` is "emb", "head", "kv", "mlp" or "logit"."""

    kind: str
    layer: int  # -1 for the embeddings, n_layers for the logit
    index: int  # the query head or KV head; 0 otherwise
    group: int  # index into GROUPS

    @property
    def label(self) -> str:
        g = GROUPS[self.group]
        return {
            "emb": f"EMB@{g}",
            "head": f"L{self.layer}H{self.index}@{g}",
            "kv": f"KV{self.layer}.{self.index}@{g}",
            "mlp": f"MLP{self.layer}@{g}",
            "logit": "LOGIT",
        }[self.kind]


@dataclass(frozen=True, eq=False)
class EdgeGraph:
    """Every edge of a model's graph (the same for every pair of the model, so scores line up).

    Residual edge e: writer `a[e]`, reader `b[e]`, group `c[e]` (`d[e]` = -1). Attention edge e:
    layer `a[e]`, query head `b[e]`, key group `c[e]`, query group `d[e]`. Writers are numbered
    0 (embeddings), then per layer its heads and its MLP; readers per layer its query heads, its
    KV heads and its MLP, then the logit."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    kind: np.ndarray
    a: np.ndarray
    b: np.ndarray
    c: np.ndarray
    d: np.ndarray
    nodes: tuple[Node, ...]
    src: np.ndarray  # node index of each edge's source
    dst: np.ndarray  # and of its destination

    def __len__(self) -> int:
        return len(self.kind)

    @property
    def n_writers(self) -> int:
        return 1 + self.n_layers * (self.n_heads + 1)

    @property
    def n_readers(self) -> int:
        return self.n_layers * self.block + 1

    @property
    def block(self) -> int:  # readers per layer
        return self.n_heads + self.n_kv_heads + 1

    @property
    def labels(self) -> list[str]:
        return [f"{self.nodes[s].label}->{self.nodes[t].label}" for s, t in zip(self.src, self.dst)]

    def index_of(self, label: str) -> int:
        """The edge index of `"SRC->DST"` (labels as `labels` gives them)."""
        try:
            return self._by_label[label]
        except KeyError:
            raise BadArgument(
                f"no edge {label!r} in this graph (labels look like 'L0H1@notes->KV1.0@notes')"
            ) from None

    @property
    def logit(self) -> int:
        """The node index of `LOGIT`."""
        return next(i for i, n in enumerate(self.nodes) if n.kind == "logit")

    @property
    def _by_label(self) -> dict[str, int]:
        if "_labels" not in self.__dict__:
            object.__setattr__(self, "_labels", {s: i for i, s in enumerate(self.labels)})
        return self.__dict__["_labels"]

    def writer_layer(self, w: int) -> int:
        return -1 if w == 0 else (w - 1) // (self.n_heads + 1)

    def layers(self) -> tuple[np.ndarray, np.ndarray]:
        """Each edge's (source layer, destination layer): what a matched random circuit matches."""
        src = np.array([self.nodes[s].layer for s in self.src])
        dst = np.array([self.nodes[t].layer for t in self.dst])
        return src, dst

    def regions(self) -> tuple[np.ndarray, np.ndarray]:
        """Each edge's (source group, destination group)."""
        return (
            np.array([self.nodes[s].group for s in self.src]),
            np.array([self.nodes[t].group for t in self.dst]),
        )


def edge_graph(model: KVModel) -> EdgeGraph:
    """The model's edge graph (cached on the model)."""
    key = ("edge_graph", model.n_layers, model.n_heads, model.n_kv_heads)
    memo = model.__dict__.setdefault("_kvnotes_memo", {})
    if key not in memo:
        memo[key] = _build_graph(model.n_layers, model.n_heads, model.n_kv_heads)
    return memo[key]


def _build_graph(L: int, H: int, KVH: int) -> EdgeGraph:
    g = H // KVH
    B = H + KVH + 1
    nodes: list[Node] = []
    index: dict[Node, int] = {}

    def node(n: Node) -> int:
        if n not in index:
            index[n] = len(nodes)
            nodes.append(n)
        return index[n]

    def writer_node(w: int, grp: int) -> Node:
        if w == 0:
            return Node("emb", -1, 0, grp)
        l, i = divmod(w - 1, H + 1)
        return Node("head", l, i, grp) if i < H else Node("mlp", l, 0, grp)

    def reader_node(r: int, grp: int) -> Node:
        if r == L * B:
            return Node("logit", L, 0, DECISION)
        l, i = divmod(r, B)
        if i < H:
            return Node("head", l, i, grp)
        if i < H + KVH:
            return Node("kv", l, i - H, grp)
        return Node("mlp", l, 0, grp)

    rows: list[tuple[int, int, int, int, int]] = []
    W = 1 + L * (H + 1)
    for r in range(L * B + 1):
        rl = r // B
        is_mlp = r < L * B and r % B == H + KVH
        for w in range(W):
            wl = -1 if w == 0 else (w - 1) // (H + 1)
            w_head = w > 0 and (w - 1) % (H + 1) < H
            if not (wl < rl or (is_mlp and w_head and wl == rl)):
                continue
            groups = (FIELD,) if w == 0 else (DECISION,) if r == L * B else range(len(GROUPS))
            for grp in groups:
                if w == 0 and r == L * B:
                    continue  # the field is not the decision's position
                rows.append((RESIDUAL, w, r, grp, -1))
    for l in range(L):
        for h in range(H):
            for gk, qs in _READS.items():
                for gq in qs:
                    rows.append((ATTENTION, l, h, gk, gq))
    src, dst = [], []
    for k, a, b, c, d in rows:
        if k == RESIDUAL:
            src.append(node(writer_node(a, c)))
            dst.append(node(reader_node(b, c)))
        else:
            src.append(node(Node("kv", a, b // g, c)))
            dst.append(node(Node("head", a, b, d)))
    arr = np.array(rows, dtype=np.int64)
    return EdgeGraph(
        n_layers=L,
        n_heads=H,
        n_kv_heads=KVH,
        kind=arr[:, 0],
        a=arr[:, 1],
        b=arr[:, 2],
        c=arr[:, 3],
        d=arr[:, 4],
        nodes=tuple(nodes),
        src=np.array(src),
        dst=np.array(dst),
    )


# --- one pair, ready for patching and scoring --------------------------------------------------
@dataclass
class _Run:
    """What one forward left behind, per layer (batch first; positions: the computed tokens)."""

    emb: Tensor | None = None
    x: dict = field(default_factory=dict)  # resid_pre [b, T, d]
    heads: dict = field(default_factory=dict)  # per-head outputs (no bias) [b, T, H, d_model]
    attn_sum: dict = field(default_factory=dict)  # sum of head outputs + b_O, before any post-norm
    mlp: dict = field(default_factory=dict)  # [b, T, d]
    mid: dict = field(default_factory=dict)  # resid_mid [b, T, d]
    q_rot: dict = field(default_factory=dict)  # [b, T, H, d_head]
    k_rot: dict = field(default_factory=dict)  # [b, T, KVH, d_head]
    k_raw: dict = field(default_factory=dict)  # the keys before any QK norm and rotation
    v: dict = field(default_factory=dict)  # [b, T, KVH, d_head]
    scores: dict = field(default_factory=dict)  # [b, H, T, slots + T]
    pattern: dict = field(default_factory=dict)
    z: dict = field(default_factory=dict)  # [b, T, H, d_head]
    mid_live: dict = field(default_factory=dict)  # resid_mid kept in the graph (gradient runs)


@dataclass(eq=False)
class EdgeSite:
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
        new run's value, the others the old run's."""
        keep = torch.as_tensor(np.asarray(circuits), dtype=torch.bool)
        if keep.ndim != 2 or keep.shape[1] != len(self.graph):
            raise BadArgument(f"circuits must be [rows, {len(self.graph)}] booleans, got {tuple(keep.shape)}")
        out = []
        for a in range(0, keep.shape[0], batch):
            out.append(self._forward(_Patch(*self._masks(keep[a : a + batch])))[0])
        lds = torch.cat(out).numpy() if out else np.zeros(0)
        return (lds - self.ld_old) / self.effect

    def exact(self, edges: Sequence[int] | np.ndarray | None = None, *, batch: int = 16) -> np.ndarray:
        """Exact scores: the recovery lost by corrupting each edge alone (default every edge)."""
        idx = np.arange(len(self.graph)) if edges is None else np.asarray(edges, dtype=np.int64)
        keep = np.ones((len(idx), len(self.graph)), dtype=bool)
        keep[np.arange(len(idx)), idx] = False
        return 1.0 - self.patch(keep, batch=batch)

    def _masks(self, keep: Tensor) -> tuple[Tensor, Tensor]:
        """Dense masks of a batch of circuits: residual [b, readers, writers, groups] and attention
        [b, layer, head, key group, query group]; True = the new run's value."""
        gr = self.graph
        b = keep.shape[0]
        res = torch.ones(b, gr.n_readers, gr.n_writers, len(GROUPS), dtype=torch.bool)
        att = torch.ones(b, gr.n_layers, gr.n_heads, len(GROUPS), len(GROUPS), dtype=torch.bool)
        r = np.flatnonzero(gr.kind == RESIDUAL)
        t = np.flatnonzero(gr.kind == ATTENTION)
        res[:, gr.b[r], gr.a[r], gr.c[r]] = keep[:, r]
        att[:, gr.a[t], gr.b[t], gr.c[t], gr.d[t]] = keep[:, t]
        # a writer no edge names (the embeddings outside the field) is the same in both runs
        return res, att

    # -- the forward ------------------------------------------------------------------------------
    def _forward(self, mode: _Mode, ids: Sequence[int] | None = None) -> tuple[Tensor, _Run]:
        """One forward of the computed tokens (the new prompt's unless `ids`) under `mode`'s hooks:
        the decision's metric per row (float64; kept in the autograd graph under `_Grad`), and what
        the forward left behind."""
        model = self.model
        ids = self.ids_new if ids is None else ids
        tok = torch.as_tensor(list(ids))[None].expand(mode.rows, -1)
        vocab, columns = answer_columns(self.metric, self.pair.answers)
        st = _Run()
        with _mlp_in_hook(model):
            _, out = run(
                model,
                self.prefix,
                tok,
                self.pos,
                write=False,
                hooks=_hooks(self, mode, st),
                logits_at=(int(self.pos[-1]),),
                vocab=vocab,
            )
        self.forwards += 1
        score = self.metric(out.last, columns)
        return (score if isinstance(mode, _Grad) else score.detach()), st


@contextlib.contextmanager
def _mlp_in_hook(model: KVModel):
    """TransformerLens fires `hook_mlp_in` only when asked; the MLP reader needs it."""
    cfg = model.tl.cfg
    before = cfg.use_hook_mlp_in
    cfg.use_hook_mlp_in = True
    try:
        yield
    finally:
        cfg.use_hook_mlp_in = before


class _Mode:
    """How a forward's hooks act: capture only (the old and new runs)."""

    rows = 1
    interpolate: Tensor | None = None  # [rows] alphas of the field's embeddings
    old_emb: Tensor | None = None
    drop: Tensor | None = None  # [rows] the layer whose outputs pass no gradient (GradDrop), or -1

    def corrections(self, site, st, l: int, readers: slice, include_layer: bool) -> Tensor | None:
        return None


class _Patch(_Mode):
    """Each row a circuit: corrupted edges carry the old run's values."""

    def __init__(self, res: Tensor, att: Tensor):
        self.res, self.att = res, att
        self.rows = res.shape[0]

    def corrections(self, site, st, l, readers, include_layer):
        """The change of each reader's input [b, readers, T, d] that its corrupted edges make."""
        gr, old = site.graph, site.old
        cut = ~self.res[:, readers][..., site.groups]  # [b, R, W, T]
        live = cut.any(-1).any(1).any(0).tolist()  # [W]: writers with a corrupted edge into these readers
        if not any(live):
            return None  # nothing corrupted: the change is zero, and adding zero changes no bit
        off = cut.to(st.x[0].dtype)
        H = gr.n_heads
        # a writer none of whose edges into these readers is corrupted adds exactly zero: skipped
        corr = off[:, :, 0, :, None] * (old.emb - st.emb)[:, None]
        last = l if include_layer and l < gr.n_layers else l - 1
        for lp in range(last + 1):
            w0 = 1 + lp * (H + 1)
            if any(live[w0 : w0 + H]):
                dh = old.heads[lp] - st.heads[lp]  # [b, T, H, d]
                D = torch.einsum("brht,bthd->brtd", off[:, :, w0 : w0 + H], dh)
                corr = corr + _post_delta(site.model, lp, st.attn_sum[lp], D)
            if lp < l and live[w0 + H]:
                corr = corr + off[:, :, w0 + H, :, None] * (old.mlp[lp] - st.mlp[lp])[:, None]
        return corr


class _Grad(_Mode):
    """Rows: runs whose field embeddings are interpolated (alpha per row); zero leaves at every
    reader's input, the scores and the head outputs, for their gradients."""

    def __init__(self, alphas: Tensor, old_emb: Tensor, drop: Tensor | None = None):
        self.interpolate = alphas
        self.old_emb = old_emb
        self.rows = len(alphas)
        self.drop = drop
        self.leaves: dict = {}

    def leaf(self, name, like: Tensor) -> Tensor:
        t = torch.zeros_like(like).requires_grad_(True)
        self.leaves[name] = t
        return t


def _post_delta(model: KVModel, l: int, s: Tensor, D: Tensor) -> Tensor:
    """post(s + D) - post(s), with post the attention output's norm where the model has one (else D):
    zero where D is zero. `s` [b, T, d], `D` [b, R, T, d]."""
    if not model.cfg.use_normalization_before_and_after:
        return D
    post = model.tl.blocks[l].ln1_post
    return post(s[:, None] + D) - post(s)[:, None]


def _weights(model: KVModel, l: int):
    attn = model.tl.blocks[l].attn
    grouped = hasattr(attn, "_W_K") and not getattr(model.cfg, "ungroup_grouped_query_attention", False)
    wk = attn._W_K if grouped else attn.W_K
    wv = attn._W_V if grouped else attn.W_V
    return attn, attn.W_Q, wk, wv


def _hooks(site: EdgeSite, mode: _Mode, st: _Run):
    """The hooks of one forward: capture what the scores need; under `_Patch` swap corrupted edges'
    values in; under `_Grad` add zero leaves (and interpolate the field's embeddings)."""
    model, gr = site.model, site.graph
    L, H, KVH = gr.n_layers, gr.n_heads, gr.n_kv_heads
    B, g = gr.block, H // KVH
    ns = site.prefix.n_slots
    grad = isinstance(mode, _Grad)
    patch = isinstance(mode, _Patch)
    hooks = []
    pend: dict = {}

    def keep(store: dict, l: int):
        """A hook that keeps its activation in `store[l]` (detached unless gradients are wanted)."""

        def f(x, hook):
            store[l] = x if grad else x.detach()
            return x

        return f

    def embed(x, hook):
        if mode.interpolate is not None:
            a = mode.interpolate.to(x.dtype)[:, None, None]
            x = mode.old_emb + a * (x - mode.old_emb)
        st.emb = x if grad else x.detach()
        return x

    hooks.append(("hook_embed", embed))

    for l in range(L):
        attn, W_Q, W_K, W_V = _weights(model, l)
        ln1 = model.tl.blocks[l].ln1

        def resid_pre(x, hook, l=l):
            st.x[l] = x
            return x

        def attn_readers(l=l, ln1=ln1):
            """The normalised-input changes of layer l's query and KV readers: [b, H + KVH, T, d]."""
            if l in pend:
                return pend[l]
            x = st.x[l]
            if grad:
                corr = mode.leaf(("attn", l), x[:, None].expand(-1, H + KVH, -1, -1))
            else:
                corr = mode.corrections(site, st, l, slice(l * B, l * B + H + KVH), False)
            if corr is None:
                pend[l] = None
            else:
                xin = x[:, None]
                pend[l] = ln1(xin + corr) - ln1(xin.expand_as(corr))
            return pend[l]

        def q_hook(q, hook, W_Q=W_Q, attn_readers=attn_readers):
            n = attn_readers()
            if n is None:
                return q
            return q + torch.einsum("bhtd,hde->bthe", n[:, :H], W_Q)

        def kv_hook(store: dict, W, attn_readers=attn_readers, l=l):
            """Keys or values with the KV readers' input changes added, kept in `store[l]`."""

            def f(x, hook):
                n = attn_readers()
                if n is not None:
                    x = x + torch.einsum("bjtd,jde->btje", n[:, H:], W)
                store[l] = x if grad else x.detach()
                return x

            return f

        k_hook, v_hook = kv_hook(st.k_raw, W_K), kv_hook(st.v, W_V)

        def scores_hook(s, hook, l=l, attn=attn):
            if patch:
                off = ~mode.att[:, l][:, :, site.groups][..., site.groups]  # [b, H, gk->T, gq->T]: key, query
                off = off.transpose(-1, -2)  # [b, H, query, key]
                if bool(off.any()):
                    k_old = site.old.k_rot[l][0].repeat_interleave(g, dim=1)  # [T, H, d]
                    s_old = torch.einsum("bqhe,phe->bhqp", st.q_rot[l], k_old)
                    s_old = _softcap(s_old / attn.attn_scale, model.cfg.attn_scores_soft_cap)
                    tail = s[..., ns:]
                    tail = torch.where(off & torch.isfinite(tail), s_old, tail)
                    s = torch.cat([s[..., :ns], tail], dim=-1)
            if grad:
                s = s + mode.leaf(("scores", l), s)
            st.scores[l] = s if grad else s.detach()
            return s

        def z_hook(z, hook, l=l, attn=attn):
            if patch:
                z = _patch_values(site, mode, st, l, z)
            if grad:
                z = z + mode.leaf(("z", l), z)
            st.z[l] = z if grad else z.detach()
            heads = torch.einsum("bthe,hed->bthd", z, attn.W_O)
            st.heads[l] = heads if grad else heads.detach()
            st.attn_sum[l] = (heads.sum(2) + attn.b_O).detach()
            return z

        def dropped(base: Tensor, x: Tensor, l: int) -> Tensor:
            """`x` with its change from `base` passing no gradient in the rows that drop layer l."""
            if mode.drop is None:
                return x
            cut = (mode.drop == l)[:, None, None]
            d = x - base
            return base + torch.where(cut, d.detach(), d)

        def mid_hook(x, hook, l=l):
            st.mid[l] = x.detach()
            if grad:
                x = dropped(st.x[l], x, l)
                st.mid_live[l] = x
            return x

        def mlp_in(x, hook, l=l):
            if grad:
                return x + mode.leaf(("mlp", l), x)
            corr = mode.corrections(site, st, l, slice(l * B + H + KVH, l * B + H + KVH + 1), True)
            return x if corr is None else x + corr[:, 0]

        def resid_post(x, hook, l=l):
            # the MLP's output: TransformerLens fires hook_mlp_out inside some MLPs and not others
            out = x - st.mid[l] if not grad else x - st.mid_live[l]
            st.mlp[l] = out if grad else out.detach()
            return dropped(st.mid_live[l], x, l) if grad else x

        p = f"blocks.{l}"
        hooks += [
            (f"{p}.hook_resid_pre", resid_pre),
            (f"{p}.attn.hook_q", q_hook),
            (f"{p}.attn.hook_k", k_hook),
            (f"{p}.attn.hook_v", v_hook),
            (f"{p}.attn.hook_rot_q", keep(st.q_rot, l)),
            (f"{p}.attn.hook_rot_k", keep(st.k_rot, l)),
            (f"{p}.attn.hook_attn_scores", scores_hook),
            (f"{p}.attn.hook_pattern", keep(st.pattern, l)),
            (f"{p}.attn.hook_z", z_hook),
            (f"{p}.hook_resid_mid", mid_hook),
            (f"{p}.hook_mlp_in", mlp_in),
            (f"{p}.hook_resid_post", resid_post),
        ]

    def final(x, hook):
        if grad:
            leaf = mode.leaf(("logit",), x[:, -1:])
            x = torch.cat([x[:, :-1], x[:, -1:] + leaf], dim=1)
        else:
            corr = mode.corrections(site, st, L, slice(L * B, L * B + 1), True)
            if corr is not None:
                x = torch.cat([x[:, :-1], x[:, -1:] + corr[:, 0, -1:]], dim=1)
        return x

    hooks.append((f"blocks.{L - 1}.hook_resid_post", final))
    return hooks


def _patch_values(site: EdgeSite, mode: _Patch, st: _Run, l: int, z: Tensor) -> Tensor:
    """Head outputs `z` [b, T, H, d] with each corrupted attention edge's values taken from the old
    run: z + sum over its keys of pattern x (v_old - v) (the pattern already reads the old keys)."""
    off = ~mode.att[:, l][:, :, site.groups][..., site.groups]  # [b, H, key, query]
    if not bool(off.any()):
        return z
    g = site.model.n_heads // site.model.n_kv_heads
    ns = site.prefix.n_slots
    dv = (site.old.v[l] - st.v[l]).repeat_interleave(g, dim=2)  # [b, T, H, d]
    w = st.pattern[l][..., ns:] * off.transpose(-1, -2).to(z.dtype)  # [b, H, q, p]
    return z + torch.einsum("bhqp,bphe->bqhe", w, dv)


def _softcap(x: Tensor, cap: float | None) -> Tensor:
    return x if not cap or cap <= 0 else cap * torch.tanh(x / cap)


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


def edge_site(model: KVModel, pair: Pair, *, metric: Metric = logit_diff) -> EdgeSite:
    """`pair` prepared for edge patching and scoring: the prefix prefilled once, both runs captured."""
    require(model, "hook_attn_scores", "edge-level circuits")
    require(model, "weights", "edge-level circuits")
    if len(pair.old.ids) != len(pair.new.ids):
        raise BadArgument("the pair's prompts differ in length; edge patching needs aligned prompts")
    start, grp = groups_of(model, pair)
    differ = [p for p, (a, b) in enumerate(zip(pair.old.ids, pair.new.ids)) if a != b]
    if differ and differ[0] < start:
        raise BadArgument(f"the prompts differ at position {differ[0]}, before the changed field at {start}")
    with torch.no_grad():
        prefix = prefill(model, list(pair.new.ids), upto=start) if start > 0 else Notebook.empty(model)
    pos = torch.arange(start, len(pair.new.ids))
    site = EdgeSite(
        model=model,
        pair=pair,
        graph=edge_graph(model),
        prefix=prefix,
        ids_old=list(pair.old.ids[start:]),
        ids_new=list(pair.new.ids[start:]),
        pos=pos,
        groups=torch.tensor(grp),
        metric=metric,
        old=_Run(),
        new=_Run(),
        ld_old=0.0,
        ld_new=0.0,
    )
    with torch.no_grad():
        for name, ids in (("old", site.ids_old), ("new", site.ids_new)):
            ld, st = site._forward(_Mode(), ids)
            setattr(site, name, st)
            setattr(site, f"ld_{name}", float(ld[0]))
    site.forwards = 0
    return site


# --- scores --------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class EdgeScores:
    """One method's score of every edge of one pair (recovery units), and what it cost."""

    method: str
    scores: np.ndarray
    forwards: int
    backwards: int
    steps: int = 1


def score_edges(
    site: EdgeSite, method: str = "eap-ig", *, steps: int = 16, chunk: int = 4, keys: str = "changed"
) -> EdgeScores:
    """Every edge's score by `method` ("eap", "eap-ig", "atp*", "atp*-gd"); see the module docstring.

    `keys`: how AtP*'s exact-key step recomputes a patched softmax: "changed" (the changed keys'
    terms swapped in) or "whole" (every key again, the reference way `kvnotes bench edges` times
    beside it). The same scores up to float64 rounding."""
    if keys not in EXACT_KEYS:
        raise BadArgument(f"keys must be one of {', '.join(EXACT_KEYS)}, got {keys!r}")
    if method not in (*METHODS, GRADDROP):
        raise BadArgument(
            f"unknown edge-scoring method {method!r}; choose one of {', '.join((*METHODS, GRADDROP))}"
        )
    if steps < 1:
        raise BadArgument(f"steps must be at least 1, got {steps}")
    f0, b0 = site.forwards, site.backwards
    if method == GRADDROP:
        scores = _graddrop(site, keys)
        steps = 1
    else:
        if method == "eap-ig":
            alphas = (torch.arange(steps, dtype=torch.float64) + 0.5) / steps
        else:
            alphas = torch.ones(1, dtype=torch.float64)
            steps = 1
        acc = _Accumulator(site, keys)
        for a in range(0, len(alphas), chunk):
            part = alphas[a : a + chunk]
            grads, st = _gradients(site, _Grad(part, site.old.emb))
            acc.add(grads, st, len(part), exact_keys=(method == "atp*"))
        scores = acc.result(len(alphas)) / site.effect * -1.0
    return EdgeScores(
        method=method,
        scores=scores,
        forwards=site.forwards - f0,
        backwards=site.backwards - b0,
        steps=steps,
    )


def _gradients(site: EdgeSite, mode: _Grad) -> tuple[dict, _Run]:
    """One gradient run: the metric summed over rows, differentiated at every leaf."""
    with torch.enable_grad():
        score, st = site._forward(mode)
        names = list(mode.leaves)
        grads = torch.autograd.grad(score.sum(), [mode.leaves[n] for n in names], allow_unused=True)
    site.backwards += 1
    return dict(zip(names, grads)), st


def _graddrop(site: EdgeSite, keys: str = "changed") -> np.ndarray:
    """AtP* with GradDrop: row m of one forward at the new run drops layer m's outputs from the
    backward; each row's AtP* scores, their magnitudes averaged over the layers that do not cut the
    edge's reader off (module docstring)."""
    L = site.graph.n_layers
    drop = torch.arange(L)
    grads, st = _gradients(site, _Grad(torch.ones(L, dtype=torch.float64), site.old.emb, drop))
    dst_layer = _reader_layers(site.graph)
    total = np.zeros(len(site.graph))
    for m in range(L):
        acc = _Accumulator(site, keys)
        acc.add({k: None if v is None else v[m : m + 1] for k, v in grads.items()}, _row(st, m), 1, True)
        total += np.where(dst_layer == m, 0.0, np.abs(acc.result(1)))
    terms = np.where(dst_layer < L, L - 1, L)
    return total / terms / abs(site.effect)


def _reader_layers(graph: EdgeGraph) -> np.ndarray:
    """Each edge's reader's layer (the logit's: the number of layers)."""
    _, dl = graph.layers()
    return np.asarray(dl)


def _row(st: _Run, m: int) -> _Run:
    """Row `m` of what a batched forward left behind."""

    def cut(d: dict) -> dict:
        return {k: v[m : m + 1] for k, v in d.items()}

    return _Run(
        emb=None if st.emb is None else st.emb[m : m + 1],
        **{f: cut(getattr(st, f)) for f in _Run.__dataclass_fields__ if f != "emb"},
    )


class _Accumulator:
    """Sums, over gradient runs, each edge's estimated change of the metric when corrupted alone."""

    def __init__(self, site: EdgeSite, keys: str = "changed"):
        self.site = site
        self.change = _exact_change if keys == "changed" else _exact_change_whole
        gr = site.graph
        self.res = torch.zeros(gr.n_readers, gr.n_writers, len(GROUPS), dtype=torch.float64)
        self.att = torch.zeros(gr.n_layers, gr.n_heads, len(GROUPS), len(GROUPS), dtype=torch.float64)
        self.kv_exact = None
        self._deltas = _writer_deltas(site)  # [W, T, d]: each writer's input change, new -> old

    def add(self, grads: dict, st: _Run, rows: int, exact_keys: bool) -> None:
        site, gr = self.site, self.site.graph
        L, H, KVH = gr.n_layers, gr.n_heads, gr.n_kv_heads
        B, g = gr.block, H // KVH
        ns = site.prefix.n_slots
        onehot = torch.nn.functional.one_hot(site.groups, len(GROUPS)).to(torch.float64)  # [T, G]
        D = self._deltas.double()
        with torch.no_grad():
            # residual edges: delta_w . grad_r summed over each group's positions
            for l in range(L):
                ga = grads[("attn", l)].double().sum(0)  # [H + KVH, T, d]
                gm = grads[("mlp", l)].double().sum(0)[None]  # [1, T, d]
                rows_g = torch.cat([ga, gm])  # readers of layer l
                self.res[l * B : (l + 1) * B] += torch.einsum("wtd,rtd,tg->rwg", D, rows_g, onehot)
            gl = torch.zeros(1, site.n_tokens, D.shape[-1], dtype=torch.float64)
            gl[0, -1] = grads[("logit",)].double().sum(0)[0]
            self.res[L * B :] += torch.einsum("wtd,rtd,tg->rwg", D, gl, onehot)
            # attention edges, linear: the scores' and the values' gradients
            for l in range(L):
                q = st.q_rot[l].detach().double()  # [b, T, H, d]
                k_new = site.new.k_rot[l][0].double().repeat_interleave(g, 1)  # [T, H, d]
                k_old = site.old.k_rot[l][0].double().repeat_interleave(g, 1)
                attn = site.model.tl.blocks[l].attn
                ds = torch.einsum("bqhe,phe->bhqp", q, k_old - k_new) / float(attn.attn_scale)
                cap = site.model.cfg.attn_scores_soft_cap
                if cap and cap > 0:
                    s = st.scores[l].detach().double()[..., ns:]
                    ds = ds * (1 - (s / cap) ** 2)
                gs = grads[("scores", l)]
                gs = torch.zeros_like(ds) if gs is None else gs.double()[..., ns:]
                term = gs * ds  # [b, H, q, p]
                gz = grads[("z", l)].double()  # [b, T, H, d]
                dv = (site.old.v[l][0] - site.new.v[l][0]).double().repeat_interleave(g, 1)  # [T, H, d]
                pat = st.pattern[l].detach().double()[..., ns:]  # [b, H, q, p]
                term = term + pat * torch.einsum("bqhe,phe->bhqp", gz, dv)
                if exact_keys:
                    term = term * 0  # replaced below by the exact softmax
                self.att[l] += torch.einsum("bhqp,pk,qg->hkg", term, onehot, onehot)
            if exact_keys:
                self._exact_keys(grads, st)

    def _exact_keys(self, grads: dict, st: _Run) -> None:
        """AtP*'s QK fix: attention edges and residual edges into KV slots, through the exact
        softmax of every query that reads the patched keys; linear from the head outputs on."""
        site, gr = self.site, self.site.graph
        model = site.model
        L, H, KVH = gr.n_layers, gr.n_heads, gr.n_kv_heads
        B, g = gr.block, H // KVH
        ns = site.prefix.n_slots
        onehot = torch.nn.functional.one_hot(site.groups, len(GROUPS)).to(torch.float64)
        D = self._deltas
        for l in range(L):
            attn, W_Q, W_K, W_V = _weights(model, l)
            ln1 = model.tl.blocks[l].ln1
            s_all = site.new.scores[l][0].double()  # [H, T, K]
            v_all = torch.cat(
                [site.prefix.values[l][0].transpose(0, 1), site.new.v[l][0]], dim=0
            ).double()  # [K, KVH, d]
            gz = grads[("z", l)][0].double()  # [T, H, d]
            z = site.new.z[l][0].double()  # [T, H, d]
            q = site.new.q_rot[l][0].double()  # [T, H, d]

            def delta_ld(s_new_keys, v_new_keys, at, base=(s_all, v_all, z, gz)):
                return self.change(*base, s_new_keys, v_new_keys, at, ns, g)

            # attention edges: the old keys and values at gk's positions
            k_old = site.old.k_rot[l][0].double().repeat_interleave(g, 1)
            s_old = _softcap(
                torch.einsum("qhe,phe->hqp", q, k_old) / float(attn.attn_scale),
                model.cfg.attn_scores_soft_cap,
            )
            v_old = site.old.v[l][0].double()
            for gk in range(len(GROUPS)):
                at = site.groups == gk
                if not bool(at.any()):
                    continue
                d = delta_ld(s_old[None], v_old[None], at)[0]  # [H, query]
                self.att[l, :, gk] += torch.einsum("hq,qg->hg", d, onehot)
            # residual edges into KV slots: each writer's change at the slot's input, exactly
            x = site.new.x[l][0]  # [T, d]
            W_writers = [w for w in range(gr.n_writers) if gr.writer_layer(w) < l]
            Dl = D[W_writers]  # [n, T, d]
            n_in = ln1(x[None] + Dl) - ln1(x[None].expand_as(Dl))  # [n, T, d]
            k_raw = site.new.k_raw[l][0]  # [T, KVH, d] before the QK norm and rotation
            dk = torch.einsum("ntd,jde->ntje", n_in, W_K)
            dv = torch.einsum("ntd,jde->ntje", n_in, W_V)
            k2 = _finish_keys(model, l, k_raw[None] + dk, site.pos)  # [n, T, KVH, d]
            k2h = k2.double().repeat_interleave(g, 2)
            s2 = _softcap(
                torch.einsum("qhe,nphe->nhqp", q, k2h) / float(attn.attn_scale),
                model.cfg.attn_scores_soft_cap,
            )
            v2 = site.new.v[l][0].double()[None] + dv.double()
            for gk in range(len(GROUPS)):
                at = site.groups == gk
                if not bool(at.any()):
                    continue
                d = delta_ld(s2, v2, at)  # [n, H, query]
                for j in range(KVH):
                    r = l * B + H + j
                    self.res[r, W_writers, gk] = d[:, j * g : (j + 1) * g].sum((1, 2))

    def result(self, rows: int) -> np.ndarray:
        """Per edge, the summed change divided by the number of runs (IG's mean)."""
        gr = self.site.graph
        out = np.zeros(len(gr))
        r = np.flatnonzero(gr.kind == RESIDUAL)
        t = np.flatnonzero(gr.kind == ATTENTION)
        res = self.res / rows
        att = self.att / rows
        out[r] = res[gr.b[r], gr.a[r], gr.c[r]].numpy()
        out[t] = att[gr.a[t], gr.b[t], gr.c[t], gr.d[t]].numpy()
        return out


def _exact_change(s_all, v_all, z, gz, s_new, v_new, at, ns: int, g: int) -> Tensor:
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


def _exact_change_whole(s_all, v_all, z, gz, s_new, v_new, at, ns: int, g: int) -> Tensor:
    """`_exact_change` the reference way: each patch's softmax recomputed over every key."""
    s = s_all[None].expand(s_new.shape[0], -1, -1, -1).clone()
    sel = at[None, None, None, :] & torch.isfinite(s_all)[None, ..., ns:]
    s[..., ns:] = torch.where(sel, s_new, s[..., ns:])
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    vv = v_all[None].expand(s.shape[0], -1, -1, -1).clone()
    vv[:, ns:][:, at] = v_new[:, at]
    z2 = torch.einsum("nhqk,nkhe->nqhe", p, vv.repeat_interleave(g, dim=2))
    return torch.einsum("nqhe,qhe->nhq", z2 - z[None], gz)


def _finish_keys(model: KVModel, l: int, k: Tensor, pos: Tensor) -> Tensor:
    """Keys `[n, T, KVH, d]` as attention reads them: the QK norm (where the model has one), then RoPE."""
    attn = model.tl.blocks[l].attn
    if model.cfg.use_qk_norm:
        k = attn._apply_qk_norm(k, attn.k_norm)
    return rope.rotate(attn, k.transpose(1, 2), pos).transpose(1, 2)


def _writer_deltas(site: EdgeSite) -> Tensor:
    """Each writer's change at a reader's input when its edge carries the old run's value:
    `[writers, T, d_model]` (a head under a post-attention norm: the change of the normed sum)."""
    gr, old, new, model = site.graph, site.old, site.new, site.model
    out = [old.emb[0] - new.emb[0]]
    for l in range(gr.n_layers):
        dh = (old.heads[l][0] - new.heads[l][0]).permute(1, 0, 2)[None]  # [1, H, T, d]
        out += list(_post_delta(model, l, new.attn_sum[l], dh)[0])
        out.append(old.mlp[l][0] - new.mlp[l][0])
    return torch.stack(out)
