"""`verify` on the embedded Gemma 3 270M: all ten invariants pass against transformers' own
Gemma3ForCausalLM on the same GGUF weights (in float64, the truth; in float32 for the rounding gap
that sizes each tensor's tolerance), and the planted engine bugs of tests/test_verify.py make their
invariants fail on real weights too (and the Hugging Face reference invariants, for every bug that
changes a prefill, an RMSNorm eps of 1e-5 or 1e-4 where the GGUF says 1e-6 included). In bfloat16
too: all ten pass in units of bfloat16's own gap, and planted bugs fail. Marked `gemma`; part of
the default suite."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from kvnotes.conformance import HF_INVARIANTS, hf_reference, verify
from kvnotes.zoo import load_model
from tests.test_verify import (
    _local_base_in_global_layers,
    _norm_eps,
    _rerotation_delta_off_by_one,
    _rope_plus_one,
    _stale_slot_attended,
    _window_off_by_one,
)

pytestmark = pytest.mark.gemma
KV = "prefill_kv_equals_transformers"


@pytest.fixture(scope="module")
def hf_gemma(gemma):
    """transformers' Gemma3ForCausalLM from the GGUF, in float32 (about half a minute to load),
    loaded once for this module: the float32 reference and the bfloat16 one (a cast copy) both
    run it."""
    return gemma.hf_source.load()


@pytest.fixture(scope="module")
def reference(gemma, hf_gemma):
    """transformers' Gemma, run once on verify's two prompts in float32 and in float64."""
    return hf_reference(gemma, hf_model=hf_gemma, source=gemma.hf_source.what)


def test_the_engine_equals_transformers_on_gemma(gemma, reference):
    """The eight self-consistency invariants run in tests/test_gemma.py; these are the two more."""
    report = verify(gemma, progress=False, only=HF_INVARIANTS, reference=reference)
    assert report.passed, report.table()
    assert [r.name for r in report.invariants] == list(HF_INVARIANTS) and not report.skipped
    assert report.prompts["long"] > report.max_window == 512  # sliding layers really slide
    assert "GGUF" in report.reference and "float64" in report.reference
    assert all(r.gap_multiple is not None for r in report.invariants)  # judged in float32's own units


# bug -> (sabotage, the invariants it must fail). A shift of every position alike is no bug under
# RoPE: rope-at-position-plus-one keeps every relative position within a prefill, so its logits
# stay right; what it breaks is the stored keys (against transformers' cache) and re-rotation.
# Every bug that changes a prefill must fail the per-layer K/V comparison with transformers (the
# logits comparison, which costs a 262k-vocabulary unembed at every position, is shown failing on
# those bugs with the tiny Gemma 3 checkpoint in tests/test_verify.py).
GEMMA_BUGS = {
    # (it fails re-rotation too, shown on tiny-gemma3 in tests/test_verify.py: that invariant's
    # float64 offset prefill is its costliest part on Gemma, paid once here, by the next bug)
    "rope-at-position-plus-one": (_rope_plus_one, (KV,)),
    "rerotation-delta-off-by-one": (_rerotation_delta_off_by_one, ("rerotation_equals_offset_prefill",)),
    "window-off-by-one": (_window_off_by_one, ("decide_equals_full_forward", KV)),
    "local-rope-base-in-global-layers": (_local_base_in_global_layers, ("decide_equals_full_forward", KV)),
    "recomputed-slot-still-attended": (_stale_slot_attended, ("refresh_unchanged_is_noop",)),
    "norm-eps-1e-5": (partial(_norm_eps, eps=1e-5), (KV,)),
    "norm-eps-1e-4": (partial(_norm_eps, eps=1e-4), (KV,)),
}


@pytest.mark.parametrize("bug", list(GEMMA_BUGS), ids=list(GEMMA_BUGS))
def test_planted_bugs_fail_their_invariants_on_gemma(gemma, reference, monkeypatch, bug):
    sabotage, invariants = GEMMA_BUGS[bug]
    sabotage(monkeypatch, gemma)
    report = verify(gemma, progress=False, only=invariants, reference=reference)
    print(report.table())
    for r in report.invariants:
        assert not r.passed and r.max_abs_error > r.tolerance, f"{r.name} missed {bug}: {report.table()}"
    assert not report.passed


@pytest.mark.low_precision
def test_bfloat16_verify_passes_on_gemma_and_planted_bugs_fail(hf_gemma, monkeypatch, record_property):
    """Gemma 3 270M in bfloat16 (its float32 weights cast once): all ten invariants pass, each
    tensor within 4x bfloat16's own gap from a float64 forward of the same bfloat16 weights
    (transformers' Gemma3ForCausalLM cast alike for the reference); fresh tokens rotated one
    position on, or the global layers rotated with the local RoPE base, fail the per-layer K/V
    comparison. (A sliding window one slot too wide, which fails in float32, passes in bfloat16:
    one extra key among 512 moves nothing past bfloat16's rounding; docs/engine.md.)"""
    model = load_model("gemma-3-270m", dtype=torch.bfloat16)
    reference = hf_reference(model, hf_model=hf_gemma, source=model.hf_source.what)  # a cast copy
    assert next(hf_gemma.parameters()).dtype == torch.float32  # left as it came, for the others
    report = verify(model, progress=False, reference=reference)
    print(report.table())
    for r in report.invariants:  # the figures scripts/kernel_sweep.py tabulates per kernel setting
        if r.gap_multiple is not None:
            record_property(f"x gap {r.name}", r.gap_multiple)
    assert report.passed and report.dtype == "bfloat16", report.table()
    assert len(report.invariants) == 10 and "bfloat16 beside it" in report.reference
    for sabotage in (_rope_plus_one, _local_base_in_global_layers):
        sabotage(monkeypatch, model)
        wrong = verify(model, progress=False, only=(KV,), reference=reference)
        print(wrong.table())
        found = wrong.invariants[0]
        record_property(f"fault {sabotage.__name__.strip('_')}", found.max_abs_error / found.tolerance)
        assert not wrong.passed and found.max_abs_error > found.tolerance
        monkeypatch.undo()
