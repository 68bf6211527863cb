"""Edits (append, recompute, re-rotation, splice) touch exactly what they claim; metrics compute
what their docstrings say on hand-checked numbers."""

from __future__ import annotations

import math

import pytest
import torch

from kvnotes.engine import run
from kvnotes.metrics import agreement, kv_deviation, logit_cosine, logit_diff, recovery
from kvnotes.notebook import Notebook
from kvnotes.ops import append, decide, prefill, recompute, recompute_suffix, rerotate, splice
from kvnotes.zoo.tiny import TINY_CONFIGS
from tests.helpers import assert_close, assert_notebooks_close, get_model, max_kv_diff

ERRATUM = "\n[STATE UPDATE] order_status -> shipped; overrides any earlier value."


# --- append (erratum) ----------------------------------------------------------------------------
def test_append_keeps_earlier_slots_and_adds_the_next_positions(case):
    model, nb = case.model, case.nb_old
    ids = model.encode(ERRATUM, bos=False)
    out = append(model, nb, ERRATUM, span="erratum")
    n = nb.n_slots
    assert_notebooks_close(out.select(nb.positions), nb, what="slots before the erratum", exact=True)
    assert out.positions[n:].tolist() == list(range(nb.next_position, nb.next_position + len(ids)))
    assert out.tokens[0, n:].tolist() == ids
    assert out.span("erratum") == range(n, n + len(ids))
    assert out.spans["order_status"] == nb.spans["order_status"]
    # the erratum's slots are what a prefill of prompt-so-far + erratum computes there
    whole = prefill(model, case.ids[: case.stop] + ids)
    assert_notebooks_close(out, whole, what="appended slots vs prefill")


def test_append_ids_then_decide_reads_after_the_erratum(case):
    model = case.model
    ids = model.encode(ERRATUM, bos=False)
    nb = append(model, case.nb_old, ids)
    query = case.ids[case.stop :]
    expected = model.tl(torch.tensor([case.ids[: case.stop] + ids + query]))[0, -1]
    assert_close(decide(model, nb, case.old).last[0], expected, what="decision after the erratum")


# --- recompute -----------------------------------------------------------------------------------
def test_recompute_changes_only_the_chosen_slots(case):
    model, f = case.model, case.field
    chosen = [f, f + 3, case.stop - 1]
    nb = recompute(model, case.nb_old, case.new, chosen)
    rest = [p for p in range(case.stop) if p not in chosen]
    assert_notebooks_close(nb.select(rest), case.nb_old.select(rest), what="other slots", exact=True)
    for p in chosen:
        assert max_kv_diff(nb.select([p]), case.nb_old.select([p])) > 1e-3, f"slot {p} unchanged"
    assert nb.positions.tolist() == case.nb_old.positions.tolist(), "slots are replaced in place"


def test_recompute_everything_from_the_field_equals_prefill_of_edited(case):
    nb = recompute(case.model, case.nb_old, case.new, range(case.field, case.stop))
    assert_notebooks_close(nb, case.nb_new, what="recompute field..end")


def test_recompute_unchanged_prompt_is_noop(case):
    nb = recompute(case.model, case.nb_old, case.old, [2, case.field, case.stop - 1])
    assert_notebooks_close(nb, case.nb_old, what="recompute with the same tokens")


def test_recompute_suffix_from_a_position(case):
    nb = recompute_suffix(case.model, case.nb_old, case.new, case.field)
    assert_notebooks_close(nb, case.nb_new, what="suffix recompute from an int position")


