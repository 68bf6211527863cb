"""Every edge's score by one method (`score_edges`), in recovery units: the share of ld_new - ld_old
that corrupting the edge alone removes, estimated from gradients at the new run (EAP), along the
field embeddings' path from old to new (EAP-IG), or with AtP*'s exact softmax where an edge reaches
attention through a key or a query (AtP*, and AtP* with GradDrop); the package docstring says how."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from circuits.edges.graph import ATTENTION, GROUPS, RESIDUAL, EdgeGraph
from circuits.edges.patcher import EdgePatcher, _Grad, _Mode, _PatchGrad, _post_delta, _Run
from circuits.edges.qk import EXACT_KEYS, qk_fix
from kvnotes.engine import hooked
from kvnotes.engine.guard import allow
from kvnotes.errors import BadArgument
from kvnotes.types import Tensor

ATTRIBUTION_METHODS = ("eap", "eap-ig", "atp*")  # what the `edges` analysis runs on every pair
GRADDROP = "atp*-gd"  # AtP* with GradDrop: one backward per layer, so asked for by name (the bench)
# EAP-IG on the activations (MIB's variant): `steps` runs per writer (1 + 3 per layer), by name
IG_ACTIVATIONS = "eap-ig-act"
BY_NAME = (GRADDROP, IG_ACTIVATIONS)


@dataclass(frozen=True, eq=False)
class EdgeScores:
    """One method's score of every edge of one pair (recovery units), and what it cost."""

    method: str
    scores: np.ndarray
    forwards: int
    backwards: int
    steps: int = 1


@allow(torch.float64)  # the scores accumulate in float64 on the model's device, whatever its dtype
def score_edges(
    patcher: EdgePatcher, method: str = "eap-ig", *, steps: int = 16, chunk: int = 4, keys: str = "changed"
) -> EdgeScores:
    """Every edge's score by `method` ("eap", "eap-ig", "atp*", "atp*-gd", "eap-ig-act"); `steps`:
    the integrated-gradient methods' points on each path (midpoint rule).

    `keys`: how AtP*'s exact-softmax step recomputes a patched key's softmax: "changed" (the changed
    keys' terms swapped in) or "whole" (every key again, the reference way `kvnotes bench edges`
    times beside it). The same scores up to float64 rounding."""
    if keys not in EXACT_KEYS:
        raise BadArgument(f"keys must be one of {', '.join(EXACT_KEYS)}, got {keys!r}")
    if method not in (*ATTRIBUTION_METHODS, *BY_NAME):
        raise BadArgument(
            f"unknown edge-scoring method {method!r}; choose one of "
            f"{', '.join((*ATTRIBUTION_METHODS, *BY_NAME))}"
        )
    if steps < 1:
        raise BadArgument(f"steps must be at least 1, got {steps}")
    f0, b0 = patcher.forwards, patcher.backwards
    if method == GRADDROP:
        scores = _graddrop(patcher, keys)
        steps = 1
    elif method == IG_ACTIVATIONS:
        scores = _ig_activations(patcher, steps, chunk)
    else:
        if method == "eap-ig":  # the midpoint rule over the field embeddings' path
            alphas = (torch.arange(steps, dtype=torch.float64, device=patcher.model.device) + 0.5) / steps
        else:
            alphas = torch.ones(1, dtype=torch.float64, device=patcher.model.device)
            steps = 1
        acc = _Accumulator(patcher, keys)
        for a in range(0, len(alphas), chunk):
            part = alphas[a : a + chunk]
            grads, st = _gradients(patcher, _Grad(part, patcher.old.emb))
            acc.add(grads, st, exact=(method == "atp*"))
        scores = acc.result(len(alphas)) / patcher.effect * -1.0
    return EdgeScores(
        method=method,
        scores=scores,
        forwards=patcher.forwards - f0,
        backwards=patcher.backwards - b0,
        steps=steps,
    )


def _gradients(patcher: EdgePatcher, mode: _Mode, start: int = 0) -> tuple[dict, _Run]:
    """One gradient run (from block `start`; below it, the new run's values, and no leaves): the
    metric summed over rows, differentiated at every leaf."""
    assert mode.leaves is not None
    with torch.enable_grad():
        score, st = patcher._forward(mode, start=start)
        names = list(mode.leaves)
        grads = torch.autograd.grad(score.sum(), [mode.leaves[n] for n in names], allow_unused=True)
    patcher.backwards += 1
    return dict(zip(names, grads)), st


