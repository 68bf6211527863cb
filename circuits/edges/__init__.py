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

Patching (`EdgePatcher.patch`, `circuits.edges.patcher`): a circuit is a set of edges; in the patched run
(on the new prompt) every edge outside it carries the old run's value: a reader's input is the
residual with each corrupted writer's output swapped for the old one (under a post-attention norm,
as Gemma has, the layer's head outputs are mixed before the norm), and a corrupted attention edge
makes that head read the old keys and values at those positions. Every edge in: the new run exactly;
none: the old run (tested against independent runs). It runs through `kvnotes.engine.run` with
hooks, many circuits as rows of one batch.

Scores, in recovery units (the share of ld_new - ld_old that corrupting the edge alone removes):
- `exact`: that patch, one row per edge (`EdgePatcher.exact`);
- `eap` / `eap-ig`: (input change) · (gradient at the reader's input), the gradient at the new run
  (EAP) or averaged over `steps` runs whose field embeddings lie on the straight path from old to new
  (integrated gradients, midpoint rule: Hanna et al. 2024); attention edges through the scores'
  and values' gradients;
- `eap-ig-act`: EAP-IG on the activations (MIB's variant): each writer's own edges interpolated from
  old to new (`steps` midpoints), everything downstream recomputed, the gradient at each reader
  averaged over its writer's runs; one writer's scores add up to its whole patch (per-writer
  completeness), at `steps` gradient runs per writer (1 + 3 per layer), each resumed at the
  writer's own block;
- `atp*`: attribution patching with the QK fix (Kramár et al. 2024) for every edge that reaches
  attention through a key or a query: an attention edge, or a residual edge into a KV slot, has its
  patched keys and values recomputed exactly and the softmax of every query that reads them
  recomputed; a residual edge into a head's query input has those queries and their softmax
  recomputed; only the head outputs' change is linearised (`circuits.edges.qk`); other edges
  (into MLPs and the logit) as EAP at the new run;
- `atp*-gd`: AtP* with GradDrop (Kramár et al. 2024), against cancellation between an edge's direct
  and indirect paths: layer m's attention and MLP outputs let no gradient through (their values
  unchanged), one row per m of one batched forward, and an edge's score is the mean over m of
  |AtP*_m| (m other than the reader's own layer, where the drop cuts the reader off: L - 1 terms;
  the logit's edges, which no layer's drop reaches, L). Unsigned: a magnitude for ranking.

Modules, one idea each: `graph` (the nodes and edges), `patcher` (one pair's two runs and the patching
forward), `scores` (EAP, EAP-IG on the inputs and on the activations, AtP*, GradDrop), `qk` (AtP*'s
exact softmax for keys and queries), `acdc` (ACDC and its threshold sweep), `pruning` (edge pruning's
learned masks), `methods` (every method by one name, the ensemble), `choose` (top, greedy and matched
random circuits), `faithfulness` (cross-fitted curves, CPR and CMD both ways, AtP*'s block bound) and
`positions` (EAP per token position, for peers whose graph has one).
"""

from circuits.edges.graph import (
    ATTENTION,
    DECISION,
    FIELD,
    GROUPS,
    NOTES,
    OTHER,
    RESIDUAL,
    EdgeGraph,
    Node,
    edge_graph,
)
from circuits.edges.patcher import EdgePatcher, edge_patcher, groups_of
from circuits.edges.qk import EXACT_KEYS
from circuits.edges.scores import (
    ATTRIBUTION_METHODS,
    GRADDROP,
    IG_ACTIVATIONS,
    EdgeScores,
    score_edges,
    writer_deltas,
)

__all__ = [
    "ATTENTION",
    "DECISION",
    "EXACT_KEYS",
    "FIELD",
    "GRADDROP",
    "GROUPS",
    "IG_ACTIVATIONS",
    "ATTRIBUTION_METHODS",
    "NOTES",
    "OTHER",
    "RESIDUAL",
    "EdgeGraph",
    "EdgeScores",
    "EdgePatcher",
    "Node",
    "edge_graph",
    "edge_patcher",
    "groups_of",
    "score_edges",
    "writer_deltas",
]
