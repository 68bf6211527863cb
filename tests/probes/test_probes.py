"""Probes: exact against the engine's unbatched operations, well-formed results, clear errors."""

from __future__ import annotations

import json
import re

import pytest
import torch

from kvnotes.analysis.stats import Estimate
from kvnotes.cli import main
from kvnotes.ops import Patch, decide, patch, refresh
from kvnotes.tasks import RULE
from probes import (
    PROBES,
    SectionReport,
    UnknownAnalysisError,
    dissociation,
    field_refresh,
    knockout,
    make_trials,
    note_map,
    notes_transplant,
    run_probes,
)
from probes.causal import single_slot_map
from probes.controls import knockout_hooks
from tests.helpers import MODEL_NAMES, get_model, readings

TASK = "order-cancel"


def unbatched_ld(t, nb) -> float:
    out = decide(t.model, nb, t.pair.new, vocab=t.pair.answers).last[0]
    return float(out[0] - out[1])


def ld_of(t, recovery: float) -> float:
    return t.ld_old + recovery * (t.ld_new - t.ld_old)


@pytest.fixture(scope="module", params=["tiny-gemma3", "tiny-gqa"])
def trials(request):
    return make_trials(get_model(request.param), TASK, 2, progress=False)


def test_note_map_values_equal_unbatched_patches(trials):
    for t in trials:
        m = single_slot_map(t, 2)
        for p, r in zip(m["positions"], m["recovery"]):
            want = unbatched_ld(t, patch(t.old_nb, t.new_nb, Patch(positions=(p,))))
            assert abs(ld_of(t, r) - want) < 2e-5, f"slot {p}"
        down = t.pair.downstream()
        for i, p in enumerate(down[:3]):
            for l in range(t.model.n_layers):
                want = unbatched_ld(t, patch(t.old_nb, t.new_nb, Patch(positions=(p,), layers=(l,))))
                assert abs(ld_of(t, m["slot_layer"][i][l]) - want) < 2e-5, f"slot {p} layer {l}"
        for l, r in enumerate(m["per_layer"]):
            want = unbatched_ld(t, patch(t.old_nb, t.new_nb, Patch(positions=tuple(down), layers=(l,))))
            assert abs(ld_of(t, r) - want) < 2e-5


def test_field_refresh_values_equal_unbatched_refresh(trials):
    res = field_refresh(trials, min_effect=0.0)
    for t, r in zip(trials, res["recovery"].values):
        want = unbatched_ld(t, refresh(t.model, t.old_nb, t.pair.new, t.pair.changed))
        assert abs(ld_of(t, r) - want) < 2e-5


def test_field_refresh_equals_transplanting_the_field_slots(trials):
    # slots before the field never saw it (deviation 0), so refreshing the field recomputes
    # exactly the new run's field K/V
    refreshed = field_refresh(trials, min_effect=0.0)
    mapped = note_map(trials, min_effect=0.0)
    for t, a, b in zip(trials, refreshed["recovery"].values, mapped["field_slots"].values):
        assert abs(ld_of(t, a) - ld_of(t, b)) < 2e-5


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_deviation_before_the_field_is_exactly_zero(name):
    res = field_refresh(make_trials(get_model(name), TASK, 2, progress=False), min_effect=0.0)
    # exact: invariant 4, slots before the field are the same computation
    assert res["deviation_before_field"].values == (0.0, 0.0)
    assert res.deviation_exactly_zero is True


def test_transplant_values_equal_unbatched_patches(trials):
    res = notes_transplant(trials, min_effect=0.0)
    for i, t in enumerate(trials):
        pos = tuple(t.pair.downstream())
        for part, spec in [
            ("kv", Patch(positions=pos)),
            ("k_only", Patch(positions=pos, values=False)),
            ("v_only", Patch(positions=pos, keys=False)),
        ]:
            want = unbatched_ld(t, patch(t.old_nb, t.new_nb, spec))
            assert abs(ld_of(t, res[part].values[i]) - want) < 2e-5, part


def test_field_plus_notes_recovers_the_new_decision(trials):
    for t in trials:
        r = t.sweep([Patch(positions=tuple(t.pair.field_span) + tuple(t.pair.downstream()))])
        assert abs(ld_of(t, float(r[0])) - t.ld_new) < 2e-5


def test_knockout_equals_deleting_the_slots(trials):
    for t in trials:
        blocked = t.pair.downstream()[:3]
        mask = torch.zeros(1, t.new_nb.n_slots, dtype=torch.bool)
        mask[0, t.new_nb.slot_index(blocked)] = True
        knocked = float(t.ld(t.new_nb, hooks=knockout_hooks(t.model, mask))[0])
        keep = [p for p in t.new_nb.positions.tolist() if p not in blocked]
        assert abs(knocked - unbatched_ld(t, t.new_nb.select(keep))) < 2e-5
        nothing = torch.zeros_like(mask)
        same = float(t.ld(t.new_nb, hooks=knockout_hooks(t.model, nothing))[0])
        # hooked layers take the reference attention path, ld_new the fast one: float32 rounding apart
        assert same == pytest.approx(t.ld_new, abs=1e-5)


def test_knockout_reports_top_and_random(trials):
    res = knockout(trials, k=2, draws=3, min_effect=0.0)
    assert res.headline == "top_xfit" and res["top"].n == res["random"].n == len(trials)
    assert all(len(s.top) == 2 for s in res.slots)


