"""The names and contexts a loader needs without importing another loader: the embedded model's
name and context, and the Hugging Face context cap (every built-in name is listed by
`kvnotes.zoo.catalog.builtin_names`, which imports the loaders, and without torch by
`kvnotes.zoo.outline.known_names`; a model's context before the load by
`kvnotes.zoo.outline.context_length`)."""

from __future__ import annotations

EMBEDDED = "gemma-3-270m"
EMBEDDED_N_CTX = 8192  # Gemma 3 270M supports 32K; 8192 keeps RoPE tables and masks small
# Hugging Face checkpoints on TransformerLens: min(max_position_embeddings, N_CTX_CAP). RoPE tables and
# masks grow with n_ctx and the notebook engine rarely needs more (`load_hf(..., n_ctx=)` changes it).
N_CTX_CAP = 8192
