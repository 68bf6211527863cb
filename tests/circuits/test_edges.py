"""Edge-level circuits: edge patching is exact (every edge in = the new run, none = the old run, a
node's out-edges = patching the node, a KV slot's out-edges = patching its keys and values) on every
tiny variant and on Gemma; the scores find the mixed organisms' designed circuit with its designed
weights, and planted faults (no QK fix, a flipped sign, values left unpatched) fail that check."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

import circuits.edges as E
from circuits.edge_circuits import EdgeCircuits, analyse_edges
from circuits.edges import patcher as patcher_module
from circuits.edges import qk, scores
from circuits.edges.choose import greedy_circuit, greedy_order, matched_random, sizes_for
from kvnotes.cli import main
from kvnotes.engine import run
from kvnotes.errors import BadArgument
from kvnotes.tasks import load_task
from kvnotes.tasks.sampler import sample
from kvnotes.zoo import load_model
from kvnotes.zoo.mixed import designed_edges
from probes import make_trials
from tests.helpers import MODEL_NAMES, get_model

# Patched and plain forwards differ in batch shape, so float32 matmuls round differently: measured
# ≤ 2e-6 logits on decisions of magnitude ≤ 10; 1e-4 logits is far below any edge's effect tested.
LOGITS = 1e-4


def _site(model, task="order-cancel", i=0, seed=0):
    pairs = sample(load_task(task), model, i + 1, seed=seed)
    return E.edge_patcher(model, pairs[i])


def _ld(site, hooks):
    _, out = run(
        site.model,
        site.prefix,
        site.ids_new,
        site.pos,
        write=False,
        hooks=hooks,
        logits_at=(int(site.pos[-1]),),
        vocab=site.pair.answers,
    )
    return float(out.last[0, 0] - out.last[0, 1])


def _check_exact(site):
    gr, n = site.graph, len(site.graph)
    eff = site.effect
    every, none = site.patch(np.stack([np.ones(n, bool), np.zeros(n, bool)]))
    assert abs((every - 1) * eff) < LOGITS and abs(none * eff) < LOGITS
    H = site.model.n_heads
    g = H // site.model.n_kv_heads
    at = site.groups == E.FIELD
    for l in sorted({0, site.model.n_layers - 1}):
        # every out-edge of head (l, 0) corrupted = that head's output taken from the old run
        w = 1 + l * (H + 1)
        keep = np.ones(n, bool)
        keep[(gr.kind == E.RESIDUAL) & (gr.a == w)] = False

        def z(t, hook, l=l):
            t = t.clone()
            t[:, :, 0] = site.old.z[l][:, :, 0]
            return t

        ref = _ld(site, [(f"blocks.{l}.attn.hook_z", z)])
        assert abs(site.patch(keep[None])[0] * eff + site.ld_old - ref) < LOGITS
        # every out-edge of the KV slot (l, 0) at the field = its keys and values from the old run
        keep = np.ones(n, bool)
        keep[(gr.kind == E.ATTENTION) & (gr.a == l) & (gr.b // g == 0) & (gr.c == E.FIELD)] = False

        def kv(name, l=l):
            def f(t, hook):
                t = t.clone()
                t[:, at, 0] = getattr(site.old, name)[l][:, at, 0]
                return t

            return f

        hooks = [(f"blocks.{l}.attn.hook_k", kv("k_raw")), (f"blocks.{l}.attn.hook_v", kv("v"))]
        ref = _ld(site, hooks)
        assert abs(site.patch(keep[None])[0] * eff + site.ld_old - ref) < LOGITS
        # every out-edge of MLP l corrupted = that MLP's output taken from the old run
        keep = np.ones(n, bool)
        keep[(gr.kind == E.RESIDUAL) & (gr.a == w + H)] = False
        mid: dict = {}

        def keep_mid(t, hook, mid=mid):
            mid["x"] = t
            return t

        def old_mlp(t, hook, l=l, mid=mid):
            return mid["x"] + site.old.mlp[l]

        hooks = [(f"blocks.{l}.hook_resid_mid", keep_mid), (f"blocks.{l}.hook_resid_post", old_mlp)]
        ref = _ld(site, hooks)
        assert abs(site.patch(keep[None])[0] * eff + site.ld_old - ref) < LOGITS


# every variant with an MLP in each block; the edge graph has an MLP node per block
WITH_MLP = [n for n in MODEL_NAMES if n != "tiny-attn-only"]


@pytest.mark.parametrize("name", WITH_MLP)
def test_edge_patching_is_exact_on_every_variant(name):
    _check_exact(_site(get_model(name)))


def test_edge_circuits_refuse_an_attention_only_model_before_any_compute(monkeypatch):
    """The graph has an MLP node in every block; an attention-only model is refused, in one line
    naming what runs instead, before the pairs are prefilled."""
    from circuits.edge_circuits import EdgesConfig, _run_edges
    from kvnotes.analysis.registry import Context
    from kvnotes.engine import backend_of
    from kvnotes.errors import UnsupportedArchitecture

    model = get_model("tiny-attn-only")
    monkeypatch.setattr(backend_of(model), "forward", lambda *a, **k: pytest.fail("a forward ran"))
    with pytest.raises(UnsupportedArchitecture, match="attention-only.*read_heads"):
        _run_edges(Context(model=model, task=None), EdgesConfig(n=2))


def test_edge_patching_is_exact_on_gemma(gemma):
    _check_exact(_site(gemma))


@pytest.mark.parametrize("name", WITH_MLP)
def test_a_patch_that_forgets_the_values_is_caught(name, monkeypatch):
    """Planted fault: attention edges swap only the keys. The KV-slot check must fail."""
    monkeypatch.setattr(patcher_module, "_old_values", lambda site, mode, st, l, z: z)
    with pytest.raises(AssertionError):
        _check_exact(_site(get_model(name)))


# --- the mixed organisms: the designed circuit, its weights ---------------------------------------
def designed_failures(graph, scores: np.ndarray, share: float, tol: float = 0.05) -> list[str]:
    """What a score vector gets wrong about the designed circuit: the top edges at the designed size
    must be exactly the designed ones, each within `tol` of its designed weight (signed)."""
    want = designed_edges(share)
    labels = graph.labels
    top = {labels[i] for i in np.argsort(-np.abs(scores), kind="stable")[: len(want)]}
    out = [f"{e} not in the top {len(want)}" for e in sorted(set(want) - top)]
    for e, w in want.items():
        got = scores[graph.index_of(e)]
        if abs(got - w) > tol:
            out.append(f"{e}: {got:+.3f}, designed {w:+.3f}")
    return out


@pytest.fixture(scope="module", params=["mixed-organism-25", "mixed-organism-75"])
def mixed_sites(request):
    m = load_model(request.param)
    share = 0.25 if request.param.endswith("25") else 0.75
    return share, [E.edge_patcher(m, p) for p in sample(load_task("mixed-organism"), m, 4, seed=1)]


# Measured on these 4 pairs of each organism: exact patching within 2.4e-8 of every designed weight
# (float32 rounding of a decision of +-8 logits), EAP-IG at 16 steps within 7.4e-4 (-25) and 2.2e-3
# (-75: the midpoint rule on the saturated softmaxes). Held to 1e-6 and 4e-3.
EXACT_DESIGNED, IG_DESIGNED = 1e-6, 4e-3


def test_exact_patching_and_eap_ig_find_the_designed_circuit(mixed_sites):
    share, sites = mixed_sites
    for site in sites:
        assert designed_failures(site.graph, site.exact(), share, tol=EXACT_DESIGNED) == []
        ig = E.score_edges(site, "eap-ig", steps=16).scores
        assert designed_failures(site.graph, ig, share, tol=IG_DESIGNED) == []


def test_atp_star_finds_the_circuit_and_underweights_only_what_feeds_a_key_through_a_head(mixed_sites):
    """AtP* recomputes the softmax where a patched key enters it, but linearises from a head's output on:
    the field's two edges into the note writer L0H0 feed the layer-2 keys through L0H0's output, where
    the saturated softmax has no gradient, so they get only the value route's share(1 - k)."""
    share, sites = mixed_sites
    k = 0.6
    for site in sites:
        got = designed_failures(site.graph, E.score_edges(site, "atp*").scores, share)
        assert got == [
            f"EMB@field->KV0.0@field: {share * (1 - k):+.3f}, designed {share:+.3f}",
            f"KV0.0@field->L0H0@notes: {share * (1 - k):+.3f}, designed {share:+.3f}",
        ]


