"""kvnotes' EAP of every residual edge at every computed position (`position_scores`): the terms that
`score_edges(patcher, "eap")` sums over each position group, kept apart so that a tool whose graph has
an edge per token position (auto-circuit's `patchable_model(..., seq_len=...)`) can be compared at
that level (`circuits.auto_circuit_peer`).

Only residual edges split this way. An attention edge `KV{l}.{j}@gk -> L{l}H{h}@gq` joins a key
position to a query position inside one head; a graph whose nodes are a head's inputs and output at
one position (auto-circuit's) has no such edge, so those stay at the group level.

    >>> from kvnotes import load_model
    >>> from kvnotes.tasks import load_task
    >>> from kvnotes.tasks.sampler import sample
    >>> from circuits.edges import edge_patcher
    >>> model = load_model("tiny-llama")
    >>> patcher = edge_patcher(model, sample(load_task("order-cancel"), model, 1, seed=0)[0])
    >>> position_scores(patcher).shape == (patcher.graph.n_readers, patcher.graph.n_writers, patcher.n_tokens)
    True
"""

from __future__ import annotations

import numpy as np
import torch

from circuits.edges.graph import GROUPS, RESIDUAL
from circuits.edges.patcher import EdgePatcher, _Grad
from circuits.edges.scores import _gradients, writer_deltas
from kvnotes.engine.guard import allow


@allow(torch.float64)  # accumulated in float64 on the model's device, as `score_edges`
def position_scores(patcher: EdgePatcher) -> np.ndarray:
    """`[readers, writers, T]`, recovery units: -(writer w's change at position t) · (the metric's
    gradient at reader r's input at t) / effect, at the new run (EAP), for every residual edge of the
    graph at every computed position t (`patcher.pos[t]` in the prompt); 0 where `position_edges` has
    none (a writer after its reader, the embeddings outside the field or straight to the logit, the
    logit before the last position). Summed over a group's positions it is
    `score_edges(patcher, "eap")`'s score of that residual edge."""
    gr = patcher.graph
    L, B, T = gr.n_layers, gr.block, patcher.n_tokens
    here = dict(dtype=torch.float64, device=patcher.model.device)
    grads, _ = _gradients(patcher, _Grad(torch.ones(1, **here), patcher.old.emb))
    D = writer_deltas(patcher).double()  # [W, T, d]
    with torch.no_grad():
        out = torch.zeros(gr.n_readers, gr.n_writers, T, **here)
        for l in range(L):
            ga = grads[("attn", l)].double().sum(0)  # [H + KVH, T, d]: query heads, then KV heads
            gm = grads[("mlp", l)].double().sum(0)[None]  # [1, T, d]
            out[l * B : (l + 1) * B] = torch.einsum("wtd,rtd->rwt", D, torch.cat([ga, gm]))
        gl = grads[("logit",)].double().sum(0)[0]  # [d]: the last position's
        out[L * B, :, T - 1] = torch.einsum("wd,d->w", D[:, T - 1], gl)
        out = out.numpy() * position_edges(patcher) / -patcher.effect
    return out


def position_edges(patcher: EdgePatcher) -> np.ndarray:
    """`[readers, writers, T]` booleans: whether the graph has the residual edge (r, w) at position t
    (one at t's group; the logit's only at the last position, the one it reads)."""
    gr = patcher.graph
    has = np.zeros((gr.n_readers, gr.n_writers, len(GROUPS)), dtype=bool)
    r = gr.kind == RESIDUAL
    has[gr.b[r], gr.a[r], gr.c[r]] = True
    out = has[:, :, patcher.groups.numpy()]
    out[gr.n_layers * gr.block, :, :-1] = False
    return out
