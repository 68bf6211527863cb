"""auto-circuit 1.0.1 beside kvnotes' edge scores (`kvnotes bench edges --auto-circuit-python`).

auto-circuit runs from its own environment: set KVNOTES_AUTO_CIRCUIT_PYTHON to its python (`kvnotes
auto-circuit-env DIR` makes one; `.ci/run` makes it in the background and points
KVNOTES_AUTO_CIRCUIT_ENV_DONE at a file holding its exit code). Without it the comparison is skipped,
unless KVNOTES_REQUIRE_AUTO_CIRCUIT=1 (CI), where that is a failure. The checks that need no peer
(refusals before any compute, the edge-name mapping, kvnotes' per-position EAP summing to its group
scores) always run.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from circuits.auto_circuit_peer import _our_names, check_peer, peer_pairs, summarise
from circuits.edges import GROUPS, RESIDUAL, edge_graph, edge_patcher, score_edges
from circuits.edges.positions import position_edges, position_scores
from kvnotes import load_model
from kvnotes.analysis.trials import MIN_EFFECT, make_trials, split_by_effect
from kvnotes.errors import BadArgument
from kvnotes.tasks import load_task
from kvnotes.tasks.sampler import sample

# EAP is one linearisation computed by both tools in float32 over the same weights: they differ
# only in summation order (measured 3.5e-6 of the largest score on tiny-llama)
EAP_REL_TOL = 1e-4
# kvnotes' per-position EAP and its group scores are the same float64 products of the same float32
# gradients, summed in another order: measured ≤ 4.4e-16 of scores ≤ 1.8 (tiny-llama, -gqa, -gemma3)
SUM_REL_TOL = 1e-12
# before the field the two prompts are the same tokens, so auto-circuit's clean - corrupt difference
# there is the same float32 ops on the same inputs: measured exactly 0 on tiny-llama
PREFIX_TOL = 1e-7


def _peer_python() -> str:
    python = os.environ.get("KVNOTES_AUTO_CIRCUIT_PYTHON")
    required = os.environ.get("KVNOTES_REQUIRE_AUTO_CIRCUIT") == "1"
    if not python:
        if required:
            pytest.fail("KVNOTES_REQUIRE_AUTO_CIRCUIT=1 but KVNOTES_AUTO_CIRCUIT_PYTHON is not set")
        pytest.skip(
            "no auto-circuit environment: set KVNOTES_AUTO_CIRCUIT_PYTHON (`kvnotes auto-circuit-env DIR`)"
        )
    done = os.environ.get("KVNOTES_AUTO_CIRCUIT_ENV_DONE")
    if done:  # made in the background: wait for it
        deadline = time.monotonic() + 1200
        while not Path(done).exists() and time.monotonic() < deadline:
            time.sleep(2)
        code = Path(done).read_text().strip() if Path(done).exists() else "timeout"
        if code != "0":
            log = Path(done).with_suffix(".log")
            tail = log.read_text()[-3000:] if log.exists() else ""
            pytest.fail(f"making the auto-circuit environment failed ({code}):\n{tail}")
    return python


def test_models_transformer_lens_1_19_cannot_build_are_refused_before_any_compute(tmp_path):
    with pytest.raises(BadArgument, match=r"qk-norm.*--model tiny-llama"):
        check_peer(load_model("tiny-gemma3"), tmp_path / "no-such-python")
    with pytest.raises(BadArgument, match="grouped-query attention"):
        check_peer(load_model("tiny-gqa"), tmp_path / "no-such-python")
    with pytest.raises(BadArgument, match="does not exist.*kvnotes auto-circuit-env"):
        check_peer(load_model("tiny-llama"), tmp_path / "no-such-python")


def test_every_residual_edge_maps_to_auto_circuits_names_and_only_those():
    g = edge_graph(load_model("tiny-llama"))
    names = _our_names(g)
    assert all(bool(ns) == (k == RESIDUAL) for k, ns in zip(g.kind, names))
    flat = {n for ns in names for n in ns}
    L, H = g.n_layers, g.n_heads
    # auto-circuit's factorized graph: every earlier source into every Q/K/V, MLP and the end, less
    # the embeddings straight into the logit (the field is never the decision's position)
    srcs = (
        ["Resid Start"] + [f"A{l}.{h}" for l in range(L) for h in range(H)] + [f"MLP {l}" for l in range(L)]
    )

    def layer(src: str) -> float:  # an MLP follows its layer's heads
        if src == "Resid Start":
            return -1
        if src.startswith("MLP"):
            return int(src.split()[1]) + 0.5
        return int(src[1:].split(".")[0])

    want = set()
    for src in srcs:
        for l in range(L):
            if layer(src) < l:
                want |= {f"{src}->A{l}.{h}.{x}" for h in range(H) for x in "QKV"}
            if layer(src) < l + 0.5:
                want.add(f"{src}->MLP {l}")
        if src != "Resid Start":
            want.add(f"{src}->Resid End")
    assert flat == want


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gqa", "tiny-gemma3"])
def test_per_position_eap_sums_to_the_group_scores(name):
    model = load_model(name)
    site = edge_patcher(model, sample(load_task("order-cancel"), model, 1, seed=0)[0])
    per_pos = position_scores(site)
    assert not per_pos[~position_edges(site)].any()  # nothing where the graph has no edge
    gr = site.graph
    r = np.flatnonzero(gr.kind == RESIDUAL)
    onehot = np.eye(len(GROUPS))[site.groups.numpy()]  # [T, groups]
    summed = np.einsum("rwt,tg->rwg", per_pos, onehot)[gr.b[r], gr.a[r], gr.c[r]]
    want = score_edges(site, "eap").scores[r]
    assert np.abs(summed - want).max() <= SUM_REL_TOL * np.abs(want).max()


@pytest.fixture(scope="module")
def compared():
    python = _peer_python()
    model = load_model("tiny-llama")
    used, _ = split_by_effect(make_trials(model, "order-cancel", 6, seed=0, progress=False), MIN_EFFECT)
    assert used, "tiny-llama gives no usable order-cancel pair at seed 0"
    return peer_pairs(model, [t.pair for t in used[:2]], python, steps=4, repeats=1)


def test_kvnotes_eap_is_auto_circuits_on_the_same_pairs(compared):
    per, peer = compared
    s = summarise(per, peer)
    assert s["parity"] < 1e-4, s  # the two TransformerLens versions compute the same model
    assert s["eap_max_rel_diff"] < EAP_REL_TOL, s
    assert s["cached_max_rel_diff"] < EAP_REL_TOL, s  # auto-circuit's KV-cached way scores the same
    assert s["outside_max"] < 1e-7, s  # what kvnotes leaves out carries nothing there
    assert s["eap_rho"] > 0.999 and s["ig_rho"] > 0.5, s
    assert set(s["seconds"]) >= {"ours-eap", "ours-ig", "theirs-eap-plain", "theirs-eap-cached"}


def test_kvnotes_eap_is_auto_circuits_at_each_token_position(compared):
    per, peer = compared
    s = summarise(per, peer)["positions"]
    assert s["eap_max_rel_diff"] < EAP_REL_TOL and s["eap_rho"] > 0.999, s
    assert s["prefix_max"] < PREFIX_TOL, s  # before the field: edges there, but nothing changes
    assert s["outside_max"] < PREFIX_TOL, s  # from the field on, what kvnotes leaves out carries nothing
    assert all(n > 1000 for n in s["edges"]), s  # every residual edge at every position, not the groups


def test_the_agreement_check_fails_on_a_misaligned_edge(compared):
    per, peer = compared
    planted = [replace(p, ours_eap=np.roll(p.ours_eap, 1)) for p in per]  # every score one edge over
    assert summarise(planted, peer)["eap_max_rel_diff"] > 0.1
    planted = [replace(p, ours_pos=np.roll(p.ours_pos, 1)) for p in per]  # and per position
    assert summarise(planted, peer)["positions"]["eap_max_rel_diff"] > 0.1