def test_planted_faults_fail_the_designed_check(mixed_sites, monkeypatch):
    share, sites = mixed_sites
    site = sites[0]
    # without the QK fix AtP* is plain EAP: the key route scores nothing, so it drops out of the top
    monkeypatch.setattr(scores, "qk_fix", lambda acc, grads: None)
    no_fix = E.score_edges(site, "atp*").scores
    assert any("not in the top" in f for f in designed_failures(site.graph, no_fix, share))
    monkeypatch.undo()
    # scored with the wrong sign: the same edges, every weight negative
    flipped = -E.score_edges(site, "eap-ig", steps=16).scores
    fails = designed_failures(site.graph, flipped, share)
    assert len(fails) == len(designed_edges(share)) and not any("not in the top" in f for f in fails)


def test_plain_eap_misses_the_key_route(mixed_sites):
    share, sites = mixed_sites
    s = E.score_edges(sites[0], "eap").scores
    gr = sites[0].graph
    assert abs(s[gr.index_of("KV2.0@notes->L2H0@decision")]) < 1e-3  # saturated softmax: no gradient


# --- GradDrop and AtP*'s false-negative bound -----------------------------------------------------
def _graddrop_failures(site) -> list[str]:
    """Where AtP* with GradDrop is not what its definition gives: a reader at layer l gets gradient
    only through layers >= l, so dropping an earlier layer leaves its AtP* score as it is, dropping
    its own cuts it off; the mean of |AtP*_m| over the other layers, each AtP*_m from a run of its own."""
    L = site.graph.n_layers
    gd = E.score_edges(site, "atp*-gd").scores
    plain = np.abs(E.score_edges(site, "atp*").scores)
    dl = E.edge_graph(site.model).layers()[1]
    per = []
    for m in range(L):  # one forward and backward each, dropping layer m: independent of the batch
        grads, st = scores._gradients(
            site, patcher_module._Grad(torch.ones(1, dtype=torch.float64), site.old.emb, torch.tensor([m]))
        )
        acc = scores._Accumulator(site)
        acc.add(grads, st, exact=True)
        per.append(np.abs(acc.result(1)) / abs(site.effect))
    per = np.stack(per)  # [L, edges]
    want = np.array(
        [sum(per[m, e] for m in range(L) if m != dl[e]) / (L - 1 if dl[e] < L else L) for e in range(len(gd))]
    )
    fails = []
    late = dl >= L - 1
    if not np.allclose(gd[late], plain[late], atol=GRAD_TOL):
        fails.append("last-layer and logit edges differ from |AtP*|")
    if not np.allclose(gd, want, atol=GRAD_TOL):
        fails.append(f"GradDrop off its definition by {np.abs(gd - want).max():.2e}")
    if np.allclose(gd[~late], plain[~late], atol=GRAD_TOL):
        fails.append("dropping layers changed nothing")
    return fails


