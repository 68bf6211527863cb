"""The weight-edit baseline: the update is exact, the weights come back bit for bit, and on the
notes organism the edit reaches its target and contaminates a concurrent request."""

from __future__ import annotations

import json

import pytest
import torch

from kvnotes.errors import KVNotesError, OutOfRange
from kvnotes.ops import decide
from probes import make_trials
from probes.results import ProbeReport, ProbeResult
from probes.weights import (
    applied,
    check_layer,
    concurrent,
    drift_trials,
    edit_hooks,
    match_decision,
    match_residual,
    pre_norm_value,
    weight_edit,
)
from tests.helpers import get_model


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.tl.state_dict().items()}


@pytest.fixture(scope="module")
def trials(notes_organism):
    return make_trials(notes_organism, "notes-organism", 6, progress=False)


@pytest.fixture(scope="module")
def result(notes_organism, trials):
    before = _weights(notes_organism)
    other = drift_trials(notes_organism, "notes-organism", 3)
    r = weight_edit(trials, other_trials=other)
    return before, r


def test_weights_are_restored_bit_for_bit(notes_organism, result):
    before, _ = result
    after = notes_organism.tl.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_weights_are_restored_after_an_error(notes_organism, trials):
    before = _weights(notes_organism)
    edit = match_decision(trials[0], 1)
    with pytest.raises(RuntimeError, match="boom"), applied(notes_organism, edit):
        assert not torch.equal(notes_organism.tl.blocks[1].mlp.W_out, before["blocks.1.mlp.W_out"])
        raise RuntimeError("boom")
    assert all(torch.equal(v, notes_organism.tl.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("target", [match_residual, match_decision], ids=lambda f: f.__name__)
def test_the_update_maps_the_key_to_the_target(notes_organism, trials, target):
    """Exactness: with the edit applied, the layer's MLP output at the key is the wanted one."""
    t, layer = trials[0], 1
    out, resid = f"blocks.{layer}.hook_mlp_out", f"blocks.{layer}.hook_resid_post"
    edit = target(t, layer)
    assert int(torch.linalg.matrix_rank(edit.delta(notes_organism), rtol=1e-5)) == 1
    with applied(notes_organism, edit):
        acts = decide(
            notes_organism, t.old_nb, t.pair.old, capture=[out, resid], vocab=t.pair.answers
        ).activations
    assert (edit.target - edit.old).norm() > 0
    torch.testing.assert_close(acts[out][0, -1], edit.target, atol=1e-4, rtol=1e-4)
    if target is match_residual:  # the residual stream after the layer is the new run's there
        new = decide(notes_organism, t.new_nb, t.pair.new, capture=[resid]).activations[resid]
        torch.testing.assert_close(acts[resid][0, -1], new[0, -1], atol=1e-4, rtol=1e-4)


def test_hooks_emulate_the_edit_on_the_decision(notes_organism, trials):
    """match_decision solves with hooks; on the decision tokens they are the weight edit itself."""
    t = trials[1]
    edit = match_decision(t, 1)
    mlp = notes_organism.tl.blocks[1].mlp
    u = edit.value - (edit.key @ mlp.W_out + mlp.b_out)
    hooked = decide(
        notes_organism,
        t.old_nb,
        t.pair.old,
        hooks=edit_hooks(notes_organism, 1, edit.key, u),
        vocab=t.pair.answers,
    ).last
    with applied(notes_organism, edit):
        edited = decide(notes_organism, t.old_nb, t.pair.old, vocab=t.pair.answers).last
    torch.testing.assert_close(hooked, edited, atol=1e-4, rtol=1e-4)
    ld = float(edited[0, 0] - edited[0, 1])
    assert abs(float(t.recovery(ld)) - 1.0) < 0.01  # the solve reached the new decision


def test_post_norm_value_reaches_a_reachable_target():
    """Gemma-style post-MLP norm: a target the normalised output can take is met exactly."""
    m = get_model("tiny-gemma3")
    assert m.cfg.use_normalization_before_and_after
    ln = m.tl.blocks[1].ln2_post
    g = torch.Generator().manual_seed(0)
    x_old = torch.randn(m.cfg.d_model, generator=g, dtype=torch.float64)
    x_new = torch.randn(m.cfg.d_model, generator=g, dtype=torch.float64)
    x_new = x_new * x_old.norm() / x_new.norm()  # same scale, so the norm's eps acts the same
    target = ln(x_new.float()).double()
    x = pre_norm_value(m, 1, x_old, target)
    torch.testing.assert_close(ln(x.float()), target.float(), atol=1e-5, rtol=1e-4)


def test_the_organism_edit_reaches_its_target(result):
    _, r = result
    assert r.layer == 1 and r.target == "match_decision"
    assert r["target"].mean > 0.95 and r["target.agree"].mean == 1.0
    assert abs(r["target.stale_cache"].mean - 1.0) < 0.01
    assert r["update_error"].mean < 1e-3
    assert r["erratum"].mean > 0.9  # the organism reads the erratum (docs/edit-compose.md)


def test_residual_matching_is_exact_at_the_last_layer_and_idle_in_the_middle(trials):
    """The notes organism's decision token holds its conclusion only after the last layer reads
    the notes: matching its state there is the new decision, in the middle layer nothing moves."""
    last = weight_edit(trials, layer=2, target=match_residual)
    assert all(abs(v - 1.0) < 1e-3 for v in last["target.stale_cache"].values)
    middle = weight_edit(trials, layer=1, target=match_residual)
    assert abs(middle["target"].mean) < 0.1


def test_contamination_is_read_on_another_request(trials, result):
    _, r = result
    for p in r.pairs:
        t, j = trials[p["index"]], p["concurrent"]
        assert j != p["index"] and p["concurrent_text"] != t.pair.old.text
        assert f"status: {t.pair.old.values['order_status']};" in p["concurrent_text"]
        assert j == concurrent(trials, p["index"])[0]
    # a weight edit is global: the concurrent request holding the old value flips with it
    assert r["contamination"].mean > 0.9 and r["contamination.flips"].mean == 1.0
    assert r.headline == "contamination"


def test_drift_and_seconds_are_measured(result):
    _, r = result
    assert r.drift_task == "lookup-organism" and r.drift_decisions == 6
    assert r["drift"].n == 6 and 0.0 <= r["drift"].mean <= 1.0 and r["drift.dld"].mean > 0
    for part in ("seconds", "reprefill_seconds", "erratum_seconds"):
        assert r[part].n == 6 and r[part].mean > 0


def test_result_round_trips_json(result):
    _, r = result
    back = ProbeResult.from_dict("weight_edit", json.loads(json.dumps(r.to_dict())))
    assert back.headline == r.headline and back.parts == r.parts
    assert back.pairs == r.pairs


def test_errors_name_the_way_out(notes_organism, trials):
    with pytest.raises(OutOfRange, match=r"pick a layer in 0\.\.2"):
        check_layer(notes_organism, 3)
    with pytest.raises(KVNotesError, match="n >= 2"):
        weight_edit(trials[:1])
    assert check_layer(notes_organism, None) == 1


def test_cli_weights_flag(tmp_path, capsys):
    from kvnotes.cli import main

    out = tmp_path / "w.json"
    assert main(["edit", "--model", "notes-organism", "--n", "3", "--weights", "--json", str(out)]) == 0
    report = ProbeReport.from_dict(json.loads(out.read_text()))
    assert set(report.probes) == {"edit_methods", "weight_edit"}
    w = report.probes["weight_edit"]
    assert w.drift_task == "lookup-organism" and w["target"].n == 3
    assert "weight_edit.contamination *" in capsys.readouterr().out
    assert main(["edit", "--model", "notes-organism", "--n", "1", "--weights"]) == 2
