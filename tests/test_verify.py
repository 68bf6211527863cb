"""`verify` reports its invariants, passes on every tiny model and on tiny Hugging Face checkpoints,
and is not vacuous: each invariant fails when the engine is made subtly wrong in the way that
invariant guards against, and the Hugging Face reference invariants fail on a wrong weight or a
corrupted notebook that every self-consistency invariant accepts."""

from __future__ import annotations

import importlib
import json
import types

import pytest
import torch
import transformers as tf

import kvnotes
from kvnotes import ops
from kvnotes.conformance import (
    DESCRIPTIONS,
    GAP_FLOOR,
    GAP_MULTIPLE,
    HF_INVARIANTS,
    SELF_INVARIANTS,
    VerifyReport,
    _hf_forward,
    _hf_result,
    _self_result,
    hf_reference,
    verify,
)
from kvnotes.engine import Capability, has, in_float64
from kvnotes.engine.float64 import hf_in_float64
from kvnotes.errors import BadArgument
from kvnotes.notebook import Notebook
from kvnotes.zoo import load_model
from kvnotes.zoo.hf import load_hf
from kvnotes.zoo.tiny import tiny_tokenizer
from tests.checkpoints import FAMILIES, _config, _randomize

# the engine modules, to monkeypatch their internals
PLAN = importlib.import_module("kvnotes.engine.plan")
TL = importlib.import_module("kvnotes.engine.transformer_lens.backend")
OPS = importlib.import_module("kvnotes.ops")
LOW = (
    pytest.mark.low_precision
)  # a bfloat16 or float16 figure: scripts/kernel_sweep.py runs it under each kernel

INVARIANTS = list(DESCRIPTIONS)


def test_verify_passes_on_every_tiny_model(model):
    """Tiny models built from a TransformerLens config skip the two Hugging Face reference
    invariants, with the reason in the report, never passed silently; tiny-gpt2 is built by
    transformers and runs them. On learned positions re-rotation is reported not applicable."""
    report = verify(model, progress=False)
    assert report.passed, report.table()
    rotary = model.facts.positions == "rotary"
    moot = [] if rotary else ["rerotation_equals_offset_prefill"]
    assert list(report.not_applicable) == moot
    assert all("learned absolute positions" in why for why in report.not_applicable.values())
    ran = [n for n in SELF_INVARIANTS if n not in moot]
    assert all(r.passed and r.max_abs_error <= r.tolerance for r in report.invariants)
    if model.hf_source is None:
        assert [r.name for r in report.invariants] == ran
        assert list(report.skipped) == list(HF_INVARIANTS)
        assert all("no Hugging Face counterpart" in why for why in report.skipped.values())
        assert "skipped" in report.table() and report.reference is None
    else:
        assert [r.name for r in report.invariants] == ran + list(HF_INVARIANTS) and not report.skipped
        assert "GPT2LMHeadModel" in report.reference
    if moot:
        assert "n/a" in report.table() and "1 not applicable" in report.table()


def test_verify_json_shape(gemma3):
    report = verify(gemma3, progress=False)
    d = json.loads(json.dumps(report.to_dict()))
    assert d["model"] == "tiny-gemma3" and d["passed"] is True
    assert len(d["invariants"]) + len(d["skipped"]) == len(INVARIANTS)
    for r in d["invariants"]:
        assert {"name", "max_abs_error", "tolerance", "passed", "worst"} <= set(r)
        assert isinstance(r["max_abs_error"], float) and isinstance(r["passed"], bool)
    assert VerifyReport.from_dict(d) == report
    assert "all invariants pass" in report.table()


def test_unknown_invariant_and_missing_reference_say_the_way_out(gemma3):
    with pytest.raises(BadArgument, match="the invariants are"):
        verify(gemma3, progress=False, only=["no_such_invariant"])
    with pytest.raises(BadArgument, match=r"no Hugging Face counterpart.*load_model\(DIR\)"):
        hf_reference(gemma3)


