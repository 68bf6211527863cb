"""The one vocabulary of tensor dimension names used across kvnotes.

batch       independent sequences (prompts, or patched copies of one notebook)
slot        a stored KV entry of a notebook (one per token that was computed)
pos         a token being computed in this call
layer       a transformer block
n_heads     query heads;  n_kv_heads  key/value heads (fewer under grouped-query attention)
d_head d_model d_vocab d_sae   the usual widths
"""

from __future__ import annotations

from jaxtyping import Bool, Float, Int
from torch import Tensor

__all__ = ["Bool", "Float", "Int", "Tensor", "KV", "Logits", "Positions", "TokenIds"]

KV = Float[Tensor, "batch n_kv_heads slot d_head"]
Logits = Float[Tensor, "batch pos d_vocab"]
Positions = Int[Tensor, " slot"]
TokenIds = Int[Tensor, "batch slot"]
