"""The Notebook object: immutability, safetensors persistence, and its tensor surgery."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from kvnotes.engine import run
from kvnotes.errors import CorruptNotebook, FingerprintMismatch, OutOfRange
from kvnotes.metrics import kv_deviation
from kvnotes.notebook import Notebook
from kvnotes.ops import (
    Patch,
    append,
    decide,
    decide_patched,
    patch,
    patch_batch,
    prefill,
    recompute,
    recompute_suffix,
    refresh,
    rerotate,
    splice,
)
from tests.helpers import assert_notebooks_close, get_model, make_case


def _snapshot(nb: Notebook) -> list[torch.Tensor]:
    return [t.clone() for t in (*nb.keys, *nb.values, nb.positions, nb.tokens)]


def _unchanged(nb: Notebook, snap: list[torch.Tensor]) -> bool:
    now = (*nb.keys, *nb.values, nb.positions, nb.tokens)
    return len(now) == len(snap) and all(torch.equal(a, b) for a, b in zip(now, snap))


# --- immutability --------------------------------------------------------------------------------
# Every entry takes (case, notebook, tmp_path), the arguments the test passes; most use only some.
OPS = {
    "run-append": lambda c, nb, tmp: run(c.model, nb, [5, 6], [nb.next_position, nb.next_position + 1]),
    "run-replace": lambda c, nb, tmp: run(c.model, nb, c.ids[3:6], [3, 4, 5]),
    "run-no-write": lambda c, nb, tmp: run(c.model, nb, c.ids[3:6], [3, 4, 5], write=False),
    "run-batch": lambda c, nb, tmp: run(c.model, nb, torch.tensor([c.ids[3:5]] * 3), [3, 4]),
    "run-replace-expanded": lambda c, nb, tmp: run(c.model, nb.expand(2), c.ids[3:6], [3, 4, 5]),
    "decide": lambda c, nb, tmp: decide(c.model, nb, c.old),
    "patch": lambda c, nb, tmp: patch(nb, c.nb_new, Patch(positions=(c.field,))),
    "patch-src": lambda c, nb, tmp: patch(c.nb_new, nb, Patch()),
    "patch_batch": lambda c, nb, tmp: patch_batch(nb, c.nb_new, [Patch(), Patch(keys=False)]),
    "decide_patched": lambda c, nb, tmp: decide_patched(
        c.model, nb, c.nb_new, [Patch(), Patch(layers=(0,))], c.new
    ),
    "recompute": lambda c, nb, tmp: recompute(c.model, nb, c.new, [c.field, c.field + 2]),
    "refresh": lambda c, nb, tmp: refresh(c.model, nb, c.new, "order_status"),
    "recompute_suffix": lambda c, nb, tmp: recompute_suffix(c.model, nb, c.new, "order_status"),
    "append": lambda c, nb, tmp: append(c.model, nb, " deny."),
    "rerotate": lambda c, nb, tmp: rerotate(c.model, nb, 7),
    "splice-host": lambda c, nb, tmp: splice(c.model, nb, prefill(c.model, c.ids[1:9]), seam=3),
    "splice-chunk": lambda c, nb, tmp: splice(
        c.model, prefill(c.model, c.ids[:4]), nb.select(range(10, 20)), seam=2
    ),
    "select": lambda c, nb, tmp: nb.select([5, 3, 1]),
    "truncate": lambda c, nb, tmp: nb.truncate(10),
    "concat": lambda c, nb, tmp: nb.truncate(10).concat(nb.select(range(10, 20))),
    "expand": lambda c, nb, tmp: nb.expand(3),
    "stack": lambda c, nb, tmp: Notebook.stack([nb, nb]),
    "index": lambda c, nb, tmp: nb[0],
    "kv_deviation": lambda c, nb, tmp: kv_deviation(nb, c.nb_new),
    "save": lambda c, nb, tmp: nb.save(tmp / "nb.safetensors"),
}


@pytest.mark.parametrize("op", list(OPS), ids=list(OPS))
def test_ops_never_mutate_their_input(gemma3, op, tmp_path):
    c = make_case(gemma3)  # fresh notebooks: a mutation must not leak into other tests
    nb = c.nb_old
    snap, snap_new = _snapshot(nb), _snapshot(c.nb_new)
    OPS[op](c, nb, tmp_path)
    assert _unchanged(nb, snap), f"{op} mutated its input notebook"
    assert _unchanged(c.nb_new, snap_new), f"{op} mutated its source notebook"


def test_notebook_is_frozen(gcase):
    with pytest.raises(dataclasses.FrozenInstanceError):
        gcase.nb_old.positions = torch.arange(3)


def test_shapes_and_facts(gcase):
    nb, m = gcase.nb_old, gcase.model
    assert nb.n_layers == m.n_layers and nb.batch == 1 and nb.n_slots == gcase.stop
    assert nb.keys[0].shape == (1, m.n_kv_heads, gcase.stop, m.d_head)
    assert nb.next_position == gcase.stop
    assert Notebook.empty(m).next_position == 0 and Notebook.empty(m).n_slots == 0
    assert list(nb.span("order_status")) == list(gcase.old.span("order_status"))
    assert "decision" not in nb.spans  # prefill stops before the decision span
    with pytest.raises(KeyError, match="no span 'nope'"):
        nb.span("nope")


# --- persistence ---------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["prefilled", "shuffled-slots", "batch-2"])
def test_save_load_round_trip(gcase, tmp_path, variant):
    nb = {
        "prefilled": gcase.nb_old,
        "shuffled-slots": gcase.nb_old.select(torch.randperm(gcase.stop)),
        "batch-2": Notebook.stack([gcase.nb_old, gcase.nb_new]),
    }[variant]
    path = nb.save(tmp_path / "nb.safetensors")
    back = Notebook.load(path, model=gcase.model)
    assert back.fingerprint == nb.fingerprint and back.model_name == nb.model_name
    assert dict(back.spans) == dict(nb.spans) and back.spans
    assert torch.equal(back.positions, nb.positions) and torch.equal(back.tokens, nb.tokens)
    for a, b in zip((*back.keys, *back.values), (*nb.keys, *nb.values)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(decide(gcase.model, back, gcase.old).last, decide(gcase.model, nb, gcase.old).last)


def _valid_file(gcase, tmp_path):
    return gcase.nb_old.save(tmp_path / "ok.safetensors")


CORRUPTIONS = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]),
    "garbage": lambda p: p.write_bytes(b"this is not a safetensors file at all" * 10),
    "empty-file": lambda p: p.write_bytes(b""),
    "no-kvnotes-header": lambda p: save_file({"keys.0": torch.zeros(1, 1, 1, 1)}, str(p)),
    "foreign-format": lambda p: save_file(
        {"x": torch.zeros(1)},
        str(p),
        metadata={"kvnotes": json.dumps({"format": "other", "version": 1})},
    ),
    "header-not-json": lambda p: save_file({"x": torch.zeros(1)}, str(p), metadata={"kvnotes": "{oops"}),
}


@pytest.mark.parametrize("how", list(CORRUPTIONS), ids=list(CORRUPTIONS))
def test_corrupted_file_raises_corrupt_notebook(gcase, tmp_path, how):
    path = _valid_file(gcase, tmp_path)
    CORRUPTIONS[how](path)
    with pytest.raises(CorruptNotebook, match=r"ok\.safetensors") as info:
        Notebook.load(path)
    msg = str(info.value)
    assert "re-create" in msg or "unknown format" in msg, msg


def test_missing_tensor_in_file_raises_corrupt_notebook(gcase, tmp_path):
    from safetensors import safe_open

    path = _valid_file(gcase, tmp_path)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "values.2"}
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(CorruptNotebook, match="values.2"):
        Notebook.load(path)


def test_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="no notebook"):
        Notebook.load(tmp_path / "absent.safetensors")


def test_load_for_another_model_raises_fingerprint_mismatch(gcase, tmp_path):
    path = _valid_file(gcase, tmp_path)
    with pytest.raises(FingerprintMismatch, match="tiny-gemma3.*tiny-llama"):
        Notebook.load(path, model=get_model("tiny-llama"))


# --- surgery -------------------------------------------------------------------------------------
def test_select_keeps_order_and_whole_spans(gcase):
    nb, f = gcase.nb_old, gcase.field
    sel = nb.select([f, 2, 0])
    assert sel.positions.tolist() == [f, 2, 0]
    assert sel.tokens[0].tolist() == [gcase.ids[f], gcase.ids[2], gcase.ids[0]]
    for l in range(nb.n_layers):
        assert torch.equal(sel.keys[l][:, :, 1], nb.keys[l][:, :, 2])
    assert set(sel.spans) == {"order_status"}  # policy span is only partly kept -> dropped
    with pytest.raises(OutOfRange, match=r"position\(s\) \[999\] not in this notebook"):
        nb.select([1, 999])


def test_truncate_drops_positions_from_before_on(gcase):
    t = gcase.nb_old.truncate(gcase.field)
    assert t.positions.tolist() == list(range(gcase.field))
    assert "order_status" not in t.spans and "policy" in t.spans
    assert gcase.nb_old.truncate(10**6).n_slots == gcase.nb_old.n_slots
    assert gcase.nb_old.truncate(0).n_slots == 0


def test_truncate_and_select_on_an_empty_notebook(gemma3):
    """Engine bug (reported): `slot_index` argmaxes over a zero-size axis on an empty notebook."""
    empty = Notebook.empty(gemma3)
    assert empty.truncate(5).n_slots == 0
    assert empty.select([]).n_slots == 0


def test_concat_joins_and_refuses_collisions(gcase):
    nb = gcase.nb_old
    a, b = nb.truncate(10), nb.select(range(10, nb.n_slots))
    joined = a.concat(b)
    assert_notebooks_close(joined, nb, what="concat of a split", exact=True)
    assert set(joined.spans) >= {"order_status"}
    with pytest.raises(OutOfRange, match=r"both notebooks hold position\(s\) \[8, 9\]"):
        a.concat(nb.select([8, 9, 10]))
    with pytest.raises(FingerprintMismatch, match="different models"):
        a.concat(_llama_nb(gcase, 10))


def _llama_nb(gcase, offset: int) -> Notebook:
    return prefill(get_model("tiny-llama"), gcase.ids[:3], offset=offset)


def test_expand_stack_and_index(gcase):
    nb, nb2 = gcase.nb_old, gcase.nb_new
    e = nb.expand(3)
    assert e.batch == 3 and e.keys[0].shape[0] == 3
    assert e.keys[0].data_ptr() == nb.keys[0].data_ptr(), "expand must be a view"
    assert nb.expand(1) is nb
    with pytest.raises(ValueError, match="cannot expand a batch of 3 to 2"):
        e.expand(2)
    s = Notebook.stack([nb, nb2, nb])
    assert s.batch == 3
    assert_notebooks_close(s[1], nb2, what="stack[1]", exact=True)
    assert_notebooks_close(s[2], nb, what="stack[2]", exact=True)
    assert s[0:2].batch == 2 and torch.equal(s[0:2].keys[1][1], nb2.keys[1][0])
    with pytest.raises(ValueError, match="same positions"):
        Notebook.stack([nb, nb.truncate(5)])
    with pytest.raises(FingerprintMismatch):
        Notebook.stack([nb.truncate(3), prefill(get_model("tiny-llama"), gcase.ids[:3])])


def test_constructor_rejects_inconsistent_shapes(gcase):
    nb = gcase.nb_old
    with pytest.raises(CorruptNotebook, match="layer 0"):
        dataclasses.replace(nb, keys=(nb.keys[0][:, :, :3], *nb.keys[1:]))
    with pytest.raises(CorruptNotebook, match="key layers"):
        dataclasses.replace(nb, keys=nb.keys[:-1])
