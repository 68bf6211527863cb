"""Every edge-scoring method by one name, for one pair (`method_scores`): the gradient methods
(`circuits.edges.scores`), exact single-edge patching, ACDC's threshold sweep, edge pruning, and the
ensemble of EAP-IG's and edge pruning's ranks. The benches and the `edges` analysis score through it,
so a method means the same everywhere.

- `exact`: the recovery lost by corrupting each edge alone (`EdgePatcher.exact`);
- `acdc`: each edge's largest surviving tau (`circuits.edges.acdc.acdc_scores`);
- `pruning`: each edge's probability of being kept under its learned mask (`circuits.edges.pruning`,
  `PRUNING`'s schedule);
- `ensemble`: each edge's rank by |score| under EAP-IG and under edge pruning, as fractions of the
  edges, averaged: the recipe of MIB's circuit-track winners (Mueller et al. 2025);
- `eap-ig+acdc`: the same average over EAP-IG and ACDC's sweep (the ensemble kvnotes ran before edge
  pruning existed here, kept beside it).
"""

from __future__ import annotations

import numpy as np
from scipy.stats import rankdata

from circuits.edges.acdc import acdc_scores
from circuits.edges.patcher import EdgePatcher
from circuits.edges.pruning import PruneSettings, prune_edges
from circuits.edges.scores import ATTRIBUTION_METHODS, BY_NAME, score_edges
from kvnotes.errors import BadArgument

# beside the gradient methods: what `method_scores` adds (each one pair at a time)
SEARCHES = ("exact", "acdc", "pruning", "ensemble", "eap-ig+acdc")
ALL = (*ATTRIBUTION_METHODS, *BY_NAME, *SEARCHES)
# each ensemble: its members, whose ranks by |score| it averages
ENSEMBLES = {"ensemble": ("eap-ig", "pruning"), "eap-ig+acdc": ("eap-ig", "acdc")}
# edge pruning's schedule for one pair: the paper's optimiser (`PruneSettings`), 300 steps with the
# target reached at 250, the length at which the mixed organisms' designed circuit is found exactly
# (tests/circuits/test_pruning.py)
PRUNING = PruneSettings(steps=300, warmup=250)


def method_scores(
    patcher: EdgePatcher, method: str, *, steps: int = 8, made: dict[str, np.ndarray] | None = None
) -> np.ndarray:
    """One pair's score of every edge by `method` (`ALL`); `steps`: the integrated-gradient methods'.
    `made`: scores already computed for this pair, by method (an ensemble reuses its members' and
    leaves them there)."""
    if method not in ALL:
        raise BadArgument(f"unknown edge-scoring method {method!r}; choose one of {', '.join(ALL)}")
    made = {} if made is None else made
    if method in made:  # computed already (an ensemble computes its members)
        return made[method]
    if method in ENSEMBLES:
        for m in ENSEMBLES[method]:
            if m not in made:
                made[m] = method_scores(patcher, m, steps=steps)
        return rank_average([made[m] for m in ENSEMBLES[method]])
    if method == "exact":
        return patcher.exact()
    if method == "acdc":
        return acdc_scores([patcher])[0]
    if method == "pruning":
        return prune_edges([patcher], PRUNING).scores
    return score_edges(patcher, method, steps=steps).scores


def rank_average(scores: list[np.ndarray]) -> np.ndarray:
    """Each item's rank by |score| under each score vector, as a fraction of the items, averaged."""
    return np.mean([rankdata(np.abs(np.nan_to_num(s))) / len(s) for s in scores], axis=0)
