"""The nnsight backend on tiny random checkpoints of every family: the same numbers as transformers'
own forward, the same hook points as TransformerLens's, and the refusals a user meets.

Each checkpoint is loaded on both backends; the TransformerLens backend is the one whose hook
names users know, so "the same hook point" means the same tensor there and here.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers as tf

from kvnotes import load_model, ops
from kvnotes.conformance import HF_INVARIANTS, hf_reference, verify
from kvnotes.engine import backend_of, run, stop_for
from kvnotes.engine.nnsight import EagerAttention, NNsightBackend, NNsightModel, feed
from kvnotes.errors import BadArgument, KVNotesError, UnknownModelError, UnsupportedArchitecture
from kvnotes.models.sites import ORDER
from kvnotes.notebook import Notebook
from tests.checkpoints import ATOL, FAMILIES, build_checkpoint
from tests.models.test_hf_families import EPS_CASES, EPS_IDS, mark_float32_limits
from tests.test_verify import _norm_eps

CUT = 25  # prefill this many tokens, then run the rest against the notebook
SITES = ORDER  # every site both backends name, in TransformerLens's spelling, in execution order


@pytest.fixture(scope="module", params=list(FAMILIES), ids=list(FAMILIES))
def both(request, tmp_path_factory):
    """(TransformerLens-backend model, nnsight-backend model, ids, transformers' logits, dir)."""
    path = tmp_path_factory.mktemp(request.param)
    _, ids, logits = build_checkpoint(request.param, path)
    return load_model(str(path)), load_model(str(path), backend="nnsight"), ids, logits, path


def test_run_in_two_pieces_equals_transformers(both):
    """Prefill, then the rest against the notebook: every position's logits are transformers' own."""
    _, nn, ids, logits, _ = both
    assert isinstance(nn, NNsightModel) and backend_of(nn).name == "nnsight" and not hasattr(nn, "cfg")
    nb, first = run(nn, Notebook.empty(nn), ids[:CUT], logits_at=range(CUT))
    nb2, rest = run(nn, nb, ids[CUT:], logits_at=range(CUT, len(ids)))
    assert logits.abs().max() > 1.0  # not vacuous
    torch.testing.assert_close(torch.cat([first.logits[0], rest.logits[0]]), logits, atol=ATOL, rtol=0)
    assert nb2.n_slots == len(ids) and nb.n_slots == CUT  # only the new tokens were computed
    cols = [5, 7, 11]  # a few answer columns: the decoder, then only those rows of the head (softcaps too)
    _, some = run(nn, nb, ids[CUT:], logits_at=[CUT + 3, len(ids) - 1], vocab=cols, write=False)
    torch.testing.assert_close(some.logits[0], logits[[CUT + 3, len(ids) - 1]][:, cols], atol=ATOL, rtol=0)


def test_every_hook_point_holds_what_transformer_lens_holds(both):
    """Capture every site at the first and last layer on both backends over the same call."""
    tl, nn, ids, _, _ = both
    names = [f"blocks.{l}.{s}" for l in (0, tl.n_layers - 1) for s in SITES]
    got = {}
    for m in (tl, nn):
        nb = ops.prefill(m, ids[:CUT])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EagerAttention)
            got[backend_of(m).name] = run(m, nb, ids[CUT:], capture=names)[1].activations
    for name in names:
        a, b = got["transformer-lens"][name], got["nnsight"][name]
        assert a.shape == b.shape, name
        finite = torch.isfinite(a)
        assert torch.equal(finite, torch.isfinite(b)), f"{name}: masked entries differ"
        scale = a[finite].abs().max().item()
        assert scale > 0, name
        err = (a[finite] - b[finite]).abs().max().item()
        assert err <= 1e-4 * scale + 1e-6, f"{name}: |Δ| {err:.2e} of scale {scale:.2e}"


def test_writing_hooks_change_the_decision_as_on_transformer_lens(both):
    """Zero one head's z and block a slot from the last token's scores: the same logits on both
    backends, and not those of the unhooked run."""
    tl, nn, ids, _, _ = both

    def zero_head(z, hook):  # noqa: ARG001 - TransformerLens passes hook= by keyword
        z[:, :, 1] = 0
        return z

    def block(scores, hook):  # noqa: ARG001
        scores[..., 3] = float("-inf")
        return scores

    hooks = [("blocks.0.attn.hook_z", zero_head), (lambda n: n.endswith("attn.hook_attn_scores"), block)]
    out = {}
    for m in (tl, nn):
        nb = ops.prefill(m, ids[:CUT])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EagerAttention)
            out[backend_of(m).name] = run(m, nb, ids[CUT:], hooks=hooks, write=False)[1].last[0]
        plain = run(m, nb, ids[CUT:], write=False)[1].last[0]
    assert (out["nnsight"] - plain).abs().max() > 1e-2  # the hooks did something
    torch.testing.assert_close(out["nnsight"], out["transformer-lens"], atol=ATOL, rtol=0)


