"""The gated organism (kvnotes.zoo.gated): its designed edge circuit comes back from exact patching,
EAP and EAP-IG, each within a tolerance measured here; the construction's facts hold (the effect, the
norms the same in both runs, a query softmax that is not saturated); and two planted faults, the
MLP writing the note with the wrong sign and a query that does not read the field, fail the check.

Tolerances (the largest error on a designed edge over the 4 pairs, measured with
`pytest -s -n 0`, which prints it):
- exact: 7.5e-9 measured (float32 rounding; one float32 ulp of the logit difference, 8, is 6e-8
  recovery units), held to 5e-7;
- EAP-IG (32 steps): 1.8e-3 measured (the field's norm moves along the path), held to 3e-3;
- EAP: 4.3e-2 measured, on EMB@field->KV0.0@field (the sum of both routes' shortfalls: the query
  route's tanh, 0.974 of b, and RMSNorm's linearisation, about 1/(squared norm) per norm crossed),
  held to 6e-2.
Every other edge stays under 4e-3 for every method (measured: 0 exact, 1.3e-3 EAP-IG, 3.8e-3 EAP),
far below the smallest designed weight, 0.4, so the top-k check has a wide margin.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from circuits.edges import edge_patcher, score_edges
from kvnotes.tasks import load_task
from kvnotes.tasks.sampler import sample
from kvnotes.zoo import gated, load_model
from kvnotes.zoo.gated import (
    DIMS,
    GAIN,
    KAPPA,
    NOTE_SHARE,
    designed_edges,
    designed_ld,
    load_gated_organism,
)

N_PAIRS = 4
EXACT_TOL = 5e-7  # measured 7.5e-9; float32 rounding: about 8 ulps of ld (6e-8 recovery each)
EAP_IG_TOL = 3e-3  # measured 1.8e-3; 1.7x above it
EAP_TOL = 6e-2  # measured 4.3e-2; 1.4x above it
LD_TOL = 1e-4  # |ld| = 8 in float32 through three norms: measured 5e-7 off
NORM_TOL = 1e-6  # RMSNorm scales of about 2.9, the same number up to float32 rounding (measured 2.4e-7)


def _sites(model):
    return [edge_patcher(model, p) for p in sample(load_task("mixed-organism"), model, N_PAIRS, seed=1)]


@pytest.fixture(scope="module")
def sites():
    return _sites(load_model("gated-organism"))


def designed_failures(graph, scores: np.ndarray, tol: float) -> tuple[list[str], float]:
    """What a score vector gets wrong about the designed circuit (the top edges at the designed size
    must be exactly the designed ones, each within `tol` of its designed weight), and its largest
    error on a designed edge."""
    want = designed_edges()
    labels = graph.labels
    top = {labels[i] for i in np.argsort(-np.abs(scores), kind="stable")[: len(want)]}
    out = [f"{e} not in the top {len(want)}" for e in sorted(set(want) - top)]
    worst = 0.0
    for e, w in want.items():
        got = float(scores[graph.index_of(e)])
        worst = max(worst, abs(got - w))
        if abs(got - w) > tol:
            out.append(f"{e}: {got:+.4f}, designed {w:+.4f} (±{tol})")
    return out, worst


def _check(sites, method: str, tol: float) -> None:
    worst, off = 0.0, 0.0
    for site in sites:
        scores = site.exact() if method == "exact" else score_edges(site, method, steps=32).scores
        fails, w = designed_failures(site.graph, scores, tol)
        assert fails == [], f"{method}: {fails}"
        worst = max(worst, w)
        rest = np.ones(len(scores), bool)
        rest[[site.graph.index_of(e) for e in designed_edges()]] = False
        off = max(off, float(np.abs(scores[rest]).max()))
    print(f"{method}: largest error on a designed edge {worst:.2e} (tolerance {tol}); other edges {off:.2e}")


def test_exact_patching_finds_the_designed_circuit(sites):
    _check(sites, "exact", EXACT_TOL)


def test_eap_ig_finds_the_designed_circuit(sites):
    _check(sites, "eap-ig", EAP_IG_TOL)


def test_eap_finds_the_designed_circuit(sites):
    _check(sites, "eap", EAP_TOL)


def test_the_shared_kv_head_feeds_only_its_designed_head(sites):
    """Grouped queries: layer 1's KV head 0 serves head 0 (the value route) and head 1 (the query
    route); at the notes only head 0's reading moves the decision (head 1 reads keys and values
    that are the same in both runs). Exact patching: a, and 0."""
    for site in sites:
        s = site.exact()
        gr = site.graph
        assert abs(s[gr.index_of("KV1.0@notes->L1H0@decision")] - NOTE_SHARE) < EXACT_TOL
        assert abs(s[gr.index_of("KV1.0@notes->L1H1@decision")]) < EXACT_TOL


def test_the_designed_weights_add_up():
    """The field's edge into the KV head both routes read carries both routes; each route's edges
    carry its share; the two shares sum to the whole effect. Float sums of closed forms: 1e-12."""
    w = designed_edges()
    a, b = NOTE_SHARE, 1.0 - NOTE_SHARE
    assert abs(w["EMB@field->KV0.0@field"] - (a + b)) < 1e-12
    assert abs(w["L1H0@decision->LOGIT"] + w["L1H1@decision->LOGIT"] - 1.0) < 1e-12
    assert all(abs(v - a) < 1e-12 for e, v in w.items() if "L0H0" in e or "MLP0" in e or "L1H0" in e)
    assert all(abs(v - b) < 1e-12 for e, v in w.items() if "L0H1" in e or "L1H1" in e)
    assert len(w) == 9


def test_the_effect_is_as_designed(sites):
    """ld = ±2 GAIN at either value, so the pair's effect is ±4 GAIN, its sign the new value's."""
    assert abs(designed_ld() - 2 * GAIN) < 1e-12
    for site in sites:
        sign = 1.0 if site.ld_new > 0 else -1.0
        assert abs(site.ld_new - sign * designed_ld()) < LD_TOL
        assert abs(site.ld_old + sign * designed_ld()) < LD_TOL
        assert abs(site.effect - sign * 2 * designed_ld()) < 2 * LD_TOL


def _scales(model, ids) -> dict[str, np.ndarray]:
    """Every RMSNorm's scale at every position of one run."""
    _, cache = model.tl.run_with_cache(torch.tensor([ids]), names_filter=lambda n: n.endswith("hook_scale"))
    return {k: v[0, :, 0].numpy() for k, v in cache.items()}


