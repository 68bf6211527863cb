"""The mixed organisms: both routes open, in a share fixed by construction (kvnotes.zoo.mixed).

Each known answer in that module's table (`designed_answers`) is checked through the probes, at
n = 32 pairs, for both shares. The notes are read through their values at layer 1 and their keys
at layer 2, so a transplant that copies only values, only keys or only the last layer misses a
known part; `test_the_checks_catch_a_transplant_that_misses_keys_or_layers` plants each of those
in the probes and asserts the checks fail. Means are held to ±0.05; where the construction is
exact (every pair gives the same figure, to about 1e-7) each pair is held to 1e-4.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

import probes.causal
from kvnotes import load_model
from kvnotes.analysis.trials import make_trials
from kvnotes.ops import Patch
from kvnotes.tasks.sampler import neutral_notes
from kvnotes.zoo import mixed
from kvnotes.zoo.mixed import (
    KEY_PART,
    LOW_PAIR,
    MIXED_ORGANISMS,
    N_LAYERS,
    ROTARY_BASE,
    ROTARY_DIM,
    designed_answers,
    designed_notes,
    load_mixed_organism,
)
from probes.causal import field_refresh, note_map, note_scores, notes_transplant
from probes.controls import cross_fitted_notes, false_note_injection, knockout

N = 32
TOL = 0.05  # on means: the bound the known answers are held to
EXACT = 1e-4  # per pair: saturated softmaxes leak under 1e-11 a slot; float32 rounding is ~1e-7


@pytest.fixture(scope="module", params=sorted(MIXED_ORGANISMS))
def case(request):
    name = request.param
    model = load_model(name)
    return MIXED_ORGANISMS[name], make_trials(model, "mixed-organism", N, progress=False)


def _close(what: str, values, want: float) -> None:
    """Every value within EXACT of `want`, and their mean within TOL."""
    values = list(values)
    mean = sum(values) / len(values)
    got = f"mean {mean:.4f}" if len(values) > 1 else f"{mean:.4f}"
    assert abs(mean - want) < TOL, f"{what}: {got}, designed {want:.4f} (±{TOL})"
    worst = max(abs(v - want) for v in values)
    assert worst < EXACT, f"{what}: a pair is {worst:.2e} from the designed {want:.4f} (±{EXACT})"


def check_transplant(share: float, trials) -> None:
    """Field refresh, and the notes transplant's K+V, K-only and V-only parts, at their designed
    answers on every pair (K only and V only read different layers, so they differ)."""
    want = designed_answers(share)
    field = field_refresh(trials).parts["recovery"]
    assert field.n == N
    _close("field_refresh.recovery", field.values, want["field_refresh"])
    result = notes_transplant(trials)
    for part in ("kv", "k_only", "v_only"):
        assert result.parts[part].n == N
        _close(f"notes_transplant.{part}", result.parts[part].values, want[part])


def check_note_map(share: float, trials) -> None:
    """The note map: each designed note at share / 2 (and at layer 1, 2 alone at its designed part),
    every other downstream slot at 0, the top slots the designed notes, and each layer's transplant
    of all downstream slots at the share that layer reads; the field's own slots together at 1 - share."""
    want = designed_answers(share)
    result = note_map(trials)
    for l in range(N_LAYERS):
        _close(f"note_map.layer_{l}", result.parts[f"layer_{l}"].values, want[f"layer_{l}"])
    _close(f"note_map.layers_0-{N_LAYERS - 1}", result.parts[f"layers_0-{N_LAYERS - 1}"].values, want["kv"])
    for t, m in zip(trials, result.maps):
        notes = designed_notes(t.pair.new)
        assert len(notes) == 2
        by_pos = {p: r for p, r, role in zip(m.positions, m.recovery, m.role) if role == "note"}
        top = sorted(by_pos, key=lambda p: -by_pos[p])[: len(notes)]
        assert sorted(top) == notes, f"top slots {sorted(top)}, designed notes {notes}"
        for p, r in by_pos.items():
            _close(f"note_map slot {p}", [r], want["note" if p in notes else "other_slot"])
        grid = dict(zip([p for p, role in zip(m.positions, m.role) if role == "note"], m.slot_layer))
        for p in notes:
            for l, r in enumerate(grid[p]):
                _close(f"note_map slot {p} at layer {l}", [r], want[f"note_layer_{l}"])
    _close("note_map.field_slots", result.parts["field_slots"].values, want["field_refresh"])


def test_the_shares_come_back(case):
    check_transplant(*case)


def test_the_note_map_finds_each_note_at_each_layer(case):
    check_note_map(*case)


def test_the_runs_differ_in_the_notes_values_at_layer_1_and_keys_at_layer_2(case):
    """Where the construction puts the difference: at the notes, layer 1's values and layer 2's keys
    (head 0's in the rotated low-frequency pair, head 1's past the rotary dims); nothing else."""
    _, trials = case
    for t in trials:
        idx = t.old_nb.slot_index(designed_notes(t.pair.new))
        for l in range(N_LAYERS):
            dk = (t.old_nb.keys[l] - t.new_nb.keys[l])[0][:, idx].abs()  # [head, note, d_head]
            dv = (t.old_nb.values[l] - t.new_nb.values[l])[0][:, idx].abs()
            if l == 2:
                assert bool((dk[0, :, LOW_PAIR] > 1.0).all()) and bool((dk[1, :, ROTARY_DIM] > 1.0).all())
                assert float(dk[0, :, ROTARY_DIM:].max()) < EXACT  # head 0's is all in the rotated dims
            else:
                assert float(dk.max()) < EXACT, f"layer {l}'s keys at the notes differ"
            if l == 1:
                assert bool((dv[1, :, ROTARY_DIM] > 1.0).all())
            else:
                assert float(dv.max()) < EXACT, f"layer {l}'s values at the notes differ"