# --- sabotage: each invariant must catch its bug -------------------------------------------------
def _window_off_by_one(mp, model=None):
    def mask(key_pos, live, pos, window):
        out = (key_pos[None, :] <= pos[:, None]) & live[None, :]
        if window is not None:
            out &= key_pos[None, :] > pos[:, None] - window - 1  # one slot too many
        return out

    mp.setattr(PLAN, "attention_mask", mask)


def _causal_leak(mp, model=None):
    real = PLAN.attention_mask

    def mask(key_pos, live, pos, window):
        return real(key_pos, live, pos, window) | (key_pos[None, :] == pos[:, None] + 1)  # sees the next

    mp.setattr(PLAN, "attention_mask", mask)


def _stale_slot_attended(mp, model=None):
    real = PLAN.attention_mask
    # a slot whose position is being recomputed stays visible beside its fresh replacement
    mp.setattr(
        PLAN,
        "attention_mask",
        lambda key_pos, live, pos, window: real(key_pos, torch.ones_like(live), pos, window),
    )


def _rope_plus_one(mp, model=None):
    """Fresh tokens (queries and keys) rotated one position past the slots they are written to:
    relative positions within one run stay right, the stored keys and re-rotation do not."""
    real = TL.rotate_at
    mp.setattr(TL, "rotate_at", lambda attn, x, positions: real(attn, x, positions + 1))


def _rerotation_delta_off_by_one(mp, model=None):
    real = TL.TransformerLensBackend.move_keys
    mp.setattr(
        TL.TransformerLensBackend,
        "move_keys",
        lambda self, model, layer, keys, old, new: real(self, model, layer, keys, old, new + 1),
    )


def _local_base_in_global_layers(mp, model):
    """Global layers rotate with a sliding layer's RoPE tables (base 1e4 instead of 1e6)."""
    local = next(b.attn for b in model.tl.blocks if b.attn.attn_type == "local")
    real = TL.rope_tables
    mp.setattr(TL, "rope_tables", lambda attn, p: real(local if attn.attn_type == "global" else attn, p))


def _notebook_keys_off(mp, model=None):
    real = TL._attention

    def attention(model, layer, x, segments, pos, keys, fast):
        (old_k, old_v), *rest = segments
        return real(model, layer, x, [(old_k * 1.001, old_v), *rest], pos, keys, fast)  # keys read 0.1% off

    mp.setattr(TL, "_attention", attention)


def _truncate_one_early(mp, model=None):
    real = Notebook.truncate
    mp.setattr(Notebook, "truncate", lambda self, before: real(self, max(0, before - 1)))


def _patch_skips_last_layer(mp, model=None):
    real = OPS.patched_slots

    def patched_slots(dst, src, specs):
        out = real(dst, src, specs)
        last = dst.keys[-1][:, :, dst.slot_index(out.positions)].expand_as(out.keys[-1])
        return type(out)(**{**vars(out), "keys": (*out.keys[:-1], last)})

    mp.setattr(OPS, "patched_slots", patched_slots)


def _norm_eps(mp, model, eps: float):
    """Every RMSNorm's eps set to `eps` where the checkpoint says otherwise (1e-6 on every tiny
    checkpoint and on Gemma 3 270M): TransformerLens keeps it in `cfg.eps` and in each norm
    module's `eps`, transformers in each norm's `eps` or `variance_epsilon`."""
    if has(model, Capability.TRANSFORMERS_MODULE):
        modules = list(model.hf.modules())
    else:
        mp.setattr(model.tl.cfg, "eps", eps)
        modules = list(model.tl.modules())
    found = [
        (m, a) for m in modules for a in ("eps", "variance_epsilon") if isinstance(vars(m).get(a), float)
    ]
    assert found and all(abs(getattr(m, a) - eps) > eps / 2 for m, a in found), "no other eps to change"
    for m, a in found:
        mp.setattr(m, a, eps)


