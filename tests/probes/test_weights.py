"""The weight-edit baseline: the update is exact, the weights come back bit for bit, and on the
notes organism the edit reaches its target and contaminates a concurrent request. ROME beside it:
keyed at the changed field, whitened by a data covariance, and measured by the same parts."""

from __future__ import annotations

import json

import pytest
import torch

from kvnotes.analysis.results import SectionReport, TaskResult
from kvnotes.errors import KVNotesError, OutOfRange
from kvnotes.ops import decide
from probes import make_trials
from probes.weights import (
    applied,
    check_layer,
    concurrent,
    drift_trials,
    edit_hooks,
    key_covariance,
    match_decision,
    match_residual,
    pre_norm_value,
    rome,
    weight_edit,
)
from tests.helpers import get_model, readings


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
    # exact: a fraction of agreeing decisions
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
    # exact: a fraction of flipped decisions
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
    back = TaskResult.from_dict(json.loads(json.dumps(r.to_dict())))
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
    report = SectionReport.from_dict(json.loads(out.read_text()))
    assert set(report.results) == {"edit_methods", "weight_edit"}
    w = report.results["weight_edit"]
    assert w.drift_task == "lookup-organism" and w["target"].n == 3
    printed = capsys.readouterr().out
    assert "weight_edit.contamination *" in printed
    assert {"edit_methods", "weight_edit"} <= set(readings(printed))
    assert main(["edit", "--model", "notes-organism", "--n", "1", "--weights"]) == 2


# --- ROME: keyed at the changed field's last token, data covariance, optimised value ----------
# On the organism ROME can act only at layer 0: the decision reads notes, which read the field at
# layer 1's attention, so an MLP output of the field at layer 1 or 2 never reaches the decision.


@pytest.fixture(scope="module")
def rome_results(notes_organism, trials):
    """Both variants at layer 0 on the same pairs and drift decisions, and ROME's covariance."""
    before = _weights(notes_organism)
    other = drift_trials(notes_organism, "notes-organism", 3)
    cov = key_covariance(notes_organism, "notes-organism", 0)
    r = weight_edit(trials, layer=0, other_trials=other, target=rome, covariance=cov)
    d = weight_edit(trials, layer=0, other_trials=other)
    return before, cov, r, d


def test_rome_is_keyed_at_the_field_and_exact(notes_organism, trials, rome_results):
    before, _, r, _ = rome_results
    assert r.method == "rome" and r.target == "rome" and r.key_position == "field"
    for p in r.pairs:  # the changed field's last token (" pending" / " shipped"), not the decision's
        pair = trials[p["index"]].pair
        assert p["key_position"] == pair.field_span.stop - 1 < pair.old.span("decision").start
    assert r["update_error"].mean < 1e-3  # the key maps to v* exactly, computed again at its token
    assert all(torch.equal(v, notes_organism.tl.state_dict()[k]) for k, v in before.items())


def test_rome_covariance_is_the_data_second_moment(notes_organism, trials, rome_results):
    _, cov, r, d = rome_results
    assert d.covariance.startswith("identity") and r.covariance == cov.describe()
    assert r.covariance.startswith(f"second moment of {cov.tokens} tokens (32 notes-organism prompts)")
    assert cov.tokens > 1000 and r.covariance_seconds == cov.seconds  # 32 prompts of 33 tokens
    torch.testing.assert_close(
        cov.ridge, 0.01 * float(torch.trace(cov.second_moment)) / notes_organism.cfg.d_mlp
    )
    edit = rome(trials[0], 0, covariance=cov)
    k, c = edit.key.double(), edit.direction.double()
    # whitening turns the key away from itself: cos(k, C⁻¹k) is 0.38 and 0.63 for the two values
    assert float(k @ c / (k.norm() * c.norm())) < 0.8
    delta = edit.delta(notes_organism).double()
    torch.testing.assert_close(
        k @ delta,
        edit.value.double()
        - k @ notes_organism.tl.blocks[0].mlp.W_out.double()
        - notes_organism.tl.blocks[0].mlp.b_out.double(),
        atol=1e-4,
        rtol=1e-4,
    )


def test_rome_reaches_its_target_where_the_field_can_move_it(trials, rome_results):
    """Measured (n = 6): pending → shipped 0.97 [0.966, 0.978]; shipped → pending 0.40–0.44, where
    Adam's optimum of the field's layer-0 MLP output plateaus at 0.47 whatever the lr or decay. The
    old cache holds the field unedited, so the stale notebook's decision does not move at all."""
    _, _, r, _ = rome_results
    by_dir = {}
    for p, v in zip(r.pairs, r["target"].values):
        by_dir.setdefault(trials[p["index"]].pair.old.values["order_status"], []).append(v)
    assert min(by_dir["pending"]) > 0.9
    assert min(by_dir["shipped"]) > 0.3
    assert abs(r["target.stale_cache"].mean) < 0.01


def test_rome_contaminates_differently_from_the_decision_keyed_edit(rome_results):
    """Measured (n = 6, layer 0): decision-keyed contamination 1.02 [1.01, 1.03], drift 4.4 logits;
    ROME 0.70 [0.49, 0.89], drift 0.09 logits. ROME still moves a concurrent request holding the
    old value as far as its own (the same field token is the same key), but no more: it no longer
    pushes every request of the task, and barely touches the other task's decisions."""
    _, _, r, d = rome_results
    # exact: a fraction of flipped decisions
    assert d["contamination"].mean > 0.95 and d["contamination.flips"].mean == 1.0
    assert r["contamination"].mean < d["contamination"].mean - 0.15
    assert abs(r["contamination"].mean - r["target"].mean) < 0.1
    assert r["drift.dld"].mean < 0.25 * d["drift.dld"].mean
    for part in ("seconds", "reprefill_seconds", "erratum_seconds"):
        assert r[part].n == d[part].n == 6 and r[part].mean > 0


def test_rome_has_no_path_above_layer_0_on_the_organism(notes_organism, trials):
    edit = rome(trials[0], 1, covariance=key_covariance(notes_organism, "notes-organism", 1, prompts=4))
    w = notes_organism.tl.blocks[1].mlp.W_out
    assert float(edit.delta(notes_organism).norm() / w.norm()) < 1e-6  # rounding; at layer 0 it is 0.23-0.30
    assert edit.position == trials[0].pair.field_span.stop - 1


def test_rome_result_round_trips_and_old_json_reads_as_decision_keyed(result, rome_results):
    _, _, r, _ = rome_results
    back = TaskResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back == r and back.name == "weight_edit_rome"
    old = result[1].to_dict()
    for key in ("method", "key_position", "covariance_seconds"):
        old["details"].pop(key)  # as saved before ROME was added
    back = TaskResult.from_dict(old)
    assert back.method == "decision" and back.key_position == "decision" and back.covariance_seconds is None


def test_cli_rome_flag(tmp_path):
    from kvnotes.cli import main

    out = tmp_path / "r.json"
    argv = ["edit", "weight_edit", "--model", "notes-organism", "--n", "3", "--layer", "0", "--rome"]
    assert main([*argv, "--cov-prompts", "4", "--json", str(out)]) == 0
    report = SectionReport.from_dict(json.loads(out.read_text()))
    assert set(report.results) == {"weight_edit", "weight_edit_rome"}
    w, r = report.results["weight_edit"], report.results["weight_edit_rome"]
    assert (w.method, r.method) == ("decision", "rome") and w.layer == r.layer == 0
    assert r.covariance.startswith("second moment of") and "(4 notes-organism prompts)" in r.covariance
    assert r["target"].n == w["target"].n == 3
