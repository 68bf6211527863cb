"""`kvnotes bench edges`: every method timed beside exact edge patching of the same pairs, its
agreement with it, and AtP*'s false-negative bound counted against the exact effects."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from circuits.edge_bench import BENCH_METHODS, EdgeBenchReport, edge_bench
from kvnotes.cli import main
from tests.helpers import get_model


@pytest.fixture(scope="module")
def tiny():
    return get_model("tiny-llama")


def test_every_edge_patched_and_every_method_beside_it(tiny):
    r = edge_bench(tiny, "order-cancel", 6, steps=4, top=10, repeats=1, progress=False)
    assert r.pairs >= 1 and not r.projected and r.exact_edges == r.n_edges
    assert [p.method for p in r.results] == list(BENCH_METHODS)
    for p in r.results:
        assert -1 <= p.rho <= 1 and 0 <= p.recall <= 1
        assert p.speedup == pytest.approx(r.exhaustive_s / p.seconds, rel=1e-9)
    assert r.results[1].backwards == 1 and r.results[1].forwards == 1  # 4 IG steps: one chunk of rows
    b = r.bound
    # every edge is patched, so every unverified edge is in the sample: pairs x (edges - 2k)
    assert b["sampled"] == r.pairs * (r.n_edges - 2 * r.top)
    assert 0 <= b["missed"] <= b["sampled"] and b["missed_rate"] <= b["missed_upper"] <= 1
    assert 0 <= b["ruled_out"] <= 1 and b["rows"] == 62
    again = EdgeBenchReport.from_dict(json.loads(json.dumps(r.to_dict())))
    assert again == r
    assert "exhaustive/method" in r.table() and "false-negative bound" in r.table()
    # AtP*'s exact-key step both ways, timed beside each other: the same scores (float64 rounding
    # of sums taken in another order: 1e-9 of the largest score)
    k = r.exact_keys
    assert k["whole_s"] > 0 and k["changed_s"] > 0 and "exact-key step" in r.table()
    assert k["max_diff"] <= 1e-9 * k["max_score"], k
    # on a page: the table as the CLI prints it, with data text escaped
    from dashboards.render import panels

    (p,) = panels(replace(r, task="<img src=x onerror=alert(1)>.toml"))
    assert "&lt;img src=x" in p.html and "<img" not in p.html and "exhaustive/method" in p.html


def test_a_large_graph_is_sampled_and_projected(tiny):
    r = edge_bench(tiny, "order-cancel", 6, steps=2, exact=50, exhaustive=0, top=5, repeats=1, progress=False)
    assert r.projected and 50 <= r.exact_edges <= 50 + 2 * 5 * len(BENCH_METHODS)
    assert r.bound["sampled"] <= r.pairs * 50
    assert np.isfinite(r.exhaustive_s) and r.exhaustive_s > 0


def test_cli_bench_edges(tmp_path, capsys):
    out = tmp_path / "e.json"
    args = ["bench", "edges", "--model", "tiny-llama", "--n", "6", "--repeats", "1", "--ig-steps", "2"]
    assert main([*args, "--json", str(out)]) == 0
    assert "edge scores vs exhaustive edge patching" in capsys.readouterr().out
    assert [p["method"] for p in json.loads(out.read_text())["results"]] == list(BENCH_METHODS)