# --- re-rotation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("q", [3, 40, 400], ids=lambda q: f"q={q}")
def test_rerotate_round_trip_restores_keys_and_never_touches_values(rotary_case, q):
    """RoPE models only: a learned-position model refuses the move (test_learned_positions.py)."""
    case = rotary_case
    model, nb = case.model, case.nb_old
    there = rerotate(model, nb, q)
    back = rerotate(model, there, nb.positions)
    assert there.positions.tolist() == (nb.positions + q).tolist()
    assert back.positions.tolist() == nb.positions.tolist()
    for l in range(nb.n_layers):
        assert torch.equal(there.values[l], nb.values[l]) and torch.equal(back.values[l], nb.values[l])
        torch.testing.assert_close(back.keys[l], nb.keys[l], rtol=0, atol=2e-6)
    assert max((a - b).abs().max().item() for a, b in zip(there.keys, nb.keys)) > 0.1
    assert there.spans["order_status"] == tuple(x + q for x in nb.spans["order_status"])
    assert torch.equal(there.tokens, nb.tokens)


def test_rerotate_by_int_equals_explicit_positions(rotary_case):
    case = rotary_case
    nb = case.nb_old.truncate(10)
    a = rerotate(case.model, nb, 5)
    b = rerotate(case.model, nb, torch.arange(5, 15))
    assert_notebooks_close(a, b, what="int offset vs positions", exact=True)


def test_rerotate_keeps_partial_rotary_dims_fixed():
    neox = get_model("tiny-neox")
    rd = TINY_CONFIGS["tiny-neox"]["rotary_dim"]
    nb = prefill(neox, neox.encode("order_status: pending."))
    moved = rerotate(neox, nb, 50)
    for l in range(nb.n_layers):
        assert torch.equal(moved.keys[l][..., rd:], nb.keys[l][..., rd:]), "non-rotary dims moved"
        assert not torch.equal(moved.keys[l][..., :rd], nb.keys[l][..., :rd])


# --- splice --------------------------------------------------------------------------------------
@pytest.mark.parametrize("offset", [None, 100], ids=["after-host", "offset-100"])
def test_splice_positions_are_contiguous_after_the_host(rotary_case, offset):
    case = rotary_case
    model = case.model
    host = prefill(model, case.ids[:10])
    chunk = prefill(model, case.old, upto="order_status", offset=0)  # a chunk with spans
    chunk = chunk.select(range(1, chunk.n_slots))  # drop its BOS
    out = splice(model, host, chunk, offset=offset, seam=2)
    start = 10 if offset is None else offset
    assert out.positions.tolist() == list(range(10)) + list(range(start, start + chunk.n_slots))
    assert torch.equal(out.tokens[0, 10:], chunk.tokens[0])
    a, b = case.old.spans["policy"]
    assert out.spans["policy"] == (a - 1 + start, b - 1 + start)


def test_splice_seam_recomputes_exactly_the_first_b_tokens(rotary_case):
    case = rotary_case
    model = case.model
    host, chunk = prefill(model, case.ids[:10]), prefill(model, case.ids[10:30])
    s0, s3 = splice(model, host, chunk), splice(model, host, chunk, seam=3)
    diff = kv_deviation(s0, s3)[0].amax(0)  # per slot, worst layer
    assert (diff[:10] == 0).all() and (diff[10:13] > 0).all() and (diff[13:] == 0).all()
    # the repaired seam slots are what a prefill of host + chunk computes there
    whole = prefill(model, case.ids[:30])
    assert_notebooks_close(s3.select(range(10, 13)), whole.select(range(10, 13)), what="seam slots")


# --- metrics on hand-computed tensors ------------------------------------------------------------
def test_logit_diff():
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, -1.0, 4.0]])
    # exact: small integers in float32
    assert logit_diff(logits, 1, 2).tolist() == [1.0, -5.0]


def test_recovery():
    got = recovery(
        torch.tensor([0.5, 2.0, -1.0]), torch.tensor([0.0, 0.0, 1.0]), torch.tensor([2.0, 2.0, 3.0])
    )
    # exact: halves and integers in float32
    assert got.tolist() == [0.25, 1.0, -1.0]
    # exact: (1 - 1) / (0 - 1) is 0 in any float
    assert recovery(torch.tensor(1.0), torch.tensor(1.0), torch.tensor(0.0)).item() == 0.0
    with pytest.raises(ValueError, match="old and new metrics are equal"):
        recovery(torch.tensor([0.3, 0.5]), torch.tensor([1.0, 2.0]), torch.tensor([2.0, 2.0]))


