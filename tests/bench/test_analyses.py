"""`kvnotes bench analyses`: the unshared and the shared way give the same numbers (every value
under the results' parts, to 1e-5: float32 rounding of the same sums in other batch shapes), the
check that says so fails on a planted fault, and a report's sections share their prompt pairs."""

from __future__ import annotations

import json
import math

import pytest

import kvnotes.analysis.trials
from kvnotes import ops
from kvnotes.analysis.report import ReportConfig, plan_parts
from kvnotes.batches import sharing
from kvnotes.bench.analyses import (
    RANK_STATISTICS,
    AnalysesReport,
    analyses_bench,
    compare,
    with_preamble,
)
from kvnotes.cli import main
from kvnotes.tasks import load_task, sample
from tests.helpers import get_model

# The two ways sum the same terms in other shapes (a prefill in two pieces, other batches):
# float32 rounding, 1e-7 of a logit. Recoveries divide it by tiny-llama's small effects and
# delimiter_share by a sum of near-zero recoveries (4e-5 measured there, 4e-6 on every recovery).
SAME = 1e-4


@pytest.fixture(scope="module")
def tiny():
    return get_model("tiny-llama")


def test_both_ways_give_the_same_numbers_and_the_exponents(tiny):
    r = analyses_bench(tiny, "order-cancel", ns=(2, 4), preambles=(0, 48), repeats=1, progress=False)
    assert [(p.n, p.preamble) for p in r.results] == [(2, 0), (4, 0), (4, 48)]
    for p in r.results:
        assert p.values > 50 and p.max_diff <= SAME, p
        assert p.unshared_s > 0 and p.shared_s > 0
    assert r.results[2].prompt_tokens >= r.results[1].prompt_tokens + 48
    assert all(isinstance(r.n_exponent[w], float) for w in ("unshared", "shared"))
    assert "speedup" in r.table() and "growth exponent" in r.table()
    # sharing removes matmul work (prefixes computed once, sweeps resumed at their layer): the
    # unshared way does more of it at every size, and the machine's rate is a positive figure
    assert all(p.work_ratio > 1.2 for p in r.results), [p.work_ratio for p in r.results]
    assert r.matmul_gflops > 0 and "matmul rate" in r.table()
    back = AnalysesReport.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back == r


def test_the_same_numbers_check_fails_on_a_planted_fault(tiny, monkeypatch):
    """Every sweep resumed one layer above its lowest patched layer: the shared way's numbers
    move, and the bench says so."""
    real = ops.first_layer
    monkeypatch.setattr(ops, "first_layer", lambda s, n: min(real(s, n) + 1, n - 1))
    r = analyses_bench(tiny, "order-cancel", ns=(2,), repeats=1, progress=False)
    assert r.results[0].max_diff > 1e-3


def test_compare_counts_every_number_and_flags_a_missing_one():
    a, b = {"a": [1.0, 2.0], "meta": {"x": 1}}, {"a": [1.0, 2.5], "meta": {"x": 9}}
    assert compare(a, b) == (2, 0.5, "/a[1]")  # exact: 2.5 - 2.0 is 0.5 in binary floating point
    assert compare({"a": float("nan")}, {"a": float("nan")}) == (1, 0.0, "")  # exact: NaN equals NaN, 0
    assert compare({"a": float("nan")}, {"a": 1.0})[1] == math.inf
    assert compare({"a": 1.0}, {"b": 1.0})[1] == math.inf
    seconds = ({"m": {"erratum.seconds": 1.0}}, {"m": {"erratum.seconds": 2.0}})
    assert compare(*seconds) == (0, 0.0, "")  # exact: nothing compared, the difference is the initial 0
    speedups = (
        {"attribution": {"speedup": [3.0], "activation_seconds": [1.0]}},
        {"attribution": {"speedup": [5.0], "activation_seconds": [2.0]}},
    )  # a timing ratio and a timing
    assert compare(*speedups) == (0, 0.0, "")  # exact: nothing compared
    ranks = {"rho_spearman": [0.5], "a": [1.0]}, {"rho_spearman": [0.0], "a": [1.25]}
    assert compare(*ranks)[2] == "/rho_spearman[0]"  # the rank statistic's step is the largest
    assert compare(*ranks, skip=RANK_STATISTICS) == (1, 0.25, "/a[0]")  # exact: 1.25 - 1.0 in binary


def test_a_preamble_lengthens_the_start_every_prompt_shares(tiny):
    task = load_task("order-cancel")
    longer = with_preamble(tiny, task, 40)
    a, b = sample(task, tiny, 2), sample(longer, tiny, 2)
    assert all(len(y.old) - len(x.old) >= 40 for x, y in zip(a, b))
    assert with_preamble(tiny, task, 0) is task


@pytest.mark.parametrize("shared", [True, False])
def test_a_reports_sections_share_their_prompt_pairs(tiny, monkeypatch, shared):
    calls = []
    real = kvnotes.analysis.trials.make_trials
    monkeypatch.setattr(
        kvnotes.analysis.trials, "make_trials", lambda *a, **k: calls.append(k.get("kind")) or real(*a, **k)
    )
    skip = ("regime", "sae", "scrubbing", "memory_blocks", "agent_loop", "seam_repair")
    cfg = ReportConfig.quick(n=2, skip=skip)
    with sharing(shared):
        for key, part in plan_parts(tiny, [load_task("order-cancel")], cfg, progress=False):
            if key.split("/")[1] in ("probes", "edit", "circuits"):
                part()
    gate = [kind for kind in calls if kind == "gate"]
    assert len(gate) == (1 if shared else 3), calls  # probes, circuits and edit draw the same pairs


def test_cli_bench_analyses(tmp_path, capsys):
    out = tmp_path / "a.json"
    code = main(
        ["bench", "analyses", "--model", "tiny-llama", "--ns", "2", "--repeats", "1", "--json", str(out)]
    )
    assert code == 0
    assert "unshared vs shared" in capsys.readouterr().out
    assert json.loads(out.read_text())["results"][0]["max_diff"] <= SAME
