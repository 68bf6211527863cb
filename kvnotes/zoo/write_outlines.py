"""Rewrite `kvnotes/zoo/outlines.json` (what the CLI checks a command's values against before torch
is imported, `kvnotes.zoo.outline`) from the built-in models as loaded; a program whose extra is not
installed (tracr's) keeps its entry. `tests/models/test_outline.py` keeps the file equal to them.

    python -m kvnotes.zoo.write_outlines
"""

from __future__ import annotations

import json
from pathlib import Path

from kvnotes.errors import MissingDependency
from kvnotes.zoo import load_model
from kvnotes.zoo.catalog import builtin_names
from kvnotes.zoo.outline import SHIPPED, shipped


def write() -> Path:
    old, out = shipped(), {}
    for name in builtin_names():
        try:
            f = load_model(name).facts
        except MissingDependency:
            out[name] = old[name]
            continue
        out[name] = {
            "n_layers": f.n_layers,
            "n_heads": f.n_heads,
            "n_kv_heads": f.n_kv_heads,
            "n_ctx": f.n_ctx,
            "positions": f.positions,
        }
    SHIPPED.write_text(json.dumps(out, indent=1) + "\n")
    shipped.cache_clear()
    return SHIPPED


if __name__ == "__main__":
    print(f"wrote {write()}")