def _batch_shuffled(mp, model=None):
    real = OPS.patched_slots

    def patched_slots(dst, src, specs):
        out = real(dst, src, specs)
        if len(specs) == 1:
            return out
        roll = lambda ts: tuple(t.roll(1, dims=0) for t in ts)  # noqa: E731
        return type(out)(**{**vars(out), "keys": roll(out.keys), "values": roll(out.values)})

    mp.setattr(OPS, "patched_slots", patched_slots)


SABOTAGES = {
    "window-off-by-one": (_window_off_by_one, "decide_equals_full_forward"),
    "notebook-keys-off-by-0.1%": (_notebook_keys_off, "prefix_then_suffix_equals_prefill"),
    "truncate-one-slot-early": (_truncate_one_early, "suffix_recompute_equals_prefill"),
    "causal-mask-leaks-next-token": (_causal_leak, "kv_deviation_before_field_is_zero"),
    "patch-skips-last-layer": (_patch_skips_last_layer, "patch_all_reproduces_source"),
    "rope-at-position-plus-one": (_rope_plus_one, "rerotation_equals_offset_prefill"),
    "recomputed-slot-still-attended": (_stale_slot_attended, "refresh_unchanged_is_noop"),
    "batched-patches-shuffled": (_batch_shuffled, "batched_patches_equal_single"),
    "rerotation-delta-off-by-one": (_rerotation_delta_off_by_one, "rerotation_equals_offset_prefill"),
    "local-rope-base-in-global-layers": (_local_base_in_global_layers, "decide_equals_full_forward"),
}


def test_every_invariant_has_a_sabotage():
    assert {inv for _, inv in SABOTAGES.values()} == set(SELF_INVARIANTS)


@pytest.mark.parametrize("bug", list(SABOTAGES), ids=list(SABOTAGES))
def test_verify_catches_a_subtly_wrong_engine(gemma3, monkeypatch, bug):
    sabotage, invariant = SABOTAGES[bug]
    sabotage(monkeypatch, gemma3)
    report = verify(gemma3, progress=False)
    result = {r.name: r for r in report.invariants}[invariant]
    assert not result.passed, f"{invariant} did not notice {bug}: {report.table()}"
    assert result.max_abs_error > result.tolerance
    assert not report.passed
    monkeypatch.undo()
    assert verify(gemma3, progress=False).passed, "the sabotage leaked past the test"


# --- the Hugging Face reference, on tiny random checkpoints ---------------------------------------
REFERENCE_FAMILIES = ("gemma3-text", "llama-gqa")  # windows + per-layer bases + 1 KV head; 2 KV heads


def _checkpoint(tmp_path_factory, family: str):
    cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(_config(cls, extra), attn_implementation="eager")
    _randomize(hf, seed=0)
    path = tmp_path_factory.mktemp(family)
    hf.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=REFERENCE_FAMILIES, ids=REFERENCE_FAMILIES)