def test_dissociation_uses_rule_trials():
    model = get_model("tiny-llama")
    with pytest.raises(ValueError, match="kind='rule'"):
        dissociation(make_trials(model, TASK, 1, progress=False))
    res = dissociation(make_trials(model, TASK, 2, kind=RULE, progress=False), min_effect=0.0)
    assert set(res.parts) == {"notes", "rule_slot", "effect"} and res["notes"].n == 2


def test_pairs_below_min_effect_are_listed_not_hidden(trials):
    res = field_refresh(trials, min_effect=1e9)
    assert res.mean is None and res["recovery"].n == 0
    assert [e["index"] for e in res.excluded] == [0, 1]
    assert res["deviation_before_field"].n == 2  # still measured on every pair


def test_report_round_trips_through_json():
    report = run_probes(get_model("tiny-gemma3"), TASK, n=3, min_effect=0.0, progress=False)
    assert list(report.results) == list(PROBES)
    d = json.loads(json.dumps(report.to_dict()))
    assert SectionReport.from_dict(d).to_dict() == d
    for name, p in d["results"].items():
        assert {"mean", "ci", "values", "headline"} <= set(p), name
        assert p["mean"] == p[p["headline"]]["mean"]
        # a pair without a matched control leaves the out-of-sample headline, counted in dropped
        assert len(p["values"]) + p.get("dropped", 0) == 3
    assert "note_map" in report.table() and "*" in report.table()


def test_estimate_ci_and_undefined_figures():
    e = Estimate.of([0.1, 0.5, 0.9, 0.4, 0.6])
    assert e.ci[0] <= e.mean <= e.ci[1] and e.ci[0] < e.ci[1]
    assert Estimate.of([0.3]).ci is None and Estimate.of([]).mean is None
    # exact: the bootstrap of a constant resamples the same numbers
    assert Estimate.of([2.0, 2.0]).ci == (2.0, 2.0)
    # exact: the values given
    assert Estimate.of([1.0, float("nan")]).values == (1.0,)


# --- CLI -----------------------------------------------------------------------------------------
def test_cli_probe_all_writes_the_documented_json(tmp_path, capsys):
    out = tmp_path / "probes.json"
    rc = main(
        [
            "probe",
            "all",
            "--model",
            "tiny-llama",
            "--task",
            TASK,
            "--n",
            "2",
            "--min-effect",
            "0",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    d = json.loads(out.read_text())
    assert (d["model"], d["task"], d["n"]) == ("tiny-llama", TASK, 2)
    assert set(d["results"]) == set(PROBES)
    for p in d["results"].values():
        # a pair without a matched control leaves the out-of-sample headline, counted in dropped
        assert len(p["values"]) + p.get("dropped", 0) == 2
        assert (p["ci"] is None) == (len(p["values"]) < 2) and (p["ci"] is None or len(p["ci"]) == 2)
    printed = capsys.readouterr().out
    assert "field_refresh.recovery *" in printed
    # the conclusion after the figures: the probes' summary, as the page reads it
    assert readings(printed)["probes"].startswith("Field-only refresh recovers ")


def test_cli_regime_on_a_tiny_model(tmp_path):
    out = tmp_path / "regime.json"
    rc = main(
        [
            "probe",
            "regime",
            "--model",
            "tiny-gemma3",
            "--task",
            TASK,
            "--n",
            "2",
            "--distances",
            "0,24",
            "--min-effect",
            "0",
            "--template",  # the shortest: the filler goes into every shot too, and n_ctx is 512
            "0",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    r = json.loads(out.read_text())["results"]["regime"]
    assert set(r) >= {"field_refresh@0", "notes_transplant@24", "mean", "ci"}
    assert r["details"]["distance"][1] >= r["details"]["distance"][0] + 24


def _exit_code(argv: list[str]) -> int:
    """`kvnotes argv`'s exit code: a name or file is refused as it is parsed (SystemExit), the rest
    by `main` (its return)."""
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code or 0)


@pytest.mark.parametrize(
    "argv,pattern",
    [
        (
            ["probe", "fieldrefresh", "--model", "tiny-llama"],
            "unknown analysis.*'fieldrefresh'.*field_refresh",
        ),
        (["probe", "all", "--model", "tiny-llama", "--task", "nosuchtask"], "unknown task 'nosuchtask'"),
        (["probe", "all", "--model", "tiny-nosuch"], "unknown model 'tiny-nosuch'"),
    ],
    ids=["probe", "task", "model"],
)
def test_cli_errors_name_the_problem(argv, pattern, capsys):
    assert _exit_code(argv) == 2
    assert re.search(pattern, capsys.readouterr().err)


def test_cli_bad_task_file(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\ntemplate = "[[decision: A:]]"\nanswers = [" a", " b"]\n')
    assert _exit_code(["probe", "all", "--model", "tiny-llama", "--task", str(bad)]) == 2
    assert "[gate]: missing table" in capsys.readouterr().err


def test_unknown_probe_error_type():
    with pytest.raises(UnknownAnalysisError):
        run_probes(get_model("tiny-llama"), TASK, ["nope"], n=1, progress=False)


def test_a_task_made_for_another_model_warns():
    with pytest.warns(UserWarning, match="made for notes-organism, not tiny-llama"):
        make_trials(get_model("tiny-llama"), "notes-organism", 1, progress=False)
