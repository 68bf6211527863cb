"""The TransformerLens backend: its model class (`model.py`: `TransformerLensModel`, `from_hooked`) and
`run()` on the model's own TransformerLens modules and hook points (`backend.py`), with
`final_logits`, which only this backend can run, and the weight-layout helpers edge circuits read.
"""

from __future__ import annotations

from kvnotes.engine.transformer_lens.backend import (
    TRANSFORMER_LENS,
    TransformerLensBackend,
    final_logits,
    kv_weights,
    position_embedding,
    qk_normed,
    rope_tables,
    rotated,
)
from kvnotes.engine.transformer_lens.model import (
    TransformerLensModel,
    ViewsGatedMLP,
    check_supported,
    from_hooked,
)

__all__ = [
    "TRANSFORMER_LENS",
    "TransformerLensBackend",
    "TransformerLensModel",
    "ViewsGatedMLP",
    "check_supported",
    "final_logits",
    "from_hooked",
    "kv_weights",
    "position_embedding",
    "qk_normed",
    "rope_tables",
    "rotated",
]
