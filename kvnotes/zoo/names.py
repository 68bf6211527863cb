"""The names and contexts a loader needs without importing another loader: the embedded model's
name and context, the Hugging Face context cap, and `context_length` (every built-in name is listed
by `kvnotes.zoo.catalog.builtin_names`, which imports the loaders)."""

from __future__ import annotations

import json
from pathlib import Path

from kvnotes.models.backends import DEFAULT_BACKEND, BackendName

EMBEDDED = "gemma-3-270m"
EMBEDDED_N_CTX = 8192  # Gemma 3 270M supports 32K; 8192 keeps RoPE tables and masks small
# Hugging Face checkpoints on TransformerLens: min(max_position_embeddings, N_CTX_CAP). RoPE tables and
# masks grow with n_ctx and the notebook engine rarely needs more (`load_hf(..., n_ctx=)` changes it).
N_CTX_CAP = 8192


def context_length(name: str, backend: str = DEFAULT_BACKEND) -> int | None:
    """The context `load_model(name, backend=backend)` will have, where it is known without loading
    the model (the embedded model; a local checkpoint's config.json), so that a length that cannot
    fit is refused before the load; None where only the loaded model can tell.

    >>> context_length("gemma-3-270m"), context_length("some/hub-model")
    (8192, None)
    """
    if backend != BackendName.TRANSFORMER_LENS:
        return None
    if name == EMBEDDED:
        return EMBEDDED_N_CTX
    config = Path(name).expanduser() / "config.json"
    try:
        c = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    most = (
        c.get("max_position_embeddings")
        or c.get("n_positions")  # GPT-2's name for it
        or c.get("text_config", {}).get("max_position_embeddings")
    )
    return min(int(most), N_CTX_CAP) if isinstance(most, int) else None
