"""Head patching (read and write side), scrubbing and attribution patching: parity with the
engine's unbatched path, exact limits, and each organism's ground truth."""

from __future__ import annotations

import pytest
import torch

from circuits import SectionReport, all_heads, attribute, read_heads, read_sweep, scrubbing, write_heads
from circuits.heads import read_capture, write_sweep
from circuits.scrubbing import _scrub_rows, resamples
from kvnotes.engine import run
from kvnotes.notebook import Notebook
from kvnotes.ops import Patch, decide, prefill
from kvnotes.tasks import load_task
from probes import make_trials
from tests.helpers import assert_close


@pytest.fixture(scope="module", params=["tiny-gemma3", "tiny-gqa", "tiny-llama"])
def tiny_trials(request):
    """Multi-query (one KV head), grouped-query and multi-head tiny models."""
    from tests.helpers import get_model

    return make_trials(get_model(request.param), "order-cancel", 2, progress=False)


@pytest.fixture(scope="module")
def notes_trials(notes_organism):
    return make_trials(notes_organism, "notes-organism", 8, progress=False)


@pytest.fixture(scope="module")
def lookup_trials(lookup_organism):
    return make_trials(lookup_organism, "lookup-organism", 8, progress=False)


SETS = [[(0, 0)], [(1, 1), (0, 3)], [], [(1, 0), (1, 1), (1, 2), (1, 3)]]


def _z(l):
    return f"blocks.{l}.attn.hook_z"


def _ld(t, recovery) -> torch.Tensor:
    """Back from recovery to the decision's logit difference (tiny models move it very little,
    so recoveries amplify rounding; compare logit differences at float32 tolerance)."""
    r = torch.as_tensor(recovery, dtype=torch.float64)
    return (t.ld_old + r * (t.ld_new - t.ld_old)).float()


def _replace(z_src, heads, where):
    """Unbatched reference hooks: heads' z at token indices `where` taken from `z_src`."""

    def make(l, hs):
        def hook(z, hook):
            z = z.clone()
            for h in hs:
                z[:, where, h] = z_src[l][:, where, h]
            return z

        return hook

    by_layer = {}
    for l, h in heads:
        by_layer.setdefault(l, []).append(h)
    return [(_z(l), make(l, hs)) for l, hs in by_layer.items()]


def test_read_patch_equals_the_unbatched_engine(tiny_trials):
    # the batched one-token path (query prefix computed once) against a plain decide with a hook
    for t in tiny_trials:
        m = t.model
        names = [_z(l) for l in range(m.n_layers)]
        ref = decide(m, t.new_nb, t.pair.new, capture=names)
        z_new = [ref.activations[n] for n in names]
        expected = []
        for heads in SETS:
            hooks = _replace(z_new, heads, [-1])
            out = decide(m, t.old_nb, t.pair.new, hooks=hooks, vocab=t.pair.answers).last
            expected.append(float(out[0, 0] - out[0, 1]))
        assert_close(_ld(t, read_sweep(t, SETS)), torch.tensor(expected), what="read patch")


def test_every_head_at_the_decision_gives_the_new_decision(tiny_trials):
    for t in tiny_trials:
        ld = _ld(t, read_sweep(t, [all_heads(t.model), []]))
        assert_close(ld, torch.tensor([t.ld_new, t.ld_old]).float(), what="all heads / no head")


def test_path_patch_through_no_slot_changes_nothing(tiny_trials):
    t = tiny_trials[0]
    assert_close(
        _ld(t, read_sweep(t, [all_heads(t.model)], path=[])),
        torch.tensor([t.ld_old]).float(),
        what="path through no slot",
    )


def test_write_patch_equals_the_unbatched_engine(tiny_trials):
    # rebuilding from the first note slot with patched heads == prefilling the whole old prompt
    # with the same heads' z replaced at the note slots
    for t in tiny_trials:
        m = t.model
        dec = t.pair.new.span("decision").start
        names = [_z(l) for l in range(m.n_layers)]
        _, full = run(m, Notebook.empty(m), t.pair.new.ids[:dec], capture=names, logits_at=())
        z_new = [full.activations[n] for n in names]
        notes = t.pair.downstream()
        expected = []
        for heads in SETS:
            nb = prefill(m, t.pair.old, hooks=_replace(z_new, heads, notes))
            expected.append(float(t.ld(nb)[0]))
        assert_close(_ld(t, write_sweep(t, SETS)), torch.tensor(expected).float(), what="write patch")


def test_every_head_at_the_notes_equals_the_notes_transplant(tiny_trials):
    for t in tiny_trials:
        transplant = t.sweep([Patch(positions=tuple(t.pair.downstream()))])
        assert_close(_ld(t, write_sweep(t, [all_heads(t.model)])), _ld(t, transplant), what="all write heads")


