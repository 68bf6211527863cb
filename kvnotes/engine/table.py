"""The engine's table of backends: which backend runs a model (`backend_of`, keyed by the model's class),
what it offers (`has`, `require`), and the operations every backend gives beside `run()`
(`move_keys`, `full_logits`, `in_float64`), dispatched through it.

The backends' names are `kvnotes.models.backends.BackendName` (the one list); `BACKENDS` holds one
backend per name, and a test keeps the two the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from kvnotes.engine.backend import Backend, Capability
from kvnotes.engine.nnsight.backend import NNSIGHT
from kvnotes.engine.nnsight.model import NNsightModel
from kvnotes.engine.transformer_lens.backend import TRANSFORMER_LENS
from kvnotes.engine.transformer_lens.model import TransformerLensModel
from kvnotes.errors import BadArgument, MissingCapability, UnsupportedArchitecture
from kvnotes.models.backends import BackendName
from kvnotes.models.model import KVModel
from kvnotes.types import Float, Int, Tensor

if TYPE_CHECKING:
    from transformer_lens import HookedTransformer

# model class -> its backend: the one table (a subclass, e.g. tracr's TracrModel, runs on its base's)
BY_MODEL_CLASS: dict[type[KVModel], Backend[Any]] = {
    TransformerLensModel: TRANSFORMER_LENS,
    NNsightModel: NNSIGHT,
}
BACKENDS: dict[BackendName, Backend[Any]] = {b.name: b for b in BY_MODEL_CLASS.values()}


def backend_of(model: KVModel) -> Backend[Any]:
    """The backend that runs `model`, by its class.

    >>> from kvnotes import load_model
    >>> backend_of(load_model("tiny-llama")).name
    <BackendName.TRANSFORMER_LENS: 'transformer-lens'>
    """
    for cls in type(model).__mro__:
        if cls in BY_MODEL_CLASS:
            return BY_MODEL_CLASS[cls]
    raise BadArgument(
        f"no backend runs a {type(model).__name__}: a model is one of "
        f"{', '.join(c.__name__ for c in BY_MODEL_CLASS)} (or a subclass), as `load_model` returns"
    )


def _capability(capability: Capability | str) -> Capability:
    try:
        return Capability(capability)
    except ValueError:
        raise BadArgument(
            f"unknown capability {capability!r}; the capabilities are {', '.join(Capability)}"
        ) from None


def has(model: KVModel, capability: Capability | str) -> bool:
    """Whether `model`'s backend offers `capability`.

    >>> from kvnotes import load_model
    >>> model = load_model("tiny-llama")
    >>> has(model, Capability.WEIGHTS), has(model, Capability.FEED)
    (True, False)
    """
    return _capability(capability) in backend_of(model).capabilities


def require(model: KVModel, capability: Capability | str, what: str = "this") -> None:
    """Raise `MissingCapability`, naming a backend that has it, unless `model`'s backend offers `capability`.

    >>> from kvnotes import load_model
    >>> require(load_model("tiny-llama"), Capability.WEIGHTS)  # TransformerLens weights: nothing raised
    """
    cap = _capability(capability)
    backend = backend_of(model)
    if cap in backend.capabilities:
        return
    others = [b.name for b in BACKENDS.values() if cap in b.capabilities and b.name != backend.name]
    way = (
        f"load it with --backend {others[0]} (load_model(name, backend={str(others[0])!r}))"
        if others
        else "no backend offers it"
    )
    raise MissingCapability(
        f"{what} needs {str(cap)!r}, which {model.name} on the {backend.name} backend does not offer; {way}"
    )


def hooked(model: KVModel, what: str = "this") -> HookedTransformer:
    """`model`'s TransformerLens `HookedTransformer`, for code that reads or edits its weight matrices
    (per-head W_Q/W_K/W_V/W_O, norms, MLPs) or calls TransformerLens itself: the one way past the
    backend seam, typed, and refused (`Capability.WEIGHTS`, naming a backend that has it, `what`
    saying what needed it) where the model's backend has no such module.

    >>> from kvnotes import load_model
    >>> hooked(load_model("tiny-llama")).blocks[0].attn.W_Q.shape  # [head, d_model, d_head]
    torch.Size([4, 64, 16])
    """
    return lens_model(model, what).tl


def lens_model(model: KVModel, what: str = "this") -> TransformerLensModel:
    """`model` as the TransformerLens backend's model class (what `final_logits` and the like take),
    refused as `hooked` refuses."""
    require(model, Capability.WEIGHTS, what)
    if not isinstance(model, TransformerLensModel):  # pragma: no cover - WEIGHTS is TransformerLens's
        raise MissingCapability(f"{what} needs TransformerLens weights, which {model.name} does not have")
    return model


def move_keys(
    model: KVModel,
    layer: int,
    keys: Float[Tensor, "... slot d_head"],
    old: Int[Tensor, " slot"],
    new: Int[Tensor, " slot"],
) -> Float[Tensor, "... slot d_head"]:
    """Post-RoPE `keys` `[..., slot, d_head]` of `layer` moved from positions `old` to `new`, with the
    layer's own RoPE (`kvnotes.ops.rerotate` moves a whole notebook with it).

    A model with learned positions refuses any move: its keys hold no rotation to undo, the
    position is mixed into the residual stream every later layer reads."""
    if model.facts.positions != "rotary" and not torch.equal(torch.as_tensor(old), torch.as_tensor(new)):
        raise UnsupportedArchitecture(
            f"{model.name} has learned absolute positions (added to the residual stream at the "
            "input), so its keys carry no rotation to undo: a chunk cannot be moved to another "
            "position. Recompute it at its new positions instead (`kvnotes.ops.prefill` of the "
            "whole prompt, or `run` of the chunk's tokens at the positions it goes to)"
        )
    return backend_of(model).move_keys(model, layer, keys, old, new)


def full_logits(model: KVModel, ids: Sequence[int]) -> Float[Tensor, "pos d_vocab"]:
    """Logits `[pos, vocab]` of one plain forward of the whole sequence `ids` (no notebook)."""
    return backend_of(model).full_logits(model, ids)


def in_float64(model: KVModel) -> AbstractContextManager[object]:
    """`model` itself computing in float64 for the duration, back to its own dtype bit for bit
    afterwards (its backend's `in_float64`): the engine then runs its own arithmetic, and any bug
    planted in it or in the weights, in float64."""
    return backend_of(model).in_float64(model)