def test_attention_hooks_run_on_eager_attention_and_say_so(both):
    _, nn, ids, _, _ = both
    nb = ops.prefill(nn, ids[:CUT])
    with pytest.warns(EagerAttention, match="eager attention"):
        run(nn, nb, ids[CUT:], capture=["blocks.0.attn.hook_pattern"])
    assert nn.hf.config._attn_implementation != "kvnotes_eager"  # switched back after the call


def test_feed_runs_the_users_own_nnsight_code(both):
    """`feed` + `model.lm.trace`: the user's intervention sees the notebook-fed forward, and the
    notebook it writes equals `run`'s."""
    _, nn, ids, logits, _ = both
    nb = ops.prefill(nn, ids[:CUT])
    with feed(nn, nb, ids[CUT:]) as fed, nn.lm.trace(fed.ids):
        h = nn.lm.model.layers[0].output.save()
        out = nn.lm.output.logits.save()
    torch.testing.assert_close(out[0, -1], logits[-1], atol=ATOL, rtol=0)
    assert h.shape[:2] == (1, len(ids) - CUT)
    expected, _ = run(nn, nb, ids[CUT:])
    mine = fed.notebook()
    for a, b in zip(mine.keys + mine.values, expected.keys + expected.values):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    assert torch.equal(mine.positions, expected.positions)


def test_read_only_points_and_unknown_names_say_the_way_out(both):
    _, nn, ids, _, _ = both
    nb = ops.prefill(nn, ids[:CUT])
    with pytest.raises(BadArgument, match="read-only.*hook_attn_out"):
        run(nn, nb, ids[CUT:], hooks=[("blocks.0.hook_resid_mid", lambda x, hook: x * 0)])  # noqa: ARG005
    with pytest.raises(BadArgument, match="hook points are blocks"):
        run(nn, nb, ids[CUT:], capture=["blocks.0.attn.hook_rot_k"])
    with pytest.raises(BadArgument, match="layers 0"):
        run(nn, nb, ids[CUT:], capture=[f"blocks.{nn.n_layers}.hook_resid_post"])
    # this backend runs the transformers module whole: a run that stops early is refused, and
    # stop_for says to run every block
    with pytest.raises(KVNotesError, match="stops before the last block"):
        run(nn, nb, ids[CUT:], stop=1, logits_at=())
    assert stop_for(nn, ["blocks.0.hook_resid_post"]) is None


def test_a_wrong_rerotation_fails_verify(tmp_path, monkeypatch):
    """Invariant 6 can fail on this backend: keys moved one position too far."""
    build_checkpoint("gemma3-text", tmp_path)
    nn = load_model(str(tmp_path), backend="nnsight")
    assert verify(nn, only=["rerotation_equals_offset_prefill"], progress=False).passed
    right = NNsightBackend.move_keys
    monkeypatch.setattr(
        NNsightBackend, "move_keys", lambda self, m, l, k, old, new: right(self, m, l, k, old, new + 1)
    )
    assert not verify(nn, only=["rerotation_equals_offset_prefill"], progress=False).passed


@pytest.mark.parametrize("eps", EPS_CASES, ids=EPS_IDS)
def test_a_wrong_norm_eps_fails_verify_here_too(both, monkeypatch, request, eps):
    """The nnsight model's own norms at eps 1e-5, 1e-4 or 1e-3 where the checkpoint says 1e-6: the
    reference invariants (transformers in float64, an independent precision) must fail."""
    name = request.node.callspec.params["both"]
    mark_float32_limits(request, name, eps)
    _, nn, _, _, _ = both
    ref = hf_reference(nn)
    assert verify(nn, progress=False, only=HF_INVARIANTS, reference=ref).passed
    _norm_eps(monkeypatch, nn, eps)
    report = verify(nn, progress=False, only=HF_INVARIANTS, reference=ref)
    assert not report.passed, f"an RMSNorm eps of {eps} passed verify on {name}:\n{report.table()}"


def test_yarn_rope_runs_here_though_transformer_lens_refuses_it(tmp_path):
    """A family TransformerLens's converters refuse (YaRN scaling: its magnitude factor must be
    divided out of a re-rotation) passes every invariant on the nnsight backend."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
    fams = {"llama-yarn": (tf.LlamaConfig, {"num_key_value_heads": 2, "rope_parameters": yarn})}
    build_checkpoint("llama-yarn", tmp_path, families=fams)
    with pytest.raises(UnsupportedArchitecture, match="yarn"):
        load_model(str(tmp_path))
    report = verify(load_model(str(tmp_path), backend="nnsight"), progress=False)
    assert report.passed, report.table()
    assert not report.skipped


def test_models_the_backend_cannot_run_are_refused_with_the_reason(tmp_path):
    tf.MambaConfig(num_hidden_layers=1, hidden_size=16, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitecture, match="state-space.*recurrent state"):
        load_model(str(tmp_path), backend="nnsight")
    with pytest.raises(UnknownModelError, match="TransformerLens-only"):
        load_model("tiny-llama", backend="nnsight")
    with pytest.raises(UnknownModelError, match="unknown backend 'jax'.*nnsight"):
        load_model("tiny-llama", backend="jax")
