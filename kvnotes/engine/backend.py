"""The seam between `run()` and what computes it: a `Backend`, and `require` for what only some offer.

A model names its backend (`model.backend`); code that needs something only one backend has asks
for it by capability (`require(model, "weights")`) instead of asking which backend it is.

Capabilities in use:
    "weights"             TransformerLens weight matrices (`model.tl`): weight edits, attribution by weights
    "transformer-lens"    TransformerLens's own calls (`run_with_cache`, `run_with_hooks`, `cfg`)
    "transformers-module" the Hugging Face module runs the forward (`model.hf`)
    "feed"                feeding a notebook to the user's own nnsight trace (`feed`)
    "remote"              experiments on NDIF (`kvnotes.serving.remote`)
    "hook_attn_scores", "hook_pattern"   attention scores and patterns as hook points
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvnotes.errors import MissingCapability

if TYPE_CHECKING:
    from kvnotes.engine.plan import Fresh, Hook, Plan
    from kvnotes.models.model import KVModel
    from kvnotes.types import Float, Int, Tensor


@runtime_checkable
class Backend(Protocol):
    """What computes `run()` for a model: a forward over a plan, re-rotation, plain logits, hooks."""

    name: str  # as `load_model(name, backend=...)` and `--backend` spell it
    capabilities: frozenset[str]

    def forward(self, model: KVModel, plan: Plan, hooks: Sequence[Hook], capture: Sequence[str]) -> Fresh:
        """The computed tokens' fresh K/V, the planned logits and the captured activations."""
        ...

    def rerotate(
        self,
        model: KVModel,
        layer: int,
        keys: Float[Tensor, "... slot d_head"],
        old: Int[Tensor, " slot"],
        new: Int[Tensor, " slot"],
    ) -> Float[Tensor, "... slot d_head"]:
        """Post-RoPE `keys` of `layer` moved from positions `old` to `new`."""
        ...

    def full_logits(self, model: KVModel, ids: Sequence[int]) -> Float[Tensor, "pos d_vocab"]:
        """Logits of one plain forward of the whole sequence `ids` (no notebook)."""
        ...

    def hook_names(self, model: KVModel) -> list[str]:
        """Every hook name the model answers to on this backend."""
        ...

    def watched(self, model: KVModel) -> bool:
        """Whether a hook outside `run()`'s own arguments watches the model (then no chunking)."""
        ...


_KNOWN: dict[str, frozenset[str]] = {}  # every backend's capabilities, as each backend module registers


def register(backend: Backend) -> Backend:
    """Record a backend's capabilities, so `require` can name the backend that has one."""
    _KNOWN[backend.name] = backend.capabilities
    return backend


def require(model: KVModel, capability: str, what: str = "this") -> None:
    """Raise `MissingCapability`, naming a backend that has it, unless `model`'s backend offers `capability`.

    >>> from kvnotes import load_model
    >>> require(load_model("tiny-llama"), "weights")  # TransformerLens weights: nothing raised
    """
    backend = model.backend
    if capability in backend.capabilities:
        return
    others = [name for name, caps in _KNOWN.items() if capability in caps and name != backend.name]
    way = (
        f"load it with --backend {others[0]} (load_model(name, backend={others[0]!r}))"
        if others
        else "no backend offers it"
    )
    raise MissingCapability(
        f"{what} needs {capability!r}, which {model.name} on the {backend.name} backend does not offer; {way}"
    )
