"""Every edge method by one name (`circuits.edges.methods`) and in `kvnotes circuits edges --methods`:
on the mixed organism each one's top 14 edges are the designed circuit (recall@14 against exact
patching 1.0, a known answer), the ensemble is its members' rank average, and a method the analysis
does not know is refused before the model loads."""

from __future__ import annotations

import json

import numpy as np
import pytest

import circuits.edges as E
from circuits.edge_circuits import EXTRA, EdgeCircuits
from circuits.edges.methods import ALL, ENSEMBLES, method_scores, rank_average
from kvnotes.cli import main
from kvnotes.errors import BadArgument
from kvnotes.tasks import load_task
from kvnotes.tasks.sampler import sample
from tests.circuits.test_edges import _site
from tests.helpers import get_model


def test_the_extra_methods_find_the_designed_circuit_through_the_command_line(tmp_path, capsys):
    out = tmp_path / "edges.json"
    args = ["circuits", "edges", "--model", "mixed-organism-75", "--n", "2", "--ig-steps", "4"]
    args += [
        "--recall-k",
        "14",
        "--methods",
        ",".join(EXTRA),
        "--edge-method",
        "ensemble",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    d = json.loads(out.read_text())["results"]["edges"]
    r = EdgeCircuits.from_dict({"name": "edges", **d})
    for key in EXTRA.values():  # the 14 designed edges are the exact top 14 on every pair
        assert r.parts[f"recall_{key}"].mean == pytest.approx(1.0, abs=1e-12), key  # exact: 14 of 14
        assert r.parts[f"{key}_seconds"].n == 2
    assert r.method == "ensemble" and r.parts["faithfulness_auc"].mean > 0.9
    assert r.cost["pruning"]["backwards"] == 300 and r.cost["acdc"]["forwards"] > 1
    printed = capsys.readouterr().out
    assert "pruning" in printed and "acdc" in printed


def test_a_method_the_analysis_does_not_know_is_refused_before_the_model_loads(capsys):
    assert main(["circuits", "edges", "--model", "org/no-such-model", "--methods", "acdc,acdcc"]) == 2
    err = capsys.readouterr().err
    assert "acdcc" in err and "pruning" in err


@pytest.mark.parametrize("name", list(ENSEMBLES))
def test_an_ensemble_is_its_members_rank_average(name):
    # the mixed organism: its members' runs are short (ACDC on tiny-llama's random weights keeps
    # most edges, a forward each) and its scores have ties, which the ranks must share
    m = get_model("mixed-organism-25")
    site = E.edge_patcher(m, sample(load_task("mixed-organism"), m, 1, seed=1)[0])
    made: dict = {}
    got = method_scores(site, name, steps=4, made=made)
    assert set(made) == set(ENSEMBLES[name])  # its members, left for the caller's other rows
    n = len(site.graph)
    by_hand = np.zeros(n)
    for m in ENSEMBLES[name]:  # rank 1 = the smallest |score|; ties share their mean rank
        a = np.abs(made[m])
        for i in range(n):
            by_hand[i] += ((a < a[i]).sum() + ((a == a[i]).sum() + 1) / 2) / n  # exact: ranks of equal floats
    np.testing.assert_allclose(got, by_hand / len(ENSEMBLES[name]), rtol=0, atol=1e-12)
    # by |score|, as fractions: the largest is 1 (exact: thirds of small integers)
    assert rank_average([np.array([3.0, -1.0, -2.0])]).tolist() == pytest.approx(
        [1.0, 1 / 3, 2 / 3], abs=1e-12
    )


def test_an_unknown_method_is_refused_before_any_forward():
    site = _site(get_model("tiny-llama"))
    before = site.forwards
    with pytest.raises(BadArgument, match="unknown edge-scoring method"):
        method_scores(site, "acdcc")
    assert site.forwards == before and "pruning" in ALL and "eap-ig-act" in ALL
    assert isinstance(E.edge_graph(site.model), E.EdgeGraph)