def _graddrop(patcher: EdgePatcher, keys: str = "changed") -> np.ndarray:
    """AtP* with GradDrop: row m of one forward at the new run drops layer m's outputs from the
    backward; each row's AtP* scores, their magnitudes averaged over the layers that do not cut the
    edge's reader off (the package docstring)."""
    L = patcher.graph.n_layers
    drop = torch.arange(L)
    ones = torch.ones(L, dtype=torch.float64, device=patcher.model.device)
    grads, st = _gradients(patcher, _Grad(ones, patcher.old.emb, drop))
    dst_layer = _reader_layers(patcher.graph)
    total = np.zeros(len(patcher.graph))
    for m in range(L):
        acc = _Accumulator(patcher, keys)
        acc.add({k: None if v is None else v[m : m + 1] for k, v in grads.items()}, st.row(m), exact=True)
        total += np.where(dst_layer == m, 0.0, np.abs(acc.result(1)))
    terms = np.where(dst_layer < L, L - 1, L)
    return total / terms / abs(patcher.effect)


def _ig_activations(patcher: EdgePatcher, steps: int, chunk: int) -> np.ndarray:
    """EAP-IG on the activations (MIB's EAP-IG-activations; per component as Marks et al. 2024
    integrate): for each writer (the embeddings; per layer its KV slots, its heads, its MLP), `steps`
    runs in which that writer's edges alone carry old + a (new - old), a at the midpoints of [0, 1],
    every other edge the new run's value and everything downstream recomputed; an edge's score is its
    writer's change . the gradient at its reader, averaged over its own writer's runs. So the scores
    of one writer's edges add up to what patching all of them removes (completeness, per writer, up
    to the midpoint rule's error), which EAP-IG on the inputs holds only for the embeddings'."""
    gr = patcher.graph
    alphas = (np.arange(steps, dtype=np.float64) + 0.5) / steps
    acc = _Accumulator(patcher)
    out = np.zeros(len(gr))
    for edges in _writers(gr):
        acc.res.zero_()
        acc.att.zero_()
        for a in range(0, steps, chunk):
            part = alphas[a : a + chunk]
            keep = np.ones((len(part), len(gr)))
            keep[:, edges] = part[:, None]
            mode = _PatchGrad(*patcher._masks(torch.as_tensor(keep)))
            grads, st = _gradients(patcher, mode, start=patcher.first_layer(keep))
            acc.add(grads, st, exact=False)
        out[edges] = acc.result(steps)[edges]
    return out / patcher.effect * -1.0


def _writers(graph: EdgeGraph) -> list[np.ndarray]:
    """The edges out of each writer whose outputs EAP-IG on the activations interpolates together:
    the embeddings, and per layer its KV slots (its attention edges), its heads, its MLP."""
    H, res = graph.n_heads, graph.kind == RESIDUAL
    out = [np.flatnonzero(res & (graph.a == 0))]
    for l in range(graph.n_layers):
        w0 = 1 + l * (H + 1)
        out.append(np.flatnonzero((graph.kind == ATTENTION) & (graph.a == l)))
        out.append(np.flatnonzero(res & (graph.a >= w0) & (graph.a < w0 + H)))
        out.append(np.flatnonzero(res & (graph.a == w0 + H)))
    return [e for e in out if len(e)]


def _reader_layers(graph: EdgeGraph) -> np.ndarray:
    """Each edge's reader's layer (the logit's: the number of layers)."""
    _, dl = graph.layers()
    return np.asarray(dl)


