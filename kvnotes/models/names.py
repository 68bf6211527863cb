"""The built-in model names, apart from the loaders, so that a loader can check a name without
importing `load_model`."""

from __future__ import annotations

EMBEDDED = "gemma-3-270m"


def builtin_names() -> list[str]:
    """Every name `load_model` knows without a checkpoint: the embedded model, tiny models, organisms."""
    from kvnotes.models.mixed import MIXED_ORGANISMS
    from kvnotes.models.organisms import NULL_ORGANISMS, ORGANISMS
    from kvnotes.models.tiny import TINY_CONFIGS

    return [EMBEDDED, *TINY_CONFIGS, *ORGANISMS, *MIXED_ORGANISMS, *NULL_ORGANISMS]
