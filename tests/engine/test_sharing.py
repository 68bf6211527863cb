"""What analyses share, checked against computing it all again: a prefix prefilled once and
extended (invariant 2), the default patch batches, and a batch resumed at its lowest patched
layer from the unpatched decision's residual. Every RoPE variant; float32 tolerances
(`tests.helpers.assert_close`), as the parity suite uses."""

from __future__ import annotations

import pytest
import torch

from kvnotes import ops
from kvnotes.batches import MAX_ROWS
from kvnotes.engine import Resume, run
from kvnotes.engine.profile import label, profile
from kvnotes.errors import BadArgument, OutOfRange, ShapeMismatch
from kvnotes.ops import (
    Patch,
    Prefixes,
    common_prefix,
    decide,
    decide_patched,
    patch,
    patch_batches,
    prefill,
    query_tokens,
)
from tests.helpers import assert_close, assert_notebooks_close


def _sweep(case) -> list[Patch]:
    """Single slots, single layers and slot x layer patches over the field and what follows it."""
    L, stop = case.model.n_layers, case.stop
    after = list(range(case.field, stop))
    return (
        [Patch(positions=(p,)) for p in after[:4]]
        + [Patch(positions=tuple(after), layers=(l,)) for l in range(L)]
        + [Patch(positions=(p,), layers=(l,)) for p in after[:3] for l in range(L)]
        + [Patch(positions=tuple(after), layers=(L - 1,), keys=False)]
    )


def _one_at_a_time(case, specs) -> torch.Tensor:
    rows = [decide(case.model, patch(case.nb_old, case.nb_new, s), case.new).last[0] for s in specs]
    return torch.stack(rows)


# --- a prefix prefilled once -------------------------------------------------------------------
def test_a_prompt_prefilled_through_a_kept_one_equals_prefill(case):
    shared = Prefixes(case.model)
    first = shared.prefill(case.ids[: case.field + 2])  # shares the start up to the field and 2 more
    assert_notebooks_close(first, case.nb_old.truncate(case.field + 2), what="a start, prefilled")
    nb = shared.prefill(case.old)
    assert_notebooks_close(nb, case.nb_old, what="kept start + the rest vs prefill")
    assert nb.spans == case.nb_old.spans
    assert shared.computed == case.stop


def test_a_pair_pays_once_for_the_start_its_prompts_share(case):
    shared = Prefixes(case.model)
    old, new = shared.prefill(case.old), shared.prefill(case.new)
    assert_notebooks_close(old, case.nb_old, what="old prompt")
    assert_notebooks_close(new, case.nb_new, what="new prompt, cut from the old one's start")
    start = common_prefix([case.old.ids[: case.stop], case.new.ids[: case.stop]])
    assert start == case.field  # the prompts differ from the changed field on
    assert shared.computed == start + 2 * (case.stop - start)
    assert shared.longest(case.ids[: case.field])[1].n_slots == case.field


def test_a_prompt_prefilled_and_decided_in_one_forward_equals_prefill_then_decide(case):
    shared = Prefixes(case.model)
    old, old_logits = shared.prefill_and_decide(case.old)
    new, new_logits = shared.prefill_and_decide(case.new, vocab=(3, 5))
    assert_notebooks_close(old, case.nb_old, what="the notebook, its decision slots dropped")
    assert_notebooks_close(new, case.nb_new, what="the new prompt's notebook, cut from the old one's")
    assert new.spans == case.nb_new.spans and new.n_slots == case.stop
    assert_close(
        old_logits, decide(case.model, case.nb_old, case.old).last, what="decision read in the prefill"
    )
    want = decide(case.model, case.nb_new, case.new, vocab=(3, 5)).last
    assert_close(new_logits, want, what="the new prompt's decision, two columns")
    assert shared.computed == case.field + 2 * (case.stop - case.field)  # the decisions add no slots


def test_prefill_and_decide_refuses_a_prompt_without_a_decision(case):
    with pytest.raises(BadArgument, match="decision span"):
        Prefixes(case.model).prefill_and_decide(case.ids[: case.stop])


def test_a_decision_with_its_field_recomputed_in_the_same_forward_equals_refresh_then_decide(case):
    field = case.new.span("order_status")
    one = ops.decide_recomputed(case.model, case.nb_old, case.new, field).last
    two = decide(case.model, ops.refresh(case.model, case.nb_old, case.new, "order_status"), case.new).last
    assert_close(one, two, what="field recomputed in the decision's forward vs refresh then decide")
    stale = decide(case.model, case.nb_old, case.new).last
    assert (one - stale).abs().max() > 1e-4  # the recomputed field is read, not the stale slot
    with pytest.raises(OutOfRange):
        ops.decide_recomputed(case.model, case.nb_old, case.new, [len(case.ids) + 3])


