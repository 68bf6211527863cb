"""Controls chosen out of sample: slots ranked on the other half of the pairs, random slots matched
to them in region and token class — against the in-sample choices they replace."""

from __future__ import annotations

import random

import pytest

from kvnotes import load_model
from kvnotes.prompt import is_delimiter
from probes import make_trials
from probes.causal import note_scores
from probes.controls import cross_fitted_notes, matched_slots, random_slots


@pytest.fixture(scope="module")
def trials():
    # one template: slots line up across pairs only within a template (controls._slot_keys)
    return make_trials(load_model("tiny-llama"), "order-cancel", 6, template=0, progress=False)


def test_a_pairs_own_scores_never_choose_its_cross_fitted_slots(trials):
    before, crossed = cross_fitted_notes(trials, 3)
    assert crossed
    # make pair 0 say its last downstream slot is by far the best: its own choice must not move,
    # the pairs of the other fold (odd indices) rank on pair 0's scores and may
    scores = note_scores(trials[0])
    trials[0].cache["note_slots"] = [(100.0 if p == scores[-1][1] else r, p) for r, p in scores]
    try:
        after, _ = cross_fitted_notes(trials, 3)
    finally:
        trials[0].cache["note_slots"] = scores
    assert after[0] == before[0]
    assert any(after[i] != before[i] for i in (1, 3, 5))


def test_matched_slots_stay_in_the_region_and_class_where_the_complement_does_not(trials):
    t = trials[0]
    down = t.pair.downstream()
    k = len(down)  # ask for as many slots as the region has: the complement must reach outside it
    chosen = down[: k // 2]
    complement = random_slots(t, k, chosen, random.Random(0))
    assert any(p not in down for p in complement)  # what the in-sample control would have drawn
    matched = matched_slots(t, chosen, random.Random(0))
    assert set(matched) <= set(down) - set(chosen) and len(matched) == min(
        len(chosen), len(down) - len(chosen)
    )
    # one delimiter and one word slot chosen: the control draws one of each from the rest of the region
    delims = [p for p, s in zip(down, t.token_strings(down)) if is_delimiter(s)]
    words = [p for p in down if p not in delims]
    assert len(delims) >= 2 and len(words) >= 2
    for seed in range(5):
        got = matched_slots(t, [delims[0], words[0]], random.Random(seed))
        assert got[0] in delims[1:] and got[1] in words[1:]
