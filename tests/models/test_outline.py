"""The outlines shipped for the built-in models (`kvnotes/zoo/outlines.json`, what the CLI checks a
command's values against before torch is imported) are the loaded models' own facts."""

from __future__ import annotations

import importlib.util
import json

import pytest

from kvnotes.zoo import builtin_names, load_model
from kvnotes.zoo.outline import Outline, known_names, outline

FIELDS = ("n_layers", "n_heads", "n_kv_heads", "n_ctx", "positions")


def _marks(name: str) -> list:
    if name == "gemma-3-270m":
        return [pytest.mark.gemma]
    if name.startswith("tracr-") and importlib.util.find_spec("tracr") is None:
        return [pytest.mark.skip(reason="tracr is not installed (the tracr extra)")]
    return []


def test_every_built_in_name_has_an_outline():
    assert known_names() == builtin_names(), "rewrite it: python -m kvnotes.zoo.write_outlines"


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in known_names()])
def test_the_shipped_outline_is_the_loaded_model_s(name):
    facts = load_model(name).facts
    shipped = outline(name)
    assert shipped is not None
    assert {f: getattr(shipped, f) for f in FIELDS} == {f: getattr(facts, f) for f in FIELDS}, (
        "stale: run `python -m kvnotes.zoo.write_outlines` to rewrite kvnotes/zoo/outlines.json"
    )


def test_a_checkpoint_s_outline_is_read_from_its_config(tmp_path):
    config = {"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32768}))
    assert outline(str(tmp_path)) == Outline(
        name=str(tmp_path), n_layers=2, n_heads=8, n_kv_heads=2, n_ctx=8192, positions="rotary"
    )
    assert outline(str(tmp_path), backend="nnsight").n_ctx is None  # nnsight takes the checkpoint's own
    assert outline(str(tmp_path / "nowhere")) is None and outline("org/hub-model") is None