def _strongest(model, n=6):
    """The pair of the first `n` whose change moves the decision most (scores divide by it)."""
    pairs = sample(load_task("order-cancel"), model, n, seed=0)
    site = max((E.edge_patcher(model, p) for p in pairs), key=lambda s: abs(s.effect))
    assert abs(site.effect) > 1e-3, "no pair moves the decision: nothing to score"
    return site


# the batched rows and single runs differ by float32 rounding (~1e-7 recovery units measured)
GRAD_TOL = 1e-5


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma3", "tiny-gqa"])
def test_graddrop_is_its_definition(model):
    m = load_model(model)
    site = _strongest(m)
    assert _graddrop_failures(site) == []


def test_graddrop_check_fails_on_a_layer_off_by_one(monkeypatch):
    site = _strongest(load_model("tiny-llama"))
    real = scores._reader_layers
    monkeypatch.setattr(scores, "_reader_layers", lambda gr: real(gr) - 1)  # drops the wrong layer's term
    assert any("differ from |AtP*|" in f for f in _graddrop_failures(site))


def test_block_bound_of_a_lone_edge_is_its_exact_effect_and_the_blocks_cover_the_rest():
    from circuits.edges.faithfulness import block_bound

    site = _strongest(load_model("tiny-llama"))
    ex = site.exact()
    rng = np.random.default_rng(0)
    order = np.argsort(-np.abs(ex))
    scores = np.zeros(len(ex))
    scores[order[:-1]] = 1.0  # every edge verified but the weakest-scored one: its blocks are itself
    lone = block_bound(site, scores, len(ex) - 1, rng, levels=3)
    assert lone.unverified.tolist() == [int(np.argsort(-np.abs(scores), kind="stable")[-1])]
    assert abs(lone.bound[0] - abs(ex[lone.unverified[0]])) < 1e-4  # float32 patches, as LOGITS
    bb = block_bound(site, ex, 20, rng, levels=4)
    assert bb.rows == 2 + 4 + 8 + 16 and len(bb.unverified) == len(ex) - 20
    assert np.isfinite(bb.bound).all() and (bb.bound >= 0).all()
    assert set(bb.verified.tolist()) == set(np.argsort(-np.abs(ex), kind="stable")[:20].tolist())
    # exact: shares of a count (every bound is below inf, none below 0)
    assert bb.ruled_out(np.inf) == 1.0 and bb.ruled_out(0.0) == 0.0


