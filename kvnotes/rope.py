"""Rotary position embeddings at arbitrary positions, with each layer's own tables.

The tables are the attention module's own (`rotary_cos`/`rotary_sin`), so every per-layer
detail — base, partial rotary dims, NeoX or GPT-J pairing, Llama-3 / YaRN scaling — is exactly
what the model's full forward uses. Keys are stored post-RoPE; re-rotating a key from position
p to q is `rotate(unrotate(k, p), q)`.
"""

from __future__ import annotations

import torch

from kvnotes.errors import OutOfRange
from kvnotes.types import Float, Int, Tensor


def rotary_dim(attn) -> int:
    """How many of a head's dimensions this layer rotates: 0 where positions are learned and
    added at the input (GPT-2, tracr), so that rotation is the identity there."""
    return (attn.cfg.rotary_dim or 0) if attn.cfg.positional_embedding_type == "rotary" else 0


def tables(attn, positions: Int[Tensor, " n"]) -> tuple[Tensor, Tensor]:
    """cos and sin rows `[n, rotary_dim]` for `positions` from `attn`'s own RoPE tables (`[n, 0]`
    where the layer rotates nothing)."""
    rd = rotary_dim(attn)
    if positions.numel() == 0 or rd == 0:
        _check_range(attn, positions)
        empty = attn.W_Q.new_zeros(positions.numel(), 0)
        return (attn.rotary_cos[:0, :rd], attn.rotary_sin[:0, :rd]) if rd else (empty, empty)
    _check_range(attn, positions)
    need = int(positions.max()) + 1
    if need > attn.rotary_cos.shape[0]:  # grow the table the way the model's own forward does
        attn._extend_rotary_embeddings(min(attn.cfg.n_ctx, max(need, 2 * attn.rotary_cos.shape[0])))
    positions = positions.to(attn.rotary_cos.device)
    return attn.rotary_cos[positions], attn.rotary_sin[positions]


def _check_range(attn, positions: Tensor) -> None:
    if positions.numel() == 0:
        return
    need = int(positions.max()) + 1
    if int(positions.min()) < 0 or need > attn.cfg.n_ctx:
        raise OutOfRange(
            f"position {int(positions.min()) if int(positions.min()) < 0 else need - 1} is out of "
            f"range: this model's context is 0..{attn.cfg.n_ctx - 1} (n_ctx={attn.cfg.n_ctx})"
        )


def rotate(attn, x: Float[Tensor, "*b n d_head"], positions: Int[Tensor, " n"]) -> Tensor:
    """Apply RoPE to `x` (positions along the second-to-last axis)."""
    cos, sin = tables(attn, positions)
    rd = cos.shape[-1]
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    return torch.cat([x_rot * cos + attn.rotate_every_two(x_rot) * sin, x_pass], dim=-1)


def unrotate(attn, x: Float[Tensor, "*b n d_head"], positions: Int[Tensor, " n"]) -> Tensor:
    """Invert `rotate`: R(-p) applied to post-RoPE `x`."""
    cos, sin = tables(attn, positions)
    rd = cos.shape[-1]
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    return torch.cat([x_rot * cos - attn.rotate_every_two(x_rot) * sin, x_pass], dim=-1)


def rerotate(
    attn, keys: Float[Tensor, "*b n d_head"], old: Int[Tensor, " n"], new: Int[Tensor, " n"]
) -> Tensor:
    """Move post-RoPE `keys` from positions `old` to `new` with this layer's RoPE."""
    return rotate(attn, unrotate(attn, keys, old), new)