class _Accumulator:
    """Sums, over gradient runs, each edge's estimated change of the metric when corrupted alone:
    residual [readers, writers, groups] and attention [layer, head, key group, query group]."""

    def __init__(self, patcher: EdgePatcher, keys: str = "changed"):
        self.patcher, self.keys = patcher, keys
        gr = patcher.graph
        here = dict(dtype=torch.float64, device=patcher.model.device)
        self.res = torch.zeros(gr.n_readers, gr.n_writers, len(GROUPS), **here)
        self.att = torch.zeros(gr.n_layers, gr.n_heads, len(GROUPS), len(GROUPS), **here)
        self.deltas = writer_deltas(patcher)  # [W, T, d]: each writer's input change, new -> old
        self.onehot = torch.nn.functional.one_hot(patcher.groups, len(GROUPS)).to(**here)  # [T, G]

    def add(self, grads: dict, st: _Run, *, exact: bool) -> None:
        """One gradient run's rows: linear in every edge, or (`exact`, AtP*) with the edges that
        reach attention through a key or a query through their exact softmax instead."""
        with torch.no_grad():
            self._residual(grads)
            if exact:
                qk_fix(self, grads)
            else:
                self._attention(grads, st)

    def _residual(self, grads: dict) -> None:
        """Residual edges: the writer's change . the reader's input gradient, summed over each group."""
        gr, patcher = self.patcher.graph, self.patcher
        L, B = gr.n_layers, gr.block
        D = self.deltas.double()
        for l in range(L):
            if ("attn", l) not in grads:  # a run resumed above layer l: no reader of it was read
                continue
            ga = grads[("attn", l)].double().sum(0)  # [H + KVH, T, d]
            gm = grads[("mlp", l)].double().sum(0)[None]  # [1, T, d]
            readers = torch.cat([ga, gm])  # the readers of layer l
            self.res[l * B : (l + 1) * B] += torch.einsum("wtd,rtd,tg->rwg", D, readers, self.onehot)
        gl = torch.zeros(1, patcher.n_tokens, D.shape[-1], dtype=torch.float64, device=D.device)
        gl[0, -1] = grads[("logit",)].double().sum(0)[0]
        self.res[L * B :] += torch.einsum("wtd,rtd,tg->rwg", D, gl, self.onehot)

    def _attention(self, grads: dict, st: _Run) -> None:
        """Attention edges, linear: through the scores' gradient (the keys' change) and the head
        outputs' (the values' change). Head h reads KV head h // g (`repeat_interleave`)."""
        patcher, gr = self.patcher, self.patcher.graph
        g, ns = gr.n_heads // gr.n_kv_heads, patcher.prefix.n_slots
        cap = patcher.model.facts.attn_scores_soft_cap
        for l in range(gr.n_layers):
            if ("z", l) not in grads:  # a run resumed above layer l
                continue
            q = st.q_rot[l].detach().double()  # [b, T, H, d]
            k_new = patcher.new.k_rot[l][0].double().repeat_interleave(g, 1)  # [T, H, d]
            k_old = patcher.old.k_rot[l][0].double().repeat_interleave(g, 1)
            scale = float(hooked(patcher.model).blocks[l].attn.attn_scale)
            ds = torch.einsum("bqhe,phe->bhqp", q, k_old - k_new) / scale
            if cap and cap > 0:  # through the softcap: d/dx cap tanh(x / cap) = 1 - tanh^2
                s = st.scores[l].detach().double()[..., ns:]
                ds = torch.where(torch.isfinite(s), ds * (1 - (s / cap) ** 2), 0.0)  # masked: no term
            gs = grads[("scores", l)]
            term = 0 * ds if gs is None else gs.double()[..., ns:] * ds  # [b, H, q, p]
            dv = (patcher.old.v[l][0] - patcher.new.v[l][0]).double().repeat_interleave(g, 1)  # [T, H, d]
            pat = st.pattern[l].detach().double()[..., ns:]  # [b, H, q, p]
            term = term + pat * torch.einsum("bqhe,phe->bhqp", grads[("z", l)].double(), dv)
            self.att[l] += torch.einsum("bhqp,pk,qg->hkg", term, self.onehot, self.onehot)

    def result(self, rows: int) -> np.ndarray:
        """Per edge, the summed change divided by the number of runs (IG's mean)."""
        gr = self.patcher.graph
        out = np.zeros(len(gr))
        r = np.flatnonzero(gr.kind == RESIDUAL)
        t = np.flatnonzero(gr.kind == ATTENTION)
        res = self.res / rows
        att = self.att / rows
        out[r] = res[gr.b[r], gr.a[r], gr.c[r]].numpy()
        out[t] = att[gr.a[t], gr.b[t], gr.c[t], gr.d[t]].numpy()
        return out


def writer_deltas(patcher: EdgePatcher) -> Tensor:
    """Each writer's change at a reader's input when its edge carries the old run's value:
    `[writers, T, d_model]` (a head under a post-attention norm: the change of the normed sum)."""
    gr, old, new, model = patcher.graph, patcher.old, patcher.new, patcher.model
    out = [old.emb[0] - new.emb[0]]
    for l in range(gr.n_layers):
        dh = (old.heads[l][0] - new.heads[l][0]).permute(1, 0, 2)[None]  # [1, H, T, d]
        out += list(_post_delta(model, l, new.attn_sum[l], dh)[0])
        out.append(old.mlp[l][0] - new.mlp[l][0])
    return torch.stack(out)
