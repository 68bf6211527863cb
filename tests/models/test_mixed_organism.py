"""The mixed organisms: both routes open, in a share fixed by construction (kvnotes.models.mixed).

Each known answer in that module's table is checked through the probes, at n = 32 pairs, for both
shares; a probe that patched the wrong slots, layers or K/V would miss them. The bound is the
issue's ±0.05; the construction itself gives them to about 1e-6.
"""

from __future__ import annotations

import json

import pytest

from kvnotes import load_model
from kvnotes.models.mixed import MIXED_ORGANISMS, designed_notes
from probes.causal import field_refresh, note_map, note_scores, notes_transplant
from probes.controls import cross_fitted_notes, false_note_injection, knockout
from probes.trials import make_trials

N = 32
TOL = 0.05


@pytest.fixture(scope="module", params=sorted(MIXED_ORGANISMS))
def case(request):
    name = request.param
    model = load_model(name)
    return MIXED_ORGANISMS[name], make_trials(model, "mixed-organism", N, progress=False)


def test_the_shares_come_back(case):
    share, trials = case
    field = field_refresh(trials).parts["recovery"]
    notes = notes_transplant(trials).parts["kv"]
    assert field.n == notes.n == N
    assert abs(field.mean - (1 - share)) < TOL
    assert abs(notes.mean - share) < TOL
    assert max(abs(v - (1 - share)) for v in field.values) < 1e-4  # per pair, not only on average


def test_the_note_maps_top_slots_are_the_designed_notes(case):
    share, trials = case
    result = note_map(trials)
    for t, m in zip(trials, result.maps):
        notes = designed_notes(t.pair.new)
        assert len(notes) == 2
        by_pos = {p: r for p, r, role in zip(m.positions, m.recovery, m.role) if role == "note"}
        top = sorted(by_pos, key=lambda p: -by_pos[p])[: len(notes)]
        assert sorted(top) == notes
        for p, r in by_pos.items():
            assert abs(r - (share / 2 if p in notes else 0.0)) < 1e-4, (p, r)


def test_knocking_out_the_notes_removes_their_term(case):
    """Fraction lost = share / 2: the notes' term is share x ld_new, the effect 2 x ld_new."""
    share, trials = case
    r = knockout(trials, k=2, draws=4)
    assert abs(r.parts["top"].mean - share / 2) < TOL
    assert abs(r.parts["top_xfit"].mean - share / 2) < TOL


def test_injecting_the_opposite_note_moves_the_decision_by_the_note_share(case):
    share, trials = case
    r = false_note_injection(trials, ks=(1, 2))
    assert abs(r.parts["xfit_k2"].mean - share) < TOL
    assert abs(r.parts["xfit_k1"].mean - share / 2) < TOL
    # the answer follows the injected note exactly when the notes outweigh the field
    assert r.parts["follows_k2"].mean == (1.0 if share > 0.5 else 0.0)


def test_cross_fitting_finds_the_notes_where_decision_offsets_would_not(case):
    """The [vary] values (names, ids) have different token lengths, so a note's offset from the
    decision differs across pairs. Slots lined up by offset (the rule before) pick a non-note on
    some pairs; lined up by token and occurrence they pick the designed notes on every pair."""
    _, trials = case
    chosen, crossed = cross_fitted_notes(trials, 2)
    assert crossed
    assert all(sorted(c) == designed_notes(t.pair.new) for c, t in zip(chosen, trials))

    def by_offset(i: int, t) -> list[int]:
        others = [trials[j] for j in range(len(trials)) if j % 2 != i % 2]
        mean: dict[int, list[float]] = {}
        for o in others:
            d = o.pair.new.span("decision").start
            for r, p in note_scores(o):
                mean.setdefault(d - p, []).append(r)
        d = t.pair.new.span("decision").start
        rank = {off: sum(v) / len(v) for off, v in mean.items()}
        return sorted(t.pair.downstream(), key=lambda p: (-rank.get(d - p, float("-inf")), -p))[:2]

    missed = [i for i, t in enumerate(trials) if sorted(by_offset(i, t)) != designed_notes(t.pair.new)]
    assert missed, "offsets lined up on every pair: this test no longer shows why keys are needed"


def test_probe_all_on_the_command_line(tmp_path, capsys):
    from kvnotes.cli import main

    out = tmp_path / "m25.json"
    main(["probe", "all", "--model", "mixed-organism-25", "--n", "8", "--json", str(out)])
    d = json.loads(out.read_text())
    assert d["task"] == "mixed-organism"
    probes = d["probes"]
    assert abs(probes["field_refresh"]["recovery"]["mean"] - 0.75) < TOL
    assert abs(probes["notes_transplant"]["kv"]["mean"] - 0.25) < TOL