def test_logit_cosine():
    a = torch.tensor([[1.0, 0.0], [1.0, 1.0], [3.0, 4.0]])
    b = torch.tensor([[0.0, 2.0], [2.0, 2.0], [-3.0, -4.0]])
    got = logit_cosine(a, b)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor([0.0, 1.0, -1.0], dtype=torch.float64))
    assert math.isclose(
        logit_cosine(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])).item(),
        1 / math.sqrt(2),
        rel_tol=1e-12,
    )


def test_agreement():
    a = torch.tensor([[5.0, 1.0, 2.0], [0.0, 1.0, 2.0]])
    b = torch.tensor([[4.0, 0.0, 9.0], [0.0, 3.0, 2.0]])
    assert agreement(a, b).tolist() == [False, False]
    assert agreement(a, a).tolist() == [True, True]
    assert agreement(a, b, answers=(0, 1)).tolist() == [True, True]
    assert agreement(a, b, answers=(1, 2)).tolist() == [True, False]


def _hand_nb(keys, values, positions) -> Notebook:
    k = torch.tensor(keys, dtype=torch.float32)[None, None]  # [1, 1, slot, d_head]
    v = torch.tensor(values, dtype=torch.float32)[None, None]
    return Notebook(
        keys=(k,),
        values=(v,),
        positions=torch.tensor(positions),
        tokens=torch.zeros(1, len(positions), dtype=torch.long),
        fingerprint="hand",
        model_name="hand",
    )


def test_kv_deviation_by_hand():
    a = _hand_nb([[0.0, 0.0], [1.0, 1.0]], [[0.0, 0.0], [2.0, 2.0]], [0, 1])
    b = _hand_nb([[3.0, 0.0], [1.0, 1.0]], [[0.0, 4.0], [2.0, 2.0]], [0, 1])
    dev = kv_deviation(a, b)
    assert dev.shape == (1, 1, 2)
    # exact: sqrt(3^2 + 4^2) and an identical slot
    assert dev[0, 0].tolist() == [5.0, 0.0]
    # slots are matched by position, not by order
    b_rev = b.select([1, 0])
    # exact: the same 3-4-5 numbers
    assert kv_deviation(a, b_rev)[0, 0].tolist() == [5.0, 0.0]
    # exact: the same 3-4-5 numbers
    assert kv_deviation(b_rev, a)[0, 0].tolist() == [0.0, 5.0]  # follows the first's slot order


def test_kv_deviation_of_model_notebooks_is_symmetric_and_zero_on_self(gcase):
    d = kv_deviation(gcase.nb_old, gcase.nb_new)
    assert torch.equal(d, kv_deviation(gcase.nb_new, gcase.nb_old))
    # exact: a notebook against itself subtracts equal numbers
    assert kv_deviation(gcase.nb_old, gcase.nb_old).max().item() == 0.0


# --- edits of nothing (engine bug, reported: `run` of zero tokens crashes) -----------------------
EMPTY_EDITS = {
    "prefill-upto-0": lambda c: (prefill(c.model, c.old, upto=0), Notebook.empty(c.model)),
    "run-no-tokens": lambda c: (run(c.model, c.nb_old, [], [], logits_at=())[0], c.nb_old),
    "recompute_suffix-at-end": lambda c: (
        recompute_suffix(c.model, c.nb_old, c.new, c.stop),
        c.nb_old,
    ),
    "append-nothing": lambda c: (append(c.model, c.nb_old, []), c.nb_old),
}


@pytest.mark.parametrize("edit", list(EMPTY_EDITS), ids=list(EMPTY_EDITS))
def test_edit_of_nothing_is_a_noop(gcase, edit):
    got, expected = EMPTY_EDITS[edit](gcase)
    assert_notebooks_close(got, expected, what=edit, exact=True)