def test_every_norm_is_the_same_in_both_runs(sites):
    """Every feature is sign-coded or the same in both runs, so each RMSNorm's scale (ln1, ln2 of
    both layers and the final one) is the same at every position in both runs."""
    model = sites[0].model
    for site in sites[:2]:
        old, new = _scales(model, list(site.pair.old.ids)), _scales(model, list(site.pair.new.ids))
        assert len(old) == 5
        for k in old:
            assert np.abs(old[k] - new[k]).max() < NORM_TOL, k


def test_the_query_route_softmax_is_not_saturated(sites):
    """Layer 1 head 1 at the decision puts sigma(KAPPA q) of its weight on the notes in the new run
    (0.599 for pending, 0.401 for shipped: two notes at KAPPA q, the first token at ln 2), not ~1 or
    ~0: EAP sees its query route. Leaks to other slots are e^-30, so 1e-5 holds it."""
    for site in sites:
        want = 1.0 / (1.0 + np.exp(-KAPPA * np.sign(site.ld_new)))  # q = the new value's sign
        pat = site.new.pattern[1][0, 1, -1].numpy()  # [slots + T] of the decision's last token
        ns = site.prefix.n_slots
        notes = [i for i, g in enumerate(site.groups.tolist()) if g == 1]
        on_notes = float(pat[[ns + i for i in notes]].sum())
        assert abs(on_notes - want) < 1e-5
        assert abs(float(pat[0]) - (1 - want)) < 1e-5  # the first token