# --- the organisms' ground truth -------------------------------------------------------------
def test_notes_organism_read_and_write_heads_are_where_its_construction_forces(notes_organism, notes_trials):
    # Every layer sees only 8 tokens and the decision sits 10+ tokens after the field, so:
    # layer-0 heads at the decision see no slot that depends on the field (read effect exactly
    # 0), and heads of the last layer write K/V no later layer reads (write effect exactly 0).
    last = notes_organism.n_layers - 1
    read = read_heads(notes_trials)
    write = write_heads(notes_trials)
    for row in read.tables["ranking"]:
        if row["layer"] == 0:
            assert max(abs(v) for v in row["values"]) < 1e-6, row
    for row in write.tables["ranking"]:
        if row["layer"] == last:
            assert max(abs(v) for v in row["values"]) < 1e-6, row
    assert write.tables["by_layer"][last]["mean"] == pytest.approx(0, abs=1e-6)
    # the conclusion is read by heads reading note slots, never the field
    assert read.parts["notes_path"].mean > 0.8 and abs(read.parts["field_path"].mean) < 1e-6
    assert read.parts["all_heads"].mean == pytest.approx(1, abs=1e-4)
    assert write.parts["all_heads"].mean == pytest.approx(1, abs=1e-3)
    # cross-fitted top-k beats random heads at small k
    top, rnd = read.curves["topk_curve"], read.curves["random_curve"]
    assert read.cross_fitted
    assert top.points[1].mean > rnd.points[1].mean + 0.3
    assert write.curves["topk_curve"].points[0].mean > write.curves["random_curve"].points[0].mean + 0.3


def test_lookup_organism_reads_the_field_and_writes_no_notes(lookup_trials):
    read, write = read_heads(lookup_trials), write_heads(lookup_trials)
    assert read.tables["ranking"][0]["mean"] > 0.9
    assert read.parts["notes_path"].mean == pytest.approx(0, abs=0.05)
    # one layer: nothing reads K/V written after it, so no head writes a note
    assert all(max(abs(v) for v in row["values"]) < 1e-6 for row in write.tables["ranking"])


def test_top_k_beats_random_k_and_random_reaches_all_heads(notes_trials):
    res = read_heads(notes_trials, draws=8)
    top, rnd = res.curves["topk_curve"], res.curves["random_curve"]
    n = len(all_heads(notes_trials[0].model))
    assert top.x == tuple(range(1, n + 1))
    assert rnd.points[-1].mean == pytest.approx(res.parts["all_heads"].mean, abs=1e-6)  # every head
    assert sum(a.mean - b.mean for a, b in zip(top.points, rnd.points)) > 1.0


# --- scrubbing ---------------------------------------------------------------------------------
def test_scrubbing_limits_are_exact(notes_trials, notes_organism):
    task = load_task("notes-organism")
    t = notes_trials[0]
    prompt = resamples(t, task, 1, seed=3)[0]
    everything = list(range(t.new_nb.n_slots))
    ld, ld_res = _scrub_rows(t, prompt, [(everything, all_heads(notes_organism)), ([], [])])
    assert float(ld[0]) == pytest.approx(t.ld_new, abs=1e-4)  # keep everything: the new decision
    assert float(ld[1]) == pytest.approx(ld_res, abs=1e-4)  # keep nothing: the resampled prompt's
    assert abs(t.ld_new - ld_res) > 5  # and the two differ


def test_scrubbing_keeps_the_notes_hypothesis_and_not_a_random_circuit(notes_trials):
    heads = [(2, h) for h in range(4)]
    res = scrubbing(notes_trials, "notes-organism", heads)
    assert res.parts["hypothesis"].mean > 0.6
    assert res.parts["random_circuit"].mean < 0.2
    assert res.parts["heads_only"].mean == pytest.approx(0, abs=0.05)


# --- attribution patching -----------------------------------------------------------------------
def test_attribution_is_the_first_order_effect(tiny_trials):
    # a small step along (new - old) at one slot and layer moves the decision by step * attribution
    t = tiny_trials[0]
    m = t.model
    a = attribute(m, t.old_nb, t.new_nb, t.pair.new, t.pair.answers)
    field = t.pair.field_span.start
    l = m.n_layers - 1
    s = int(t.old_nb.slot_index([field])[0])
    eps = 1e-2
    keys = list(t.old_nb.keys)
    values = list(t.old_nb.values)
    keys[l] = keys[l].clone()
    values[l] = values[l].clone()
    keys[l][:, :, s] += eps * (t.new_nb.keys[l][:, :, s] - t.old_nb.keys[l][:, :, s])
    values[l][:, :, s] += eps * (t.new_nb.values[l][:, :, s] - t.old_nb.values[l][:, :, s])
    from dataclasses import replace

    moved = float(t.ld(replace(t.old_nb, keys=tuple(keys), values=tuple(values)))[0]) - t.ld_old
    assert moved == pytest.approx(eps * float(a.slot_layer[l, s]), rel=0.05, abs=1e-6)
    # slots before the field never changed: no attribution
    assert torch.all(a.slot_layer[:, :s] == 0)


def test_circuit_report_round_trips_through_json(notes_organism):
    from circuits import run_circuits

    r = run_circuits(
        notes_organism,
        "notes-organism",
        ["read_heads", "scrubbing", "attribution"],
        n=4,
        draws=4,
        progress=False,
    )
    d = r.to_dict()
    assert {"read_heads", "scrubbing", "attribution"} <= set(d["results"])
    assert {"ranking", "topk_curve", "random_curve"} <= set(d["results"]["read_heads"])
    assert {"rank_correlation", "speedup"} <= set(d["results"]["attribution"])
    back = SectionReport.from_dict(d)
    assert back.to_dict() == d


def test_the_paths_add_up_to_the_whole_head_output_change(tiny_trials):
    from circuits.heads import path_delta
    from circuits.read_write import path_positions

    for t in tiny_trials:
        site = read_capture(t)
        total = sum(path_delta(t, where) for where in path_positions(t).values())
        assert_close(total, site.z_new - site.z_old, what="prefix+field+notes+query+self")
        every = sorted(p for where in path_positions(t).values() for p in where)
        assert every == list(range(site.position + 1))  # each key exactly once
