"""Serving: what kvnotes puts in front of, or hands to, an inference server.

- `manager`: the erratum-aware prompt manager (`PromptManager`, `Compaction`, `hoist`).
- `vllm`: launch and talk to a vLLM server in its own environment (`launch`, `connect`).
- `remote`: the per-slot sweep as one nnsight session, here or on NDIF.

    from kvnotes.serving import PromptManager
"""

from __future__ import annotations

from kvnotes.lazy import lazy_exports

_LAZY = {
    "PromptManager": "kvnotes.serving.manager",
    "Compaction": "kvnotes.serving.manager",
    "EngineSession": "kvnotes.serving.manager",
    "hoist": "kvnotes.serving.manager",
    "fill": "kvnotes.serving.manager",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY)