def checkpoint(request, tmp_path_factory):
    return _checkpoint(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def hf_gemma3(tmp_path_factory):
    """A tiny Gemma 3 checkpoint (sliding windows of 8, local/global RoPE bases), its KVModel
    and the transformers reference on verify's prompts."""
    model = load_hf(str(_checkpoint(tmp_path_factory, "gemma3-text")))
    return model, hf_reference(model)


def test_all_invariants_pass_on_a_tiny_checkpoint(checkpoint):
    report = verify(load_hf(str(checkpoint)), progress=False)
    print(report.table())  # the figures docs/engine.md quotes (pytest -rP shows them)
    assert report.passed, report.table()
    assert [r.name for r in report.invariants] == INVARIANTS and not report.skipped
    assert str(checkpoint) in report.reference
    hf = {r.name: r for r in report.invariants if r.name in HF_INVARIANTS}
    assert hf["prefill_kv_equals_transformers"].worst.split(": ")[1].startswith("layer ")
    assert all(r.max_abs_error > 0 for r in hf.values())  # two implementations: rounding, not bits


def test_a_wrong_weight_passes_every_self_check_but_not_the_reference(checkpoint):
    """One value direction 5% off in layer 1 keeps the engine consistent with itself (and with
    TransformerLens, which shares the weight); only transformers, on the checkpoint's own
    weights, tells it apart. (Not a uniform scale: Gemma's post-attention norm would undo it.)"""
    model = load_hf(str(checkpoint))
    with torch.no_grad():
        for name, p in model.tl.named_parameters():
            if name in ("blocks.1.attn.W_V", "blocks.1.attn._W_V"):
                p[..., 0].mul_(1.05)
    report = verify(model, progress=False)
    result = {r.name: r for r in report.invariants}
    assert all(result[n].passed for n in SELF_INVARIANTS), report.table()
    for name in HF_INVARIANTS:
        assert not result[name].passed and result[name].max_abs_error > result[name].tolerance
    assert "layer 1 values" in result["prefill_kv_equals_transformers"].worst
    assert not report.passed


def test_a_corrupted_notebook_fails_the_reference_at_its_layer(hf_gemma3, monkeypatch):
    model, ref = hf_gemma3
    real = OPS.prefill

    def prefill(model, prompt, **kw):
        nb = real(model, prompt, **kw)
        keys = list(nb.keys)
        keys[2] = keys[2].clone()
        keys[2][:, :, nb.n_slots // 2] += 0.01 * keys[2].abs().max()  # one slot of layer 2
        return type(nb)(**{**vars(nb), "keys": tuple(keys)})

    monkeypatch.setattr(OPS, "prefill", prefill)
    report = verify(model, progress=False, only=HF_INVARIANTS, reference=ref)
    kv, logits = report.invariants
    assert not kv.passed and kv.worst.endswith("layer 2 keys"), report.table()
    assert logits.passed  # logits come from run(), not from the corrupted prefill


# The engine bugs that change a prefill; the reference invariants must catch each of them.
PREFILL_BUGS = {
    "rope-at-position-plus-one": (_rope_plus_one, ("prefill_kv_equals_transformers",)),
    "window-off-by-one": (_window_off_by_one, HF_INVARIANTS),
    "local-rope-base-in-global-layers": (_local_base_in_global_layers, HF_INVARIANTS),
    "causal-mask-leaks-next-token": (_causal_leak, HF_INVARIANTS),
}


@pytest.mark.parametrize("bug", list(PREFILL_BUGS), ids=list(PREFILL_BUGS))
def test_the_reference_catches_engine_bugs_in_a_prefill(hf_gemma3, monkeypatch, bug):
    model, ref = hf_gemma3
    sabotage, caught_by = PREFILL_BUGS[bug]
    sabotage(monkeypatch, model)
    report = verify(model, progress=False, only=HF_INVARIANTS, reference=ref)
    for r in report.invariants:
        if r.name in caught_by:
            assert not r.passed and r.max_abs_error > r.tolerance, f"{r.name} missed {bug}: {report.table()}"
    if bug == "rope-at-position-plus-one":  # every position shifted alike: no error under RoPE
        assert {r.name: r for r in report.invariants}["logits_equal_transformers"].passed
    monkeypatch.undo()
    assert verify(model, progress=False, only=HF_INVARIANTS, reference=ref).passed


def test_the_float64_reference_is_float64_throughout(checkpoint):
    """A transformers model merely cast to float64 still rounds its norms, softmax and RoPE angles in
    float32; under `hf_in_float64` it does not, and the model is left as it came."""
    hf = tf.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager")
    ids = list(range(10, 40))
    with torch.no_grad():
        before = _hf_forward(hf, ids)[2]
        with hf_in_float64(hf):
            truth = _hf_forward(hf, ids)[2]
        after = _hf_forward(hf, ids)[2]
        cast = _hf_forward(hf.to(torch.float64), ids)[2]
    assert truth.dtype == torch.float64 and torch.equal(before, after)  # left as it came, bit for bit
    gap = (before.double() - truth).abs().max().item()
    # a float64 forward agrees with itself to float64 rounding; the mere cast keeps float32's in it
    assert (cast - truth).abs().max().item() > 1e-3 * gap > 0


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, pytest.param(torch.bfloat16, marks=LOW), pytest.param(torch.float16, marks=LOW)],
    ids=str,
)
def test_a_model_in_float64_comes_back_bit_for_bit(dtype):
    """`in_float64` (verify's truths): the engine's own prefill in float64 (a bfloat16 or float16
    weight upcast exactly), then the model's own dtype again, bit for bit."""
    model = load_model("tiny-gemma3", dtype=dtype)
    ids = list(range(3, 40))
    before = ops.prefill(model, ids)
    with torch.no_grad(), in_float64(model):
        truth = ops.prefill(model, ids)
    after = ops.prefill(model, ids)
    assert truth.keys[0].dtype == torch.float64 and model.dtype == dtype == before.keys[0].dtype
    assert all(torch.equal(a, b) for a, b in zip(before.keys + before.values, after.keys + after.values))
    err = max((a.double() - b).abs().max().item() for a, b in zip(before.keys, truth.keys))
    assert err > 0  # the model's dtype rounds; float64 is what it rounds from


