"""Learned absolute positions (tiny-attn-only, tiny-gpt2): the position lives in the residual
stream, not in a rotation of the keys, so every operation runs except moving a chunk, which refuses
with the reason before any compute; a move of zero is allowed, and a chunk prefilled where it goes
splices without a move. tiny-gpt2 equals transformers' own GPT2LMHeadModel, and GPT-2 checkpoint
directories load through the Hugging Face loader."""

from __future__ import annotations

import importlib

import pytest
import torch

from kvnotes.conformance import HF_INVARIANTS, verify
from kvnotes.engine import Capability, backend_of, full_logits, has
from kvnotes.engine.profile import profile
from kvnotes.errors import BadArgument, UnsupportedArchitecture
from kvnotes.ops import decide, precompile, prefill, rerotate, splice
from kvnotes.zoo import load_model
from kvnotes.zoo.outline import context_length
from kvnotes.zoo.tiny import tiny_gpt2_hf, tiny_tokenizer
from tests.helpers import LEARNED_NAMES, ROTARY_NAMES, assert_close, assert_notebooks_close, make_case

TL = importlib.import_module("kvnotes.engine.transformer_lens.backend")
REASON = r"learned absolute positions \(added to the residual stream at the input\)"


def test_the_model_lists_split_by_how_positions_are_kept():
    assert set(LEARNED_NAMES) == {"tiny-attn-only", "tiny-gpt2"}
    assert LEARNED_NAMES and ROTARY_NAMES and not set(LEARNED_NAMES) & set(ROTARY_NAMES)


@pytest.fixture
def no_compute(monkeypatch):
    """Fails the test if anything rotates a key or runs a forward inside the `with` block."""

    def forbidden(*args, **kwargs):
        raise AssertionError("computed before refusing")

    monkeypatch.setattr(TL, "unrotate_at", forbidden)  # a key move's first step
    monkeypatch.setattr(type(TL.TRANSFORMER_LENS), "move_keys", forbidden)
    return profile


def test_facts_say_learned_and_rotation_is_the_identity(learned_model):
    f = learned_model.facts
    assert f.positions == "learned" and set(f.rotary_dims) == {0}
    attn = learned_model.tl.blocks[0].attn
    x = torch.randn(1, 5, 7, learned_model.d_head)
    # exact: rotation by zero dimensions returns the tensor's own values
    assert torch.equal(TL.rotated(attn, x, torch.arange(5)), x)


@pytest.mark.parametrize("move", [1, 40], ids=["by-1", "by-40"])
def test_rerotate_refuses_a_move_before_any_compute(learned_model, no_compute, move):
    nb = prefill(learned_model, make_case(learned_model).ids[:20])
    with no_compute() as p, pytest.raises(UnsupportedArchitecture, match=REASON) as e:
        rerotate(learned_model, nb, move)
    assert p.calls == [] and learned_model.name in str(e.value) and "Recompute" in str(e.value)
    with pytest.raises(UnsupportedArchitecture, match=REASON):
        rerotate(learned_model, nb, torch.arange(100, 120))  # explicit positions alike


def test_rerotate_by_zero_is_allowed_and_changes_nothing(learned_model):
    nb = prefill(learned_model, make_case(learned_model).ids[:20])
    for same in (0, nb.positions):
        moved = rerotate(learned_model, nb, same)
        assert_notebooks_close(moved, nb, what="a move of zero", exact=True)  # exact: nothing moves
        assert moved.spans == nb.spans


def test_splice_refuses_to_move_a_chunk_before_any_compute(learned_model, no_compute):
    ids = make_case(learned_model).ids
    host, chunk = prefill(learned_model, ids[:10]), precompile(learned_model, ids[10:30])
    for kw in ({}, {"seam": 3}, {"offset": 100}):
        with no_compute() as p, pytest.raises(UnsupportedArchitecture, match=REASON):
            splice(learned_model, host, chunk, **kw)
        assert p.calls == [], kw


