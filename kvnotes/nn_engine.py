"""The old address of the nnsight backend's user-facing names; they live in `kvnotes.engine.nnsight`."""

from __future__ import annotations

from kvnotes.engine.nnsight import EAGER, EagerAttention, Fed, HookPoint, feed

__all__ = ["EAGER", "EagerAttention", "Fed", "HookPoint", "feed"]
