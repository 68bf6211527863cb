"""What kvnotes can tell of a model before loading it, without importing torch: its name is known,
and its layers, heads and context, so that a value that cannot apply is refused in a fraction of a
second rather than after the load.

The built-in models' outlines ship as data (`kvnotes/zoo/outlines.json`, written from the loaded
models; a test keeps it equal to them); a Hugging Face checkpoint directory's come from its
config.json; a hub name's are known only once it loads (None).

    python -m kvnotes.zoo.write_outlines   # rewrite kvnotes/zoo/outlines.json from the loaded models

>>> outline("tiny-llama")
Outline(name='tiny-llama', n_layers=3, n_heads=4, n_kv_heads=4, n_ctx=512, positions='rotary')
>>> outline("some/hub-model") is None
True
"""

from __future__ import annotations

import difflib
import json
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

from kvnotes.errors import UnknownModelError
from kvnotes.models.backends import DEFAULT_BACKEND, BackendName
from kvnotes.zoo.names import N_CTX_CAP, check_program_spec, is_program_spec

SHIPPED = Path(__file__).with_name("outlines.json")


@dataclass(frozen=True, kw_only=True)
class Outline:
    """A model's shape as its config gives it: the facts a command's values are checked against
    before the load (`kvnotes.analysis.registry.fit_to_model`); a loaded `KVModel` has the same
    attributes, so one check serves both."""

    name: str
    n_layers: int
    n_heads: int  # query heads per layer
    n_kv_heads: int
    n_ctx: int | None  # positions the model takes as loaded; None where only the load tells
    positions: str = "rotary"  # or "learned" (GPT-2, tracr: no chunk can be moved)


@cache
def shipped() -> dict[str, dict]:
    return json.loads(SHIPPED.read_text())


def known_names() -> list[str]:
    """Every built-in name, read from the shipped outlines (the loaders' `builtin_names` import torch)."""
    return list(shipped())


def check_name(name: str) -> None:
    """Refuse a name that is no built-in model, no local directory and no hub name ("org/model"),
    naming the closest built-in names.

    >>> check_name("gemma-3-270mm")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    kvnotes.errors.UnknownModelError: unknown model 'gemma-3-270mm' (did you mean gemma-3-270m?): ...
    """
    if is_program_spec(name):  # a user's RASP program, FILE.py:NAME (kvnotes.zoo.tracr.load_program)
        check_program_spec(name)
        return
    if name in shipped() or "/" in name or Path(name).expanduser().is_dir():
        return
    close = difflib.get_close_matches(name, known_names(), n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    raise UnknownModelError(
        f"unknown model {name!r}{hint}: built-in names are {known_names()}; otherwise pass a local "
        "Hugging Face checkpoint directory or a hub name such as 'Qwen/Qwen3-0.6B'"
    )


def outline(name: str, backend: str = DEFAULT_BACKEND) -> Outline | None:
    """`name`'s outline as `load_model(name, backend=backend)` will have it, where it is known without
    the load: a built-in model, a local checkpoint's config.json; None for a hub name. The context is
    known on TransformerLens only (nnsight takes the checkpoint's own; None there)."""
    if name in shipped():
        found = Outline(name=name, **shipped()[name])
    else:
        found = _from_config(name)
    if found is None or backend == BackendName.TRANSFORMER_LENS:
        return found
    return Outline(**{**asdict(found), "n_ctx": None})


def _from_config(name: str) -> Outline | None:
    """A Hugging Face checkpoint directory's outline, from its config.json (Gemma 3's multimodal
    configs keep it under text_config; GPT-2 names its fields n_layer, n_head and n_positions)."""
    try:
        c = json.loads((Path(name).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    c = {**c.get("text_config", {}), **c}
    layers = c.get("num_hidden_layers") or c.get("n_layer")
    heads = c.get("num_attention_heads") or c.get("n_head")
    most = c.get("max_position_embeddings") or c.get("n_positions")
    if not (isinstance(layers, int) and isinstance(heads, int) and isinstance(most, int)):
        return None
    return Outline(
        name=name,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=c.get("num_key_value_heads") or heads,
        n_ctx=min(most, N_CTX_CAP),
        positions="learned" if "n_positions" in c else "rotary",
    )


def context_length(name: str, backend: str = DEFAULT_BACKEND) -> int | None:
    """The context `load_model(name, backend=backend)` will have, where it is known without loading
    the model (a built-in model, a local checkpoint's config.json), so that a length that cannot
    fit is refused before the load; None where only the loaded model can tell.

    >>> context_length("gemma-3-270m"), context_length("some/hub-model")
    (8192, None)
    """
    found = outline(name, backend)
    return found.n_ctx if found else None
