"""Controls chosen out of sample: slots ranked on the other half of the pairs, random slots matched
to them in region and token class — against the in-sample choices they replace."""

from __future__ import annotations

import json
import random

import pytest

from kvnotes import load_model
from kvnotes.prompt import is_delimiter
from probes import controls, make_trials
from probes.causal import note_scores
from probes.controls import cross_fitted_notes, false_note_injection, knockout, matched_slots, random_slots


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


# --- headlines out of sample; controls that say what they are -------------------------------------


@pytest.fixture(scope="module")
def across():
    # six pairs across the task's four templates: two templates fall in one half only (0 and 3)
    return make_trials(load_model("tiny-llama"), "order-cancel", 6, progress=False)


def _in_sample_headline(monkeypatch):
    """The headline as it was: the in-sample figure."""
    real = controls.Knockout.of.__func__
    monkeypatch.setattr(
        controls.Knockout, "of", classmethod(lambda cls, **f: real(cls, **{**f, "headline": "top"}))
    )


def _position_reported_as_cross_fitted(monkeypatch):
    """Every pair reported cross-fitted once there are two, whatever ranked its slots."""
    monkeypatch.setattr(controls, "_ranked_there", lambda keys, rank: True)


def _off_class_counted_as_matched(monkeypatch):
    monkeypatch.setattr(controls, "off_class", lambda t, chosen, picked: 0)


def _unpaired(monkeypatch):
    """top_xfit kept on pairs that have no matched control."""
    real = controls.paired
    monkeypatch.setattr(controls, "paired", lambda a, b: (list(a), *real(a, b)[1:]))


def _check_headline(res, in_sample: list[str]):
    d = json.loads(json.dumps(res.to_dict()))
    assert d["headline"] == "top_xfit" and d["in_sample"] == in_sample
    # exact: the JSON headline is a copy of the part's mean
    assert d["mean"] == d["top_xfit"]["mean"] and d["mean"] != d["top"]["mean"]
    rows = dict(res.rows())
    assert "knockout.top_xfit *" in rows and "knockout.top (in-sample)" in rows, list(rows)


@pytest.mark.parametrize("planted", [None, _in_sample_headline])
def test_the_knockout_headline_is_the_cross_fitted_figure(across, monkeypatch, planted):
    if planted:
        planted(monkeypatch)
    res = knockout(across, k=2, draws=2, min_effect=0.0)
    if planted:
        with pytest.raises(AssertionError):
            _check_headline(res, ["top", "random"])
    else:
        _check_headline(res, ["top", "random"])


def test_the_injection_headline_is_the_cross_fitted_figure(across):
    res = false_note_injection(across, ks=(1, 2), min_effect=0.0)
    d = res.to_dict()
    room = max(k for k in (1, 2) if res[f"xfit_k{k}"].n)  # the largest k with a matched control
    assert d["headline"] == f"xfit_k{room}" and d["mean"] == d[f"xfit_k{room}"]["mean"]  # exact: a copy
    assert set(d["in_sample"]) == {"k1", "k2", "follows_k1", "follows_k2", "random_k1", "random_k2"}
    head, *body = [line for line in res.grid() if line]  # k as rows, the figures as columns
    assert "recovery (in-sample)" in head and "xfit (in-sample)" not in head and "xfit " in head
    starred = [line.split()[0] for line in body if "*" in line]
    assert starred == [f"k={room}"], body


@pytest.mark.parametrize("planted", [None, _position_reported_as_cross_fitted])
def test_pairs_ranked_by_position_are_not_reported_as_cross_fitted(across, monkeypatch, planted):
    if planted:
        planted(monkeypatch)
    k = 3
    chosen, crossed = cross_fitted_notes(across, k)
    templates = [t.pair.template for t in across]
    lone = [i for i, c in enumerate(templates) if c not in templates[1 - i % 2 :: 2]]
    assert lone, f"every template falls in both halves ({templates}): nothing here falls back"
    for i in lone:  # no pair of its template in the other half: its slots are the latest ones
        assert chosen[i] == sorted(across[i].pair.downstream(), reverse=True)[:k]
    try:
        assert not crossed and crossed.fallback >= len(lone)
        assert not any(crossed.pairs[i] for i in lone), crossed.pairs
        res = knockout(across, k=k, draws=1, min_effect=0.0)
        assert res.cross_fitted is False and res.cross_fitted_pairs == crossed.pairs
        assert f"{crossed.fallback} by position" in dict(res.rows())["knockout.cross_fitted"]
    except AssertionError:
        if planted:
            return
        raise
    assert not planted, "the planted bug passed"


def _region_classes(t, chosen):
    down = t.pair.downstream()
    free = [p for p in down if p not in chosen]
    cd = sum(map(is_delimiter, t.token_strings(list(chosen))))
    fd = sum(map(is_delimiter, t.token_strings(free)))
    return cd, len(chosen) - cd, fd, len(free) - fd


@pytest.mark.parametrize("planted", [None, _off_class_counted_as_matched])
def test_matched_controls_that_left_their_class_are_counted(across, monkeypatch, planted):
    if planted:
        planted(monkeypatch)
    k, draws = min(len(t.pair.downstream()) for t in across) // 2, 2  # half the smallest region
    xfit, _ = cross_fitted_notes(across, k)
    # greedy matching, class first: the chosen slots of a class beyond the free slots of that
    # class take the other class, once per draw
    want = [0, 0]
    for t, c in zip(across, xfit):
        cd, cw, fd, fw = _region_classes(t, c)
        if fd + fw >= cd + cw:  # else the pair has no matched control
            want[0] += draws * (max(0, cd - fd) + max(0, cw - fw))
            want[1] += draws * (cd + cw)
    assert want[0] > 0, "no control here had to leave its class: choose a larger k"
    res = knockout(across, k=k, draws=draws, min_effect=0.0)
    try:
        assert res.matched_off_class == tuple(want)
        row = dict(res.rows())["knockout.matched off class"]
        assert row == f"{want[0]} of {want[1]} control slots left their token class"
    except AssertionError:
        if planted:
            return
        raise
    assert not planted, "the planted bug passed"


@pytest.mark.parametrize("planted", [None, _unpaired])
def test_cross_fitted_and_matched_figures_run_over_the_same_pairs(across, monkeypatch, planted):
    if planted:
        planted(monkeypatch)
    sizes = sorted(len(t.pair.downstream()) for t in across)
    k = sizes[-1] // 2  # the largest region can be matched, some smaller ones cannot
    assert 2 * k > sizes[0], f"every region has 2k slots ({sizes}): nothing is dropped"
    res = knockout(across, k=k, draws=2, min_effect=0.0)
    x, m, d = res["top_xfit"], res["matched"], res["xfit_minus_matched"]
    try:
        assert m.dropped > 0 and x.dropped == m.dropped == d.dropped and x.n == m.n == d.n
        # 1e-12: a difference of two float64 means of float32 recoveries, formed in the same order
        assert all(abs(a - b - c) < 1e-12 for a, b, c in zip(x.values, m.values, d.values))
    except AssertionError:
        if planted:
            return
        raise
    assert not planted, "the planted bug passed"
