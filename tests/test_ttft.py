"""The time-to-first-token benchmark: the composed path is exact when the seam covers the chunk,
and the report has the documented JSON shape. (No timing is asserted: speed is a benchmark.)"""

from __future__ import annotations

import json

import pytest

from kvnotes.cli import main
from kvnotes.errors import OutOfRange
from kvnotes.ops import decide, precompile, prefill
from kvnotes.ttft import (
    HOST,
    QUERY,
    SUFFIX,
    EditCostReport,
    TTFTReport,
    _text_ids,
    compose_and_decide,
    edit_cost,
    ttft,
)
from tests.helpers import assert_close, get_model


def test_composed_context_with_a_full_seam_equals_full_prefill(model):
    chunk = _text_ids(model, 40)
    suffix, query = model.encode(SUFFIX, bos=False), model.encode(QUERY, bos=False)
    host = model.encode(HOST)
    full = decide(model, prefill(model, [*host, *chunk, *suffix]), query).last[0]
    composed = compose_and_decide(model, host, precompile(model, chunk), suffix, query, seam=len(chunk))
    assert_close(composed, full, what="seam over the whole chunk = full recompute")


def test_ttft_report_round_trips_with_exponents():
    report = ttft(get_model("tiny-llama"), [128, 256], progress=False)
    assert [p.tokens for p in report.results] == [128, 256]
    assert report.exponent_full is not None and report.exponent_composed is not None
    for p in report.results:  # medians of 3 side-by-side repeats, with their spread
        assert p.repeats == 3 and p.composed_min_s <= p.composed_s <= p.composed_max_s
        assert p.full_min_s <= p.full_s <= p.full_max_s and p.ratio == p.full_s / p.composed_s
        # the null baseline: an unrelated context's logits, never the composed answer's own
        assert p.null_cosine is not None and p.null_cosine < 1.0
    assert TTFTReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report
    assert "growth exponent" in report.table()


def test_lengths_that_do_not_fit_are_named():
    with pytest.raises(OutOfRange, match=r"lengths \[10, 100000\] do not fit"):
        ttft(get_model("tiny-llama"), [10, 128, 100000], progress=False)


def test_cli_bench_ttft_writes_the_documented_json(tmp_path):
    out = tmp_path / "ttft.json"
    assert main(["bench", "ttft", "--model", "tiny-gqa", "--lengths", "128,160", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert {"model", "results", "exponent_composed", "exponent_full"} <= set(d)
    assert all({"tokens", "composed_s", "full_s", "ratio"} <= set(r) for r in d["results"])


def test_edit_cost_moves_the_field_and_round_trips(tmp_path):
    report = edit_cost(get_model("tiny-gemma3"), 300, (0.2, 0.8), progress=False)
    a, b = report.results
    assert a.field_position < b.field_position and a.tokens == b.tokens
    assert a.suffix_tokens > b.suffix_tokens and a.erratum_tokens == b.erratum_tokens
    # suffix recompute is exact, so its answer is full recompute's; the erratum's is measured
    for p in (a, b):
        assert p.suffix_agrees is True and p.suffix_recovery == pytest.approx(1.0, abs=1e-3)
        assert p.erratum_agrees is not None and p.erratum_recovery is not None and p.repeats == 3
    assert EditCostReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report
    out = tmp_path / "cost.json"
    assert main(["bench", "edit-cost", "--model", "tiny-llama", "--tokens", "200", "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())["results"]) == 5