# --- the default batches and resumed batches ---------------------------------------------------
def test_default_batches_equal_one_patch_at_a_time(case):
    specs = _sweep(case)
    batched = decide_patched(case.model, case.nb_old, case.nb_new, specs, case.new).last
    assert_close(batched, _one_at_a_time(case, specs), what="default batches (resumed) vs single patches")
    assert (batched - batched[0]).abs().amax(-1).max() > 1e-3  # the sweep is not degenerate


def test_a_batch_resumed_one_layer_too_late_is_caught(case, monkeypatch):
    """The parity check above fails on a planted fault: each patch resumed one layer above the
    layer it patches, so that it is never read."""
    after = tuple(range(case.field, case.stop))
    specs = [Patch(positions=after, layers=(l,)) for l in range(case.model.n_layers - 1)]
    right = _one_at_a_time(case, specs)
    real = ops.first_layer
    monkeypatch.setattr(ops, "first_layer", lambda s, n: real(s, n) + 1)
    wrong = decide_patched(case.model, case.nb_old, case.nb_new, specs, case.new, batch_size=1).last
    with pytest.raises(AssertionError, match="resumed"):
        assert_close(wrong, right, what="resumed")


def test_batches_keep_the_order_and_the_limits(case, monkeypatch):
    specs = [Patch(positions=(p,)) for p in range(case.stop)] * 20
    batches = patch_batches(case.nb_old, specs, 2)
    assert [i for b in batches for i in b] == list(range(len(specs)))
    assert max(len(b) for b in batches) <= MAX_ROWS
    per_slot = sum(k.shape[1] * k.shape[-1] * k.element_size() for k in case.nb_old.keys) * 2
    monkeypatch.setattr(ops, "OVERLAY_BYTES", 8 * per_slot)  # room for 8 one-slot rows at most
    small = patch_batches(case.nb_old, specs, 2)
    assert max(len(b) for b in small) <= 8 and [i for b in small for i in b] == list(range(len(specs)))


def test_later_first_layers_get_batches_of_their_own(case):
    """Rows resumed at the last layer are cheap: the batching does not start them at layer 0."""
    L = case.model.n_layers
    first = [0] * 4 + [L - 1] * 60
    batches = patch_batches(case.nb_old, [Patch(positions=(case.field,))] * len(first), 1, first)
    assert all(len({first[i] for i in b}) == 1 for b in batches), batches


def test_resume_refuses_writes_and_wrong_shapes(case):
    model, nb = case.model, case.nb_old
    ids, pos = query_tokens(model, nb, case.old)
    ok = torch.zeros(1, len(ids), model.facts.d_model)
    with pytest.raises(BadArgument, match="write=False"):
        run(model, nb, ids, pos, resume=Resume(1, ok))
    with pytest.raises(ShapeMismatch, match="d_model"):
        run(model, nb, ids, pos, write=False, resume=Resume(1, ok[..., :-1]))
    with pytest.raises(OutOfRange, match="resume layer"):
        run(model, nb, ids, pos, write=False, resume=Resume(model.n_layers, ok))


def test_the_profile_files_each_call_under_its_operation_and_analysis(case):
    with profile() as p, label("mine"):
        nb = prefill(case.model, case.old)
        decide(case.model, nb, case.old)
    assert [(c.op, c.label) for c in p.calls] == [("prefill", "mine"), ("decide", "mine")]
    assert p.calls[0].tokens == case.stop and p.seconds > 0
    assert "prefill" in p.table(("op",))
    # the matmuls' work, counted from the widths: a prefill of n tokens costs about n decisions'
    # blocks (within the attention and unembedding terms, a few percent apart)
    f = case.model.facts
    per_token_block = 2 * (
        f.d_model * (f.n_heads + 2 * f.n_kv_heads) * f.d_head
        + f.n_heads * f.d_head * f.d_model
        + (0 if f.d_mlp is None else (3 if f.gated_mlp else 2) * f.d_model * f.d_mlp)  # None: no MLP
    )
    blocks = p.calls[0].tokens * f.n_layers * per_token_block / 1e9
    assert 1.0 < p.calls[0].gflop / blocks < 1.5, (p.calls[0].gflop, blocks)
    assert p.gflop == pytest.approx(sum(c.gflop for c in p.calls), rel=1e-12)
    # a run resumed at layer l runs only the blocks from l on: its block work is (L - l) / L of the
    # same run from block 0 (the unembedding, the same in both, taken out; rel 1e-9: float sums)
    model, L = case.model, case.model.n_layers
    ids, pos = query_tokens(model, nb, case.old)
    l = L // 2
    resid = torch.zeros(1, len(ids), model.facts.d_model)
    with profile() as q:
        run(model, nb, ids, pos, write=False, logits_at=())
        run(model, nb, ids, pos, write=False, logits_at=(), resume=Resume(l, resid))
    full, resumed = (c.gflop for c in q.calls)
    assert resumed == pytest.approx(full * (L - l) / L, rel=1e-9), (full, resumed)
