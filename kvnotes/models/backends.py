"""The backends' names: the one list that `load_model(name, backend=...)`, the CLI's `--backend` and
the engine's table (`kvnotes.engine.BACKENDS`) read.

A name is all a model-loading caller needs, so it lives here, below the engine, where reading it
imports nothing heavy.
"""

from __future__ import annotations

from enum import StrEnum


class BackendName(StrEnum):
    """What runs a model's forward (docs/backends.md); each is also a plain string.

    >>> [str(b) for b in BackendName]
    ['transformer-lens', 'nnsight']
    """

    TRANSFORMER_LENS = "transformer-lens"  # TransformerLens's HookedTransformer, converted from the weights
    NNSIGHT = "nnsight"  # the Hugging Face module itself, wrapped by nnsight


DEFAULT_BACKEND = BackendName.TRANSFORMER_LENS
