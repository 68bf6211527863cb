"""The nnsight backend: its model class (`model.py`: `NNsightModel`, `Layout`, `from_module`) and `run()`
on the Hugging Face forward fed the notebook as its cache (`backend.py`), with `feed`, which gives the
user's own nnsight trace the same feeding.
"""

from __future__ import annotations

from kvnotes.engine.nnsight.backend import (
    EAGER,
    NNSIGHT,
    EagerAttention,
    Fed,
    HookPoint,
    NNsightBackend,
    feed,
)
from kvnotes.engine.nnsight.model import Layout, NNsightModel, check_plain_kv, from_lm, from_module, layout

__all__ = [
    "EAGER",
    "NNSIGHT",
    "EagerAttention",
    "Fed",
    "HookPoint",
    "Layout",
    "NNsightBackend",
    "NNsightModel",
    "check_plain_kv",
    "feed",
    "from_lm",
    "from_module",
    "layout",
]
