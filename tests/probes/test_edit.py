"""Editing methods: the exact ones are exact, the counts are right, the oracle text is right."""

from __future__ import annotations

import pytest

from probes import make_trials
from probes.edit import ERRATUM, edit_methods, hoisted_text, methods
from tests.helpers import get_model


@pytest.fixture(scope="module")
def result(notes_organism):
    trials = make_trials(notes_organism, "notes-organism", 4, progress=False)
    return trials, edit_methods(trials, ks=(1, 2, 4, 64))


def test_suffix_recompute_is_full_recompute(result):
    _, r = result
    assert all(abs(v - 1.0) < 1e-4 for v in r["suffix"].values)
    assert all(abs(v - 1.0) < 1e-4 for v in r["full"].values)
    assert r["suffix.agree"].mean == 1.0  # exact: a fraction of agreeing decisions


def test_notes_organism_ignores_an_in_place_refresh(result):
    _, r = result
    # exact: a fraction of agreeing decisions
    assert abs(r["refresh"].mean) < 0.1 and r["refresh.agree"].mean == 0.0


def test_selective_over_every_downstream_slot_equals_suffix(result):
    trials, r = result
    for t in trials:
        n_down = len(t.pair.downstream())
        res = methods(t, (n_down,), ERRATUM)
        for rank in ("causal", "deviation"):
            assert abs(res[f"selective_{rank}@{n_down}"][0] - res["suffix"][0]) < 1e-4
    # K larger than the downstream region is skipped, never silently clipped
    assert "selective_causal@64" not in r.parts
    assert r["selective_causal@1"].n == 4 and r["selective_deviation@4"].n == 4


def test_token_counts_order_the_methods(result):
    _, r = result
    assert r["refresh.tokens"].mean < r["suffix.tokens"].mean < r["full.tokens"].mean
    assert r["erratum.tokens"].mean < r["full.tokens"].mean


def test_hoisted_text_moves_the_field_line_before_the_decision():
    t = make_trials(get_model("tiny-llama"), "order-cancel", 1, progress=False)[0]
    text, new = hoisted_text(t), t.pair.new.text
    line = f"order_status: {t.pair.new.values['order_status']}\n"
    assert text.endswith(line + "decision:") and sorted(text) == sorted(new)
    assert text.count(line) == new.count(line)  # moved, not copied
