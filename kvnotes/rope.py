"""Rotary position embeddings, applied and undone: the one implementation both backends use.

Each backend reads the cos and sin rows of a layer at the positions it needs from the model's own
tables (TransformerLens's `rotary_cos`/`rotary_sin`; the Hugging Face module's `rotary_emb`), so
every per-layer detail (base, partial rotary dims, Llama-3 / YaRN scaling) is what the model's full
forward uses, and passes how the model pairs dimensions (`rotate_half`, NeoX's halves as in
transformers, or TransformerLens's `attn.rotate_every_two`, which follows the model's config). Keys are
stored post-RoPE; a key moves from position p to q as `rotate(unrotate(k, p), q)`
(`kvnotes.engine.move_keys`).

>>> import torch
>>> x = torch.randn(3, 8)
>>> angle = torch.arange(3.0)[:, None] * torch.tensor([1.0, 0.1, 1.0, 0.1])  # [n, rotary_dim]
>>> cos, sin = angle.cos(), angle.sin()
>>> back = unrotate(rotate(x, cos, sin), cos, sin)
>>> bool((back - x).abs().max() < 1e-6)  # float32 rounding of two rotations
True
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvnotes.types import Float, Tensor

Pairing = Callable[[Tensor], Tensor]


def rotate_half(x: Float[Tensor, "*b d"]) -> Float[Tensor, "*b d"]:
    """NeoX's pairing, as transformers' `rotate_half`: dimension i turns with i + d/2."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotate(
    x: Float[Tensor, "*b n d_head"],
    cos: Float[Tensor, "n rotary_dim"],
    sin: Float[Tensor, "n rotary_dim"],
    pairs: Pairing = rotate_half,
) -> Float[Tensor, "*b n d_head"]:
    """Apply RoPE to `x` (positions along the second-to-last axis): its first `rotary_dim`
    dimensions turn by the angles whose cos and sin are given, the rest pass through."""
    rd = cos.shape[-1]
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    return torch.cat([x_rot * cos + pairs(x_rot) * sin, x_pass], dim=-1)


def unrotate(
    x: Float[Tensor, "*b n d_head"],
    cos: Float[Tensor, "n rotary_dim"],
    sin: Float[Tensor, "n rotary_dim"],
    pairs: Pairing = rotate_half,
) -> Float[Tensor, "*b n d_head"]:
    """Invert `rotate` at the same angles: R(-p) applied to post-RoPE `x`."""
    rd = cos.shape[-1]
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    return torch.cat([x_rot * cos - pairs(x_rot) * sin, x_pass], dim=-1)