def test_a_chunk_prefilled_where_it_goes_splices_without_a_move(learned_model):
    """The way out the refusal names: compute the chunk at its target positions. Splicing it then
    moves nothing; with a full seam it equals the prefill of host + chunk (float32 tolerance of
    tests/helpers.py: the same arithmetic, batched differently)."""
    model, ids = learned_model, make_case(learned_model).ids
    host_ids, chunk_ids = ids[:10], ids[10:30]
    host, chunk = prefill(model, host_ids), prefill(model, chunk_ids, offset=10)
    seam0 = splice(model, host, chunk)
    assert_notebooks_close(seam0.select(range(10, 30)), chunk, what="spliced chunk", exact=True)
    full = splice(model, host, chunk, seam=len(chunk_ids))
    assert_notebooks_close(full, prefill(model, host_ids + chunk_ids), what="full-seam splice")


def test_every_other_operation_runs_on_learned_positions(learned_model):
    """decide after a refresh-free prefill equals TransformerLens's full forward (float32, the
    tolerance of tests/helpers.py); the parity suite checks the rest invariant by invariant."""
    case = make_case(learned_model)
    full = full_logits(learned_model, case.ids)[-1]
    assert_close(decide(learned_model, case.nb_old, case.old).last[0], full, what="decision")


# --- tiny-gpt2 against transformers ---------------------------------------------------------------
def test_tiny_gpt2_equals_transformers_gpt2():
    """The engine's logits at every position against transformers' own GPT2LMHeadModel on the
    same weights. Two implementations in float32 (TransformerLens einsums, transformers' Conv1D
    addmm) round differently: measured 3e-5 on logits of magnitude ~30; stated tolerance 1e-5 of
    the logits' scale (3e-4), ten times that, far below the O(1) error of any wrong position."""
    from kvnotes.engine import run
    from kvnotes.notebook import Notebook

    model, hf = load_model("tiny-gpt2"), tiny_gpt2_hf()
    assert type(hf).__name__ == "GPT2LMHeadModel" and model.facts.model_type == "GPT2LMHeadModel"
    ids = make_case(model).ids
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    _, out = run(model, Notebook.empty(model), ids, logits_at=range(len(ids)))
    tol = 1e-5 * ref.abs().max().item()
    assert (out.logits[0] - ref).abs().max().item() <= tol
    assert (full_logits(model, ids) - ref).abs().max().item() <= tol


@pytest.mark.parametrize("backend", ["transformer-lens", "nnsight"])
def test_a_gpt2_checkpoint_directory_loads_and_verifies(tmp_path, backend):
    """A local GPT-2 checkpoint loads (through `load_hf` on TransformerLens), with its context read
    from `n_positions`, and passes verify against transformers reloading the same directory."""
    tiny_gpt2_hf().save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    assert context_length(str(tmp_path)) == 512
    model = load_model(str(tmp_path), backend=backend)
    assert model.facts.positions == "learned" and model.n_ctx == 512
    report = verify(model, progress=False)
    assert report.passed, report.table()
    assert str(tmp_path) in report.reference and list(report.not_applicable) == [
        "rerotation_equals_offset_prefill"
    ]


