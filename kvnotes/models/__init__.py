"""What a model is, whatever runs it: `KVModel`, `ModelFacts`, `HFSource` (`model.py`), the backends'
names (`backends.py`), and where TransformerLens's hook names live in a Hugging Face layer
(`sites.py`).

Nothing here imports TransformerLens or the engine. The loaders (`load_model`) stand above the
engine, in `kvnotes.zoo`; each backend's model class stands beside its backend in `kvnotes.engine`.
Names are read lazily, as in `kvnotes`: `from kvnotes.models.backends import BackendName` (the CLI's
`--backend` choices) costs no torch import.
"""

from __future__ import annotations

from kvnotes.lazy import lazy_exports

_EXPORTS = {
    "KVModel": "kvnotes.models.model",
    "ModelFacts": "kvnotes.models.model",
    "HFSource": "kvnotes.models.model",
    "BackendName": "kvnotes.models.backends",
    "DEFAULT_BACKEND": "kvnotes.models.backends",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
