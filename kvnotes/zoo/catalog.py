"""Every name `load_model` knows without a checkpoint, read from the loaders that define them (the
loaders import `names.py`, never this module, so no loader depends on another through it)."""

from __future__ import annotations

from kvnotes.zoo.names import EMBEDDED


def builtin_names() -> list[str]:
    """Every name `load_model` knows without a checkpoint: the embedded model, tiny models, organisms,
    tracr's compiled programs."""
    from kvnotes.zoo.gated import GATED_ORGANISMS
    from kvnotes.zoo.mixed import MIXED_ORGANISMS
    from kvnotes.zoo.organisms import NULL_ORGANISMS, ORGANISMS
    from kvnotes.zoo.tiny import TINY_CONFIGS, TINY_HF
    from kvnotes.zoo.tracr import library_names

    return [
        EMBEDDED,
        *TINY_CONFIGS,
        *TINY_HF,
        *ORGANISMS,
        *MIXED_ORGANISMS,
        *GATED_ORGANISMS,
        *NULL_ORGANISMS,
        *library_names(),  # tracr's compiled programs (the tracr extra)
    ]
