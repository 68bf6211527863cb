"""Conformance suite: the eight invariants of docs/engine.md, checked directly on every tiny model
against TransformerLens's own full forward (and against prefill of the edited prompt), on both
attention paths: the reference (full score matrix) and the fast one, with long appends run in
chunks of 13 tokens (so every prefill here is chunked, across windows; the rest of the suite runs
the fast path with the default chunk)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from kvnotes import engine
from kvnotes.engine import run
from kvnotes.metrics import kv_deviation
from kvnotes.notebook import Notebook
from kvnotes.ops import (
    Patch,
    decide,
    decide_patched,
    patch,
    prefill,
    recompute_suffix,
    refresh,
    rerotate,
    splice,
)
from tests.helpers import (
    LONG_TEMPLATE,
    OLD,
    WINDOW,
    assert_close,
    assert_notebooks_close,
    full_logits,
    max_kv_diff,
)


@pytest.fixture(autouse=True, params=["reference", "fast-chunked"])
def attention_path(request, monkeypatch):
    if request.param == "fast-chunked":
        monkeypatch.setattr(engine, "PREFILL_CHUNK", 13)
    with engine.fast_attention(request.param != "reference"):
        yield request.param


# --- 1. decide == full forward -------------------------------------------------------------------
def test_decide_equals_full_forward_last_logits(case):
    out = decide(case.model, case.nb_old, case.old)
    assert out.logits.shape == (1, 1, case.model.facts.d_vocab_out)
    assert_close(out.last[0], full_logits(case.model, case.ids)[-1], what="decision logits")


def test_logits_at_several_positions_equal_full_forward_rows(case):
    model, ids = case.model, case.ids
    full = full_logits(model, ids)
    at = [0, 3, WINDOW + 1, case.field, len(ids) - 1]
    _, out = run(model, Notebook.empty(model), ids, logits_at=at)
    assert out.positions == tuple(at)
    assert_close(out.logits[0], full[at], what="logits from an empty notebook")

    # the same rows when the computed tokens start mid-prompt, against a prefilled prefix
    k = case.field - 2
    at = [k, case.field, len(ids) - 2, len(ids) - 1]
    _, out = run(model, prefill(model, ids, upto=k), ids[k:], logits_at=at)
    assert_close(out.logits[0], full[at], what="logits after a prefilled prefix")


def test_decide_on_prompt_much_longer_than_window(model):
    prompt = LONG_TEMPLATE.render(model, order_status=OLD)
    assert len(prompt) > 150 > 10 * WINDOW
    full = full_logits(model, prompt.ids)
    out = decide(model, prefill(model, prompt), prompt)
    assert_close(out.last[0], full[-1], what="long-prompt decision")
    at = [WINDOW - 1, WINDOW, 3 * WINDOW + 1, len(prompt) - 1]
    _, out = run(model, prefill(model, prompt, upto=WINDOW - 1), list(prompt.ids[WINDOW - 1 :]), logits_at=at)
    assert_close(out.logits[0], full[at], what="long-prompt rows")


# --- 2. prefill(prefix) + run(suffix) == prefill(all) --------------------------------------------
@pytest.mark.parametrize("split", ["bos-only", "before-field", "last-token"])
def test_prefix_then_suffix_equals_prefill(case, split):
    model, ids, stop = case.model, case.ids, case.stop
    k = {"bos-only": 1, "before-field": case.field, "last-token": stop - 1}[split]
    nb, _ = run(model, prefill(model, ids, upto=k), ids[k:stop], torch.arange(k, stop), logits_at=())
    assert nb.positions.tolist() == list(range(stop))
    assert_notebooks_close(nb, prefill(model, ids, upto=stop), what=f"prefix {k} + suffix")


# --- 3. suffix recompute == prefill of the edited prompt -----------------------------------------
def test_recompute_suffix_equals_prefill_of_edited_prompt(case):
    model = case.model
    nb = recompute_suffix(model, case.nb_old, case.new, "order_status")
    assert_notebooks_close(nb, case.nb_new, what="suffix recompute")
    assert_close(
        decide(model, nb, case.new).last,
        decide(model, case.nb_new, case.new).last,
        what="decision after suffix recompute",
    )
    # and it really changed something: the old notebook decides differently
    assert not torch.allclose(
        decide(model, case.nb_old, case.old).last,
        decide(model, case.nb_new, case.new).last,
        atol=1e-3,
    )


# --- 4. KV deviation before the field is exactly 0 -----------------------------------------------
def test_kv_deviation_zero_before_field_positive_at_field(case):
    dev = kv_deviation(case.nb_old, case.nb_new)
    assert dev.shape == (1, case.model.n_layers, case.nb_old.n_slots)
    before = dev[:, :, case.nb_old.positions < case.field]
    # exact: invariant 4, slots before the field are the same computation
    assert before.numel() > 0 and before.max().item() == 0.0
    assert dev[0, :, case.field].min().item() > 0.0, "every layer's K/V at the field must change"
    # layer 0 K/V are a function of the token alone; downstream slots change from layer 1 on
    # exact: invariant 4, slots before the field are the same computation
    assert dev[0, 0, case.field + 1 :].max().item() == 0.0
    assert dev[0, 1, case.field + 1].item() > 0.0


# --- 5. patch-all reproduces the source decision -------------------------------------------------
def test_patch_all_reproduces_source_decision(case):
    model = case.model
    patched = patch(case.nb_old, case.nb_new, Patch())
    assert torch.equal(decide(model, patched, case.new).last, decide(model, case.nb_new, case.new).last)
    untouched = patch(case.nb_old, case.nb_new, Patch(positions=()))
    assert torch.equal(decide(model, untouched, case.new).last, decide(model, case.nb_old, case.new).last)


# --- 6. re-rotation of an isolated chunk == prefill at offset q ----------------------------------
@pytest.mark.parametrize("q", [1, 5, WINDOW + 3, 100, 400], ids=lambda q: f"q={q}")
def test_rerotate_chunk_equals_prefill_at_offset(rotary_case, q):
    """RoPE models only: a learned-position model refuses the move (test_learned_positions.py)."""
    case = rotary_case
    model = case.model
    chunk = case.ids[1 : case.stop]  # the prompt without BOS, as a chunk
    moved = rerotate(model, prefill(model, chunk), q)
    expected = prefill(model, chunk, offset=q)
    assert moved.positions.tolist() == list(range(q, q + len(chunk)))
    assert_notebooks_close(moved, expected, what=f"chunk re-rotated 0 -> {q}")


# --- 7. refresh ----------------------------------------------------------------------------------
def test_refresh_unchanged_value_is_noop(case):
    nb = refresh(case.model, case.nb_old, case.old, "order_status")
    assert_notebooks_close(nb, case.nb_old, what="refresh with the same value")


def test_refresh_changed_value_rewrites_the_field_slot_only(case):
    model, f = case.model, case.field
    nb = refresh(model, case.nb_old, case.new, "order_status")
    others = [p for p in case.nb_old.positions.tolist() if p != f]
    assert_notebooks_close(nb.select(others), case.nb_old.select(others), what="non-field slots", exact=True)
    # the field slot saw the same (unchanged) prefix, so it equals the edited prompt's field slot
    assert_notebooks_close(nb.select([f]), case.nb_new.select([f]), what="refreshed field slot")
    assert max_kv_diff(nb.select([f]), case.nb_old.select([f])) > 1e-2
    assert int(nb.tokens[0, nb.slot_index([f])]) == case.new.ids[f]


# --- 8. batched patches == single patches --------------------------------------------------------
def _mixed_patches(case) -> list[Patch]:
    L, H, f, stop = case.model.n_layers, case.model.n_kv_heads, case.field, case.stop
    rng = random.Random(0)
    return [
        Patch(positions=(f,)),
        Patch(positions=(f, f + 1, f + 2), layers=(0,)),
        Patch(positions=(stop - 1,), layers=(L - 1,), keys=False),
        Patch(positions=(stop - 2, stop - 1), values=False),
        Patch(positions=tuple(range(f, stop)), layers=(1, -1)),
        Patch(positions=(f,), heads=(H - 1,)),
        Patch(positions=tuple(rng.sample(range(f, stop), 4)), layers=(0, 2), heads=(0,), keys=False),
        Patch(layers=(1,), values=False),
        Patch(positions=()),
        Patch(),
        Patch(positions=(1, 2, 3)),  # before the field: no effect
    ]


def test_decide_patched_equals_loop_of_single_patches(case):
    model = case.model
    specs = _mixed_patches(case)
    batched = decide_patched(model, case.nb_old, case.nb_new, specs, case.new, batch_size=4).last
    single = torch.stack([decide(model, patch(case.nb_old, case.nb_new, s), case.new).last[0] for s in specs])
    assert batched.shape == (len(specs), model.facts.d_vocab_out)
    assert_close(batched, single, what="batched vs single patches")
    # the sweep is not degenerate: patches differ from each other
    assert (batched - batched[-3]).abs().amax(-1).max() > 1e-3


# --- run: positions need not be contiguous or ordered --------------------------------------------
def test_run_positions_out_of_order_equals_sorted(case):
    model, ids = case.model, case.ids
    nb = prefill(model, ids, upto=3)
    a, out_a = run(model, nb, [ids[5], ids[3], ids[4]], [5, 3, 4], logits_at=[3, 4, 5])
    b, out_b = run(model, nb, ids[3:6], [3, 4, 5], logits_at=[3, 4, 5])
    assert a.positions.tolist() == [0, 1, 2, 5, 3, 4]
    assert_close(out_a.logits, out_b.logits, what="logits, unordered positions")
    assert_notebooks_close(a, b, what="unordered positions")
    assert_close(out_b.logits[0], full_logits(model, ids)[3:6], what="logits vs full forward")


def test_run_ignores_notebook_slots_at_later_positions(case):
    """Attention is causal by position: slots after the computed tokens are not seen."""
    model, ids = case.model, case.ids
    full_nb = prefill(model, ids, upto=8)
    holey = full_nb.select([0, 1, 2, 6, 7])
    nb, out = run(model, holey, ids[3:6], [3, 4, 5], logits_at=[3, 4, 5])
    assert_notebooks_close(nb, full_nb, what="filled gap")
    assert_close(out.logits[0], full_logits(model, ids)[3:6], what="gap logits")


def test_slot_order_carries_no_meaning(case):
    perm = torch.randperm(case.nb_old.n_slots)
    shuffled = case.nb_old.select(case.nb_old.positions[perm])
    assert_close(
        decide(case.model, shuffled, case.old).last,
        decide(case.model, case.nb_old, case.old).last,
        what="decision, shuffled slots",
    )


# --- splice --------------------------------------------------------------------------------------
def _host_and_chunk(case) -> tuple[list[int], list[int]]:
    ids = case.ids
    cut = case.old.span("policy").stop + 1  # host: BOS + policy + newline; chunk: the rest
    return ids[:cut], ids[cut : case.stop]


def test_splice_seam0_chunk_slots_equal_isolated_prefill_at_target(rotary_case):
    case = rotary_case
    model = case.model
    host_ids, chunk_ids = _host_and_chunk(case)
    host = prefill(model, host_ids)
    spliced = splice(model, host, prefill(model, chunk_ids))
    h = len(host_ids)
    assert_notebooks_close(spliced.truncate(h), host, what="host slots", exact=True)
    chunk_part = spliced.select(range(h, h + len(chunk_ids)))
    assert_notebooks_close(chunk_part, prefill(model, chunk_ids, offset=h), what="spliced chunk")


def test_splice_full_seam_equals_prefill_of_host_plus_chunk(rotary_case):
    case = rotary_case
    model = case.model
    host_ids, chunk_ids = _host_and_chunk(case)
    spliced = splice(model, prefill(model, host_ids), prefill(model, chunk_ids), seam=len(chunk_ids))
    assert_notebooks_close(spliced, prefill(model, host_ids + chunk_ids), what="full-seam splice")


def test_splice_without_rerotation_visibly_differs(rotary_case):
    case = rotary_case
    model = case.model
    host_ids, chunk_ids = _host_and_chunk(case)
    host, chunk = prefill(model, host_ids), prefill(model, chunk_ids)
    h = len(host_ids)
    rotated = splice(model, host, chunk)
    naive = host.concat(replace(chunk, positions=chunk.positions + h))  # keys still at 0..n
    assert naive.positions.tolist() == rotated.positions.tolist()
    for l in range(model.n_layers):
        assert torch.equal(naive.values[l], rotated.values[l]), "re-rotation must not touch values"
    assert max((a - b).abs().max().item() for a, b in zip(naive.keys, rotated.keys)) > 0.1
    query = case.ids[case.stop :]
    d_rot, d_naive = decide(model, rotated, query).last, decide(model, naive, query).last
    assert (d_rot - d_naive).abs().max().item() > 1e-2, "the un-rotated ablation must change the decision"


def test_vocab_subset_equals_the_same_columns_of_full_logits(case):
    model = case.model
    ids = [5, 17, 3]
    full = decide(model, case.nb_old, case.old).last[0]
    sub = decide(model, case.nb_old, case.old, vocab=ids).last[0]
    assert sub.shape == (3,)
    assert_close(sub, full[ids], what="vocab-restricted logits")
    specs = [Patch(positions=(case.field,)), Patch(positions=(case.field + 1,), keys=False)]
    batched = decide_patched(model, case.nb_old, case.nb_new, specs, case.new, vocab=ids).last
    whole = decide_patched(model, case.nb_old, case.nb_new, specs, case.new).last
    assert_close(batched, whole[:, ids], what="vocab-restricted patched logits")


def test_a_weight_edited_in_place_or_replaced_is_read_on_the_next_forward(case):
    """The TransformerLens backend keeps each layer's Q/K/V and output weights packed between
    forwards; an edit (in place, or a new tensor) must reach the next decision, which must still
    equal TransformerLens's own forward. Shown failing once with the packing keyed on the tensor's
    storage alone: the in-place edit was not seen."""
    model, ids = case.model, case.ids
    attn = model.tl.blocks[0].attn
    before = decide(model, prefill(model, case.old), case.old).last[0]
    saved_q, saved_o = attn.W_Q.detach().clone(), attn.W_O.detach().clone()
    try:
        with torch.no_grad():
            gen = torch.Generator().manual_seed(0)  # noise, not a scale: a QK norm undoes a scale
            attn.W_Q.add_(torch.randn(attn.W_Q.shape, generator=gen) * attn.W_Q.std())  # in place
        edited = decide(model, prefill(model, case.old), case.old).last[0]
        assert_close(edited, full_logits(model, ids)[-1], what="decision after an in-place W_Q edit")
        assert (edited - before).abs().max() > 1e-3  # the edit moved the decision
        with torch.no_grad():
            noise = torch.randn(attn.W_O.shape, generator=gen) * attn.W_O.std()
            attn.W_O.data = attn.W_O.data + noise  # a new tensor behind the same parameter
        again = decide(model, prefill(model, case.old), case.old).last[0]
        assert_close(again, full_logits(model, ids)[-1], what="decision after W_O was replaced")
        assert (again - edited).abs().max() > 1e-3
    finally:
        with torch.no_grad():
            attn.W_Q.copy_(saved_q)
            attn.W_O.data = saved_o
    assert_close(decide(model, prefill(model, case.old), case.old).last[0], before, what="weights restored")
