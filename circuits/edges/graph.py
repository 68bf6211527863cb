"""The edge graph of a model: nodes (embeddings, query heads, KV slots, MLPs at each position group,
and the logit) and every edge between them, the same for every pair of the model so that scores
line up (the package docstring says what each edge means)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvnotes.errors import BadArgument, UnsupportedArchitecture
from kvnotes.models.model import KVModel

GROUPS = ("field", "notes", "decision", "other")
FIELD, NOTES, DECISION, OTHER = range(4)
RESIDUAL, ATTENTION = 0, 1

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
    """The model's edge graph (cached on the model). Refused for a model without MLPs: the graph has
    an MLP node in every block (a reader and a writer), which an attention-only model never runs."""
    if model.facts.d_mlp is None:
        raise UnsupportedArchitecture(
            f"edge circuits need an MLP in every block and {model.name} is attention-only; run the "
            "head circuits (kvnotes circuits read_heads,write_heads) or attribution on it instead"
        )
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
