"""The seam between `run()` and its backends: both satisfy the `Backend` protocol, say what they can
do, and `require` on what a model's backend lacks names the backend that has it."""

from __future__ import annotations

import pytest
import torch

from kvnotes import load_model, prefill
from kvnotes.engine import BACKENDS, Backend, require, run
from kvnotes.errors import BadArgument, MissingCapability, UnsupportedArchitecture
from kvnotes.models.model import KVModel, ModelFacts, TransformerLensModel
from tests.checkpoints import ATOL, build_checkpoint


@pytest.fixture(scope="module")
def tl_model():
    return load_model("tiny-llama")


@pytest.fixture(scope="module")
def nn_model(tmp_path_factory):
    """The smallest nnsight model the tests build: a tiny random Llama checkpoint."""
    path = tmp_path_factory.mktemp("llama-gqa")
    build_checkpoint("llama-gqa", path)
    return load_model(str(path), backend="nnsight")


@pytest.mark.parametrize("name", ["transformer-lens", "nnsight"])
def test_each_backend_satisfies_the_protocol_and_says_what_it_can_do(name):
    backend = BACKENDS[name]
    assert isinstance(backend, Backend) and backend.name == name
    assert isinstance(backend.capabilities, frozenset) and backend.capabilities
    assert {"hook_attn_scores", "hook_pattern"} <= backend.capabilities


def test_capabilities_tell_the_backends_apart():
    tl, nn = BACKENDS["transformer-lens"].capabilities, BACKENDS["nnsight"].capabilities
    assert "weights" in tl and "weights" not in nn
    assert {"remote", "feed", "transformers-module"} <= nn and not {"remote", "feed"} & tl


def test_a_transformer_lens_model_has_its_backend_and_neutral_facts(tl_model):
    assert isinstance(tl_model, TransformerLensModel) and isinstance(tl_model, KVModel)
    assert tl_model.backend is BACKENDS["transformer-lens"]
    assert isinstance(tl_model.facts, ModelFacts)
    assert tl_model.facts.n_layers == tl_model.n_layers == len(tl_model.facts.windows)
    assert tl_model.facts.d_vocab_out == tl_model.cfg.d_vocab_out
    require(tl_model, "weights")  # offered: nothing raised


def test_require_names_the_other_backend(tl_model):
    with pytest.raises(MissingCapability, match=r"--backend nnsight.*backend='nnsight'"):
        require(tl_model, "remote", "remote experiments")
    with pytest.raises(MissingCapability, match="no backend offers it"):
        require(tl_model, "time-travel")
    # the error is what the callers caught before there was a seam
    assert issubclass(MissingCapability, UnsupportedArchitecture) and issubclass(
        MissingCapability, BadArgument
    )


def test_the_nnsight_model_has_its_backend_and_no_transformer_lens_config(nn_model):
    assert nn_model.backend is BACKENDS["nnsight"] and isinstance(nn_model, KVModel)
    assert not hasattr(nn_model, "cfg") and not hasattr(nn_model, "tl")
    assert isinstance(nn_model.facts, ModelFacts) and nn_model.facts.n_kv_heads < nn_model.facts.n_heads
    require(nn_model, "remote")
    with pytest.raises(MissingCapability, match=r"weight edits.*--backend transformer-lens"):
        require(nn_model, "weights", "weight edits")


def test_both_backends_run_the_same_checkpoint_alike(nn_model):
    """The same weights on either side of the seam: the same decision logits."""
    tl = load_model(nn_model.source)
    ids = tl.encode("The order has shipped. Can it be cancelled?")
    outs = {}
    for m in (tl, nn_model):
        nb = prefill(m, ids[:-3])
        outs[m.backend.name] = run(m, nb, ids[-3:], write=False)[1].last[0]
    torch.testing.assert_close(outs["nnsight"], outs["transformer-lens"], atol=ATOL, rtol=0)
