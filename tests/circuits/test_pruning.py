"""Edge pruning on the notebook (`circuits.edges.pruning`): learned hard-concrete masks find the
mixed organisms' designed circuit (a known answer no architecture forces: the organisms carry a
designed weight on each of 14 edges of 294), and its parts are their definitions.

Planted and seen failing: masks that do not reach the K/V slots (the attention edges' shares left
at the new run's value, so only the residual edges are learned) lose the five designed attention
edges and recover 0 (`test_masks_that_miss_the_kv_slots_lose_the_attention_edges`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import circuits.edges as E
from circuits.edges import patcher as patcher_module
from circuits.edges.pruning import (
    PruneSettings,
    deterministic_circuit,
    keep_probability,
    prune_edges,
    sample_masks,
)
from kvnotes.errors import BadArgument
from kvnotes.tasks import load_task
from kvnotes.tasks.sampler import sample
from kvnotes.zoo import load_model
from kvnotes.zoo.mixed import designed_edges

# The paper's optimiser, shortened for a test: 300 steps, the target reached at 250. Measured on these
# 2 pairs: the 14 designed edges end at log alpha >= 5.5, every other edge at <= -8.3, and the
# deterministic circuit is the designed one (recovery 1.0). A run of 150 steps has not converged
# (3 to 5 designed edges still below others), so 300 is the shortest honest length.
SHORT = PruneSettings(steps=300, warmup=250)
# the designed circuit's recovery: 1 up to float32 rounding of a +-8 logit decision (exact patching
# holds the designed weights within 2.4e-8, tests/circuits/test_edges.py)
RECOVERY = 1e-5


def _sites(name: str):
    m = load_model(name)
    return [E.edge_patcher(m, p) for p in sample(load_task("mixed-organism"), m, 2, seed=1)]


def _designed(sites, share):
    graph = sites[0].graph
    return np.array(sorted(graph.index_of(e) for e in designed_edges(share)))


def test_edge_pruning_keeps_exactly_the_designed_circuit():
    """On the 75% organism (its saturated softmaxes the harder case for a gradient); the planted
    fault below runs on the 25% one, where the same run keeps the designed circuit too."""
    share = 0.75
    sites = _sites("mixed-organism-75")
    run = prune_edges(sites, SHORT)
    want = _designed(sites, share)
    assert np.flatnonzero(run.kept).tolist() == want.tolist()
    others = np.delete(run.log_alpha, want)
    assert run.log_alpha[want].min() > others.max()  # the ranking puts every designed edge first
    assert abs(run.recovery - 1.0) < RECOVERY
    assert run.forwards >= SHORT.steps * len(sites) and run.backwards == SHORT.steps * len(sites)


def test_masks_that_miss_the_kv_slots_lose_the_attention_edges(monkeypatch):
    sites = _sites("mixed-organism-25")
    masks = patcher_module.EdgePatcher._masks

    def no_kv(self, keep):  # the learned shares reach the residual edges only
        res, att = masks(self, keep)
        return res, (att.detach() * 0 if keep.requires_grad else att)

    monkeypatch.setattr(patcher_module.EdgePatcher, "_masks", no_kv)
    run = prune_edges(sites, SHORT)
    graph = sites[0].graph
    attention = [graph.index_of(e) for e in designed_edges(0.25) if e.startswith("KV")]
    assert len(attention) == 5
    top = set(np.argsort(-run.log_alpha)[:14].tolist())
    assert not top.issuperset(attention) and run.recovery < 0.5


def test_the_mask_s_mass_above_zero_is_its_keep_probability():
    """An independent statement of P(z > 0): the share of 200,000 draws above 0, per log alpha."""
    la = torch.tensor([-3.0, -1.0, 0.0, 1.0, 4.0], dtype=torch.float64)
    n = 200_000
    z = sample_masks(la, n, torch.Generator().manual_seed(0))
    share = (z > 0).double().mean(0)
    p = keep_probability(la)
    sd = torch.sqrt(p * (1 - p) / n)
    assert bool(((share - p).abs() < 5 * sd + 1e-9).all()), (share, p)
    assert bool(((z == 0).any(0) & (z == 1).any(0))[1:4].all())  # both ends reached with mass
    assert float(z.min()) >= 0.0 and float(z.max()) <= 1.0


def test_the_deterministic_circuit_is_the_expected_count_of_largest_log_alphas():
    la = np.array([10.0, -10.0, 3.0, -10.0, 8.0, -10.0])
    kept = deterministic_circuit(la)
    n = round(float(keep_probability(torch.as_tensor(la)).sum()))
    assert n == 3 and kept.tolist() == [True, False, True, False, True, False]


@pytest.mark.parametrize(
    "bad",
    [dict(steps=0), dict(steps=10, warmup=11), dict(target=1.5), dict(lr=0.0)],
)
def test_bad_settings_are_refused(bad):
    with pytest.raises(BadArgument):
        PruneSettings(**bad)


def test_no_pairs_is_refused():
    with pytest.raises(BadArgument, match="at least one pair"):
        prune_edges([], SHORT)
