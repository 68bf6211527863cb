"""ACDC on the notebook (`circuits.edges.acdc`): its visiting order is its definition (reverse
topological, each node's incoming edges together, latest source first); a forward that starts at the
lowest block a removed edge reaches equals the whole forward; on the mixed organisms ACDC keeps
exactly the designed circuit, and the threshold sweep scores each designed edge with the largest
threshold below its designed weight (a known answer no architecture forces).

Planted and seen failing (see the issue note): the order not reversed fails the order test; the
threshold compared on the signed change (removal that lowers recovery always "passes") keeps none
of the designed edges and fails both organism tests."""

from __future__ import annotations

import numpy as np
import pytest

import circuits.edges as E
from circuits.edges import patcher as patcher_module
from circuits.edges.acdc import acdc, acdc_scores, visiting_order
from kvnotes.errors import BadArgument
from kvnotes.tasks import load_task
from kvnotes.tasks.sampler import sample
from kvnotes.zoo import load_model
from kvnotes.zoo.mixed import designed_edges
from tests.helpers import get_model

# The designed weights hold to float32 rounding (exact patching: within 2.4e-8 of each, tests/circuits/
# test_edges.py); the thresholds sit at least 0.02 from every weight, so 1e-6 decides nothing.
RECOVERY = 1e-6


@pytest.fixture(scope="module", params=["mixed-organism-25", "mixed-organism-75"])
def mixed(request):
    m = load_model(request.param)
    share = 0.25 if request.param.endswith("25") else 0.75
    return share, [E.edge_patcher(m, p) for p in sample(load_task("mixed-organism"), m, 4, seed=1)]


def test_the_visiting_order_is_reverse_topological_with_each_node_s_edges_together():
    graph = E.edge_graph(get_model("tiny-llama"))
    order = visiting_order(graph)
    assert sorted(order.tolist()) == list(range(len(graph)))  # every edge once
    where = np.empty(len(graph), dtype=np.int64)
    where[order] = np.arange(len(order))
    for e in range(len(graph)):  # every edge out of e's destination is visited before e
        out = np.flatnonzero(graph.src == graph.dst[e])
        assert (where[out] < where[e]).all(), graph.labels[e]
    dst = graph.dst[order]
    changes = np.flatnonzero(dst[1:] != dst[:-1])
    assert len(changes) == len(set(dst.tolist())) - 1  # each destination's edges in one run
    assert graph.nodes[dst[0]].kind == "logit"


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-gqa"])
def test_a_forward_started_at_the_first_block_a_removed_edge_reaches_is_the_whole_forward(name, monkeypatch):
    """Rows that corrupt only edges read from block l on: the forward resumed at l (the clean run's
    residual in, the blocks below not run) gives the recovery the whole forward gives."""
    from tests.circuits.test_edges import _site

    site = _site(get_model(name))
    layer = site._edge_layer
    rng = np.random.default_rng(0)
    for start in range(1, site.graph.n_layers + 1):
        rows = rng.random((6, len(site.graph))) > 0.3
        rows[:, layer < start] = True  # nothing below `start` corrupted
        assert site.first_layer(rows) == start or not (~rows).any()
        resumed = site.patch(rows)
        monkeypatch.setattr(patcher_module.EdgePatcher, "first_layer", lambda self, keep: 0)
        whole = site.patch(rows)
        monkeypatch.undo()
        # float32 forwards in another batch shape: recoveries agree to ~1e-6 of the pair's effect
        assert np.abs(resumed - whole).max() < 1e-5, (start, resumed, whole)


def test_acdc_keeps_exactly_the_designed_circuit(mixed):
    """Every edge outside the designed circuit moves nothing and goes; every designed edge moves the
    decision by its designed weight (>= 0.075) and stays at tau = 0.03; the circuit recovers 1."""
    share, sites = mixed
    run = acdc(sites, 0.03)
    labels = sites[0].graph.labels
    assert {labels[i] for i in np.flatnonzero(run.kept)} == set(designed_edges(share))
    assert abs(run.recovery - 1) < RECOVERY
    assert run.forwards < len(labels) / 4  # chunks: far fewer forwards than edges


def test_a_run_stopped_at_a_forward_limit_is_the_whole_run_s_first_decisions(mixed):
    """`limit` (the bench's sample of a long run): the edges it visited are decided as the whole run
    decides them, in its order; the rest are kept."""
    _, sites = mixed
    whole, part = acdc(sites, 0.03), acdc(sites, 0.03, limit=3)
    order = visiting_order(sites[0].graph)
    assert part.forwards == 3 and 0 < part.visited < whole.visited == len(order)
    seen = order[: part.visited]
    assert np.array_equal(part.kept[seen], whole.kept[seen]) and part.kept[order[part.visited :]].all()


# thresholds away from every designed weight (0.075, 0.1, 0.225, 0.25, 0.3, 0.75), so no decision
# rests on float rounding
GRID = (0.01, 0.05, 0.09, 0.15, 0.24, 0.28, 0.5)


def test_the_sweep_scores_each_edge_by_the_routes_left_when_acdc_reaches_it(mixed):
    """An edge on one route survives while tau is below that route's weight. The note writer's two
    edges feed the value route and the key route; ACDC prunes from the logit down, so by the time it
    reaches them a route under tau is gone, and they survive while tau is below the stronger route's
    weight, not their own (share): with share 0.25 they score 0.09, not 0.24."""
    share, sites = mixed
    score, runs = acdc_scores(sites[:2], GRID)
    graph = sites[0].graph
    weights = designed_edges(share)
    writer = ("EMB@field->KV0.0@field", "KV0.0@field->L0H0@notes")
    routes = max(weights["L1H1@decision->LOGIT"], weights["L2H0@decision->LOGIT"])
    want = np.zeros(len(graph))
    for label, w in weights.items():
        want[graph.index_of(label)] = max(t for t in GRID if t < (routes if label in writer else w))
    assert [r.tau for r in runs] == list(GRID)
    # exact: each score is one of the grid's own values, assigned, never computed
    assert dict(zip(graph.labels, score)) == pytest.approx(dict(zip(graph.labels, want)), abs=0)


def test_bad_thresholds_are_refused(mixed):
    _, sites = mixed
    with pytest.raises(BadArgument, match="at least 0"):
        acdc(sites, -0.1)
    with pytest.raises(BadArgument, match="positive"):
        acdc_scores(sites, [0.0, 0.1])
    with pytest.raises(BadArgument, match="at least one pair"):
        acdc([], 0.1)