# --- circuits and the analysis --------------------------------------------------------------------
def test_circuit_helpers():
    gr = E.edge_graph(load_model("mixed-organism-25"))
    n = len(gr)
    assert sizes_for(n)[0] == 0 and sizes_for(n)[-1] == n
    rng = np.random.default_rng(0)
    scores = rng.normal(size=n)
    g = greedy_circuit(gr, scores, 10)
    assert g.sum() == 10
    reached = {int(i) for i, nd in enumerate(gr.nodes) if nd.kind == "logit"}
    for e in np.flatnonzero(g):  # grown from the logit: each edge's destination already reached
        assert int(gr.dst[e]) in reached or int(gr.dst[e]) in {int(gr.src[x]) for x in np.flatnonzero(g)}
        reached.add(int(gr.src[e]))
    # the heap's order equals the plain definition: each step the reachable edge of largest |score|
    # (lowest index among ties; a third of the scores tied at 0)
    tied = np.where(rng.random(n) < 0.3, 0.0, scores)
    reach, order = np.zeros(len(gr.nodes), bool), []
    reach[[i for i, nd in enumerate(gr.nodes) if nd.kind == "logit"]] = True
    taken = np.zeros(n, bool)
    while (cand := np.flatnonzero(reach[gr.dst] & ~taken)).size:
        e = cand[np.argmax(np.abs(tied[cand]))]
        taken[e], reach[gr.src[e]] = True, True
        order.append(e)
    assert greedy_order(gr, tied).tolist() == order


