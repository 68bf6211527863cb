"""`verify` reports the eight invariants, passes on every tiny model, and is not vacuous: each
invariant fails when the engine is made subtly wrong in the way that invariant guards against."""

from __future__ import annotations

import importlib
import json
import types

import pytest
import torch

import kvnotes
from kvnotes.conformance import DESCRIPTIONS, VerifyReport, verify
from kvnotes.notebook import Notebook

# the engine modules, to monkeypatch their internals
RUN = importlib.import_module("kvnotes.engine")
ROPE = importlib.import_module("kvnotes.rope")
OPS = importlib.import_module("kvnotes.ops")

INVARIANTS = list(DESCRIPTIONS)


def test_verify_passes_on_every_tiny_model(model):
    report = verify(model, progress=False)
    assert report.passed, report.table()
    assert [r.name for r in report.invariants] == INVARIANTS
    assert all(r.passed and r.max_abs_error <= r.tolerance for r in report.invariants)


def test_verify_json_shape(gemma3):
    report = verify(gemma3, progress=False)
    d = json.loads(json.dumps(report.to_dict()))
    assert d["model"] == "tiny-gemma3" and d["passed"] is True
    assert len(d["invariants"]) == 8
    for r in d["invariants"]:
        assert {"name", "max_abs_error", "tolerance", "passed"} <= set(r)
        assert isinstance(r["max_abs_error"], float) and isinstance(r["passed"], bool)
    assert VerifyReport.from_dict(d) == report
    assert "all invariants pass" in report.table()


# --- sabotage: each invariant must catch its bug -------------------------------------------------
def _window_off_by_one(mp):
    def masks(model, nb, pos):
        key_pos = torch.cat([nb.positions, pos])
        live = torch.cat([~torch.isin(nb.positions, pos), torch.ones_like(pos, dtype=torch.bool)])
        causal = (key_pos[None, :] <= pos[:, None]) & live[None, :]
        out = {None: causal}
        for l in range(model.n_layers):
            w = model.window(l)
            if w is not None:
                out[w] = causal & (key_pos[None, :] > pos[:, None] - w - 1)  # one slot too many
        return out

    mp.setattr(RUN, "_masks", masks)


def _causal_leak(mp):
    real = RUN._masks

    def masks(model, nb, pos):
        out = real(model, nb, pos)
        key_pos = torch.cat([nb.positions, pos])
        leak = key_pos[None, :] == pos[:, None] + 1  # each token also sees the next one
        return {w: m | leak for w, m in out.items()}

    mp.setattr(RUN, "_masks", masks)


def _stale_slot_attended(mp):
    real = RUN._masks

    def masks(model, nb, pos):
        out = real(model, nb, pos)
        stale = torch.cat([torch.isin(nb.positions, pos), torch.zeros_like(pos, dtype=torch.bool)])
        key_pos = torch.cat([nb.positions, pos])
        see = stale[None, :] & (key_pos[None, :] <= pos[:, None])
        return {w: m | see for w, m in out.items()}

    mp.setattr(RUN, "_masks", masks)


def _rope_plus_one(mp):
    real = ROPE.rotate
    mp.setattr(ROPE, "rotate", lambda attn, x, positions: real(attn, x, positions + 1))


def _notebook_keys_off(mp):
    real = RUN._attention

    def attention(model, layer, x, old_k, old_v, pos, mask):
        return real(model, layer, x, old_k * 1.001, old_v, pos, mask)  # keys read 0.1% off

    mp.setattr(RUN, "_attention", attention)


def _truncate_one_early(mp):
    real = Notebook.truncate
    mp.setattr(Notebook, "truncate", lambda self, before: real(self, max(0, before - 1)))


def _patch_skips_last_layer(mp):
    real = OPS.patch_batch

    def patch_batch(dst, src, specs):
        out = real(dst, src, specs)
        keys = (*out.keys[:-1], dst.keys[-1].expand_as(out.keys[-1]))
        return type(out)(**{**vars(out), "keys": keys})

    mp.setattr(OPS, "patch_batch", patch_batch)


def _batch_shuffled(mp):
    real = OPS.patch_batch

    def patch_batch(dst, src, specs):
        out = real(dst, src, specs)
        if len(specs) == 1:
            return out
        roll = lambda ts: tuple(t.roll(1, dims=0) for t in ts)  # noqa: E731
        return type(out)(**{**vars(out), "keys": roll(out.keys), "values": roll(out.values)})

    mp.setattr(OPS, "patch_batch", patch_batch)


SABOTAGES = {
    "window-off-by-one": (_window_off_by_one, "decide_equals_full_forward"),
    "notebook-keys-off-by-0.1%": (_notebook_keys_off, "prefix_then_suffix_equals_prefill"),
    "truncate-one-slot-early": (_truncate_one_early, "suffix_recompute_equals_prefill"),
    "causal-mask-leaks-next-token": (_causal_leak, "kv_deviation_before_field_is_zero"),
    "patch-skips-last-layer": (_patch_skips_last_layer, "patch_all_reproduces_source"),
    "rope-at-position-plus-one": (_rope_plus_one, "rerotation_equals_offset_prefill"),
    "recomputed-slot-still-attended": (_stale_slot_attended, "refresh_unchanged_is_noop"),
    "batched-patches-shuffled": (_batch_shuffled, "batched_patches_equal_single"),
}


def test_every_invariant_has_a_sabotage():
    assert sorted(inv for _, inv in SABOTAGES.values()) == sorted(INVARIANTS)


@pytest.mark.parametrize("bug", list(SABOTAGES), ids=list(SABOTAGES))
def test_verify_catches_a_subtly_wrong_engine(gemma3, monkeypatch, bug):
    sabotage, invariant = SABOTAGES[bug]
    sabotage(monkeypatch)
    report = verify(gemma3, progress=False)
    result = {r.name: r for r in report.invariants}[invariant]
    assert not result.passed, f"{invariant} did not notice {bug}: {report.table()}"
    assert result.max_abs_error > result.tolerance
    assert not report.passed
    monkeypatch.undo()
    assert verify(gemma3, progress=False).passed, "the sabotage leaked past the test"


# --- the public namespace ------------------------------------------------------------------------
@pytest.mark.parametrize("name", kvnotes.__all__)
def test_from_kvnotes_import_gives_the_documented_object(name):
    """`from kvnotes import run, verify` must give the functions, never a same-named submodule."""
    ns: dict = {}
    exec(f"from kvnotes import {name}", ns)
    assert not isinstance(ns[name], types.ModuleType), f"`from kvnotes import {name}` gave a module"
    assert ns[name] is getattr(importlib.import_module(kvnotes._EXPORTS[name]), name)
