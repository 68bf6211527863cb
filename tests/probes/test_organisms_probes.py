"""The probes recover each organism's known answer (docs/organisms.md): the instrument is right.

notes-organism: its decision cannot see the field (window 8 in every layer), so the conclusion
must travel through the slots in between. lookup-organism: one global layer, so no slot after
the field can carry it and the decision reads the field's own slot.
"""

from __future__ import annotations

import pytest

from kvnotes.tasks import RULE
from probes import (
    dissociation,
    false_note_injection,
    field_refresh,
    knockout,
    make_trials,
    note_map,
    notes_transplant,
)

N = 16


@pytest.fixture(scope="module")
def notes_trials(notes_organism):
    return make_trials(notes_organism, "notes-organism", N, progress=False)


@pytest.fixture(scope="module")
def lookup_trials(lookup_organism):
    return make_trials(lookup_organism, "lookup-organism", N, progress=False)


def test_every_pair_is_usable(notes_trials, lookup_trials):
    # trained organisms: the field moves the decision by many logits, the right way
    assert all(t.effect > 5 for t in notes_trials + lookup_trials)


def test_notes_organism_keeps_its_conclusion_in_notes(notes_trials):
    assert field_refresh(notes_trials).mean < 0.1
    assert notes_transplant(notes_trials).mean > 0.9


def test_lookup_organism_reads_the_field(lookup_trials):
    assert field_refresh(lookup_trials).mean > 0.9
    assert notes_transplant(lookup_trials).mean < 0.1


def test_notes_organism_top_notes_lie_inside_the_decision_window(notes_organism, notes_trials):
    window = notes_organism.window(0)
    res = note_map(notes_trials)
    for m in res.maps:
        notes = [(r, d) for r, d, role in zip(m.recovery, m.distance_to_decision, m.role) if role == "note"]
        top_r, top_d = max(notes)
        assert top_r > 1e-3 and 1 <= top_d <= window - 1, m
        # a slot no decision token can attend to cannot matter on its own (up to the rounding of
        # a batched forward against the unbatched reference)
        assert all(abs(r) < 1e-5 for r, d in notes if d >= window), m
    # the field is outside every decision token's window: nothing but the batched forward's
    # float32 rounding (measured 1.6e-8) separates its transplant from the old decision
    assert res["field_slots"].mean == pytest.approx(0.0, abs=1e-6)


def test_knockout_of_the_notes_costs_the_notes_organism_its_decision(notes_trials, lookup_trials):
    notes = knockout(notes_trials)
    assert notes["top"].mean > 0.2 and notes["top"].mean > notes["random"].mean + 0.2
    lookup = knockout(lookup_trials)
    assert abs(lookup["top"].mean) < 0.05  # the lookup organism never reads notes


def test_dissociation_notes_carry_the_flipped_rule(notes_organism, lookup_organism):
    notes = dissociation(make_trials(notes_organism, "notes-organism", N, kind=RULE, progress=False))
    assert notes["notes"].mean > 0.9 and abs(notes["rule_slot"].mean) < 0.1
    lookup = dissociation(make_trials(lookup_organism, "lookup-organism", N, kind=RULE, progress=False))
    assert abs(lookup["notes"].mean) < 0.1 and lookup["rule_slot"].mean > 0.9


def test_false_notes_govern_the_notes_organism_only(notes_trials, lookup_trials):
    notes = false_note_injection(notes_trials)
    assert notes["k8"].mean > 0.5 and notes["follows_k8"].mean > 0.5
    # a few top notes carry what as many random slots of the same region do not
    assert notes["k1"].mean > notes["random_k1"].mean + 0.2
    assert notes["k4"].mean > notes["random_k4"].mean + 0.2
    lookup = false_note_injection(lookup_trials)
    # exact: a fraction of decisions that follow
    assert abs(lookup["k8"].mean) < 0.1 and lookup["follows_k8"].mean == 0.0
