"""The seam between `run()` and what computes it: the `Backend` protocol and the `Capability` enum.

A backend is typed against its own model class (`Backend[TransformerLensModel]`), so a backend that
reads an attribute its model class lacks fails the type check (`python -m mypy`, docs/engine.md).
The engine's table (`kvnotes.engine.table`) maps a model to its backend; code that needs something
only one backend has asks for it by capability (`has(model, Capability.WEIGHTS)`,
`require(model, Capability.WEIGHTS, "weight edits")`) instead of asking which backend it is.

Capabilities (every one in use):
    WEIGHTS              "weights"              TransformerLens weight matrices (`model.tl`): weight
                                                edits, attribution by weights, edge circuits
    TRANSFORMER_LENS     "transformer-lens"     TransformerLens's own calls (`run_with_cache`,
                                                `run_with_hooks`, `cfg`, exporting the HookedTransformer)
    TRANSFORMERS_MODULE  "transformers-module"  the Hugging Face module runs the forward (`model.hf`)
    NNSIGHT              "nnsight"              nnsight's model object (`model.lm`) for the user's traces
    FEED                 "feed"                 feeding a notebook to the user's own nnsight trace (`feed`)
    REMOTE               "remote"               experiments on NDIF (`kvnotes.serving.remote`)
    RESUME               "resume"               `run(..., resume=)`: start the forward at a later block
    STOP                 "stop"                 `run(..., stop=)`: end the forward before a later block
    HOOK_ATTN_SCORES     "hook_attn_scores"     attention scores as a hook point
    HOOK_PATTERN         "hook_pattern"         attention patterns as a hook point
    HOOK_ROT_Q           "hook_rot_q"           rotated queries as a hook point
    HOOK_ROT_K           "hook_rot_k"           rotated keys (what a notebook stores) as a hook point
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

from kvnotes.models.backends import BackendName
from kvnotes.models.model import KVModel

if TYPE_CHECKING:
    from kvnotes.engine.plan import Fresh, Hook, Plan
    from kvnotes.types import Tensor


class Capability(StrEnum):
    """What only some backends offer (the module docstring says what each means). Each is also its
    plain string, so `"weights"` and `Capability.WEIGHTS` name the same capability."""

    WEIGHTS = "weights"
    TRANSFORMER_LENS = "transformer-lens"
    TRANSFORMERS_MODULE = "transformers-module"
    NNSIGHT = "nnsight"
    FEED = "feed"
    REMOTE = "remote"
    RESUME = "resume"
    STOP = "stop"
    HOOK_ATTN_SCORES = "hook_attn_scores"
    HOOK_PATTERN = "hook_pattern"
    HOOK_ROT_Q = "hook_rot_q"
    HOOK_ROT_K = "hook_rot_k"


M = TypeVar("M", bound=KVModel, contravariant=True)


@runtime_checkable
class Backend(Protocol[M]):
    """What computes `run()` for models of one class `M`: a forward over a plan, key moves, plain
    logits, hook names, and the float64 reference forward."""

    @property
    def name(self) -> BackendName:
        """As `load_model(name, backend=...)` and `--backend` spell it."""
        ...

    @property
    def capabilities(self) -> frozenset[Capability]: ...

    def forward(self, model: M, plan: Plan, hooks: Sequence[Hook], capture: Sequence[str]) -> Fresh:
        """The computed tokens' fresh K/V, the planned logits and the captured activations."""
        ...

    def move_keys(self, model: M, layer: int, keys: Tensor, old: Tensor, new: Tensor) -> Tensor:
        """Post-RoPE `keys` `[..., slot, d_head]` of `layer` moved from positions `old` to `new`."""
        ...

    def full_logits(self, model: M, ids: Sequence[int]) -> Tensor:
        """Logits `[pos, d_vocab]` of one plain forward of the whole sequence `ids` (no notebook)."""
        ...

    def hook_names(self, model: M) -> list[str]:
        """Every hook name the model answers to on this backend."""
        ...

    def watched(self, model: M) -> bool:
        """Whether a hook outside `run()`'s own arguments watches the model (then no chunking)."""
        ...

    def in_float64(self, model: M) -> AbstractContextManager[object]:
        """`model` computing in float64 for the duration (weights, RoPE tables, every norm and
        softmax), back to its own dtype bit for bit afterwards: `verify`'s truth for re-rotation."""
        ...