def _bin_by_label(label: str) -> tuple:
    """An edge's bin read from its label alone, not from `match_bins`: the edge's kind (a KV slot's
    read by its head is an attention edge), its source and destination layers (the embeddings -1,
    the logit past the last layer) and their position groups."""
    import re

    def end(x: str) -> tuple:
        if x == "LOGIT":
            return (10**6, None)
        name, group = x.split("@")
        m = re.fullmatch(r"EMB|MLP(\d+)|L(\d+)H\d+|KV(\d+)\.\d+", name)
        assert m, label
        return (next((int(v) for v in m.groups() if v is not None), -1), group)

    src, dst = label.split("->")
    (sl, sg), (dl, dg) = end(src), end(dst)
    return ("attention" if src.startswith("KV") else "residual", sl, dl, sg, dg)


def test_the_match_bins_are_kind_layers_and_groups_read_from_the_labels():
    """Two edges share a bin exactly when they share kind, source and destination layer and source
    and destination group, as their labels say: a bin definition that dropped the groups (or any
    part) would merge bins, and the random baseline would draw edges from regions the circuit
    never touches."""
    from circuits.edges.choose import match_bins

    gr = E.edge_graph(load_model("mixed-organism-25"))
    bins = match_bins(gr).tolist()
    hand = [_bin_by_label(lab) for lab in gr.labels]
    assert len(set(hand)) > 20  # many bins, so merging any two shows
    assert len(set(zip(hand, bins))) == len(set(hand)) == len(set(bins))  # the same partition


def test_matched_random_circuits_are_uniform_within_the_circuit_s_bins():
    """The fair baseline: per bin (kind, source/destination layer and group) as many edges as the
    circuit has there, each edge of the bin equally likely, the circuit's own edges included."""
    from circuits.edges.choose import match_bins

    gr = E.edge_graph(load_model("mixed-organism-25"))
    n, rng = len(gr), np.random.default_rng(0)
    bins = match_bins(gr)
    c = np.zeros(n, bool)
    c[np.argsort(-rng.normal(size=n))[:15]] = True
    draws = np.stack([matched_random(gr, c, rng) for _ in range(4000)])
    want = np.bincount(bins[c], minlength=bins.max() + 1)
    for r in draws[:50]:  # the same make-up as the circuit, bin by bin
        assert np.array_equal(np.bincount(bins[r], minlength=bins.max() + 1), want)
    assert draws[:, c].any(), "circuit edges must be drawable"
    # each edge of a bin the circuit uses is drawn with probability need / bin size; 4000 draws give
    # a binomial standard error of at most 0.008, so 0.04 (5 sigma) cannot fail by chance
    freq = draws.mean(0)
    for b in np.unique(bins[c]):
        members = bins == b
        assert np.abs(freq[members] - want[b] / members.sum()).max() < 0.04
    assert not draws[:, ~np.isin(bins, bins[c])].any()  # nothing from a bin the circuit does not use
    assert matched_random(gr, np.ones(n, bool), rng).all()  # the whole graph's match is the whole graph


def test_exact_key_change_equals_the_whole_softmax_recomputed():
    """AtP*'s exact-key change swaps only the changed keys' terms into the new run's softmax; it
    must equal the softmax recomputed over every key (float64: within 1e-12 of a change of order 1),
    with masked keys, grouped KV heads and scores above the run's maximum."""

    whole = qk.whole_softmax
    gen = torch.Generator().manual_seed(0)
    for H, kvh, ns, T, n in ((4, 1, 7, 9, 5), (4, 2, 0, 6, 3), (2, 2, 3, 5, 1)):
        g, d = H // kvh, 8
        s_all = torch.randn(H, T, ns + T, generator=gen, dtype=torch.float64) * 3
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        s_all[..., ns:] = s_all[..., ns:].masked_fill(~causal, -torch.inf)
        v_all = torch.randn(ns + T, kvh, d, generator=gen, dtype=torch.float64)
        z = torch.randn(T, H, d, generator=gen, dtype=torch.float64)
        gz = torch.randn(T, H, d, generator=gen, dtype=torch.float64)
        s_new = torch.randn(n, H, T, T, generator=gen, dtype=torch.float64) * 3 + 6  # above the max
        v_new = torch.randn(n, T, kvh, d, generator=gen, dtype=torch.float64)
        for at in (torch.arange(T) % 3 == 1, torch.arange(T) == T - 1, torch.ones(T, dtype=torch.bool)):
            got = qk.changed_keys(s_all, v_all, z, gz, s_new, v_new, at, ns, g)
            want = whole(s_all, v_all, z, gz, s_new, v_new, at, ns, g)
            assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()


