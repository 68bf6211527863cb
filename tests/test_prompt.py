"""Templates and prompts: spans come from tokenizer offsets, BOS leads, delimiters are
punctuation."""

from __future__ import annotations

import unicodedata

import pytest

from kvnotes.prompt import Template
from tests.helpers import LONG_TEMPLATE, TEMPLATE


def _decoded(model, prompt, name) -> str:
    a, b = prompt.spans[name]
    return model.tokenizer.decode(list(prompt.ids[a:b]))


@pytest.mark.parametrize("template", [TEMPLATE, LONG_TEMPLATE], ids=["task", "long-task"])
@pytest.mark.parametrize("value", ["pending", "shipped", "delivered", "on hold", "x", "12"])
def test_every_span_decodes_to_its_text(gemma3, template, value):
    prompt = template.render(gemma3, order_status=value)
    assert set(prompt.spans) == {"policy", "order_status", "query", "decision"}
    for name, (cs, ce) in prompt.char_spans.items():
        text = prompt.text[cs:ce].strip()
        assert text, name
        decoded = _decoded(gemma3, prompt, name)
        assert text in decoded, f"span {name!r}: {text!r} not in tokens {decoded!r}"
        # tight: dropping either edge token loses part of the text
        a, b = prompt.spans[name]
        assert text not in gemma3.tokenizer.decode(list(prompt.ids[a + 1 : b]))
        assert text not in gemma3.tokenizer.decode(list(prompt.ids[a : b - 1]))
    assert prompt.text[slice(*prompt.char_spans["order_status"])] == value
    assert prompt.values == {"order_status": value}


def test_bos_first_and_no_span_covers_it(gemma3):
    prompt = TEMPLATE.render(gemma3, order_status="pending")
    assert prompt.ids[0] == gemma3.tokenizer.bos_token_id
    assert prompt.offsets[0] == (0, 0)
    assert all(a >= 1 for a, _ in prompt.spans.values())
    assert list(prompt.ids) == gemma3.encode(prompt.text)


def test_decision_is_the_last_span(gemma3):
    prompt = TEMPLATE.render(gemma3, order_status="pending")
    assert prompt.spans["decision"][1] == len(prompt)
    assert _decoded(gemma3, prompt, "decision") == "A:"


@pytest.mark.parametrize(
    "text, value, token",
    [
        ("Status: pen{v}ng.", "di", " pending"),  # value is the middle of one token
        ("is {v}ing now", "pend", " pending"),  # value merges with the following characters
        ("order_status:{v}.", "pend", "pend"),  # value merges with nothing but abuts ':'
    ],
)
def test_value_merged_into_a_token_is_still_covered(gemma3, text, value, token):
    prompt = Template(text).render(gemma3, v=value)
    a, b = prompt.spans["v"]
    assert b > a, "a merged value must still get a non-empty span"
    covered = gemma3.tokenizer.decode(list(prompt.ids[a:b]))
    assert value in covered and token in covered


def test_empty_value_gets_an_empty_span_at_the_right_place(gemma3):
    prompt = Template("order_status:{v}.").render(gemma3, v="")
    a, b = prompt.spans["v"]
    assert a == b and gemma3.token_strings([prompt.ids[a]]) == ["."]


def test_field_inside_a_named_span(gemma3):
    prompt = Template("[[query:Is {v} allowed?]] [[decision:A:]]").render(gemma3, v="shipped")
    q, v = prompt.spans["query"], prompt.spans["v"]
    assert q[0] <= v[0] < v[1] <= q[1]
    assert "shipped" in _decoded(gemma3, prompt, "v")


def test_literal_braces(gemma3):
    t = Template("a {{literal}} {v}")
    assert t.fields == ("v",)
    prompt = t.render(gemma3, v="x")
    assert prompt.text == "a {literal} x"
    assert _decoded(gemma3, prompt, "v").strip() == "x"


def test_defaults_fill_missing_fields(gemma3):
    t = Template("order_status: {order_status}.", defaults={"order_status": "pending"})
    assert t.render(gemma3).values == {"order_status": "pending"}
    assert t.render(gemma3, order_status="shipped").values == {"order_status": "shipped"}


def test_aligned_values_keep_every_span(gemma3):
    old = TEMPLATE.render(gemma3, order_status="pending")
    new = old.with_values(gemma3, order_status="shipped")
    assert len(new) == len(old) and dict(new.spans) == dict(old.spans)
    diff = [i for i, (a, b) in enumerate(zip(old.ids, new.ids)) if a != b]
    assert diff == list(old.span("order_status"))


def test_delimiters_are_only_punctuation_or_whitespace(gemma3):
    prompt = TEMPLATE.render(gemma3, order_status="pending")
    strs = gemma3.token_strings(prompt.ids)
    delims = prompt.delimiters(gemma3)

    def punct(s):
        return bool(s) and all(c.isspace() or unicodedata.category(c).startswith("P") for c in s)

    assert delims == [i for i, s in enumerate(strs) if punct(s)], "complete and sound"
    assert all(strs[i].strip() in {"", ".", ",", ":", "?", "_", "\n"} for i in delims)
    f = prompt.span("order_status").stop
    assert f in delims and strs[f] == "."  # the note right after the field
    assert any(strs[i] == "\n" for i in delims)
    assert 0 not in delims  # BOS is not a delimiter
    sub = prompt.delimiters(gemma3, start=f, end=f + 2)
    assert sub == [i for i in delims if f <= i < f + 2] and sub
