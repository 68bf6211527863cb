"""`kvnotes.models` is what a model is, whatever runs it: importing it (every module in it) loads
neither TransformerLens, transformers, nnsight nor the engine. A fresh interpreter, so that nothing an
earlier test imported hides an import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = """
import importlib, json, pkgutil, sys
import kvnotes.models
for m in pkgutil.iter_modules(kvnotes.models.__path__):
    importlib.import_module("kvnotes.models." + m.name)
top = {".".join(n.split(".")[:2]) if n.startswith("kvnotes.") else n.split(".")[0] for n in sys.modules}
print(json.dumps(sorted(top)))
"""
BACKENDS_AND_ABOVE = {"transformer_lens", "transformers", "nnsight", "kvnotes.engine", "kvnotes.zoo"}


def test_importing_the_models_loads_no_backend_and_no_engine():
    out = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout))
    assert "kvnotes.models" in loaded and "torch" in loaded  # it did import them
    assert not loaded & BACKENDS_AND_ABOVE, sorted(loaded & BACKENDS_AND_ABOVE)