def test_an_unknown_exact_key_way_is_refused_before_any_forward(mixed_sites):
    site = mixed_sites[1][0]
    before = site.forwards
    with pytest.raises(BadArgument, match="keys must be one of changed, whole"):
        E.score_edges(site, "atp*", keys="some")
    assert site.forwards == before


def test_the_analysis_on_the_mixed_organism():
    m = load_model("mixed-organism-25")
    trials = make_trials(m, "mixed-organism", n=6, progress=False)
    r = analyse_edges(trials, steps=8, draws=4)
    assert isinstance(r, EdgeCircuits) and r.n_edges == len(E.edge_graph(m))
    f = r.curves["faithfulness"]
    assert f.points[0].mean == pytest.approx(0, abs=1e-6) and f.points[-1].mean == pytest.approx(1, abs=1e-6)
    assert r.curves["random"].points[-1].mean == pytest.approx(1, abs=1e-6)
    # out of sample, the designed circuit (14 edges, 5% of the graph) keeps all; matched random
    # circuits, drawn fairly, keep what their size and bins give them: a figure that varies over
    # draws and pairs, so its CI has width, well below the circuit's
    assert r.parts["faithfulness_auc"].mean > 0.9
    rnd = r.parts["random_auc"]
    assert rnd.ci[1] - rnd.ci[0] > 0.005 and rnd.ci[1] < r.parts["faithfulness_auc"].mean
    assert r.parts["rho_eap_ig"].mean > r.parts["rho_eap"].mean
    top = {row["edge"] for row in r.tables["edges"][:14]}
    assert top == set(designed_edges(0.25))
    assert "other half" in r.circuits_note
    assert EdgeCircuits.from_dict(r.to_dict()).to_dict() == r.to_dict()


def test_circuits_edges_command(tmp_path, capsys):
    out = tmp_path / "edges.json"
    rc = main(
        [
            "circuits",
            "edges",
            "--model",
            "mixed-organism-75",
            "--n",
            "2",
            "--ig-steps",
            "4",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    d = json.loads(out.read_text())["results"]["edges"]
    assert {"faithfulness", "random", "greedy", "graph"} <= set(d)
    printed = capsys.readouterr().out
    assert "edges.faithfulness_auc" in printed
    # every edge was patched here, so exhaustive patching's time is measured, not estimated; where a
    # sample was patched, its rows say so (a figure extrapolated from k edges never reads as measured)
    assert "edges.exhaustive_seconds" in printed and "estimated" not in printed
    r = EdgeCircuits.from_dict({"name": "edges", **d})
    sampled = replace(
        r, recall_over="a random 64 per pair and each method's top 40", cost={"exact": {"edges": 80}}
    )
    rows = dict(sampled.rows())
    label = f" (estimated from 80 of {r.n_edges} edges patched)"
    assert f"edges.exhaustive_seconds{label}" in rows and f"edges.speedup{label}" in rows
    assert not any("estimated" in k for k in rows if "rho" in k or "faithfulness" in k)


def test_a_bad_edge_method_is_refused_before_the_model_loads(capsys):
    with pytest.raises(SystemExit) as e:
        main(["circuits", "edges", "--model", "org/no-such-model", "--edge-method", "eap2"])
    assert e.value.code == 2
    assert "eap-ig" in capsys.readouterr().err
