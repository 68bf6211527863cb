"""The names and contexts a loader needs without importing another loader: the embedded model's
name and context, the Hugging Face context cap, and `context_length` (every built-in name is listed
by `kvnotes.zoo.catalog.builtin_names`, which imports the loaders, and without torch by
`kvnotes.zoo.outline.known_names`)."""

from __future__ import annotations

from kvnotes.models.backends import DEFAULT_BACKEND

EMBEDDED = "gemma-3-270m"
EMBEDDED_N_CTX = 8192  # Gemma 3 270M supports 32K; 8192 keeps RoPE tables and masks small
# Hugging Face checkpoints on TransformerLens: min(max_position_embeddings, N_CTX_CAP). RoPE tables and
# masks grow with n_ctx and the notebook engine rarely needs more (`load_hf(..., n_ctx=)` changes it).
N_CTX_CAP = 8192


def context_length(name: str, backend: str = DEFAULT_BACKEND) -> int | None:
    """The context `load_model(name, backend=backend)` will have, where it is known without loading
    the model (a built-in model, a local checkpoint's config.json: `kvnotes.zoo.outline`), so that a
    length that cannot fit is refused before the load; None where only the loaded model can tell.

    >>> context_length("gemma-3-270m"), context_length("some/hub-model")
    (8192, None)
    """
    from kvnotes.zoo.outline import outline

    found = outline(name, backend)
    return found.n_ctx if found else None
