"""The seam between `run()` and its backends: the engine's table maps each model class to its backend,
both backends say what they can do by `Capability`, `has` answers and `require` on what a model's
backend lacks names the backend that has it; the backends' names are written once."""

from __future__ import annotations

import pytest
import torch

from kvnotes import load_model, prefill
from kvnotes.engine import BACKENDS, Backend, Capability, backend_of, has, require, run
from kvnotes.engine.nnsight import NNSIGHT, NNsightModel
from kvnotes.engine.table import BY_MODEL_CLASS
from kvnotes.engine.transformer_lens import TRANSFORMER_LENS, TransformerLensModel
from kvnotes.errors import BadArgument, MissingCapability, UnsupportedArchitecture
from kvnotes.models import BackendName, KVModel, ModelFacts
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


@pytest.mark.parametrize("name", list(BackendName))
def test_each_backend_is_in_the_table_once_and_says_what_it_can_do(name):
    backend = BACKENDS[name]
    assert isinstance(backend, Backend) and backend.name == name and isinstance(backend.name, BackendName)
    assert isinstance(backend.capabilities, frozenset) and backend.capabilities
    assert all(isinstance(c, Capability) for c in backend.capabilities)
    assert {Capability.HOOK_ATTN_SCORES, Capability.HOOK_PATTERN} <= backend.capabilities
    for method in ("forward", "move_keys", "full_logits", "hook_names", "watched", "in_float64"):
        assert callable(getattr(backend, method)), method


def test_the_backends_are_named_once():
    """One list of names (`BackendName`); the table has one backend per name, and the CLI's
    `--backend` choices and its default are read from the same list."""
    from kvnotes.cli import build_parser

    assert set(BACKENDS) == set(BackendName) and len(BY_MODEL_CLASS) == len(BackendName)
    backend = next(
        a
        for sp in build_parser()._subparsers._group_actions[0].choices.values()
        for a in sp._actions
        if "--backend" in a.option_strings
    )
    assert list(backend.choices) == [str(b) for b in BackendName] and backend.default == "transformer-lens"


def test_capabilities_tell_the_backends_apart():
    tl, nn = TRANSFORMER_LENS.capabilities, NNSIGHT.capabilities
    assert Capability.WEIGHTS in tl and Capability.WEIGHTS not in nn
    assert {Capability.REMOTE, Capability.FEED, Capability.TRANSFORMERS_MODULE} <= nn
    assert not {Capability.REMOTE, Capability.FEED} & tl
    # every capability is offered by some backend (the enum lists only what is in use)
    assert set(Capability) == tl | nn


def test_a_transformer_lens_model_has_its_backend_and_neutral_facts(tl_model):
    assert isinstance(tl_model, TransformerLensModel) and isinstance(tl_model, KVModel)
    assert backend_of(tl_model) is TRANSFORMER_LENS is BY_MODEL_CLASS[TransformerLensModel]
    assert isinstance(tl_model.facts, ModelFacts)
    assert tl_model.facts.n_layers == tl_model.n_layers == len(tl_model.facts.windows)
    assert tl_model.facts.d_vocab_out == tl_model.cfg.d_vocab_out
    require(tl_model, Capability.WEIGHTS)  # offered: nothing raised
    require(tl_model, "weights")  # a capability is also its plain string
    assert has(tl_model, Capability.RESUME) and not has(tl_model, "feed")


def test_a_model_no_backend_runs_is_refused_in_one_line(tl_model):
    bare = KVModel(name="bare", tokenizer=tl_model.tokenizer, fingerprint="", facts=tl_model.facts)
    with pytest.raises(BadArgument, match="no backend runs a KVModel.*TransformerLensModel"):
        backend_of(bare)


def test_require_names_the_other_backend(tl_model):
    with pytest.raises(MissingCapability, match=r"--backend nnsight.*backend='nnsight'"):
        require(tl_model, Capability.REMOTE, "remote experiments")
    with pytest.raises(BadArgument, match="unknown capability 'time-travel'; the capabilities are weights"):
        require(tl_model, "time-travel")
    # the error is what the callers caught before there was a seam
    assert issubclass(MissingCapability, UnsupportedArchitecture) and issubclass(
        MissingCapability, BadArgument
    )


def test_the_nnsight_model_has_its_backend_and_no_transformer_lens_config(nn_model):
    assert backend_of(nn_model) is NNSIGHT and isinstance(nn_model, NNsightModel)
    assert not hasattr(nn_model, "cfg") and not hasattr(nn_model, "tl")
    assert isinstance(nn_model.facts, ModelFacts) and nn_model.facts.n_kv_heads < nn_model.facts.n_heads
    require(nn_model, Capability.REMOTE)
    with pytest.raises(MissingCapability, match=r"weight edits.*--backend transformer-lens"):
        require(nn_model, Capability.WEIGHTS, "weight edits")


def test_feed_on_a_transformer_lens_model_names_the_nnsight_backend(tl_model):
    from kvnotes.engine.nnsight import feed

    nb = prefill(tl_model, "The order has shipped.")
    with pytest.raises(MissingCapability, match=r"feed\(\) needs 'feed'.*--backend nnsight"):
        with feed(tl_model, nb, tl_model.encode(" Deny.", bos=False)):
            pass


def test_both_backends_run_the_same_checkpoint_alike(nn_model):
    """The same weights on either side of the seam: the same decision logits."""
    tl = load_model(nn_model.source)
    ids = tl.encode("The order has shipped. Can it be cancelled?")
    outs = {}
    for m in (tl, nn_model):
        nb = prefill(m, ids[:-3])
        outs[backend_of(m).name] = run(m, nb, ids[-3:], write=False)[1].last[0]
    torch.testing.assert_close(outs["nnsight"], outs["transformer-lens"], atol=ATOL, rtol=0)