def check_far_transplant(model) -> None:
    """With filler the notes sit 400+ tokens before the decision; K+V, K only and V only still at
    their designed answers on every pair."""
    want = designed_answers(MIXED_ORGANISMS[model.name])
    trials = make_trials(model, "mixed-organism", 8, filler=neutral_notes(8), progress=False)
    far = min(t.pair.new.span("decision").start - p for t in trials for p in designed_notes(t.pair.new))
    assert far > 400, f"the notes are only {far} tokens before the decision: add filler"
    result = notes_transplant(trials)
    for part in ("kv", "k_only", "v_only"):
        _close(f"notes_transplant.{part} ({far}+ tokens away)", result.parts[part].values, want[part])


@pytest.mark.parametrize(
    "base, holds", [(ROTARY_BASE, True), (1e4, False)], ids=["base-1e6", "planted-base-1e4"]
)
def test_the_rotated_key_route_stays_saturated_across_the_context(base, holds, monkeypatch):
    """At the organism's RoPE base the low-frequency pair turns under 0.5 rad over 400+ tokens (cos
    0.9), so the key route's softmax stays saturated; planted at the usual base, 1e4, it turns past
    a right angle there and the key route, K only and K+V with it, misses."""
    monkeypatch.setattr(mixed, "ROTARY_BASE", base)
    model = load_mixed_organism("mixed-organism-25")
    if holds:
        check_far_transplant(model)
        return
    with pytest.raises(AssertionError) as caught:
        check_far_transplant(model)
    print(f"rotary base {base:g}: {str(caught.value).splitlines()[0]}")


def planted(bug: str, n_layers: int):
    """`Patch` as `probes.causal` calls it, with `bug` planted: every K+V patch copies values only
    ("values_only"), keys only ("keys_only"), or only the last layer where it meant all of them
    ("last_layer"). "none" passes every patch through unchanged."""

    def make(**kw) -> Patch:
        p = Patch(**kw)
        whole = p.keys and p.values
        if bug == "values_only" and whole:
            return dataclasses.replace(p, keys=False)
        if bug == "keys_only" and whole:
            return dataclasses.replace(p, values=False)
        if bug == "last_layer" and p.layers is None:
            return dataclasses.replace(p, layers=(n_layers - 1,))
        assert bug in ("none", "values_only", "keys_only", "last_layer"), bug
        return p

    return make


@pytest.mark.parametrize("bug", ["none", "values_only", "keys_only", "last_layer"])
def test_the_checks_catch_a_transplant_that_misses_keys_or_layers(case, bug, monkeypatch):
    """Each planted bug moves the notes transplant and every note's single-slot recovery by a known
    part (KEY_PART or 1 - KEY_PART of the notes' share), so both checks fail; unplanted, they pass."""
    share, trials = case
    fresh = [dataclasses.replace(t, cache={}) for t in trials]  # no note map computed unplanted
    monkeypatch.setattr(probes.causal, "Patch", planted(bug, trials[0].model.n_layers))
    for check in (check_transplant, check_note_map):
        if bug == "none":
            check(share, fresh)
            continue
        with pytest.raises(AssertionError) as caught:
            check(share, fresh)
        print(f"{bug} share={share} {check.__name__}: {str(caught.value).splitlines()[0]}")
    assert 0.0 < KEY_PART < 1.0  # else one of the bugs would copy everything the decision reads


def test_knocking_out_the_notes_removes_their_term(case):
    """Fraction lost = share / 2: the notes' terms are share x ld_new, the effect 2 x ld_new."""
    share, trials = case
    want = designed_answers(share)["knockout"]
    r = knockout(trials, k=2, draws=4)
    _close("knockout.top", r.parts["top"].values, want)
    _close("knockout.top_xfit", r.parts["top_xfit"].values, want)


def test_injecting_the_opposite_note_moves_the_decision_by_the_note_share(case):
    share, trials = case
    want = designed_answers(share)
    r = false_note_injection(trials, ks=(1, 2))
    _close("false_note_injection.xfit_k2", r.parts["xfit_k2"].values, want["inject_all"])
    _close("false_note_injection.xfit_k1", r.parts["xfit_k1"].values, want["inject_one"])
    # the answer follows the injected note exactly when the notes outweigh the field
    follows = r.parts["follows_k2"].values
    assert all(v == (1.0 if share > 0.5 else 0.0) for v in follows)  # exact: 0/1 indicators


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

    name = "mixed-organism-25"
    want = designed_answers(MIXED_ORGANISMS[name])
    out = tmp_path / "m25.json"
    main(["probe", "all", "--model", name, "--n", "8", "--json", str(out)])
    d = json.loads(out.read_text())
    assert d["task"] == "mixed-organism"
    probes_ = d["results"]
    assert abs(probes_["field_refresh"]["recovery"]["mean"] - want["field_refresh"]) < TOL
    for part in ("kv", "k_only", "v_only"):
        assert abs(probes_["notes_transplant"][part]["mean"] - want[part]) < TOL, part


def test_the_designed_answers_add_up():
    """The routes' parts sum to the whole: K only + V only = K+V, the layers' = K+V, the notes' = K+V."""
    for share in MIXED_ORGANISMS.values():
        w = designed_answers(share)
        assert abs(w["k_only"] + w["v_only"] - w["kv"]) < 1e-12  # float sums of closed forms
        assert abs(sum(w[f"layer_{l}"] for l in range(N_LAYERS)) - w["kv"]) < 1e-12
        assert abs(2 * w["note"] - w["kv"]) < 1e-12
        assert abs(w["field_refresh"] + w["kv"] - 1.0) < 1e-12
    with pytest.raises(ValueError, match="share must be in"):
        designed_answers(1.5)