def test_a_calibrated_tolerance_is_a_multiple_of_the_gap_with_a_floor():
    """Each tensor against GAP_MULTIPLE x its own float32 gap: just past it fails, just under
    passes, and a tensor float32 rounds exactly still gets GAP_FLOOR of its scale."""
    gap, scale = 1e-6, 1.0
    over = _hf_result(
        "prefill_kv_equals_transformers", [("short: layer 0 keys", GAP_MULTIPLE * gap * 1.01, scale, gap)]
    )
    under = _hf_result(
        "prefill_kv_equals_transformers", [("short: layer 0 keys", GAP_MULTIPLE * gap * 0.99, scale, gap)]
    )
    assert not over.passed and under.passed and over.gap_multiple > GAP_MULTIPLE > under.gap_multiple
    exact = _hf_result("logits_equal_transformers", [("short: logits", 0.5 * GAP_FLOOR * 10.0, 10.0, 0.0)])
    assert exact.passed and exact.tolerance == pytest.approx(GAP_FLOOR * 10.0)


# --- the public namespace ------------------------------------------------------------------------
@pytest.mark.parametrize("name", kvnotes.__all__)
def test_from_kvnotes_import_gives_the_documented_object(name):
    """`from kvnotes import run, verify` must give the functions, never a same-named submodule."""
    ns: dict = {}
    exec(f"from kvnotes import {name}", ns)
    assert not isinstance(ns[name], types.ModuleType), f"`from kvnotes import {name}` gave a module"
    assert ns[name] is getattr(importlib.import_module(kvnotes._EXPORTS[name]), name)


def test_each_tensor_is_judged_on_its_own_scale():
    """Each tensor against GAP_MULTIPLE x its own gap: an error of 1e-4 in a layer whose gap is
    1e-5 is 10x it, even when another layer's gap reaches 1e-2 (one tolerance over all layers,
    4e-2, would have let it pass)."""
    ok = ("layer 5 keys", 1e-6, 100.0, 1e-2)
    r = _self_result("prefix_then_suffix_equals_prefill", {"short": [("layer 0 keys", 1e-4, 1.0, 1e-5), ok]})
    assert not r.passed and r.worst == "short: layer 0 keys" and r.tolerance == pytest.approx(4e-5)
    assert r.gap_multiple == pytest.approx(10.0)
    r = _self_result("prefix_then_suffix_equals_prefill", {"short": [("layer 0 keys", 3e-5, 1.0, 1e-5), ok]})
    assert r.passed
    exact = _self_result("patch_all_reproduces_source", {"short": [("logits", 1e-9, 10.0)]})
    assert not exact.passed and exact.tolerance == 0.0  # exact: no tolerance is set for an exact invariant