def _faulty(fault: str):
    """`compile_weights` with `fault` planted: "mlp_sign" (MLP 0 writes -copy into the note) or
    "constant_query" (layer 1 head 1's query reads a constant +1 where it read `qsign`)."""
    compile_weights = gated.compile_weights

    def compile_(tl) -> None:
        compile_weights(tl)
        with torch.no_grad():
            if fault == "mlp_sign":
                tl.blocks[0].mlp.W_out.neg_()
            else:
                q = tl.blocks[1].attn.W_Q
                w = q[1, DIMS["qsign"], gated._A].clone()
                q[1, DIMS["qsign"], gated._A] = 0.0
                q[1, DIMS["one"], gated._A] = w / gated.BALLAST  # `one` is BALLAST everywhere

    return compile_


@pytest.mark.parametrize("fault", ["mlp_sign", "constant_query"])
def test_planted_faults_fail_the_designed_check(fault, monkeypatch):
    """The MLP writing the note with the wrong sign turns the note route against the query route
    (the effect is 4 GAIN (b - a) s, each route's edges score a / (a - b) = 3 or -2); a query that
    does not read the field leaves the query route nothing to move (its edges 0, the note route's 1).
    Both fail the designed check, under exact patching and under EAP-IG."""
    monkeypatch.setattr(gated, "compile_weights", _faulty(fault))
    site = _sites(load_gated_organism())[0]
    for method, tol in (("exact", EXACT_TOL), ("eap-ig", EAP_IG_TOL)):
        scores = site.exact() if method == "exact" else score_edges(site, method, steps=32).scores
        fails, worst = designed_failures(site.graph, scores, tol)
        assert fails, f"{fault} passed the {method} check"
        print(f"{fault} {method}: {len(fails)} failures, e.g. {fails[0]} (largest error {worst:.2f})")


ATP_TOL = 6e-2  # measured 3.8e-2 (EMB@field->KV0.0@field: the query route's tanh upstream of layer 1's query)
QUERY_EDGE = "L0H1@decision->L1H1@decision"  # the designed query edge, weight b = 0.4
QUERY_TOL = 6e-3  # AtP* with the query softmax recomputed: 0.396 measured, short by the final norm's 0.0038


def test_atp_star_finds_the_designed_circuit_and_the_query_edge_exactly(sites):
    """AtP* recomputes the softmax of a query its edge changes (Kramar et al.'s QK fix, query side),
    so the designed query edge scores its weight up to the final norm's linearisation; EAP's gradient
    at the new run gives it 0.382-0.387 (the tanh of a live softmax)."""
    _check(sites, "atp*", ATP_TOL)
    for site in sites:
        got = score_edges(site, "atp*").scores[site.graph.index_of(QUERY_EDGE)]
        assert abs(got - designed_edges()[QUERY_EDGE]) < QUERY_TOL, got


def test_atp_star_without_the_query_side_misses_the_query_edge(sites, monkeypatch):
    """Planted: AtP*'s QK fix for keys only (the query edges left linear, as EAP's)."""
    from circuits.edges import qk

    monkeypatch.setattr(qk, "_query_edges", lambda acc, layer, writers, n_in: None)
    site = sites[0]
    got = score_edges(site, "atp*").scores[site.graph.index_of(QUERY_EDGE)]
    assert abs(got - designed_edges()[QUERY_EDGE]) > QUERY_TOL


def test_graddrop_gives_what_its_definition_leaves_of_each_designed_edge(sites):
    """GradDrop averages |AtP*| over the runs that drop one layer other than the reader's. With two
    layers an edge into a layer-0 reader has one term, layer 1 dropped, and every designed route
    crosses layer 1: that term is ~0 (measured 4e-3, what leaks through the norms). An edge into
    layer 1 or the logit keeps its AtP* magnitude (no drop cuts it). So GradDrop recovers the
    designed circuit's edges into layer 1 and the logit, within AtP*'s tolerance, and cannot see
    the rest on this organism: said in docs/organisms.md."""
    want = designed_edges()
    for site in sites:
        gd = score_edges(site, "atp*-gd").scores
        gr = site.graph
        late = {e for e in want if gr.nodes[gr.dst[gr.index_of(e)]].layer >= 1}
        assert late and len(late) < len(want)
        for e, w in want.items():
            got = gd[gr.index_of(e)]
            assert abs(got - (w if e in late else 0.0)) < (ATP_TOL if e in late else 1e-2), (e, got)
        top = {gr.labels[i] for i in np.argsort(-gd, kind="stable")[: len(late)]}
        assert top == late
