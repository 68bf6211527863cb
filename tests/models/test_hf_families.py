"""`load_hf` on tiny random checkpoints of every supported family: TL and the engine equal HF.

Each family is a seeded random transformers model saved with the tiny tokenizer, so the whole
path (config mapping, TL's weight converters, unprocessed loading) runs offline in seconds.
Weights are drawn large enough that attention is sharp, so a wrong window, RoPE base or scale
shows up in the logits.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from kvnotes.conformance import HF_INVARIANTS, hf_reference, verify
from kvnotes.engine import run
from kvnotes.errors import UnknownModelError, UnsupportedArchitecture
from kvnotes.notebook import Notebook
from kvnotes.zoo.hf import load_hf, tl_config_from_hf, tl_from_hf_model
from kvnotes.zoo.tiny import tiny_tokenizer
from tests.checkpoints import ATOL, FAMILIES, WINDOW, _config, _randomize, build_checkpoint
from tests.test_verify import _norm_eps


@pytest.fixture(scope="module", params=list(FAMILIES), ids=list(FAMILIES))
def family(request, tmp_path_factory):
    """(hf logits [pos, vocab], loaded KVModel, prompt ids, checkpoint dir) for one family."""
    path = tmp_path_factory.mktemp(request.param)
    _, ids, hf_logits = build_checkpoint(request.param, path)
    return hf_logits, load_hf(str(path)), ids, path


def test_tl_logits_equal_hf(family):
    hf_logits, model, ids, _ = family
    with torch.no_grad():
        tl_logits = model.tl(torch.tensor([ids]))[0]
    assert hf_logits.abs().max() > 1.0  # the check is not vacuous
    torch.testing.assert_close(tl_logits, hf_logits, atol=ATOL, rtol=0)


def test_engine_equals_hf(family):
    hf_logits, model, ids, _ = family
    _, out = run(model, Notebook.empty(model), ids)
    torch.testing.assert_close(out.last[0], hf_logits[-1], atol=ATOL, rtol=0)


def test_engine_in_two_chunks_equals_hf(family):
    """Prefill 25 tokens, then run the last 15 against that notebook (windows cross the cut)."""
    hf_logits, model, ids, _ = family
    nb, _ = run(model, Notebook.empty(model), ids[:25])
    _, out = run(model, nb, ids[25:])
    torch.testing.assert_close(out.last[0], hf_logits[-1], atol=ATOL, rtol=0)


def test_gemma3_multimodal_uses_the_text_tower():
    """model_type "gemma3" (Gemma3ForConditionalGeneration): the text tower converts exactly."""
    cls, extra = FAMILIES["gemma3-text"]
    vision = tf.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    cfg = tf.Gemma3Config(
        text_config=_config(cls, extra).to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=500,
        boi_token_index=501,
        eoi_token_index=502,
    )
    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    _randomize(hf, seed=0)
    ids = torch.tensor([[2, *range(10, 49)]])
    with torch.no_grad():
        expected = hf.eval()(input_ids=ids).logits[0]
        model = tl_from_hf_model(hf, tiny_tokenizer(), "tiny-gemma3-multimodal")
        got = model.tl(ids)[0]
    assert model.cfg.original_architecture == "Gemma3ForConditionalGeneration"
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_config_fields_for_gemma3():
    cls, extra = FAMILIES["gemma3-linear-rope"]
    cfg = tl_config_from_hf(_config(cls, extra))
    assert cfg["original_architecture"] == "Gemma3ForCausalLM"
    assert cfg["attn_types"] == ["local", "local", "global", "local"]
    # exact: values copied from the config
    assert (cfg["window_size"], cfg["rotary_base"], cfg["rotary_base_local"]) == (WINDOW, 1e6, 1e4)
    assert cfg["rotary_scaling_factor"] == 8.0 and cfg["use_qk_norm"]  # exact: values copied from the config
    # exact: values copied from the config; sqrt(256), the default
    assert cfg["n_key_value_heads"] == 1 and cfg["attn_scale"] == 16.0


def test_n_ctx_is_capped():
    cfg = tl_config_from_hf(tf.LlamaConfig(max_position_embeddings=131072, num_hidden_layers=1))
    assert cfg["n_ctx"] == 8192


def test_unreachable_hub_name_says_so(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    name = "kvnotes-tests/no-such-model"
    with pytest.raises(UnknownModelError) as err:
        load_hf(name)
    msg = str(err.value)
    assert name in msg and "could not be reached" in msg and "local directory" in msg


def test_directory_without_checkpoint(tmp_path):
    with pytest.raises(UnknownModelError, match="config.json"):
        load_hf(str(tmp_path))


def test_unsupported_model_type(tmp_path):
    with pytest.raises(UnsupportedArchitecture, match="bloom.*supported: gemma"):  # ALiBi
        tl_config_from_hf(tf.BloomConfig())
    tf.BloomConfig(n_layer=1).save_pretrained(tmp_path)  # refused before any weights are read
    with pytest.raises(UnsupportedArchitecture, match="bloom"):
        load_hf(str(tmp_path))


def test_gpt2_variants_the_engine_cannot_reproduce_are_refused():
    """GPT-2 loads (tests/engine/test_learned_positions.py); its per-layer attention scaling and
    cross-attention do not, with the field named."""
    for field in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        with pytest.raises(UnsupportedArchitecture, match=field):
            tl_config_from_hf(tf.GPT2Config(n_layer=1, **{field: True}))


def test_unsupported_rope_scaling():
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    with pytest.raises(UnsupportedArchitecture, match="yarn"):
        tl_config_from_hf(tf.LlamaConfig(num_hidden_layers=1, rope_parameters=yarn))


@pytest.mark.parametrize("backend", ["transformer-lens", "nnsight"])
def test_cli_verify_on_a_local_checkpoint_directory(family, backend, tmp_path):
    """`kvnotes verify --backend B --model DIR --json FILE` runs offline and all invariants pass on
    both backends, the two against transformers' own forward on the checkpoint included."""
    import json

    from kvnotes.cli import main
    from kvnotes.conformance import DESCRIPTIONS

    _, _, _, path = family
    out = tmp_path / "verify.json"
    assert main(["verify", "--backend", backend, "--model", str(path), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["passed"] and len(report["invariants"]) == len(DESCRIPTIONS) and not report["skipped"]
    assert {"name", "max_abs_error", "tolerance", "passed"} <= set(report["invariants"][0])


# Gemma 1 scales its embeddings by sqrt(d_model), so every norm of this checkpoint sees a mean
# square of about 64: an eps of 1e-5 instead of 1e-6 changes each norm's output by ~7e-8 of itself,
# float32's own rounding (it moves no tensor by more than 1.3x the float32 forward's gap from
# float64, docs/engine.md), so no float32 comparison can tell it from the checkpoint's eps.
BELOW_FLOAT32 = {("gemma-mha", 1e-5)}
# At 1e-4 the same checkpoint sits at float32's edge: the change moves its values 3.7x the float32
# forward's gap where verify allows 4x (transformers 5.24, torch 2.13; other releases landed just
# above it), so the outcome is the rounding's, not verify's. 1e-3 is this family's planted bug
# (about 60x float32's epsilon on a norm whose mean square is ~64), and it must fail.
AT_FLOAT32_EDGE = {("gemma-mha", 1e-4)}
EPS_CASES = [1e-5, 1e-4, 1e-3]
EPS_IDS = ["eps-1e-5", "eps-1e-4", "eps-1e-3"]


def mark_float32_limits(request, name: str, eps: float) -> None:
    """Strict xfail where the eps change is below float32's rounding; skip where it sits on its edge."""
    if (name, eps) in BELOW_FLOAT32:
        reason = "the eps change is below float32's rounding"
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
    if (name, eps) in AT_FLOAT32_EDGE:
        pytest.skip("the eps change sits at float32's rounding edge for this family; its 1e-3 case runs")


@pytest.fixture(scope="module")
def reference(family):
    """transformers' float64 forward (and float32 gap) on verify's prompts, once per family."""
    return hf_reference(family[1])


@pytest.mark.parametrize("eps", EPS_CASES, ids=EPS_IDS)
def test_a_wrong_norm_eps_fails_verify(family, reference, monkeypatch, request, eps):
    """Every RMSNorm's eps at 1e-5, 1e-4 or 1e-3 where the checkpoint says 1e-6: the reference
    invariants, whose tolerances are a few times float32's own rounding gap, must fail."""
    name = request.node.callspec.params["family"]
    mark_float32_limits(request, name, eps)
    _, model, _, _ = family
    clean = verify(model, progress=False, only=HF_INVARIANTS, reference=reference)
    assert clean.passed, clean.table()
    _norm_eps(monkeypatch, model, eps)
    report = verify(model, progress=False, only=HF_INVARIANTS, reference=reference)
    print(report.table())
    assert not report.passed, f"an RMSNorm eps of {eps} passed verify on {name}:\n{report.table()}"
    assert all(r.max_abs_error > r.tolerance for r in report.invariants if not r.passed)
