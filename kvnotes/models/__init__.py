"""What a model is, whatever runs it: `KVModel`, `ModelFacts`, `HFSource` (`model.py`), the backends'
names (`backends.py`), and where TransformerLens's hook names live in a Hugging Face layer
(`sites.py`).

Nothing here imports TransformerLens or the engine. The loaders (`load_model`) stand above the
engine, in `kvnotes.zoo`; each backend's model class stands beside its backend in `kvnotes.engine`.
Names are read lazily, as in `kvnotes`: `from kvnotes.models.backends import BackendName` (the CLI's
`--backend` choices) costs no torch import.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "KVModel": "kvnotes.models.model",
    "ModelFacts": "kvnotes.models.model",
    "HFSource": "kvnotes.models.model",
    "BackendName": "kvnotes.models.backends",
    "DEFAULT_BACKEND": "kvnotes.models.backends",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvnotes.models' has no attribute {name!r}")


def __dir__():
    return __all__