def test_cli_verify_runs_tiny_gpt2_against_transformers(tmp_path, capsys):
    from kvnotes.cli import main  # here: the rest of this file does not need the command line

    out = tmp_path / "v.json"
    assert main(["verify", "--model", "tiny-gpt2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "logits_equal_transformers" in text and "n/a" in text and "all invariants pass" in text


# --- the planted off-by-one position: verify must fail against transformers -----------------------
NN = importlib.import_module("kvnotes.engine.nnsight.backend")


def _engine_adds_the_next_position(mp, model):
    """The engine adds W_pos[pos + 1] where the token is at pos (TransformerLens backend), or hands
    transformers position_ids one past the tokens' own (nnsight backend)."""
    if has(model, Capability.TRANSFORMERS_MODULE):
        real = NN._inputs
        mp.setattr(NN, "_inputs", lambda *a, **kw: (lambda c, m, p: (c, m, p + 1))(*real(*a, **kw)))
    else:
        real = TL.position_embedding
        mp.setattr(TL, "position_embedding", lambda tl, pos: real(tl, pos + 1))


@pytest.fixture(scope="module", params=["transformer-lens", "nnsight"])
def gpt2(request):
    return load_model("tiny-gpt2", backend=request.param)


def test_an_off_by_one_position_fails_verify_against_transformers(gpt2, monkeypatch):
    """Every position shifted alike is no error under RoPE, but with learned positions it is: both
    reference invariants fail by far (the planted run is printed with -rP), and verify as a whole."""
    _engine_adds_the_next_position(monkeypatch, gpt2)
    report = verify(gpt2, progress=False)
    print(report.table())
    result = {r.name: r for r in report.invariants}
    for name in ("prefill_kv_equals_transformers", "logits_equal_transformers"):
        assert not result[name].passed and result[name].gap_multiple > 1e3, report.table()
    # the model's own full forward (TransformerLens's, or transformers') takes the right positions
    assert not result["decide_equals_full_forward"].passed, report.table()
    assert not report.passed
    monkeypatch.undo()
    assert verify(gpt2, progress=False).passed, "the planted fault leaked past the test"


def test_a_shifted_position_table_passes_every_self_check_but_not_transformers(monkeypatch):
    """W_pos itself one row off in TransformerLens's weights: the engine and TransformerLens's full
    forward share it and agree; only transformers, on the checkpoint's own weights, tells."""
    model = load_model("tiny-gpt2")
    w = model.tl.pos_embed.W_pos
    monkeypatch.setattr(model.tl.pos_embed, "W_pos", torch.nn.Parameter(w.roll(-1, 0), requires_grad=False))
    report = verify(model, progress=False)
    result = {r.name: r for r in report.invariants}
    assert all(r.passed for n, r in result.items() if n not in HF_INVARIANTS), report.table()
    assert not any(result[n].passed for n in HF_INVARIANTS) and not report.passed


# --- the nnsight backend runs GPT-2 too ----------------------------------------------------------
def test_tiny_gpt2_on_nnsight_runs_the_notebook_exactly_and_refuses_a_move():
    """transformers' GPT-2 takes position_ids and a cache, so the notebook runs on its own forward:
    prefill then the rest equals transformers' logits (float32, the same module: stated 1e-5 of the
    logits' scale), a move refuses as on TransformerLens, a move of zero is allowed."""
    nn, hf = load_model("tiny-gpt2", backend="nnsight"), tiny_gpt2_hf()
    assert backend_of(nn).name == "nnsight" and nn.facts.positions == "learned"
    ids = make_case(nn).ids
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    from kvnotes.engine import run

    nb = prefill(nn, ids[:25])
    nb2, out = run(nn, nb, ids[25:], logits_at=range(25, len(ids)))
    assert nb2.n_slots == len(ids)
    assert (out.logits[0] - ref[25:]).abs().max().item() <= 1e-5 * ref.abs().max().item()
    with pytest.raises(UnsupportedArchitecture, match=REASON):
        rerotate(nn, nb, 3)
    assert_notebooks_close(rerotate(nn, nb, 0), nb, what="a move of zero", exact=True)  # exact: no move
    with pytest.raises(BadArgument, match="no map of 'gpt2' modules"):  # module sites: not mapped yet
        run(nn, nb, ids[25:], capture=["blocks.0.hook_resid_post"])


def test_tiny_gpt2_patterns_agree_across_backends():
    """Attention patterns of the same call on both backends (nnsight: kvnotes' eager attention):
    float32 softmax of scores from two implementations, stated 1e-5 absolute on probabilities."""
    import warnings

    names = [f"blocks.{l}.attn.hook_pattern" for l in range(3)]
    got = []
    for backend in ("transformer-lens", "nnsight"):
        m = load_model("tiny-gpt2", backend=backend)
        ids = make_case(m).ids
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got.append(decide(m, prefill(m, ids[:40]), ids[40:], capture=names).activations)
    for name in names:
        assert (got[0][name] - got[1][name]).abs().max().item() <= 1e-5, name
