"""Scrubbing's hypothesis chosen out of sample: each pair's read heads and note slots ranked on the
other half of the pairs, and a random circuit matched to them in region, token class and layers."""

from __future__ import annotations

import importlib
from collections import Counter

import pytest

from circuits import scrubbing
from circuits.heads import all_heads, cross_fitted_heads, ranked_read_heads, read_scores
from kvnotes.prompt import is_delimiter
from probes import make_trials
from probes.causal import note_scores
from probes.controls import cross_fitted_notes

K_HEADS, N_NOTES, DRAWS = 4, 4, 4
scrubbing_module = importlib.import_module("circuits.scrubbing")  # `circuits.scrubbing` is the function


@pytest.fixture(scope="module")
def trials(notes_organism):
    return make_trials(notes_organism, "notes-organism", 8, progress=False)


def _boost(scores, best):
    """Single-slot scores (as cached) with the slot at `best` made by far the largest."""
    return [(100.0 if p == best else r, p) for r, p in scores]


def test_a_trials_own_read_scores_never_choose_its_cross_fitted_heads(trials):
    before, crossed = cross_fitted_heads(trials, K_HEADS)
    assert crossed
    assert before[0] == ranked_read_heads(trials[1::2], K_HEADS)  # the other half's ranking
    assert before[1] == ranked_read_heads(trials[0::2], K_HEADS)
    # make trial 0 say a head outside every current choice is by far the best: its own choice must
    # not move; the odd trials rank on trial 0 and must take it, and so would the in-sample ranking
    own = read_scores(trials[0])
    last = min(range(len(own)), key=lambda j: float(own[j]))
    trials[0].cache["read_scores"] = own.clone()
    trials[0].cache["read_scores"][last] = 100.0
    try:
        after, _ = cross_fitted_heads(trials, K_HEADS)
        in_sample = ranked_read_heads(trials, K_HEADS)
    finally:
        trials[0].cache["read_scores"] = own
    boosted = all_heads(trials[0].model)[last]
    assert boosted not in before[0] and boosted not in before[1]
    assert after[0] == before[0]
    assert all(boosted in after[i] for i in (1, 3, 5, 7))
    assert boosted in in_sample


def test_scrubbing_keeps_the_cross_fitted_circuit_against_a_matched_one(trials, monkeypatch):
    rows_seen = []
    real = scrubbing_module._scrub_rows

    def spy(t, prompt, rows):
        rows_seen.append((t, rows))
        return real(t, prompt, rows)

    monkeypatch.setattr(scrubbing_module, "_scrub_rows", spy)
    heads_before, _ = cross_fitted_heads(trials, K_HEADS)
    notes_before, _ = cross_fitted_notes(trials, N_NOTES)
    # trial 0's own scores changed (a head and a slot boosted): its out-of-sample circuit must not move
    own_heads, own_notes = read_scores(trials[0]), note_scores(trials[0])
    last = min(range(len(own_heads)), key=lambda j: float(own_heads[j]))
    trials[0].cache["read_scores"] = own_heads.clone()
    trials[0].cache["read_scores"][last] = 100.0
    worst = min(own_notes)[1]
    trials[0].cache["note_slots"] = _boost(own_notes, worst)
    try:
        heads_during, _ = cross_fitted_heads(trials, K_HEADS)
        notes_during, _ = cross_fitted_notes(trials, N_NOTES)
        res = scrubbing(
            trials,
            "notes-organism",
            ranked_read_heads(trials, K_HEADS),
            n_notes=N_NOTES,
            n_resamples=1,
            draws=DRAWS,
        )
    finally:
        trials[0].cache["read_scores"] = own_heads
        trials[0].cache["note_slots"] = own_notes
    ran = [trials.index(t) for t, _ in rows_seen]  # one resample each; a trial may find none
    assert res.cross_fitted and 0 in ran and len(ran) >= 6
    labels = [tuple(f"L{l}H{h}" for l, h in heads_before[i]) for i in ran]
    boosted = f"L{all_heads(trials[0].model)[last][0]}H{all_heads(trials[0].model)[last][1]}"
    for i, got, before in zip(ran, res.heads_xfit, labels):
        if i % 2 == 0:  # ranked on the odd trials only: trial 0's own boost never enters
            assert got == before and notes_during[i] == notes_before[i]
        else:  # ranked on the even trials, trial 0 among them
            assert boosted in got and boosted not in before
    j = ran.index(0)
    assert res.note_tokens_xfit[j] == tuple(trials[0].token_strings(notes_before[0]))
    assert res.note_tokens[j][0] == trials[0].token_strings([worst])[0]  # in-sample took the boost
    for name in ("hypothesis_xfit", "matched_circuit"):
        assert res.parts[name].n == len(ran)

    for i, (t, rows) in zip(ran, rows_seen):
        (x_notes, x_heads), matched = rows[-DRAWS - 1], rows[-DRAWS:]
        assert list(x_notes) == notes_during[i] and list(x_heads) == heads_during[i]
        assert [f"L{l}H{h}" for l, h in x_heads] == list(res.heads_xfit[ran.index(i)])
        down = t.pair.downstream()
        free = set(down) - set(x_notes)
        kind = dict(zip(down, (is_delimiter(s) for s in t.token_strings(down))))
        for slots, heads in matched:
            assert set(slots) <= free and len(slots) == len(x_notes)  # in the region, none chosen
            for c in (True, False):  # each token class as often as chosen, where the region has them
                want = sum(kind[p] == c for p in x_notes)
                have = sum(kind[p] == c for p in free)
                assert sum(kind[p] == c for p in slots) >= min(want, have)
            assert Counter(l for l, _ in heads) == Counter(l for l, _ in x_heads)  # the same layers
    # the notes organism reads its notes: the cross-fitted hypothesis keeps more of the effect than
    # the matched circuit (other slots of the same region and kind; on this model the same heads)
    assert res.parts["hypothesis_xfit"].mean > res.parts["matched_circuit"].mean
